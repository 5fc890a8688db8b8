"""Batches without padding waste: each batch is cut to its own longest row, and rows of
similar length can be drawn together.

Rows are stored padded on the right to `train.seq_len` (a feature cache stores them so too),
and `trim_padding` cuts a batch to the longest row in it: every position past it is padding
in every row, so dropping it changes no loss (attention masks hide padded keys, loss masks
skip padded labels) and saves its compute in the target forward and the drafter.

With `data.group_by_length`, `LengthGroupedSampler` draws batches of similar length, so the
longest row of a batch is close to the others (the bucketing of transformers' `group_by_length`).
With `data.packing`, a batch's rows are laid end to end instead (data/packing.py).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler, default_collate

# Rows shuffled together, then sorted by length, per batch drawn: transformers' LengthGroupedSampler
# uses 50 (megabatches of 50 batches), enough to find neighbours in length yet keep batches varied.
MEGABATCH = 50


def real_length(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index after its last real token (rows are padded on the right)."""
    positions = torch.arange(1, attention_mask.shape[-1] + 1, device=attention_mask.device)
    return (attention_mask.bool() * positions).amax(-1)


def trim_padding(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`default_collate`, then every per-position tensor cut to the batch's longest row.

    Per-position tensors are those whose second dimension is the rows' length (the token
    columns, and a feature cache's hidden states and logits); rows without an
    `attention_mask` (packed pretraining text, all real) are left as they are."""
    batch = default_collate(rows)
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return batch
    length = mask.shape[1]
    longest = max(1, int(real_length(mask).max()))
    if longest == length:
        return batch
    return {k: v[:, :longest] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == length else v
            for k, v in batch.items()}


class LengthGroupedSampler(Sampler[int]):
    """Row indices in an order where each run of `batch_size` rows has similar lengths.

    Per epoch: a permutation drawn from (seed, epoch) alone, cut into megabatches of
    `MEGABATCH * batch_size` rows, each sorted by length and cut into batches, as
    transformers' LengthGroupedSampler does. Two departures: the batches of a megabatch are
    drawn in a random order (transformers' go longest to shortest, and a dataset within one
    megabatch would see the same order every epoch), and the longest row is not moved to
    the first batch. The order being a function of (seed, epoch), a resumed run sees the
    same batches."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int):
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # accelerate calls it through the prepared loader
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=gen).tolist()
        size = MEGABATCH * self.batch_size
        for start in range(0, len(order), size):
            chunk = order[start:start + size]
            # Rows beyond whole batches (the data's last megabatch only): random ones, yielded
            # last, so that every batch before them stays whole and grouped.
            spare = len(chunk) % self.batch_size
            ranked = sorted(chunk[spare:], key=lambda i: -self.lengths[i])
            batches = [ranked[i:i + self.batch_size] for i in range(0, len(ranked), self.batch_size)]
            for b in torch.randperm(len(batches), generator=gen).tolist():
                yield from batches[b]
            yield from chunk[:spare]


def padding_share(lengths: list[int], batches: list[list[int]]) -> float:
    """The fraction of positions that are padding when each batch is cut to its longest row."""
    total = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / max(1, total)


def batches_of(order: list[int], batch_size: int) -> list[list[int]]:
    """`order` cut into whole batches (the loop drops a short last one)."""
    return [order[i:i + batch_size] for i in range(0, math.floor(len(order) / batch_size) * batch_size, batch_size)]
