"""A run's checkpoints: where they are, which are whole, saving one and resuming from one.

accelerate names them (`ProjectConfiguration(automatic_checkpoint_naming=True)`):
RUN/checkpoints/checkpoint_<n>, where `save_checkpoint` sets n to the step saved, and it
deletes the oldest beyond `train.keep_checkpoints` before writing a new one. A checkpoint is
whole once its step.json exists: `save_checkpoint` writes it last, atomically, after every
process has saved; `resume_point` and `load_checkpoint` take one back.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Callable

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import (
    apply_user_modes,
    atomic_file,
    full_disk_reason,
    is_disk_full,
    open_safetensors,
    write_failure,
)

log = logging.getLogger(__name__)

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


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = saved_checkpoints(out_dir)
    return done[-1] if done else None


def _other_checkpoints(path: Path) -> str:
    others = [str(p) for p in saved_checkpoints(path.parent.parent) if p != path]
    if not others:
        return "no earlier checkpoint to resume from"
    return f"resume from an earlier one with train.resume=PATH ({', '.join(others)})"


def check_checkpoint(path: Path) -> int:
    """The step of checkpoint `path`, once every file its save recorded is there, whole."""
    meta_file = path / "step.json"
    if not meta_file.is_file():
        raise DraftsmithError(f"train.resume: {path} is not a checkpoint (no step.json; checkpoints are "
                              f"RUN/{CHECKPOINTS}/checkpoint_STEP)")
    try:
        meta = json.loads(meta_file.read_text())
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError):
        raise DraftsmithError(f"checkpoint {path}: step.json is damaged; {_other_checkpoints(path)}") from None
    for name, size in meta.get("files", {}).items():  # absent in checkpoints from before the manifest
        file = path / name
        if not file.is_file():
            raise DraftsmithError(f"checkpoint {path}: {name} is missing; {_other_checkpoints(path)}")
        if file.stat().st_size != size:
            raise DraftsmithError(f"checkpoint {path}: {name} is truncated ({file.stat().st_size} of {size} bytes); "
                                  f"{_other_checkpoints(path)}")
    return step


def save_checkpoint(accelerator, out_dir: Path, step: int, window: dict | None = None,
                    weights: Callable[[Path], object] | None = None) -> None:
    """accelerate's save_state into RUN/checkpoints/checkpoint_<step>, the method's model
    (`weights(folder)` writes folder/model, which export and eval read), then step.json.

    accelerate picks the folder from its save iteration, set here to the step, and first
    deletes the oldest checkpoints beyond train.keep_checkpoints (its total_limit). step.json,
    written last and atomically once every process has saved, lists every file with its size:
    a folder without it is a save that did not finish, never resumed from, and a resume
    names a file lost or cut short later. `window` (each rank's unlogged metric sums) lets a
    resumed run log the same windows as an uninterrupted one. A write that fails (a full
    disk) removes its folder and stops the run; the previous checkpoints are left as they were."""
    folder = out_dir / CHECKPOINTS
    final = folder / checkpoint_name(step)
    if accelerator.is_main_process and final.exists():  # this step of a later run abandoned by a resume
        shutil.rmtree(final)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.iteration = step
    try:
        # Under automatic naming accelerate derives this same folder itself; it is passed for clarity.
        accelerator.save_state(str(final))
        (final / f"window-{accelerator.process_index}.json").write_text(json.dumps(window or {}))
        if accelerator.is_main_process and weights is not None:
            weights(final)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            apply_user_modes(final)  # safetensors leaves its files 0600, unreadable by a server of another user
            files = {str(f.relative_to(final)): f.stat().st_size for f in sorted(final.rglob("*")) if f.is_file()}
            with atomic_file(final / "step.json") as f:
                json.dump({"step": step, "files": files}, f)
            log.debug("saved %s", final)
    except Exception as exc:
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
        # torch.save reports a full disk as a RuntimeError ("unexpected pos", "file write failed").
        if not isinstance(exc, OSError) and not is_disk_full(exc):
            raise
        previous = latest_checkpoint(out_dir)
        reason = (f"{write_failure(exc)}: {full_disk_reason(exc)}" if is_disk_full(exc)
                  else exc.strerror or first_lines(exc, 1))
        raise DraftsmithError(f"cannot write the checkpoint of step {step} in {folder} ({reason}); "
                              + (f"the previous checkpoint {previous} is intact" if previous
                                 else "no earlier checkpoint exists")) from None
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, checkpoint: Path) -> dict:
    """Load the optimizer, scheduler, RNG and data state of `checkpoint` into the prepared
    objects; the unlogged metric sums this process saved with it (`save_checkpoint`'s window)."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as exc:  # another model shape, a damaged file: the checkpoint, not our bug
        raise DraftsmithError(f"cannot resume from {checkpoint}: {first_lines(exc)}") from None
    saved = checkpoint / f"window-{accelerator.process_index}.json"
    return json.loads(saved.read_text()) if saved.is_file() else {}


def remove_unfinished_checkpoints(out_dir: Path) -> None:
    """Main process, before a run starts: the folders of saves that did not finish (no
    step.json). accelerate's rotation would count them, and they hold nothing to resume."""
    for folder in checkpoint_folders(out_dir):
        if not (folder / "step.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)


def last_finite_checkpoint(out_dir: Path) -> tuple[Path | None, list[Path]]:
    """The newest checkpoint whose saved weights are all finite, and the newer ones that are not:
    a run stopped by a NaN names as good only a checkpoint that is (weights in safetensors files
    are read; a checkpoint without any is taken as it is)."""
    bad = []
    for folder in reversed(saved_checkpoints(out_dir)):
        if all(_finite_file(f) for f in sorted(folder.rglob("*.safetensors"))):
            return folder, bad
        bad.append(folder)
    return None, bad


def _finite_file(file: Path) -> bool:
    try:
        with open_safetensors(file) as f:
            return all(not t.is_floating_point() or bool(t.isfinite().all()) for t in map(f.get_tensor, f.keys()))
    except DraftsmithError:  # damaged since it was saved: no good either
        return False


def resume_point(resume: bool | str, out_dir: Path) -> tuple[Path | None, int | None]:
    """The checkpoint train.resume names (true: the run folder's latest) and its step; (None, None) for a fresh run."""
    if resume is True:
        path = latest_checkpoint(out_dir)
        if path is None:
            raise DraftsmithError(f"train.resume=true but {out_dir}/{CHECKPOINTS} holds no checkpoint")
    elif resume:
        path = Path(resume)
    else:
        return None, None
    return path, check_checkpoint(path)
