"""The decoder adapter for DFlash: one drafter forward per step gives the draft.

The adapter keeps the drafter's context cache: the projected context K/V, per layer, of
every committed position whose target hidden state is known, i.e. all committed tokens
but the last one, which is the next anchor. Each commit crops the cache to the position
its context starts at and appends the newly verified positions, so nothing of a rejected
draft survives (the block's own K/V are never cached). A proposal runs the block
[anchor, MASK ...] at positions len(cache).. over that cache.

DSpark's adapter (`dspark.py`) extends this one with its refiner and confidence stop.
"""

from __future__ import annotations

import torch

from draftsmith.eval.proposers.base import Draft, Proposer, SamplingParams, TargetContext
from draftsmith.eval.sampling import draw
from draftsmith.models.dflash import ContextCache, DFlashDrafter, check_target, concat_layers


class DFlashProposer(Proposer):
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


def on_target_device(drafter, target):
    return drafter.to(next(target.parameters()).device)


def load_proposer(path, target, **options) -> DFlashProposer:
    """From a DFlash checkpoint in any layout we read (a training run's native model/, a z-lab,
    SpecForge or speculators folder, ours or trained by those tools: models/formats/dflash.py)."""
    from draftsmith.models.formats.dflash import read

    return DFlashProposer(on_target_device(read(path, target), target), target, **options)
