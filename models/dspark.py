"""DSpark: DFlash's parallel backbone, a light serial refiner and a confidence head.

The backbone is DFlashDrafter itself (same modules, same parameter names), with the
anchor as the first prediction slot: the block [anchor, MASK x (B - 1)] at positions
a .. a + B - 1 gives B drafts, slot k predicting the token at a + k + 1.

Serial refiner: a Markov head adds W2(W1[x_{k-1}]) to draft k's logits (W1: V x r
embedding, W2: r -> V linear; x_0 is the anchor). At decode time it runs left to right on
the drafted tokens (greedy or sampled); in training it is teacher-forced with the true
tokens in the same single pass. Both go through `refined_logits`, so the two agree
exactly on the same tokens. DeepSpec trains the backbone and both heads together from
scratch (the default here); `from_dflash` puts the heads on a trained DFlash backbone
instead ("DFlash + refiner"), W2 then starting at zero so that the untrained refiner leaves
the backbone's drafts unchanged. markov_rank 0 drops the refiner: with only the CE term,
that is DeepSpec's DFlash (the anchor slot predicting draft 1).

Confidence head: sigmoid(w . [h_k; W1[x_{k-1}]]) predicts whether draft k is accepted,
given that the drafts before it were. As in DeepSpec's decoder, a draft may end before
the first position whose own confidence is below a threshold (not the running product
of confidences); the rows it would not have kept are not verified. The default
threshold is DeepSpec's, 0: the full block, because at the tile rule's D the verify rows
are free at batch 1 and stopping early can only lose accepted tokens there. Acceptance
stays exact either way; only the draft length changes.

Loss: 0.1*CE + 0.9*TV + 1.0*BCE with DFlash's position weights. TV is the L1 distance
||p_draft - p_target||_1 (twice the total variation); under rejection sampling draft k is
accepted with probability 1 - TV/2, which is the BCE target of the confidence head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fields import DEFAULT_TILE, option, positive
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter, check_target
from draftsmith.models.dflash_loss import draft_reduction, greedy_metrics, position_means, weighted_mean
from draftsmith.models.dflash_tile import block_line
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.native import load_drafter
from draftsmith.models.tile import TilePlan

ANCHOR_IS_FIRST_PREDICTION = "anchor_is_first_prediction"  # DSpark's own: B inputs, B drafts
ANCHOR_IS_CONTEXT = "anchor_is_context"  # DFlash's: B inputs, B - 1 drafts (a frozen DFlash backbone)
BLOCK_CONVENTIONS = (ANCHOR_IS_FIRST_PREDICTION, ANCHOR_IS_CONTEXT)
HEADS = ("markov_head.", "confidence_head.")  # parameter prefixes outside the backbone


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int | None = option(None, "r, the Markov refiner's rank (None: 256, or hidden_size // 4 when smaller; "
                                           "0: no refiner, DeepSpec's DFlash with tv_weight=0 bce_weight=0 ce_weight=1)")
    ce_weight: float = option(0.1, "weight of the cross-entropy term of the loss")
    tv_weight: float = option(0.9, "weight of the L1 (twice total-variation) term against the target")
    bce_weight: float = option(1.0, "weight of the confidence head's BCE term")
    # Stop a draft before the first position whose own confidence sigmoid(c_k) is below
    # this (DeepSpec's rule and default); 0 drafts the full block. Eval may override it.
    confidence_threshold: float = option(0.0, "end a draft before the first confidence below this (0: full block)")
    block_convention: str = option(ANCHOR_IS_FIRST_PREDICTION, "anchor_is_first_prediction (B drafts per block) or "
                                   "anchor_is_context (B - 1: a frozen DFlash backbone's)")
    # Training on a trained DFlash backbone: its run or native folder ("" = from scratch),
    # and whether to keep it frozen and train only the refiner and confidence head.
    backbone: str = option("", "a trained DFlash run or native folder to start from (empty: from scratch)")
    freeze_backbone: bool = option(False, "keep the backbone frozen; train only the refiner and confidence head")

    @property
    def first_prediction_slot(self) -> int:
        return 0 if self.block_convention == ANCHOR_IS_FIRST_PREDICTION else 1

    @classmethod
    def check_params(cls, params: dict, seq_len: int | None = None, target_config=None) -> None:
        super().check_params(params, seq_len, target_config)
        values = {k: v for k, v in params.items() if v is not None}
        positive(values, ("markov_rank", "ce_weight", "tv_weight", "bce_weight"), low=0)

    def derive(self) -> "DSparkConfig":
        if self.block_convention not in BLOCK_CONVENTIONS:
            raise DraftsmithError(
                f"block_convention {self.block_convention!r} is not one of {', '.join(BLOCK_CONVENTIONS)}"
            )
        if self.markov_rank is None and self.hidden_size is not None:
            self.markov_rank = min(256, max(1, self.hidden_size // 4))
        if self.markov_rank is not None and self.markov_rank < 0:
            raise DraftsmithError(f"markov_rank must be 0 (no refiner) or more, got {self.markov_rank}")
        check_threshold(self.confidence_threshold)
        return super().derive()


def dflash_backbone(backbone: str, target) -> DFlashDrafter:
    """The trained DFlash drafter at `backbone` (a run or native folder), checked against `target`."""
    dflash = load_drafter(find_model_dir(backbone), DFlashDrafter.method)
    try:
        check_target(dflash, target)
    except DraftsmithError as exc:
        raise DraftsmithError(f"method.backbone {backbone}: {exc}") from None
    return dflash


def check_threshold(threshold: float, what: str = "confidence_threshold") -> float:
    if not 0.0 <= threshold <= 1.0:  # also refuses NaN
        raise DraftsmithError(f"{what} must be in [0, 1], got {threshold}")
    return float(threshold)


def below_threshold(confidence_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which positions' own confidence sigmoid(c) is below the threshold (0: none)."""
    return confidence_logits.float().sigmoid() < threshold


class MarkovHead(nn.Module):
    """Low-rank first-order logit bias W2(W1[x_prev]); names as DeepSpec's VanillaMarkov.

    Both start at N(0, 0.02), as DeepSpec's `post_init` leaves them (transformers'
    `_init_weights` at initializer_range 0.02; nn.Embedding's own default is N(0, 1))."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.normal_(self.markov_w2.weight, std=0.02)

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_tokens))


class ConfidenceHead(nn.Module):
    """Acceptance logit of a draft from [h_k; W1[x_{k-1}]]; DeepSpec's `proj` name."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    method = "dspark"
    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        # markov_rank 0: DeepSpec's DFlash (no refiner; its confidence head reads h alone).
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank) if config.markov_rank else None
        self.confidence_head = ConfidenceHead(config.hidden_size + config.markov_rank)

    @classmethod
    def from_target(cls, target, tile: int = DEFAULT_TILE, backbone: str = "", freeze_backbone: bool = False,
                    **overrides) -> "DSparkDrafter":
        """A fresh DSpark for `target` (DFlash's `from_target`), or, with `backbone` (a trained
        DFlash run or native folder), one on that backbone (`from_dflash`), kept frozen with
        `freeze_backbone`; `overrides`, the recipe's keys, win."""
        if not backbone:
            if freeze_backbone:
                raise DraftsmithError("method.freeze_backbone=true needs method.backbone=RUN (a trained DFlash run)")
            return super().from_target(target, tile=tile, **overrides)
        if overrides.get("block_size") == "auto":  # the backbone's block, unless a number is given
            overrides.pop("block_size")
        drafter = cls.from_dflash(dflash_backbone(backbone, target), freeze_backbone=freeze_backbone,
                                  backbone=str(backbone), **overrides)
        drafter.config.freeze_backbone = freeze_backbone  # provenance, saved with the config
        return drafter

    @classmethod
    def from_dflash(cls, dflash: DFlashDrafter, freeze_backbone: bool = False,
                    block_convention: str | None = None, **overrides) -> "DSparkDrafter":
        """A DSpark on a trained DFlash backbone: its weights, context layers and number of
        drafts per block. A DFlash backbone reads draft j from slot j, so kept frozen it
        keeps that reading (ANCHOR_IS_CONTEXT, the default when freezing) and only the
        refiner and confidence head train; trained on, it learns DSpark's own convention."""
        convention = block_convention or (ANCHOR_IS_CONTEXT if freeze_backbone else ANCHOR_IS_FIRST_PREDICTION)
        if freeze_backbone and convention != ANCHOR_IS_CONTEXT:
            raise DraftsmithError(
                f"a frozen DFlash backbone predicts draft j at slot j; it cannot serve block_convention {convention!r}"
            )
        fields = {**dataclasses.asdict(dflash.config), "block_convention": convention, **overrides}
        if "block_size" not in overrides:
            fields["block_size"] = dflash.drafts_per_block + (1 if convention == ANCHOR_IS_CONTEXT else 0)
        weight = dflash.fc.weight
        drafter = cls(DSparkConfig(**fields)).to(device=weight.device, dtype=weight.dtype)
        missing, unexpected = drafter.load_state_dict(dflash.state_dict(), strict=False)
        if unexpected or any(not name.startswith(HEADS) for name in missing):
            raise DraftsmithError(
                f"DFlash backbone does not fit DSpark (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        if drafter.markov_head is not None:
            # Departure from DeepSpec's N(0, 0.02) for this variant (DeepSpec has no frozen-backbone
            # DSpark): W2 = 0, so the untrained drafter drafts exactly what its backbone drafts,
            # and W1 ~ N(0, 1) (nn.Embedding's default), so the bias W2 W1 grows as fast as W2
            # learns. With both at N(0, 0.02) the bias stays near zero for the first hundreds of
            # steps: tests/test_train_posthoc.py's 20-step refiner measured tau 1.23, its
            # backbone's exactly, against +0.5 over it with this start.
            nn.init.normal_(drafter.markov_head.markov_w1.weight, std=1.0)
            nn.init.zeros_(drafter.markov_head.markov_w2.weight)
        if freeze_backbone:
            drafter.freeze_backbone()
        return drafter

    def freeze_backbone(self) -> None:
        """Train only the refiner and the confidence head."""
        for name, param in self.named_parameters():
            if not name.startswith(HEADS):
                param.requires_grad_(False)

    def refined_logits(self, base_logits: torch.Tensor, prev_tokens: torch.Tensor,
                       refiner: bool = True) -> torch.Tensor:
        """Draft logits given the token before each draft; `refiner=False`: the backbone's."""
        if not refiner or self.markov_head is None:
            return base_logits
        return base_logits + self.markov_head(prev_tokens).to(base_logits.dtype)

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        if self.markov_head is None:
            return self.confidence_head(hidden)
        prev = self.markov_head.markov_w1(prev_tokens).to(hidden.dtype)
        return self.confidence_head(torch.cat([hidden, prev], dim=-1))

    def refine(self, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: torch.Tensor,
               pick: Callable[[torch.Tensor, int], torch.Tensor], refiner: bool = True,
               min_confidence: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-to-right decoding of one block per row.

        hidden [B, n, H] and base_logits [B, n, V] of the prediction slots, anchor [B].
        `pick(logits [B, V], k) -> tokens [B]` chooses draft k (argmax, a sample, or the
        true token when teacher forcing). Stops before the first draft whose own
        confidence is below `min_confidence` in every row (DeepSpec's rule, applied as the
        drafts are drawn; 0: never stops).
        Returns tokens [B, m], refined logits [B, m, V], confidence logits [B, m], m <= n."""
        prev, tokens, logits, confidence = anchor, [], [], []
        for k in range(hidden.shape[1]):
            conf = self.confidence_logits(hidden[:, k], prev)
            # the threshold test reads the device; at 0 (the default) it never stops
            if min_confidence > 0 and bool(below_threshold(conf, min_confidence).all()):
                break
            step = self.refined_logits(base_logits[:, k], prev, refiner)
            prev = pick(step, k)
            tokens.append(prev)
            logits.append(step)
            confidence.append(conf)
        if not tokens:
            empty = hidden.new_zeros(anchor.shape[0], 0)
            return empty.long(), base_logits[:, :0], empty
        return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(confidence, 1)

    def loss(self, target_hidden, input_ids, loss_mask, embed: nn.Module,
             head: Callable[[torch.Tensor], torch.Tensor], target_logits: torch.Tensor,
             generator: torch.Generator | None = None, anchors: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """0.1*CE + 0.9*TV + 1.0*BCE (config weights), position-weighted, teacher-forced.

        target_logits [B, T, V]: the frozen target's logits on the same sequences (position
        p predicts token p + 1), the distribution each draft is matched to."""
        cfg = self.config
        blocks = self.sample_blocks(input_ids, loss_mask, generator, anchors, position_ids)
        hidden = self.training_hidden(target_hidden, blocks, embed)
        logits = self.refined_logits(head(hidden).float(), blocks.prev_tokens)
        ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view_as(blocks.label_mask)
        # DFlash's decay or D-PACE from these drafts' own CE (method.position_weights), on the prefix DeepSpec trains
        reduce = draft_reduction(cfg, ce, blocks.label_mask)
        # Draft j of anchor a is the token at a + j, which the target predicts at a + j - 1.
        rows = (blocks.anchors[..., None] + torch.arange(self.drafts_per_block, device=logits.device))
        rows = rows.clamp_max(target_logits.shape[1] - 1)
        batch = torch.arange(rows.shape[0], device=rows.device)[:, None, None]
        p_target = target_logits[batch, rows].float().softmax(-1)
        tv = (logits.softmax(-1) - p_target).abs().sum(-1)
        accept = (1.0 - tv / 2).clamp(0.0, 1.0).detach()
        confidence = self.confidence_logits(hidden, blocks.prev_tokens).float()
        bce = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")

        parts = {name: reduce(value) for name, value in (("ce", ce), ("tv", tv), ("bce", bce))}
        loss = cfg.ce_weight * parts["ce"] + cfg.tv_weight * parts["tv"] + cfg.bce_weight * parts["bce"]
        metrics = {name: float(value.detach()) for name, value in parts.items()}
        metrics.update(greedy_metrics(logits.argmax(-1), blocks))
        metrics.update(position_means("ce", ce, blocks.label_mask))
        metrics.update(position_means("tv", tv, blocks.label_mask))
        with torch.no_grad():
            mask = blocks.label_mask
            started = mask[..., 0] > 0
            # Expected acceptance length under sampling at temperature 1.
            tau_prob = 1.0 + (accept * mask).cumprod(-1).sum(-1)
            metrics["tau_prob"] = float(tau_prob[started].mean()) if started.any() else 1.0
            metrics["conf_err"] = float(weighted_mean((confidence.sigmoid() - accept).abs(), mask))
        return loss, metrics


def plan_line(plan: TilePlan) -> str:
    """DSpark's line of `draftsmith plan` (slot 0, the anchor first: a block of D drafts)."""
    return block_line("DSpark", plan, 0)
