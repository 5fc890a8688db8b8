"""Drafter specs (`NAME[:PATH]`) -> drafters behind the decoder's protocol.

PATH is a training run folder (its `model/` is used) or an export folder. Each method's
adapter module exposes `load_drafter(path, target, **options)`; it is imported only when a
spec names it, so evaluating n-gram never imports a drafter model.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from draftsmith.errors import DraftsmithError

# spec name -> (adapter module, options passed to its load_drafter, needs a path)
SPECS: dict[str, tuple[str, dict, bool]] = {
    "ngram": ("draftsmith.eval.draft_ngram", {}, False),
    "draft_lm": ("draftsmith.eval.draft_lm", {}, True),
    "mtp": ("draftsmith.eval.draft_mtp", {}, True),
    "eagle3": ("draftsmith.eval.draft_eagle3", {}, True),
    "eagle3_tree": ("draftsmith.eval.draft_eagle3", {"tree": True}, True),
    "dflash": ("draftsmith.eval.draft_dflash", {"method": "dflash"}, True),
    "dspark": ("draftsmith.eval.draft_dflash", {"method": "dspark"}, True),
}


def parse_spec(spec: str) -> tuple[str, Path | None]:
    name, _, path = spec.partition(":")
    if name not in SPECS:
        raise DraftsmithError(f"drafter {spec!r}: unknown name {name!r} (known: {', '.join(SPECS)})")
    needs_path = SPECS[name][2]
    if needs_path and not path:
        raise DraftsmithError(f"drafter {spec!r}: {name} needs a path, as {name}:RUN_OR_EXPORT")
    if path and not needs_path:
        raise DraftsmithError(f"drafter {spec!r}: {name} takes no path")
    if path:
        folder = Path(path)
        if not folder.exists():
            raise DraftsmithError(f"drafter {spec!r}: {folder} not found")
        if (folder / "model").is_dir():
            folder = folder / "model"
        return name, folder
    return name, None


def load_drafter(spec: str, target):
    name, path = parse_spec(spec)
    module_name, options, _ = SPECS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise DraftsmithError(f"drafter {spec!r}: not available in this build ({exc.name} missing)") from None
    drafter = module.load_drafter(path, target, **options)
    drafter.name = spec.split(":")[0] if name != spec else name
    return drafter
