"""The target's KV caches, handled only here: transformers' DynamicCache (grows, is cropped
by -n), and its StaticCache (preallocated, fixed addresses: what CUDA graphs need), rolled back
by moving its write position.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.errors import DraftsmithError


def new_cache(model: nn.Module, rollback: int = 1):
    """A DynamicCache that can be rolled back by up to `rollback` tokens.

    Sliding-window and linear-attention layers drop rows past their window (or kernel) as
    they go, which a rejected draft's crop could then not undo; told to record their past,
    they keep those rows until the next `crop_cache`. A recurrent state (Mamba, gated
    delta-net) cannot be recomputed backwards: transformers (>= 5.25, the floor) keeps the
    states after each of a forward's last `rollback` tokens, so a verify of 1 + D tokens
    needs `rollback >= 1 + D`.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.activate_past_recording(recurrent_states_to_keep=max(1, int(rollback)))
    return cache


def new_static_cache(model: nn.Module, max_len: int):
    """A transformers StaticCache of `max_len` tokens, its buffers allocated by the first forward.

    A StaticLayer writes each forward at its length counter, `cumulative_length` (a device
    tensor, so that a compiled graph reads it rather than baking it in), and reports the
    whole buffer as the keys; the causal mask transformers builds from that counter hides
    every slot past the query positions. So keeping the first n tokens is setting the
    counter to n (`crop_cache`): rows past it are never read and the next forward overwrites
    them. A tree verify passes its own 4D mask, which must then span all `max_len` slots.
    """
    from transformers import StaticCache

    impl = getattr(model.config, "_attn_implementation", "") or ""
    if "flash" in impl:
        # flash-attn takes no mask: it would read the stale slots past the write position
        raise DraftsmithError(f"a static target cache needs a masked attention (sdpa or eager), "
                              f"not attn_implementation={impl!r}")
    cache = StaticCache(config=model.config, max_cache_len=int(max_len))
    if any(cache.is_sliding):
        raise DraftsmithError("a static target cache needs full-attention layers; use the dynamic cache")
    return cache


def is_static_cache(cache) -> bool:
    from transformers import StaticCache

    return isinstance(cache, StaticCache)


def cache_length(cache) -> int:
    """Tokens in the cache as a Python int (a StaticCache reports a device tensor)."""
    return int(cache.get_seq_length())


def crop_cache(cache, keep: int) -> None:
    """Keep the first `keep` tokens of the cache.

    A DynamicCache is cropped by -n (transformers 5 refuses a positive argument). A
    StaticCache gets its write position set to `keep` (see `new_static_cache`), without
    reading its length: that read would wait for the device.
    """
    if is_static_cache(cache):
        if not 0 <= keep <= cache.get_max_length():
            raise ValueError(f"cannot set a static cache of {cache.get_max_length()} slots to {keep} tokens")
        for layer in cache.layers:
            layer.cumulative_length.fill_(keep)
        return
    drop = cache.get_seq_length() - keep
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {keep}")
    if drop:
        _check_rollback(cache, drop)
    cache.crop(-drop)  # crop(0) too: it trims the rows that recording layers kept past their window


def _check_rollback(cache, drop: int) -> None:
    """Refuse a crop of `drop` tokens that the cache cannot undo exactly."""
    if not getattr(cache, "is_croppable", True):
        raise DraftsmithError("this target's cache cannot be rolled back past rejected drafts; "
                              "decode it without drafts")
    for layer in cache.layers:
        history = getattr(layer, "recurrent_states_history", {}).get(0)
        if history is not None and layer.is_recurrent_states_initialized[0] and drop > len(history):
            # transformers would restore a state from before the tokens it should keep
            raise ValueError(f"cannot roll a recurrent state back {drop} tokens: the cache kept {len(history)} "
                             "(new_cache's `rollback` sizes it)")


def tree_cache_problem(cache) -> str | None:
    """Why a tree's accepted path cannot be gathered in this cache (None: it can). The
    gather moves rows by absolute slot, which only plain full-attention layers keep."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if any(getattr(cache, "is_sliding", ())):
        return "this target has sliding-window layers"
    other = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in (DynamicLayer, StaticLayer)})
    if other:
        return f"this target's cache has {', '.join(other)} layers"
    return None


def keep_cache_rows(cache, first: int, rows: list[int]) -> None:
    """Move KV rows `rows` (absolute, increasing, each >= its destination) onto
    `first, first + 1, ...` and drop everything after them. Either kind of cache: a row's
    slot is its token position in both."""
    moved = [(dst, src) for dst, src in enumerate(rows, start=first) if dst != src]
    if moved:
        dst = torch.tensor([d for d, _ in moved])
        src = torch.tensor([s for _, s in moved])
        for layer in cache.layers:
            dst, src = dst.to(layer.keys.device), src.to(layer.keys.device)
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]
    crop_cache(cache, first + len(rows))
