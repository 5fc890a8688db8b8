"""DFlash's reference rules: the published drafters' choices (z-lab's, SpecForge's,
DeepSpec's) that size a drafter from its target where a recipe leaves a field unset: the loss
decay by drafts per block, the context layers spread over the target's depth, the drafter's
depth and KV heads, and the block that fills one verify tile (models/tile.py). `DFlashConfig`
(dflash.py) derives its fields from them; DSpark's config extends it.
"""

from __future__ import annotations

from draftsmith.errors import DraftsmithError
from draftsmith.fields import DEFAULT_TILE
from draftsmith.models.dflash_tile import auto_block
from draftsmith.models.tile import plan_tile

# Loss decay by drafts per block: DFlash's gamma 7 / 5 / 4 for B = 16 / 10 / 8 (15 / 9 / 7
# drafts). Keyed by drafts so that DSpark's convention gets the same decay per draft.
_GAMMA_BY_DRAFTS = ((7, 4.0), (9, 5.0), (15, 7.0))


def default_gamma(num_drafts: int) -> float:
    """Piecewise-linear through the published points, extended linearly below them and
    capped at the largest published gamma, 7 (a recipe may set more)."""
    pts = _GAMMA_BY_DRAFTS
    i = 0 if num_drafts <= pts[1][0] else 1
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return min(pts[-1][1], max(1.0, y0 + (num_drafts - x0) * (y1 - y0) / (x1 - x0)))


def reference_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab's and SpecForge's `build_target_layer_ids` as written, for any depth: what they
    read from a folder whose config names no layer ids (n: its drafter layers)."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def spread_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """DFlash's context layers: round(1 + i*(L - 4)/(n - 1)) (z-lab's and SpecForge's
    `build_target_layer_ids`: [1, 9, 17, 25, 33] for 36 layers), or L // 2 for one. A target
    too shallow for that spread to give n distinct layers (it spans layers 1 .. L - 3) gets
    n layers spread evenly over 0 .. L - 2 instead: the last layer's output mostly encodes
    the next token the target already verifies, which is why the references skip it."""
    ids = reference_layer_ids(num_target_layers, n)
    if len(set(ids)) < n and n <= num_target_layers - 1:
        ids = [round(i * (num_target_layers - 2) / (n - 1)) for i in range(n)]
    return ids


# The drafter's shape as the reference configs choose it (docs/design.md section 7):
# SpecForge configs/qwen2.5-0.5b-dflash.json (24 target layers), qwen3-4b-dflash.json and
# qwen3-8b-dflash.json (36), lfm2.5-1.2b-instruct-dflash.json (16), z-lab's Qwen3 and
# Llama-3.1 drafters and DeepSpec config/dflash/dflash_qwen3_8b.py all read 5 target layers,
# and all but LFM's have 5 layers of their own.
REFERENCE_DEPTH = 5


REFERENCE_CONTEXT_LAYERS = 5


# Query heads per KV head in those drafters: 4 (Qwen3-4B/8B, Llama-3.1-8B, LFM) and at most 7
# (Qwen2.5-0.5B: 14 over 2). They copy the target's grouping because their targets group
# like that; the drafter's KV heads never enter the target's verify tile.
REFERENCE_MAX_GROUP, REFERENCE_GROUP = 7, 4


def reference_depth(num_target_layers: int) -> int:
    """5 layers, but never deeper than half a shallow target: a drafter as deep as its target
    would cost a verify pass per block."""
    return max(1, min(REFERENCE_DEPTH, num_target_layers // 2))


def reference_context_layers(num_target_layers: int) -> int:
    """5 context layers, at most every layer but the last of a shallow target."""
    return max(1, min(REFERENCE_CONTEXT_LAYERS, num_target_layers - 1))


def reference_kv_heads(num_heads: int, target_kv_heads: int) -> int:
    """The target's KV heads where its grouping is one a reference drafter has (2 or more KV
    heads, at most 7 query heads each); otherwise (MQA, or wider groups) the fewest KV heads
    that divide the query heads with at most 4 per KV head, the Qwen3 and Llama drafters'."""
    group = num_heads // max(1, target_kv_heads)
    if target_kv_heads >= 2 and group <= REFERENCE_MAX_GROUP:
        return target_kv_heads
    return next(kv for kv in range(1, num_heads + 1) if num_heads % kv == 0 and num_heads // kv <= REFERENCE_GROUP)


def tile_draft_budget(target_config, tile: int = DEFAULT_TILE) -> tuple[int, int]:
    """(G, D) of the tile rule at tp 1."""
    plan = plan_tile(target_config, tile)
    return plan.G, plan.D


def auto_block_size(target_config, tile: int = DEFAULT_TILE, first_prediction_slot: int = 1) -> int:
    """The block that fills one verify tile, 1 + D for DFlash and D for DSpark, but never
    past 16, the largest published DFlash block (`models.dflash_tile.auto_block`); a recipe that
    sets block_size gets what it sets."""
    plan = plan_tile(target_config, tile)
    group, budget = plan.G, plan.D
    if budget == 0:
        raise DraftsmithError(
            f"block_size auto: no room for drafts, G = {group} query heads per KV head fill the "
            f"{tile}-row tile with the root token alone; a tile of {2 * group} rows would fit one draft"
        )
    return auto_block(plan, first_prediction_slot)
