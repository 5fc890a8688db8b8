"""DFlash's block by the tile rule (models/tile.py): `block_size: auto` fills one verify tile,
capped where the published drafters stop, and the line `draftsmith plan` prints for it
(the registry's `plan_line`). DSpark's block (models/dspark.py) is sized by the same rule.
"""

from __future__ import annotations

from draftsmith.models.tile import TilePlan

# Every published DFlash configuration uses a block of 8, 10 or 16 (loss decay gamma 4 to
# 7); a block past 16 is untested territory, so `block_size: auto` stops there.
MAX_AUTO_BLOCK = 16


def auto_block(plan: TilePlan, first_prediction_slot: int = 1) -> int:
    """`block_size: auto`: the D drafts of one tile plus the slots before the first prediction
    (DFlash reads draft 1 from slot 1: 1 + D; DSpark from slot 0: D), capped at 16."""
    return min(plan.D + first_prediction_slot, MAX_AUTO_BLOCK)


def block_line(label: str, plan: TilePlan, first_prediction_slot: int) -> str:
    """The plan's line for a block drafter: its auto block, the drafts it gives, and the cap
    where it applies."""
    block = auto_block(plan, first_prediction_slot)
    capped = (f", capped at {MAX_AUTO_BLOCK} (the largest published DFlash block; set block_size and gamma in "
              "the recipe to go past it)") if block < plan.D + first_prediction_slot else ""
    return f"block  {label} block_size auto = {block} ({block - first_prediction_slot} drafts){capped}"


def plan_line(plan: TilePlan) -> str:
    """DFlash's line of `draftsmith plan` (slot 1: a block of 1 + D)."""
    return block_line("DFlash", plan, 1)
