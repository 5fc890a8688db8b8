"""Decoder adapters for DFlash and DSpark: one drafter forward per step gives the draft.

The adapter keeps the drafter's context cache: the projected context K/V, per layer, of
every committed position whose target hidden state is known, i.e. all committed tokens
but the last one, which is the next anchor. Each commit crops the cache to the position
its context starts at and appends the newly verified positions, so nothing of a rejected
draft survives (the block's own K/V are never cached). A proposal runs the block
[anchor, MASK ...] at positions len(cache).. over that cache.

DSpark adds the serial refiner (left to right over the drafted tokens) and may end a draft
before the first position whose own confidence is below a threshold (DeepSpec's rule;
default 0, the full block); it counts those early stops and the verify rows they saved
(`report_extra()`).
"""

from __future__ import annotations

import torch

from draftsmith.eval.proposers.base import Draft, SamplingParams, TargetContext
from draftsmith.eval.sampling import draw
from draftsmith.models.dflash import ContextCache, DFlashDrafter, check_target, concat_layers
from draftsmith.models.dspark import DSparkDrafter, check_threshold


class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, target, name: str = "dflash"):
        check_target(drafter, target)
        self.name = name
        self.drafter = drafter.eval()
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.device = drafter.fc.weight.device
        self.cache = ContextCache()
        self.last: torch.Tensor | None = None  # [1] the anchor of the next block

    def begin(self, prompt_ids: torch.Tensor, ctx: TargetContext) -> None:
        self.cache = ContextCache()
        self._extend(ctx)
        self.last = prompt_ids[-1:].to(self.device)

    def commit(self, accepted: torch.Tensor, ctx: TargetContext) -> None:
        self._extend(ctx)
        self.last = accepted[-1:].to(self.device)

    def _extend(self, ctx: TargetContext) -> None:
        with torch.no_grad():
            features = concat_layers(ctx.hidden, self.drafter.config.target_layer_ids)[None]
            self.cache.extend(self.drafter, features.to(self.device), ctx.start)

    def draft_block(self, max_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prediction-slot hidden [1, n, H] and the head's logits [1, n, V] of one block."""
        n = min(max_nodes, self.drafter.drafts_per_block)
        hidden = self.drafter.decode_hidden(self.last, self.cache, self.embed)[:, :n]
        return hidden, self.head(hidden.to(self.head.weight.dtype))

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if max_nodes <= 0:
            return Draft.empty(self.device)
        tokens, probs = draw(self.draft_block(max_nodes)[1][0], sampling, generator)
        return Draft(tokens, None, probs)


class DSparkProposer(DFlashProposer):
    """`confidence_threshold`: None takes the checkpoint's, 0 always drafts the full block
    (`draftsmith eval --confidence-threshold` sets it per run).
    `refiner=False` drafts with the backbone alone (an ablation; the result stays exact)."""

    def __init__(self, drafter: DSparkDrafter, target, name: str = "dspark",
                 confidence_threshold: float | None = None, refiner: bool = True):
        super().__init__(drafter, target, name)
        chosen = drafter.config.confidence_threshold if confidence_threshold is None else confidence_threshold
        self.threshold = check_threshold(chosen, "dspark confidence threshold")
        self.refiner = refiner
        self.proposals = 0  # proposals that asked for at least one draft
        self.early_stops = 0  # of those, ended early by the confidence head
        self.rows_saved = 0  # verify rows those early stops did not spend

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if max_nodes <= 0:
            return Draft.empty(self.device)
        hidden, base = self.draft_block(max_nodes)
        probs: list[torch.Tensor] = []

        def pick(logits: torch.Tensor, k: int) -> torch.Tensor:
            token, q = draw(logits, sampling, generator)
            if q is not None:
                probs.append(q)
            return token

        tokens, _, _ = self.drafter.refine(hidden, base, self.last, pick, self.refiner, self.threshold)
        self.proposals += 1
        if tokens.shape[1] < hidden.shape[1]:
            self.early_stops += 1
            self.rows_saved += hidden.shape[1] - tokens.shape[1]
        return Draft(tokens[0], None, torch.cat(probs) if probs else None)

    def report_extra(self) -> dict:
        return {
            "confidence_threshold": self.threshold,
            "proposals": self.proposals,
            "early_stops": self.early_stops,
            "early_stop_rate": self.early_stops / self.proposals if self.proposals else 0.0,
            "verify_rows_saved": self.rows_saved,
        }


def load_proposer(path, target, method: str = "dflash", **options) -> DFlashProposer:
    """The decode adapter of a DFlash or DSpark checkpoint in any layout we write (a
    training run's native model/, a z-lab, SpecForge or DeepSpec folder, ours or trained
    by those tools); `method` must be what the checkpoint holds."""
    from draftsmith.models.export_dflash import load_any

    drafter = load_any(path, method, target).to(next(target.parameters()).device)
    adapter = DSparkProposer if method == "dspark" else DFlashProposer
    return adapter(drafter, target, name=method, **options)


def load_dspark_proposer(path, target, **options) -> DSparkProposer:
    return load_proposer(path, target, method="dspark", **options)
