"""Learning-rate schedules by name (`train.lr_schedule`) and the run's length in steps
(`train.max_steps`, or `train.num_epochs` over the training rows).

Every name but the default is transformers' own (`get_scheduler`). The default,
`cosine_with_min_lr`, is built here: it has the shape of transformers' schedule of that name
(linear warmup, then a cosine from lr down to lr * train.min_lr_ratio) but its warmup starts
at lr / (warmup + 1) where transformers' starts at 0, which would spend the first optimizer
step at a learning rate of 0; the golden loss curves were recorded with it.
"""

from __future__ import annotations

import math

import torch

from draftsmith.errors import DraftsmithError

DEFAULT = "cosine_with_min_lr"
# transformers' schedules that need nothing beyond warmup and length (reduce_lr_on_plateau reads
# a metric, warmup_stable_decay a decay length, greedy its own settings: none is in the recipe).
TRANSFORMERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                "inverse_sqrt", "cosine_warmup_with_min_lr")
SCHEDULES = (DEFAULT, *TRANSFORMERS)
MIN_LR = ("cosine_warmup_with_min_lr",)  # the transformers schedules that read train.min_lr_ratio


def check_schedule(name: str) -> None:
    if name not in SCHEDULES:
        raise DraftsmithError(f"train.lr_schedule: expected one of {', '.join(SCHEDULES)}, got {name!r}")


def warmup_steps(warmup_ratio: float, total: int) -> int:
    return max(0, round(warmup_ratio * total))


def cosine_with_min_lr(optimizer, total: int, warmup: int, min_lr_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_scheduler(optimizer, name: str, total: int, warmup_ratio: float, min_lr_ratio: float):
    """The schedule `name` over `total` optimizer steps, `warmup_ratio` of them warming up."""
    check_schedule(name)
    warmup = warmup_steps(warmup_ratio, total)
    if name == DEFAULT:
        return cosine_with_min_lr(optimizer, total, warmup, min_lr_ratio)
    from transformers import get_scheduler

    extra = {"min_lr_rate": min_lr_ratio} if name in MIN_LR else None
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                         scheduler_specific_kwargs=extra)


def total_steps(max_steps: int, num_epochs: float, steps_per_epoch: int) -> int:
    """The run's optimizer steps: `max_steps`, or `num_epochs` passes of `steps_per_epoch`
    (a fraction of an epoch rounds up to a whole step). recipe.validate makes one of them 0."""
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(num_epochs * steps_per_epoch))
