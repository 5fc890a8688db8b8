"""Which weights of a training run a path stands for, and what a report calls them.

A run writes its last weights to RUN/model, the best so far by validation to RUN/best/model
(with RUN/best/best.json: step, metric, value; train/best.py), and each checkpoint's to
RUN/checkpoints/checkpoint_<step>/model. A run folder stands for its best weights when it
has them, as SpecForge exports `<run>-best` and speculators links the best by validation:
the last step of a run is not the one that drafts best when validation peaks early.
RUN/model names the last explicitly, RUN/checkpoints/checkpoint_<step> that checkpoint's.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.fsutil import read_json

MODEL = "model"  # a run's (or a checkpoint's, or best/'s) model folder
BEST = "best"
BEST_RECORD = "best.json"


def run_weights(folder: Path) -> Path | None:
    """The model folder a run-like folder stands for: its best, else its own model/."""
    for candidate in (folder / BEST / MODEL, folder / MODEL):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _origin(model_dir: Path) -> tuple[str, Path, dict] | None:
    """Which weights of which run `model_dir` holds: ("best" | "checkpoint" | "last", the run
    folder, the record naming their step: best.json, step.json, {}); None for a folder that is
    not a run's."""
    holder = model_dir.parent
    if model_dir.name != MODEL:
        return None
    if (holder / BEST_RECORD).is_file():
        return "best", holder.parent, read_json(holder / BEST_RECORD)
    if (holder / "step.json").is_file():
        return "checkpoint", holder.parent.parent, read_json(holder / "step.json")
    if (holder / "run.json").is_file():
        return "last", holder, {}
    return None


def weights_label(model_dir: str | Path) -> str | None:
    """What a report calls the weights in `model_dir`: "best (step 40, val/tau_est 1.23)",
    "checkpoint step 20" or "last"; None for a folder that is not a run's."""
    origin = _origin(Path(model_dir))
    if origin is None:
        return None
    kind, _, record = origin
    if kind == "best":
        return f"best (step {record['step']}, {record['metric']} {record['value']:.4g})"
    return f"checkpoint step {record['step']}" if kind == "checkpoint" else "last"


def weights_run(model_dir: str | Path) -> tuple[Path, int | None] | None:
    """The run folder that wrote `model_dir` and the step its weights are from (None: the
    run's last), for a reader of the run's records (metrics.jsonl) about these weights; the
    best and a checkpoint sit below the run folder, not in it. None for a folder not a run's."""
    origin = _origin(Path(model_dir))
    if origin is None:
        return None
    _, run, record = origin
    step = record.get("step")
    return run, step if isinstance(step, int) and not isinstance(step, bool) else None
