"""MTP heads as a drafter: an EAGLE-style chain over the modules (default), module 1 alone as
the engines serve it today, or DeepSeek-V3's exact depths.

Depth m at position j reads h^{m-1}_j and token t_{j+m} and predicts t_{j+m+1} (h^0: the
target's state after its final norm, as the engines feed it; models/mtp.py). With n
committed tokens (the last one, t_{n-1}, not yet seen by the target), draft 1 is depth 1's
output at position n - 2, which reads only committed inputs: the target's h^0_{n-2} and
t_{n-1}. Every depth keeps its own KV cache of *settled* positions j <= n - 1 - m (all
inputs committed), computed once, on the commit that settles them, and kept from then on:
the rows of accepted drafts stay; only rows that read drafts are cropped at each commit.

mode "engine" (default; EAGLE's chain, one module per draft depth): one new row per
draft. Draft m <= K is module m's row at position n - 2, fed the previous draft's output
hidden state and token; past K, module K chains on itself, one position further each draft,
its own output as the next input. O(D) rows a step (plus K rows per committed token).

`modules` = 1 (`eval --drafter mtp_nextn:RUN`) is the engine mode over module 1 alone,
chained for every draft: what the engines serve today. SGLang's NextN loads one module,
and vLLM's EAGLE-style MTP proposer runs layer 0 at every step (it passes no
`spec_step_idx`: "intentional since we do eagle-style drafting", vllm-project/vllm#36910;
#52688 reports it for vLLM 0.22.1, the fix #53397 is open), so modules 2..K of a vLLM
export are loaded but never run there.

mode "exact": draft m is depth m's prediction at position n - 2 with every position
before it computed too, so each depth attends to the same rows as in training: the m - 1
positions n - m .. n - 2 that read drafts are recomputed at every step (O(D^2) rows), and
depths beyond K reuse module K, each with a cache of its own.

The two agree on draft 1 always, and on draft 2 when K >= 2 (depth 2's only draft-reading
row is its query row); from draft 3 on, exact depths also attend to draft-reading rows that
the engine never computes. `rows` counts the block rows each mode runs. Every MTP block
attends with its cache at index 0 (we own these copies of the heads).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import Draft, Proposer, SamplingParams
from draftsmith.eval.sampling import draw
from draftsmith.models.mtp import MTPDrafter, causal_mask, final_norm
from draftsmith.models.target import rotary_embedding
from draftsmith.models.target_cache import crop_cache


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


MODES = ("engine", "exact")


class MTPProposer(Proposer):
    def __init__(self, heads: MTPDrafter, target, name: str = "mtp", mode: str = "engine", modules: int | None = None):
        if mode not in MODES:
            raise DraftsmithError(f"MTP drafting mode {mode!r} does not exist (modes: {', '.join(MODES)})")
        if modules is not None and (mode != "engine" or not 1 <= modules <= heads.num_depths):
            raise DraftsmithError(f"MTP modules={modules}: the engine mode chains modules 1..m of the "
                                  f"{heads.num_depths} trained")
        self.name, self.mode = name, mode
        self.chain = modules or heads.num_depths  # drafts past it chain the last of these modules
        self.rows = 0  # block rows run (drafting and settling), for the report
        self.prompt_rows = 0  # of those, the one-off rows that settle a new depth over the prompt
        self.proposals = 0
        self.heads = heads.eval()
        for layer in heads.layers:
            layer.block.self_attn.layer_idx = 0  # one cache per virtual depth, see module doc
        self.target = target
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.rotary = rotary_embedding(target)
        self.capture_layers = (target.config.num_hidden_layers - 1,)
        # h^0 is the last layer's output after the final norm (models/mtp.py), found once, not per commit
        self.final_norm = final_norm(target)
        self.depths: list[_Depth] = []
        self.tokens = torch.empty(0, dtype=torch.long)
        self.hidden: torch.Tensor | None = None  # h^0 (after the final norm) of committed positions but the last

    def _layer(self, m: int):
        return self.heads.layers[min(m, self.heads.num_depths) - 1]

    def report_extra(self) -> dict:
        steps = (self.rows - self.prompt_rows) / self.proposals if self.proposals else 0.0
        return {"mtp_mode": self.mode, "mtp_modules": self.chain if self.mode == "engine" else self.heads.num_depths,
                "mtp_rows_per_step": steps, "mtp_prompt_rows": self.prompt_rows}

    def _run(self, depth: _Depth, start: int, prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Feed positions start .. start + len - 1 of this depth through its block."""
        q = prev.shape[0]
        past = depth.cache.get_seq_length()
        positions = torch.arange(start, start + q, device=prev.device)[None]
        x = prev[None]
        rope = self.rotary(x, positions)
        mask = causal_mask(self.target.config._attn_implementation, q, past, x)  # cached rows all visible
        self.rows += q
        return depth.layer(self.embed(tokens)[None], x, rope, attention_mask=mask, cache=depth.cache,
                           position_ids=positions)[0]

    def begin(self, prompt_ids, ctx) -> None:
        self.depths = []
        self.tokens = prompt_ids.clone()
        self.hidden = self.final_norm(ctx.hidden[self.capture_layers[0]])

    @torch.no_grad()
    def commit(self, accepted, ctx) -> None:
        self.tokens = torch.cat([self.tokens, accepted.to(self.tokens.device)])
        if len(ctx):
            self.hidden = torch.cat([self.hidden, self.final_norm(ctx.hidden[self.capture_layers[0]])])
        n = len(self.tokens)
        for m, depth in enumerate(self.depths, start=1):
            crop_cache(depth.cache, depth.settled)  # drop the rows that read drafts
            self._settle(m, depth, n)

    def _settle(self, m: int, depth: _Depth, n: int) -> None:
        start, stop = depth.settled, max(0, n - m)
        if stop <= start:
            return
        prev = self.hidden[start:stop] if m == 1 else self._next_input(self.depths[m - 2], self.depths[m - 2].outputs[start:stop])
        out = self._run(depth, start, prev, self.tokens[start + m: stop + m])
        depth.outputs = out if depth.outputs is None else torch.cat([depth.outputs, out])

    def _depth(self, m: int, n: int) -> _Depth:
        """Depth m, made (and settled) on first use, after the depths below it."""
        while len(self.depths) < m:
            before = self.rows
            self.depths.append(_Depth(self._layer(len(self.depths) + 1)))
            self._settle(len(self.depths), self.depths[-1], n)
            self.prompt_rows += self.rows - before  # once per sequence (the first proposal), not per step
        return self.depths[m - 1]

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator) -> Draft:
        if max_nodes <= 0:
            return Draft.empty(self.tokens.device)
        self.proposals += 1
        pick = self._engine if self.mode == "engine" else self._exact
        drafts, probs = pick(max_nodes, sampling, generator)
        return Draft(torch.stack(drafts), None, torch.stack(probs) if probs else None)

    def _next_input(self, depth: _Depth, out: torch.Tensor) -> torch.Tensor:
        """What the next draft depth reads of `depth`'s outputs (MTPConfig.chain_input)."""
        return self.heads.next_input(depth.layer, out)

    def _draw(self, depth: _Depth, last: torch.Tensor, sampling, generator, drafts: list, probs: list) -> None:
        token, q = draw(self.head(depth.layer.shared_head.norm(last)), sampling, generator)
        if q is not None:
            probs.append(q)
        drafts.append(token)

    def _engine(self, max_nodes: int, sampling: SamplingParams, generator) -> tuple[list, list]:
        """One row per draft: module min(s, K) fed draft s - 1's output and token (K: `chain`)."""
        n, K = len(self.tokens), self.chain
        drafts, probs = [], []
        last = self._depth(1, n).outputs[n - 2]  # settled: the target's h^0_{n-2} and t_{n-1}
        self._draw(self.depths[0], last, sampling, generator, drafts, probs)
        for s in range(2, max_nodes + 1):
            m = min(s, K)
            depth = self._depth(m, n)
            position = n - 2 + (s - m)  # n - 2 up to K; past K, module K one position further each draft
            prev = self._next_input(self.depths[min(s - 1, K) - 1], last)
            last = self._run(depth, position, prev[None], drafts[-1][None])[-1]
            self._draw(depth, last, sampling, generator, drafts, probs)
        return drafts, probs

    def _exact(self, max_nodes: int, sampling: SamplingParams, generator) -> tuple[list, list]:
        n = len(self.tokens)
        drafts, probs = [], []
        below = None  # depth m - 1's draft-time outputs, positions max(0, n - m + 1) .. n - 2
        for m in range(1, max_nodes + 1):
            depth = self._depth(m, n)
            if m == 1:  # position n - 2 is settled at depth 1: nothing to run
                last = depth.outputs[n - 2]
                below = depth.outputs[:0]
            else:  # positions lo .. n - 2 read drafts (lo = n - m, or 0 early in a sequence)
                lo = max(0, n - m)
                upper = self.depths[m - 2]
                settled = [] if upper.outputs is None else [upper.outputs[lo: upper.settled]]
                prev = self._next_input(upper, torch.cat(settled + [below]))
                below = self._run(depth, lo, prev, torch.stack(drafts[lo + m - n:]))
                last = below[-1]
            self._draw(depth, last, sampling, generator, drafts, probs)
        return drafts, probs


def load_proposer(path, target, **options) -> MTPProposer:
    from draftsmith.models.formats.mtp import read

    return MTPProposer(read(path, target), target, **options)  # a run or target with mtp/, or a DeepSeek layout
