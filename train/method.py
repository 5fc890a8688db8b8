"""What a training method supplies to the one loop, and `build_method`, which finds a
recipe's method in the registry (`draftsmith/registry.py`, the one place methods are listed).

A method owns its trainable module, its datasets and its loss; the loop in `loop.py` owns
everything else (devices, precision, accumulation, schedule, checkpoints, trackers).
A frozen target a method reads from is kept outside the trainable module: it is never
given to the optimizer and never wrapped for training.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.models.model_dir import target_folder
from draftsmith.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The sizes a benchmark of one training step asks for (scripts/bench_train.py), said
    without naming a method; each method turns those it has into its keys (`step_keys`)."""

    vocab_size: int  # the target's; its last id is left out of the batch, free to be a mask token
    draft_vocab_size: int  # a drafter's own vocabulary, where it has one
    anchors: int  # blocks drafted per sequence, where a drafter drafts blocks at anchors
    drafter_layers: int  # the drafter's decoder layers, where it stacks several (0: its own rule)
    target_layers: int


class TrainMethod:
    """Base class: subclasses set `model`, `train_data`, `validation_data` in __init__.

    The classmethods below build a drafter, its features and its loss from explicit inputs
    alone (a target in memory, method keys), so that a benchmark builds a method's training
    step without a run or a name (scripts/bench_train.py, scripts/bench_ablation.py); a
    method's own `build_drafter`, `extract` and `loss` go through them, so what is timed is
    what trains."""

    model: nn.Module
    train_data: Any  # a map-style dataset of dicts of equal-shape tensors, or a stream (an IterableDataset)
    validation_data: Any
    packs: bool = False  # its loss reads a packed batch's position_ids (data.packing, data/packing.py)
    # Why it cannot train under ZeRO-3 ("": it can): ZeRO-3 gathers a parameter only inside its module's
    # forward, so a method that reads parameters otherwise says so here (train/launch_checks.py).
    no_zero3: str = ""

    def __init__(self, recipe: Recipe, device: torch.device, target_dir: Path | str | None = None):
        self.recipe = recipe  # a method may replace it with a copy holding what it decided (recipe.yaml records it)
        self.device = device
        # The target's folder: resolved once by the command (train/loop.py) and passed on; here
        # only for a method built on its own.
        self.target_dir = target_dir if target_dir is not None else target_folder(recipe.target.path)

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

    @classmethod
    def step_keys(cls, shape: StepShape) -> dict[str, Any]:
        """The method keys (`method.*`) that give this method's drafter `shape`'s sizes."""
        return {}

    @classmethod
    def drafter_config(cls, target_config, keys: dict[str, Any], tile: int):
        """The config of the drafter `new_drafter` builds over a target of `target_config` (a
        transformers config, or config.json as a dict) with method keys `keys`, at verify
        tile `tile`. What a run picks from its rows or tokenizer takes a placeholder here."""
        raise NotImplementedError

    @classmethod
    def new_drafter(cls, target: nn.Module, keys: dict[str, Any], tile: int) -> nn.Module:
        """A fresh drafter over the frozen `target` from method keys: what `build_drafter`
        builds before it reads anything of the run's rows."""
        raise NotImplementedError

    @classmethod
    def features_of(cls, drafter: nn.Module, out) -> dict[str, torch.Tensor]:
        """What the loss reads of one frozen target forward `out` (models/target.py: TargetOutput):
        nothing, for a method that reads the batch alone."""
        return {}

    @classmethod
    def loss_on(cls, model, target: nn.Module, batch: dict[str, torch.Tensor], features: dict[str, torch.Tensor],
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss, metrics) of one batch from its `features_of`; `model` computes the drafter's
        loss (the run's wrapped module, or a drafter's own `loss`); `generator` draws what the
        loss draws at random."""
        raise NotImplementedError

    @classmethod
    def step_note(cls, config) -> str:
        """What sizes one training step of a drafter of `config`, in a line."""
        return cls.describe(config)

    @classmethod
    def describe(cls, config) -> str:
        """The fields of a drafter config that tell one drafter from another, in a line."""
        return ", ".join(f"{name} {value}" for name, value in dataclasses.asdict(config).items())


def build_method(recipe: Recipe, device: torch.device, target_dir: Path | str | None = None) -> TrainMethod:
    return recipe.method.spec.load("training")(recipe, device, target_dir=target_dir)
