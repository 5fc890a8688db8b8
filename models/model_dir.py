"""Where a path on the command line becomes a model folder (`find_model_dir`): a training
run, a checkpoint, a model folder, a hub name or a GGUF file. A command resolves its target
once and passes the folder on.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.models.gguf import gguf_folder
from draftsmith.models.hub import hub_snapshot, looks_like_repo_id
from draftsmith.models.run_weights import run_weights


def target_folder(path: str) -> Path | str | None:
    """`find_model_dir` of a recipe's target.path, which a command calls once and passes on;
    None where the recipe names no target (a tiny one built in memory)."""
    return find_model_dir(path) if path else None


def find_model_dir(path: str | Path, require: str = "") -> Path | str:
    """The one place a path on the command line becomes a model folder: a training run
    folder stands for its best weights (RUN/best/model) or else the model it wrote last
    (RUN/model; models/run_weights.py), a checkpoint folder for its own, a model folder for itself, and a hub
    name for its snapshot in the Hugging Face cache (downloaded there first when online,
    models/hub.py). A name found nowhere stays a string, for the loader to name what is
    wrong. With `require` (what the path is for, e.g. "target"), it must come to a folder
    with a config.json. A GGUF file (a `.gguf` path, a folder holding one, or an embedded
    name such as `smollm2-135m-instruct`) stands for the folder it is converted into once
    (models/gguf.py)."""
    converted = gguf_folder(path)
    if converted is not None:
        return converted
    local = Path(path)
    weights = run_weights(local)
    if weights is not None:
        return weights
    if not local.exists() and looks_like_repo_id(path):
        try:
            return hub_snapshot(str(path), what=require or "model")
        except DraftsmithError as exc:
            if require:
                raise DraftsmithError(f"{require} {path}: no such folder (a model folder or a training run "
                                      f"folder), nor a hub model: {str(exc).split(': ', 1)[-1]}") from None
            return str(path)
    if require and not (local / "config.json").is_file():
        raise DraftsmithError(f"{require} {path}: no config.json (a model folder or a training run folder)")
    return local if local.exists() or require else str(path)
