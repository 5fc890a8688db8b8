"""MTP heads as a drafter, with DeepSeek-V3's depth semantics kept exactly.

Depth m at position j reads h^{m-1}_j and token t_{j+m} and predicts t_{j+m+1}. With n
committed tokens (the last one, t_{n-1}, not yet seen by the target), draft m is depth m's
prediction at position n - 2. Each depth keeps its own KV cache:

- *settled* positions j <= n - 1 - m, whose inputs are all committed, are computed once
  (on commit) and stay in the cache;
- the m - 1 positions n - m .. n - 2 read drafted tokens; they are computed while drafting
  and cropped away at the next commit.

Depths beyond K reuse the last module's weights, each with a cache of its own. Every MTP
block attends with its cache at index 0 (we own these copies of the heads).
"""

from __future__ import annotations

import torch

from draftsmith.eval.proposers.base import Draft, SamplingParams
from draftsmith.eval.sampling import draw
from draftsmith.models.mtp import MTPDrafter
from draftsmith.models.target import crop_cache


class _Depth:
    """One virtual depth: its module, its cache, and the outputs of its settled positions."""

    def __init__(self, layer):
        from transformers import DynamicCache

        self.layer = layer
        self.cache = DynamicCache()
        self.outputs: torch.Tensor | None = None  # [settled, H]

    @property
    def settled(self) -> int:
        return 0 if self.outputs is None else self.outputs.shape[0]


class MTPProposer:
    def __init__(self, heads: MTPDrafter, target, name: str = "mtp"):
        self.name = name
        self.heads = heads.eval()
        for layer in heads.layers:
            layer.block.self_attn.layer_idx = 0  # one cache per virtual depth, see module doc
        self.target = target
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.rotary = target.model.rotary_emb
        self.capture_layers = (target.config.num_hidden_layers - 1,)
        self.depths: list[_Depth] = []
        self.tokens = torch.empty(0, dtype=torch.long)
        self.hidden: torch.Tensor | None = None  # h^0 of committed positions (all but the last)

    def _layer(self, m: int):
        return self.heads.layers[min(m, self.heads.num_depths) - 1]

    def _run(self, depth: _Depth, start: int, prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Feed positions start .. start + len - 1 of this depth through its block."""
        q = prev.shape[0]
        past = depth.cache.get_seq_length()
        positions = torch.arange(start, start + q, device=prev.device)[None]
        x = prev[None]
        rope = self.rotary(x, positions)
        mask = None
        if q > 1:  # causal over the new rows, everything cached visible
            mask = torch.full((q, past + q), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
            mask = mask.triu(past + 1)[None, None]
        return depth.layer(self.embed(tokens)[None], x, rope, attention_mask=mask, cache=depth.cache,
                           position_ids=positions)[0]

    def begin(self, prompt_ids, ctx) -> None:
        self.depths = []
        self.tokens = prompt_ids.clone()
        self.hidden = ctx.hidden[self.capture_layers[0]]

    @torch.no_grad()
    def commit(self, accepted, ctx) -> None:
        self.tokens = torch.cat([self.tokens, accepted.to(self.tokens.device)])
        if len(ctx):
            self.hidden = torch.cat([self.hidden, ctx.hidden[self.capture_layers[0]]])
        n = len(self.tokens)
        for m, depth in enumerate(self.depths, start=1):
            crop_cache(depth.cache, depth.settled)  # drop the rows that read drafts
            self._settle(m, depth, n)

    def _settle(self, m: int, depth: _Depth, n: int) -> None:
        start, stop = depth.settled, max(0, n - m)
        if stop <= start:
            return
        prev = self.hidden[start:stop] if m == 1 else self.depths[m - 2].outputs[start:stop]
        out = self._run(depth, start, prev, self.tokens[start + m: stop + m])
        depth.outputs = out if depth.outputs is None else torch.cat([depth.outputs, out])

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator) -> Draft:
        n = len(self.tokens)
        drafts, probs = [], []
        below = None  # depth m - 1's draft-time outputs, positions max(0, n - m + 1) .. n - 2
        for m in range(1, max_nodes + 1):
            if m > len(self.depths):
                self.depths.append(_Depth(self._layer(m)))
                self._settle(m, self.depths[-1], n)
            depth = self.depths[m - 1]
            if m == 1:  # position n - 2 is settled at depth 1: nothing to run
                last = depth.outputs[n - 2]
                below = depth.outputs[:0]
            else:  # positions lo .. n - 2 read drafts (lo = n - m, or 0 early in a sequence)
                lo = max(0, n - m)
                upper = self.depths[m - 2]
                settled = [] if upper.outputs is None else [upper.outputs[lo: upper.settled]]
                prev = torch.cat(settled + [below])
                below = self._run(depth, lo, prev, torch.stack(drafts[lo + m - n:]))
                last = below[-1]
            token, q = draw(self.head(depth.layer.shared_head.norm(last)), sampling, generator)
            if q is not None:
                probs.append(q)
            drafts.append(token)
        if not drafts:
            return Draft.empty(self.tokens.device)
        return Draft(torch.stack(drafts), None, torch.stack(probs) if probs else None)


def load_proposer(path, target, **options) -> MTPProposer:
    from draftsmith.models.mtp import mtp_dir
    from draftsmith.models.native import load_drafter

    return MTPProposer(load_drafter(mtp_dir(path), "mtp", target), target)
