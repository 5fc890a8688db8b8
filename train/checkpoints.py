"""Where a run's checkpoints are and which of them are whole.

accelerate names them (`ProjectConfiguration(automatic_checkpoint_naming=True)`):
RUN/checkpoints/checkpoint_<n>, where the loop sets n to the step saved, and it deletes the
oldest beyond `train.keep_checkpoints` before writing a new one. A checkpoint is whole once
its step.json exists: the loop writes it last, atomically, after every process has saved.
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"checkpoint_(\d+)")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step}"


def checkpoint_step(path: Path) -> int | None:
    """The step in a checkpoint folder's name, None for anything else."""
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoint_folders(out_dir: Path) -> list[Path]:
    """Every checkpoint folder of the run, whole or not, by step."""
    folder = out_dir / CHECKPOINTS
    found = [p for p in folder.iterdir() if p.is_dir() and checkpoint_step(p) is not None] if folder.is_dir() else []
    return sorted(found, key=checkpoint_step)


def saved_checkpoints(out_dir: Path) -> list[Path]:
    """The run's whole checkpoints (step.json written), by step."""
    return [p for p in checkpoint_folders(out_dir) if (p / "step.json").is_file()]
