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


def weights_label(model_dir: str | Path) -> str | None:
    """What a report calls the weights in `model_dir`: "best (step 40, val/tau_est 1.23)",
    "checkpoint step 20" or "last"; None for a folder that is not a run's."""
    model_dir = Path(model_dir)
    holder = model_dir.parent
    if model_dir.name != MODEL:
        return None
    if (holder / BEST_RECORD).is_file():
        record = read_json(holder / BEST_RECORD)
        return f"best (step {record['step']}, {record['metric']} {record['value']:.4g})"
    if (holder / "step.json").is_file():
        return f"checkpoint step {read_json(holder / 'step.json')['step']}"
    if (holder / "run.json").is_file():
        return "last"
    return None
