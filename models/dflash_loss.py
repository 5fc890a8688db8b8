"""DFlash's loss weighting over draft positions and its training metrics (DSpark's too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draftsmith.models.dflash_blocks import Blocks

if TYPE_CHECKING:  # dflash.py imports this module
    from draftsmith.models.dflash import DFlashConfig


def position_weights(num_drafts: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(j - 1)/gamma) for drafts j = 1..num_drafts: later drafts matter less, since
    they only count when every earlier one was accepted."""
    return torch.exp(-torch.arange(num_drafts, device=device, dtype=torch.float32) / gamma)


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE (speculators 0.9.0 losses/utils.py `dpace_loss_decay`; SpecForge 0.2.0
    `OnlineDFlashModel._dpace_weight`): the expected acceptance a draft carries, from the
    drafter's own smoothed confidence in the true token, s_j = (1 - alpha) * exp(-ce_j) +
    alpha on drafts in `mask` and 1 elsewhere, as w_k = sum_{j >= k} m_j * prod_{i <= j} s_i:
    a draft is worth every later accepted token that needs it right. Detached, as there.
    ce and mask [..., drafts]; the weights of drafts outside `mask` are left to the caller."""
    m = mask.float()
    smooth = torch.where(m > 0, (1.0 - alpha) * torch.exp(-ce.detach().float()) + alpha, torch.ones_like(m))
    return (smooth.cumprod(-1) * m).flip(-1).cumsum(-1).flip(-1)


def draft_reduction(config: DFlashConfig, ce: torch.Tensor, mask: torch.Tensor):
    """values [..., drafts] -> the scalar loss term, by `config.position_weights` over the
    supervised drafts (`mask`): DFlash's fixed decay, sum(v * w) / sum(w) (SpecForge's
    `loss_den = loss_weights.sum()`); or D-PACE's weights from the drafts' own ce, sum(v * w) /
    (drafts supervised), as speculators 0.9.0 reduces it (losses/utils.py `loss_function`:
    the masked, decayed sum over `loss_mask.sum()`). SpecForge 0.2.0 divides its D-PACE sum by
    the batch size instead, a scale that varies with the anchors a batch holds."""
    if config.position_weights == "dpace":
        weights = mask * dpace_weights(ce, mask, config.dpace_alpha)
        count = mask.float().sum().clamp_min(1e-6)
        return lambda values: (values * weights).sum() / count
    weights = mask * position_weights(config.drafts_per_block, config.gamma, ce.device)
    return lambda values: weighted_mean(values, weights)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-6)


@torch.no_grad()
def position_means(name: str, values: torch.Tensor, label_mask: torch.Tensor) -> dict[str, float]:
    """{name_k: mean of values [..., drafts] at draft k over supervised blocks}: a plateau
    in the weighted loss tells apart positions that still learn from those at their floor."""
    counts = label_mask.flatten(0, -2).sum(0)
    sums = (values.detach().float() * label_mask).flatten(0, -2).sum(0)
    return {f"{name}_{k + 1}": m for k, m in enumerate((sums / counts.clamp_min(1)).tolist())}


@torch.no_grad()
def greedy_metrics(predicted: torch.Tensor, blocks: Blocks) -> dict[str, float]:
    """acc_k: draft k matches, among supervised blocks whose drafts 1..k-1 all matched (the
    conditional accuracy), so tau_est = 1 + sum_k prod_{j<=k} acc_j estimates the greedy
    acceptance length of a full block."""
    valid = blocks.label_mask.bool()
    right = (predicted == blocks.labels) & valid
    prefix = right.long().cumprod(-1).bool()
    reached = torch.cat([valid[..., :1], prefix[..., :-1] & valid[..., 1:]], dim=-1)
    metrics, survive, tau = {}, 1.0, 1.0
    for k in range(predicted.shape[-1]):
        seen = int(reached[..., k].sum())
        acc = int(prefix[..., k].sum()) / seen if seen else 0.0
        metrics[f"acc_{k + 1}"] = acc
        survive *= acc
        tau += survive
    metrics["tau_est"] = tau
    return metrics
