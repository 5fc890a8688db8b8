"""What a training method supplies to the one loop, and `build_method`, which finds a
recipe's method in the registry (`draftsmith/registry.py`, the one place methods are listed).

A method owns its trainable module, its datasets and its loss; the loop in `loop.py` owns
everything else (devices, precision, accumulation, schedule, checkpoints, trackers).
A frozen target a method reads from is kept outside the trainable module: it is never
given to the optimizer and never wrapped for training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.recipe import Recipe


class TrainMethod:
    """Base class: subclasses set `model`, `train_data`, `eval_data` in __init__."""

    model: nn.Module
    train_data: Any  # a map-style dataset of dicts of equal-shape tensors, or a stream (an IterableDataset)
    eval_data: Any
    packs: bool = False  # its loss reads a packed batch's position_ids (data.packing, data/packing.py)

    def __init__(self, recipe: Recipe, device: torch.device):
        self.recipe = recipe  # a method may replace it with a copy holding what it decided (recipe.yaml records it)
        self.device = device

    def train_tokens(self) -> dict[str, torch.Tensor]:
        """The training rows' token columns [N, T] (`attention_mask` sizes data.group_by_length's groups)."""
        return self.train_data[:]

    def build_drafter(self) -> nn.Module:
        """The fresh module this method trains, from the recipe's method keys and the target (or
        its tokenizer): one call to its model class's `from_target`, never a registry lookup."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], step: int, micro: int = 0,
             total_steps: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss, metrics) of one micro-batch; `micro` numbers the run's micro-batches (the
        loop's count, resumed with it; validation numbers its own batches), for methods that
        draw random numbers per batch; `total_steps` is the run's length in optimizer steps,
        known to the loop once the data is (train.num_epochs), for losses that follow it."""
        raise NotImplementedError

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """The batch's real tokens (padding left out where a mask marks it)."""
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())

    def save(self, model: nn.Module, out_dir: Path) -> Path:
        """Write the final artifact (atomically) and return its folder."""
        raise NotImplementedError


def build_method(recipe: Recipe, device: torch.device) -> TrainMethod:
    return recipe.method.spec.load("training")(recipe, device)
