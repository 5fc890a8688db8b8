"""DFlash's training blocks and who sees what in them.

A training pass drafts many blocks per sequence at once: `sample_anchors` draws the anchors,
`make_blocks` lays out each block (the anchor token, then mask slots, at absolute positions,
models/dflash.py's conventions), and the masks here say which keys a block's queries read:
the context strictly before its anchor (of its own conversation in a packed row, within the
window on a sliding layer) and its own block, nothing of any other block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from draftsmith.models.attention import block_mask, document_ids, positions_of

if TYPE_CHECKING:  # dflash.py imports this module
    from draftsmith.models.dflash import DFlashConfig


def window_visibility(anchor_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Bool [B, 1, Q, K]: context key k within `window` positions before the anchor of query
    q's block (k >= anchor - window), every row of a block alike, as speculators' DFlash trains
    sliding layers (models/dflash/attention.py `create_anchor_block_mask_mod`). vLLM's
    sliding attention measures from each row instead, hiding up to block_size - 1 more keys
    at the window's far end: a departure of the engine's at its edge, not ours."""
    return (key_positions[:, None, :] >= anchor_positions[:, :, None] - window)[:, None]


@dataclass
class Blocks:
    """N blocks per sequence; draft j of block i is the token at anchors[:, i] + j."""

    anchors: torch.Tensor  # [B, N] (0 for padding blocks, which carry no labels)
    input_ids: torch.Tensor  # [B, N, block] anchor token, then MASK
    positions: torch.Tensor  # [B, N, block] anchor + slot
    labels: torch.Tensor  # [B, N, drafts]
    label_mask: torch.Tensor  # [B, N, drafts] float 0/1, a prefix: supervised drafts
    prev_tokens: torch.Tensor  # [B, N, drafts] the true token before each draft (teacher forcing)
    in_data: torch.Tensor  # [B, N, drafts] float 0/1: every loss-masked draft in the sequence, past gaps too
    context_positions: torch.Tensor  # [B, T] the context tokens' positions (a packed row's restart per conversation)
    docs: torch.Tensor | None  # [B, T] the conversation of each context token in a packed row; None: one per row


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None,
                   docs: torch.Tensor | None = None) -> torch.Tensor:
    """Up to `num_anchors` distinct random anchors per row (per conversation of a packed
    row, `docs`), sorted; -1 pads short rows.

    An anchor a is a loss-masked position whose next token is loss-masked too, in the same
    conversation, so that its first draft is supervised (in decoding the anchor is always a
    generated token)."""
    mask = loss_mask.bool()
    valid = mask[:, :-1] & mask[:, 1:]
    doc = torch.zeros_like(valid, dtype=torch.long) if docs is None else docs[:, :-1]
    if docs is not None:
        valid &= docs[:, :-1] == docs[:, 1:]
    device = generator.device if generator is not None else loss_mask.device
    keys = torch.rand(valid.shape, generator=generator, device=device).to(loss_mask.device)
    # Sorted by conversation, then valid ones first in random order: each conversation's first
    # num_anchors are its draw (one conversation per row: the row's first num_anchors).
    order = (keys.double().masked_fill(~valid, 2.0) + 4.0 * doc).argsort(dim=1)  # exact to ~2**50 conversations
    index = torch.arange(order.shape[1], device=order.device).expand_as(order)
    sorted_doc = torch.gather(doc, 1, order)
    starts = torch.diff(sorted_doc, dim=1, prepend=sorted_doc[:, :1] - 1) != 0
    rank = index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    taken = torch.gather(valid, 1, order) & (rank < num_anchors)
    count = max(1, int(taken.sum(1).max()) if taken.numel() else 0)
    anchors = torch.where(taken, order, torch.full_like(order, valid.shape[1] + 1)).sort(dim=1).values[:, :count]
    return anchors.masked_fill(anchors > valid.shape[1], -1)


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                config: DFlashConfig, position_ids: torch.Tensor | None = None) -> Blocks:
    """The training blocks of given anchors [B, N] (-1: padding); `position_ids` [B, T] of a
    packed batch: a block takes its anchor's position, and its drafts stop where the
    anchor's conversation ends."""
    seq = input_ids.shape[1]
    drafts, size = config.drafts_per_block, config.block_size
    real = anchors >= 0
    anchors = anchors.clamp_min(0)
    slots = torch.arange(size, device=input_ids.device)
    ids = torch.full((*anchors.shape, size), config.mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[..., 0] = torch.gather(input_ids, 1, anchors)
    where = anchors[..., None] + torch.arange(1, drafts + 1, device=input_ids.device)  # draft j at a + j
    inside = where < seq
    where = where.clamp_max(seq - 1)
    gather = lambda t: torch.gather(t[:, None, :].expand(-1, anchors.shape[1], -1), 2, where)  # noqa: E731
    labels = gather(input_ids)
    in_data = inside & gather(loss_mask.bool()) & real[..., None]
    positions = positions_of(input_ids, position_ids)
    docs = None if position_ids is None else document_ids(positions)
    if docs is not None:
        in_data &= gather(docs) == torch.gather(docs, 1, anchors)[..., None]
    # Supervise a prefix only: acceptance stops at the first draft that leaves the data.
    label_mask = in_data.long().cumprod(-1).float()
    prev = torch.cat([ids[..., :1], labels[..., :-1]], dim=-1)
    block_positions = torch.gather(positions, 1, anchors)[..., None] + slots
    return Blocks(anchors, ids, block_positions, labels, label_mask, prev, in_data.float(), positions, docs)


def block_visibility(anchors: torch.Tensor, context_len: int, block_size: int,
                     docs: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask [B, 1, N*block, T + N*block] over keys [context; block 0; block 1; ...].

    Query q of block i = q // block sees context key k iff k < anchors[:, i] (and, in a
    packed row, k is of the anchor's conversation `docs`) and block key k iff
    (k - T) // block == i: the context strictly before its anchor and its own block,
    nothing of any other block. `block_mask_mod` is the same predicate for flex attention.
    """
    queries = anchors.shape[1] * block_size
    block_of = torch.arange(queries, device=anchors.device) // block_size
    context = torch.arange(context_len, device=anchors.device) < anchors[:, block_of, None]  # [B, Q, T]
    if docs is not None:
        anchor_docs = torch.gather(docs, 1, anchors.clamp_min(0))
        context &= docs[:, None, :] == anchor_docs[:, block_of, None]
    own = (block_of[:, None] == block_of[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([context, own], dim=-1)[:, None]


def block_mask_mod(anchors: torch.Tensor, context_len: int, block_size: int, docs: torch.Tensor | None = None,
                   window: int = 0, context_positions: torch.Tensor | None = None,
                   block_positions: torch.Tensor | None = None) -> Callable:
    """`block_visibility`'s predicate as a flex-attention mask_mod (query q, key k), and with
    `window` that of a sliding-window layer (`DFlashDrafter.layer_masks`)."""
    anchor_docs = None if docs is None else torch.gather(docs, 1, anchors.clamp_min(0))

    def mask_mod(b, h, q, k):
        block = q // block_size
        context = k < anchors[b, block]
        inside = k.clamp(max=context_len - 1)  # block keys index past the context: clamped, and not read there
        if docs is not None:
            context = context & (docs[b, inside] == anchor_docs[b, block])
        if window:  # `window_visibility`'s rule
            context = context & (context_positions[b, inside] >= block_positions[b, block * block_size] - window)
        return torch.where(k < context_len, context, (k - context_len) // block_size == block)

    return mask_mod


def training_mask(anchors: torch.Tensor, context_len: int, block_size: int, flex: bool = False,
                  docs: torch.Tensor | None = None, window: int = 0, context_positions=None, block_positions=None):
    """The visibility of a training pass: the dense mask (of full-attention layers: the window
    is `layer_masks`'), or the flex BlockMask of the same rule (with `window`, a sliding layer's)."""
    if not flex:
        return block_visibility(anchors, context_len, block_size, docs)
    queries = anchors.shape[1] * block_size
    mask_mod = block_mask_mod(anchors, context_len, block_size, docs, window, context_positions, block_positions)
    return block_mask(mask_mod, anchors.shape[0], queries, context_len + queries, anchors.device)
