"""Packed post-hoc batches (`data.packing`): a batch's conversations end to end in as few
rows of `train.seq_len` as hold them, as speculators (multipack) and NeMo Automodel pack.

A batch cut to its longest row (data/batching.py) still pays for the padding of its
shorter rows; packed, the same conversations fill rows instead. Each conversation keeps
its own positions (`position_ids` restart at 0 where it starts), which is all that tells
conversations apart: the target sees them through transformers' packed-sequence masks
(position ids and no 2-D mask: block-diagonal causal attention on every backend), and a
drafter's loss reads the document of each position from the same column
(`models/attention.py: document_ids`), so nothing attends across two conversations and
the loss of a packed batch is the loss of its rows unpacked.

The batch still holds `train.batch_size` conversations (one step trains as many as
unpacked): what packing saves is the padding, not the step count, so the schedule, the
epochs and a resume are the unpacked run's.
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from draftsmith.data.batching import real_length


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `capacity`, longest first, each into the first
    bin it fits (first-fit decreasing: within 11/9 of the fewest bins)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        spot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if spot is None:
            bins.append([])
            room.append(capacity)
            spot = len(bins) - 1
        bins[spot].append(i)
        room[spot] -= lengths[i]
    return bins


def pack_rows(rows: list[dict[str, torch.Tensor]], capacity: int | None = None) -> dict[str, torch.Tensor]:
    """The collate of a packed batch: every per-position tensor of the rows (their first
    dimension the row length: token columns, a feature cache's hidden states and logits)
    laid end to end in first-fit rows, padded on the right to the longest, with a
    `position_ids` column; `capacity` defaults to the rows' own (padded) length. Rows
    without an `attention_mask` (pretraining text, packed already) are collated as they are."""
    if "attention_mask" not in rows[0]:
        return default_collate(rows)
    width = rows[0]["attention_mask"].shape[0]
    lengths = [max(1, int(real_length(r["attention_mask"]))) for r in rows]
    bins = first_fit(lengths, capacity or width)
    longest = max(sum(lengths[i] for i in b) for b in bins)
    per_position = [k for k, v in rows[0].items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == width]
    out = {k: rows[0][k].new_zeros((len(bins), longest, *rows[0][k].shape[1:])) for k in per_position}
    positions = torch.zeros(len(bins), longest, dtype=torch.long)
    for b, members in enumerate(bins):
        start = 0
        for i in members:
            n = lengths[i]
            for k in per_position:
                out[k][b, start:start + n] = rows[i][k][:n]
            positions[b, start:start + n] = torch.arange(n)
            start += n
        positions[b, start:] = torch.arange(longest - start)  # the padding: a document of its own
    out["position_ids"] = positions
    return out
