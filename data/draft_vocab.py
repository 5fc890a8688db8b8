"""The draft vocabulary of EAGLE-3: the target tokens the drafter can propose.

A drafter's output head over a 128k vocabulary costs as much as the rest of it, while a
few tens of thousands of tokens cover nearly every token it will ever need to propose.
So its head covers the N most frequent target tokens of the loss-masked training data
(the tokens it is trained to predict), and two buffers translate:

    d2t: int64 [N]     draft id i is target id  i + d2t[i]
    t2d: bool  [V]     t2d[j] says whether target id j has a draft id

Draft ids are assigned in increasing target-id order, so d2t is a non-decreasing list of
non-negative offsets: the layout SGLang and vLLM load (`hot_token_id = d2t + arange(N)`).
"""

from __future__ import annotations

from typing import Iterable

import torch

from draftsmith.errors import DraftsmithError


def count_tokens(token_id_batches: Iterable, loss_masks: Iterable | None, vocab_size: int) -> torch.Tensor:
    """How often each target token occurs at loss-masked positions: int64 [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    masks = iter(loss_masks) if loss_masks is not None else None
    for n, ids in enumerate(token_id_batches):
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if masks is not None:
            mask = next(masks, None)
            if mask is None:
                raise DraftsmithError(f"draft vocabulary: batch {n} of token ids has no loss mask")
            mask = torch.as_tensor(mask).reshape(-1).bool()
            if mask.shape != ids.shape:
                raise DraftsmithError(
                    f"draft vocabulary: batch {n} has {ids.numel()} token ids but a loss mask of {mask.numel()}"
                )
            ids = ids[mask]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            raise DraftsmithError(f"draft vocabulary: token id {bad} is outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(
    token_id_batches: Iterable,
    loss_masks: Iterable | None,
    target_vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent loss-masked target tokens.

    Deterministic: ties in frequency go to the lower token id, and when the data holds
    fewer distinct tokens than the draft vocabulary, the lowest unused ids fill it up.
    `draft_vocab_size == target_vocab_size` is the identity (d2t all zeros, t2d all True).
    """
    if draft_vocab_size > target_vocab_size:
        raise DraftsmithError(
            f"draft vocabulary of {draft_vocab_size} tokens is larger than the target vocabulary of {target_vocab_size}"
        )
    if draft_vocab_size < 1:
        raise DraftsmithError(f"draft vocabulary size must be at least 1, got {draft_vocab_size}")
    counts = count_tokens(token_id_batches, loss_masks, target_vocab_size)
    # A stable sort by descending count keeps equal counts in increasing id order, which
    # is both the tie-break and the padding rule (unseen tokens: count 0, lowest id first).
    order = torch.sort(counts, descending=True, stable=True).indices
    return vocab_maps(order[:draft_vocab_size], target_vocab_size)


def vocab_maps(target_ids: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a set of distinct target ids (any order)."""
    chosen = torch.sort(torch.as_tensor(target_ids, dtype=torch.long)).values
    if chosen.numel() != torch.unique(chosen).numel():
        raise DraftsmithError("draft vocabulary: target ids must be distinct")
    d2t = chosen - torch.arange(chosen.numel())
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d
