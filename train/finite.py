"""A run stops at the first loss, gradient or weight that is not finite.

Checked before a step is logged or saved: a NaN would otherwise train on silently and be
written as the model. The stop names the last checkpoint whose weights are finite.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.train.checkpoints import last_finite_checkpoint


def first_not_finite(metrics: dict[str, float]) -> str | None:
    """The loss or gradient norm of one micro-batch that is NaN or infinite, in words."""
    for name, what in (("loss", "loss"), ("grad_norm", "gradient norm")):
        if not math.isfinite(metrics.get(name, 0.0)):
            return f"{what} is {metrics[name]}"
    return None


def weights_problem(model) -> str | None:
    """What is wrong with the weights, if any is NaN or infinite (one device read)."""
    # FSDP2 holds DTensors: each process checks its own shard (stop_if_not_finite gathers the verdict).
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]
    flags = [p.isfinite().all() for p in local if p.numel()]
    return None if not flags or bool(torch.stack(flags).all()) else "weights hold NaN or infinity"


def stop_if_not_finite(accelerator, problem: str | None, step: int, out_dir: Path) -> None:
    """End the run in one line at the first step whose loss, gradient or weights are not finite
    (on any process), before that step is logged or saved: a NaN would otherwise train on
    silently and be written as the model. The checkpoints already saved are kept as they are."""
    bad = problem is not None
    if accelerator.num_processes > 1:  # every process stops together, or the others would wait forever
        bad = bool(accelerator.reduce(torch.tensor([float(bad)], device=accelerator.device), reduction="sum").item())
    if not bad:
        return
    previous, bad = last_finite_checkpoint(out_dir)
    kept = (f"the last good checkpoint {previous} is kept (resume from it, e.g. with a lower train.lr)" if previous
            else "no checkpoint with finite weights had been saved")
    if bad:
        kept += f"; the later {', '.join(p.name for p in bad)} hold NaN, infinite or unreadable weights"
    problem = problem or "loss or weights of another process are not finite"
    raise DraftsmithError(f"step {step}: the training {problem}; stopped, {kept}")
