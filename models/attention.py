"""The accelerator paths of drafter training: attention backends and activation checkpointing.

DFlash/DSpark training blocks and EAGLE-3's training-time test attend under structured
masks (a block sees the context before its anchor and its own block; a TTT step sees the
causal context and its own chain). `attention_backend` in their configs picks how:

- "sdpa" (default): an explicit dense mask, as always (DFlash: SDPA; EAGLE-3: its own
  `attend`). CPU results are exactly those of this path.
- "flex": torch's flex_attention with a BlockMask built from the same visibility
  predicate (a `mask_mod`), so that only tiles holding a visible key are computed and no
  dense mask is stored. Compiled on an accelerator; on CPU it runs uncompiled and forward
  only (torch has no CPU backward for it), which is enough to check it against "sdpa".
- "auto": flex on CUDA, sdpa elsewhere.

flash-attn is not offered for drafter training: neither mask is a causal or varlen one.
Each DFlash block reads its own context prefix (varlen would copy that prefix per block),
and a TTT step adds keys of other steps on the diagonal.

`checkpointed` runs a layer under torch.utils.checkpoint (non-reentrant) when a drafter's
`gradient_checkpointing` is set: the same values and gradients, activations recomputed in
backward instead of stored.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith.errors import DraftsmithError

BACKENDS = ("sdpa", "flex", "auto")
_compiled_flex = None
_compiled_block_mask = None


def check_backend(value) -> None:
    if value not in BACKENDS:
        raise DraftsmithError(f"attention_backend {value!r} is not one of {', '.join(BACKENDS)}")


def use_flex(backend: str, device: torch.device) -> bool:
    """Whether a training pass on `device` takes the flex path."""
    return backend == "flex" or (backend == "auto" and torch.device(device).type == "cuda" and _flex_available())


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_module():
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        raise DraftsmithError(f"attention_backend flex needs torch >= 2.5 (this is {torch.__version__})") from None
    return flex_attention


def is_block_mask(mask) -> bool:
    if mask is None or isinstance(mask, torch.Tensor) or not _flex_available():
        return False
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def block_mask(mask_mod: Callable, batch: int | None, q_len: int, kv_len: int, device) -> object:
    """A flex BlockMask of `mask_mod(b, h, q, k) -> bool` (True: visible), the same for all heads."""
    global _compiled_block_mask
    flex = _flex_module()
    device = torch.device(device)
    if device.type == "cpu":  # uncompiled: the whole [batch, q_len, kv_len] mask is materialised once
        return flex.create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
    # Compiled, the mask is evaluated tile by tile and never stored whole.
    if _compiled_block_mask is None:
        _compiled_block_mask = torch.compile(flex.create_block_mask)
    return _compiled_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """Attention of q [B, h, Q, d] over k, v [B, kv, L, d] (grouped heads) where `mask` (a
    BlockMask) allows; returns [B, h, Q, d]."""
    global _compiled_flex
    flex = _flex_module()
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise DraftsmithError("attention_backend flex: torch has no flex-attention backward on CPU; "
                              "train with sdpa (or auto) there")
    # Under autocast SDPA computes in the autocast dtype; flex needs one dtype for all three.
    kind = q.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if kind == "cpu":  # uncompiled reference path; warns that it materialises the scores
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return flex.flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex.flex_attention)
    return _compiled_flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def positions_of(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The positions [B, T] of a batch's tokens: a packed batch's own (data/packing.py), else 0..T-1."""
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Which conversation each position of a row belongs to [B, T] (0, 1, ...): a new one
    starts wherever the position does not follow its predecessor, as transformers reads
    packed rows (masking_utils.find_packed_sequence_indices), so target and drafter agree."""
    step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
    return (step != 1).cumsum(-1)


def checkpointed(enabled: bool, fn: Callable, *args):
    """fn(*args), recomputed in backward rather than stored when `enabled` and grads are on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
