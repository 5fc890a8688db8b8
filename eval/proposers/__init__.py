"""Decode-time proposers: what each drafter does inside the speculative decoder.

`base.py` holds the protocol the decoder speaks; each method's proposer lives in
`<method>.py` beside it and exposes `load_proposer(path, target, **options)`. A drafter
spec on the command line is `NAME[:PATH]`; the names, their options and whether they
need a path all come from the method registry (`draftsmith/registry.py`). A proposer's
module is imported only when a spec names it, so evaluating n-gram imports no model.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.models.target import check_capturable, resolve_model_dir
from draftsmith.registry import proposer_names, resolve


def parse_spec(spec: str) -> tuple[str, Path | None]:
    """`NAME[:PATH]` -> (name, the model folder PATH stands for, or None)."""
    name, _, path = spec.partition(":")
    names = proposer_names()
    if name not in names:
        raise DraftsmithError(f"drafter {spec!r}: unknown name {name!r} (known: {', '.join(names)})")
    needs_path = names[name][0].needs_path
    if needs_path and not path:
        raise DraftsmithError(f"drafter {spec!r}: {name} needs a path, as {name}:RUN_OR_EXPORT")
    if path and not needs_path:
        raise DraftsmithError(f"drafter {spec!r}: {name} takes no path")
    if not path:
        return name, None
    if not Path(path).exists():
        raise DraftsmithError(f"drafter {spec!r}: {path} not found")
    return name, Path(resolve_model_dir(path))


def proposer_from_spec(spec: str, target, overrides: dict[str, dict] | None = None):
    """The proposer a spec names, built for `target`; its `name` is the spec's name.
    `overrides`: method name -> proposer options set for this run (e.g. eval's
    --confidence-threshold for dspark); they win over a variant's own options."""
    name, path = parse_spec(spec)
    method, options = proposer_names()[name]
    options = {**options, **(overrides or {}).get(method.name, {})}
    proposer = resolve(method.proposer, f"drafter {spec!r}")(path, target, **options)
    proposer.name = name
    check_capturable(target, proposer.capture_layers, f"drafter {spec!r}")
    return proposer
