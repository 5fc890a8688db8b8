"""The tile rule (DESIGN.md section 3), in one place for every part that sizes a draft.

Verify kernels pack the G query heads that share a KV head with the 1 + D query tokens
into the rows of one tile, so one tile holds the verify while G * (1 + D) <= T:

    D = max(0, T // G - 1)

The planner built on it (tables, reading configs, the CLI) is `eval/tile.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError

# GPT-2 style configs (GPT-BigCode/StarCoder, old Falcon) spell the head count `n_head`.
_HEAD_KEYS = ("num_attention_heads", "n_head")


@dataclass(frozen=True)
class TilePlan:
    """Figures named as in DESIGN.md section 3; H and KV are whole-model counts."""

    H: int  # query heads
    KV: int  # KV heads (1 for multi-latent attention)
    G: int  # query heads per KV head on one tensor-parallel rank
    tile: int  # rows per tile, T
    tp: int  # tensor-parallel degree
    D: int  # drafts that fit one tile with the root token
    mla: bool  # multi-latent attention: all heads share one latent KV


def has_heads(config: dict) -> bool:
    return any(config.get(key) for key in _HEAD_KEYS)


def plan_tile(config, tile: int = 128, tp: int = 1) -> TilePlan:
    """Size the draft for `config` (a dict or a transformers config) on a verify kernel
    with `tile` rows at tensor parallel `tp`."""
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    if tile < 1 or tp < 1:
        raise DraftsmithError(f"tile ({tile}) and tp ({tp}) must be positive")
    heads = next((config[key] for key in _HEAD_KEYS if config.get(key)), None)
    if heads is None:
        raise DraftsmithError("config has no num_attention_heads")
    mla = config.get("kv_lora_rank") is not None
    if mla:
        # MLA caches one latent vector per token that every query head attends to.
        kv = 1
    elif config.get("num_key_value_heads") is not None:
        kv = config["num_key_value_heads"]
    elif config.get("multi_query"):
        kv = 1
    else:
        kv = heads  # plain multi-head attention
    if kv < 1 or heads % kv:
        raise DraftsmithError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if heads % tp:
        raise DraftsmithError(f"num_attention_heads {heads} does not split over tp {tp}")
    # KV heads are split across ranks, or replicated when there are fewer than ranks.
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise DraftsmithError(f"num_key_value_heads {kv} does not split over tp {tp}")
    group = (heads // tp) // max(1, kv // tp)
    return TilePlan(H=heads, KV=kv, G=group, tile=tile, tp=tp, D=max(0, tile // group - 1), mla=mla)
