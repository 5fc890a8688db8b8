"""Decode-time proposers: what each drafter does inside the speculative decoder.

`base.py` holds the protocol the decoder speaks; each method's proposer lives in
`<method>.py` beside it and exposes `load_proposer(path, target, **options)`. A drafter
argument on the command line (`--drafter`) is `[LABEL=]NAME[:PATH]`; the names, their options and whether they
need a path all come from the method registry (`draftsmith/registry.py`). A proposer's
module is imported only when an argument names it, so evaluating n-gram imports no model.
"""

from __future__ import annotations

import re
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.run_weights import weights_label
from draftsmith.models.target import check_capturable
from draftsmith.registry import import_ref, proposer_names

_LABEL = re.compile(r"([A-Za-z0-9_.+-]+)=(.*)")


def split_label(arg: str) -> tuple[str | None, str]:
    """`LABEL=NAME[:PATH]` -> (LABEL, "NAME[:PATH]"); without a label, (None, arg). The label
    names the drafter's row in reports, so that two checkpoints of one method (a DSpark trained
    jointly and one on a frozen DFlash backbone, say) can sit side by side."""
    match = _LABEL.fullmatch(arg)
    if match and ":" not in match.group(1):
        return match.group(1), match.group(2)
    return None, arg


def parse_drafter_arg(arg: str) -> tuple[str, Path | None]:
    """A `--drafter` argument, `[LABEL=]NAME[:PATH]` -> (name, the model folder PATH stands for, or None). PATH may be
    a hub name (`eagle3:ORG/NAME`, a published drafter), found through huggingface_hub's cache."""
    name, _, path = split_label(arg)[1].partition(":")
    names = proposer_names()
    if name not in names:
        raise DraftsmithError(f"drafter {arg!r}: unknown name {name!r} (known: {', '.join(names)})")
    needs_path = names[name][0].needs_path
    if needs_path and not path:
        raise DraftsmithError(f"drafter {arg!r}: {name} needs a path, as {name}:RUN_OR_EXPORT")
    if path and not needs_path:
        raise DraftsmithError(f"drafter {arg!r}: {name} takes no path")
    if not path:
        return name, None
    folder = find_model_dir(path)  # a run, a model folder, or a hub name (ORG/NAME) through its cache
    if not Path(folder).exists():
        raise DraftsmithError(f"drafter {arg!r}: {path} not found (a local folder, or a hub name in the "
                              "Hugging Face cache or downloadable)")
    return name, Path(folder)


def proposer_from_arg(arg: str, target, overrides: dict[str, dict] | None = None):
    """The proposer a `--drafter` argument names, built for `target`; its `name` is the argument's
    LABEL or NAME. `overrides`: method name -> proposer options set for this run (eval's flags of
    the registry's decode options); they win over a variant's own options."""
    name, path = parse_drafter_arg(arg)
    method, options = proposer_names()[name]
    options = {**options, **(overrides or {}).get(method.name, {})}
    proposer = import_ref(method.proposer, f"drafter {arg!r}")(path, target, **options)
    proposer.name = split_label(arg)[0] or name
    # Which of a run's weights it reads (best, a checkpoint, last), for the report's weights column.
    proposer.weights = weights_label(path) if path is not None else None
    check_capturable(target, proposer.capture_layers, f"drafter {arg!r}")
    return proposer
