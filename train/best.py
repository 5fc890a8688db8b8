"""The run's best weights by validation, kept in RUN/best beside the last (models/run_weights.py).

A drafter's worth is its acceptance, so a run is judged by the tau it estimates on held-out
rows (`val/tau_est`, as SpecForge picks `<run>-best` by its simulated acceptance length);
a method that estimates none (MTP in pretraining, a draft model) by its validation loss.
Each validation that beats the best so far rewrites RUN/best whole (atomic_dir), with
best.json naming the step, metric and value. A resumed run keeps the best of the steps it
continues from; one written past the resumed step belongs to the abandoned trajectory and
is set aside with that trajectory's checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from pathlib import Path
from typing import Callable

from draftsmith.fsutil import atomic_dir, read_json, write_json
from draftsmith.models.run_weights import BEST, BEST_RECORD
from draftsmith.train.run_folder import ABANDONED

log = logging.getLogger(__name__)

# metric, higher is better: the first a validation reports decides
CRITERIA = (("val/tau_est", True), ("val/loss", False))


def criterion(val: dict[str, float]) -> tuple[str, bool] | None:
    return next(((name, higher) for name, higher in CRITERIA if name in val), None)


class BestWeights:
    """Keeps RUN/best; `writer` is the main process (the others only follow the values)."""

    def __init__(self, out_dir: Path, resume_step: int | None, writer: bool):
        self.folder = out_dir / BEST
        self.writer = writer
        self.value: float | None = None
        record = self.folder / BEST_RECORD
        if not writer or not record.is_file():  # only the writer compares: the others never read the folder
            return
        saved = read_json(record)
        if resume_step is not None and saved["step"] <= resume_step:
            self.value = saved["value"]
        else:  # a fresh run's folder holds none (check_owner); a resumed run's later best is set aside
            aside = out_dir / ABANDONED / f"{BEST}-step{saved['step']}-{uuid.uuid4().hex[:6]}"
            aside.parent.mkdir(exist_ok=True)
            os.rename(self.folder, aside)
            log.warning("draftsmith: the best weights of step %d (past the resumed step) are kept in %s",
                        saved["step"], aside)

    def offer(self, val: dict[str, float], step: int, write: Callable[[Path], object]) -> bool:
        """Keep the weights `write(folder)` writes if `val` beats the best so far."""
        found = criterion(val)
        if found is None:
            return False
        metric, higher = found
        value = val[metric]
        if not math.isfinite(value):
            return False
        if self.value is not None and not (value > self.value if higher else value < self.value):
            return False
        self.value = value
        if self.writer:
            with atomic_dir(self.folder) as tmp:
                write(tmp)
                write_json(tmp / BEST_RECORD, {"step": step, "metric": metric, "value": value})
            log.debug("best weights: step %d, %s %.4g", step, metric, value)
        return True
