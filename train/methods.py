"""What a training method supplies to the one loop, and the registry of methods.

A method owns its trainable module, its datasets and its loss; the loop in `loop.py` owns
everything else (devices, precision, accumulation, schedule, checkpoints, trackers).
A frozen target a method reads from is kept outside the trainable module: it is never
given to the optimizer and never wrapped for training.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.recipe import Recipe

# method name -> module defining `Method` (a TrainMethod subclass)
REGISTRY = {
    "mtp": "draftsmith.train.method_mtp",
    "draft_lm": "draftsmith.train.method_draft_lm",
    "eagle3": "draftsmith.train.method_eagle3",
    "dflash": "draftsmith.train.method_dflash",
    "dspark": "draftsmith.train.method_dflash",
}


class TrainMethod:
    """Base class: subclasses set `model`, `train_data`, `eval_data` in __init__."""

    model: nn.Module
    train_data: Any  # a map-style dataset of dicts of equal-shape tensors
    eval_data: Any

    def __init__(self, recipe: Recipe, device: torch.device):
        self.recipe = recipe
        self.device = device

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].numel())

    def save(self, model: nn.Module, out_dir: Path) -> Path:
        """Write the final artifact (atomically) and return its folder."""
        raise NotImplementedError


def build_method(recipe: Recipe, device: torch.device) -> TrainMethod:
    name = recipe.method.name
    if name not in REGISTRY:
        raise DraftsmithError(f"method.name: unknown method {name!r} (known: {', '.join(REGISTRY)})")
    try:
        module = importlib.import_module(REGISTRY[name])
    except ModuleNotFoundError as exc:
        raise DraftsmithError(f"method {name!r} cannot be trained in this build ({exc.name} missing)") from None
    return module.Method(recipe, device)
