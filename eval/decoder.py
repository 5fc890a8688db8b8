"""The speculative decoder: one engine for every drafter, batch size 1.

Cache invariant between steps: the target's KV cache holds every committed token except
the last one, which is the first input of the next verify pass `[last, d1 .. dN]`. So a
step is one target forward over 1 + N positions, the acceptance rule, and a cache trim:

- chain: `crop_cache` to the accepted prefix (the rejected tail is simply dropped);
- tree: the accepted path's KV rows are gathered in place onto consecutive slots right
  after `last`, then the cache is cropped. Gathering costs a copy of a few rows per layer;
  the alternative (crop, then re-run the path through the target) costs a forward pass.

The prompt is prefilled once (not a verify pass); its last logits give the first token.
Plain decoding is the same loop with an empty draft every step (`generate_plain`).

`cache_kind="static"` keeps the target's KV in a preallocated transformers StaticCache owned by
the decoder and reused by every sequence (so one sequence in flight per decoder); its
rollback is a move of the write position (models/target_cache.py). `compile=True` (static cache
only) runs the verify forward under torch.compile, CUDA graphs on CUDA: every verify is
padded to 1 + D rows so that one graph serves all steps. The pad rows come after the real
ones and only see the prefix and themselves, so the real rows' results are unchanged; D is
sized by the tile rule to fill one attention tile, so the pad costs little there. The KV
they write lies past the committed length and is dropped with the rejected drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import GREEDY, NoProposer, Proposer, SamplingParams, TargetContext
from draftsmith.eval.sampling import (
    accept_chain_greedy,
    accept_chain_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    next_token,
    process_logits,
)
from draftsmith.eval.settings import CACHE_KINDS
from draftsmith.fields import DEFAULT_TILE
from draftsmith.models.compiled_verify import CompiledVerify
from draftsmith.models.target import check_capturable, target_forward
from draftsmith.models.target_cache import (
    cache_length,
    crop_cache,
    keep_cache_rows,
    new_cache,
    new_static_cache,
    tree_cache_problem,
)
from draftsmith.models.tile import plan_tile


def default_num_draft(config, tile: int = DEFAULT_TILE, tp: int = 1) -> int:
    """Drafts per verify that keep it in one attention tile: D = max(0, tile // G - 1),
    G the query heads per KV head (the tile planner, docs/design.md section 3)."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return plan_tile(fields, tile, tp).D


@dataclass
class DecodeStats:
    """Per-generate counters; `merge` sums runs. Times in seconds."""

    num_draft: int
    verify_passes: int = 0
    committed: int = 0  # tokens committed by verify passes (the prefill's token excluded)
    accepted_hist: list[int] = field(default_factory=list)  # [D + 1]: steps with a drafts kept
    position_accepted: list[int] = field(default_factory=list)  # [D]: steps keeping draft k
    accepted_steps: list[int] = field(default_factory=list)  # drafts kept, verify pass by verify pass
    prefill_s: float = 0.0  # target prefill + the drafter's begin
    draft_s: float = 0.0  # propose + commit of the drafter
    verify_s: float = 0.0  # target forward of the verify pass
    total_s: float = 0.0

    def __post_init__(self):
        self.accepted_hist = self.accepted_hist or [0] * (self.num_draft + 1)
        self.position_accepted = self.position_accepted or [0] * self.num_draft

    @property
    def tau(self) -> float:
        return self.committed / self.verify_passes if self.verify_passes else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        n = max(self.verify_passes, 1)
        return [c / n for c in self.position_accepted]

    @property
    def other_s(self) -> float:
        """Step time spent neither drafting nor in the target forward (acceptance, cache)."""
        return self.total_s - self.prefill_s - self.draft_s - self.verify_s

    def record_step(self, accepted: int, committed: int) -> None:
        self.verify_passes += 1
        self.committed += committed
        self.accepted_hist[accepted] += 1
        self.accepted_steps.append(accepted)
        for k in range(accepted):
            self.position_accepted[k] += 1

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        if other.num_draft != self.num_draft:
            raise ValueError("cannot merge stats of different draft lengths")
        out = DecodeStats(self.num_draft)
        for name in ("verify_passes", "committed", "prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.accepted_hist = [a + b for a, b in zip(self.accepted_hist, other.accepted_hist)]
        out.position_accepted = [a + b for a, b in zip(self.position_accepted, other.position_accepted)]
        out.accepted_steps = self.accepted_steps + other.accepted_steps
        return out

    def as_dict(self) -> dict:
        return {
            "num_draft": self.num_draft,
            "verify_passes": self.verify_passes,
            "committed": self.committed,
            "tau": self.tau,
            "accepted_hist": list(self.accepted_hist),
            "per_position_acceptance": self.per_position_acceptance,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "other_s": self.other_s,
            "total_s": self.total_s,
        }


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [n] generated tokens (EOS included when hit), prompt excluded
    stats: DecodeStats


@dataclass
class DecodeState:
    """One sequence in flight: the target cache (all committed tokens but `last`). A static
    cache belongs to the decoder, so a new `start` takes it over from this state."""

    cache: object
    last: torch.Tensor  # [1] the last committed token, not yet in the cache
    generated: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    stats: DecodeStats
    started: float = 0.0  # perf_counter at the start of the prefill
    done: bool = False
    tree_checked: bool = False  # the cache's layers cannot change within a sequence: check once


class _TreeMask:
    """Additive 4D attention mask for tree verifies, kept in one buffer across steps.

    Between steps, columns [0, visible) are zero (visible to every row) and all later ones
    blocked. A step unblocks the columns committed since the last one, opens its tree block
    at [prefix, prefix + q) along the ancestor pattern and blocks it again after the
    forward, so only columns that change are written. The mask is `prefix + q` columns wide
    for a DynamicCache and `width` (all the slots) for a StaticCache, whose slots past the
    block hold stale rows and so must stay blocked.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.blocked = torch.finfo(dtype).min
        self.buf = torch.zeros(1, 1, 0, 0, dtype=dtype, device=device)
        self.visible = 0
        self._block: torch.Tensor | None = None

    def build(self, prefix: int, ancestors: torch.Tensor, width: int | None = None) -> torch.Tensor:
        q = ancestors.shape[0]
        rows, cols = self.buf.shape[2:]
        if rows < q or cols < (width or prefix + q):
            # a growing cache: grow geometrically; a static one: its size once
            cols = max(cols, width or -(-2 * (prefix + q) // 64) * 64)
            self.buf = torch.full((1, 1, max(rows, q), cols), self.blocked, dtype=self.dtype, device=self.device)
            self.visible = 0
        if prefix > self.visible:
            self.buf[..., self.visible : prefix].zero_()
        elif prefix < self.visible:  # a new sequence
            self.buf[..., prefix : self.visible].fill_(self.blocked)
        self.visible = prefix
        self._block = self.buf[0, 0, :q, prefix : prefix + q]
        self._block.masked_fill_(ancestors, 0.0)
        return self.buf[:, :, :q, : width or prefix + q]

    def clear(self) -> None:
        if self._block is not None:
            self._block.fill_(self.blocked)
            self._block = None


def _tree_layout(parents: list[int]) -> tuple[list[int], torch.Tensor, list[list[int]]]:
    """Depth of each verify row, the ancestor-or-self matrix, and children per row.

    Row 0 is the last committed token (the root), row i + 1 is draft node i.
    """
    n = len(parents)
    depth = [0] * (n + 1)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise DraftsmithError(f"draft tree node {i} has parent {parent}: nodes must come after their parent")
        depth[i + 1] = depth[parent + 1] + 1
        children[parent + 1].append(i)
    # Walk every row up to the root at once, one tree level per iteration.
    parent_row = torch.tensor([0] + [p + 1 for p in parents])
    rows = torch.arange(n + 1)
    ancestors = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    node = rows
    for _ in range(max(depth) + 1):
        ancestors[rows, node] = True
        node = parent_row[node]
    return depth, ancestors, children


class SpeculativeDecoder:
    def __init__(
        self,
        target,
        proposer: Proposer,
        num_draft: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        *,
        cache_kind: str = "dynamic",
        max_cache_len: int | None = None,
        compile: bool = False,
    ):
        """`num_draft` defaults to the tile rule; `eos_token_id` to the target's generation
        config (pass `()` to decode to the limit regardless of EOS). `cache_kind` is the kind of
        the target's KV cache, "dynamic" or "static"; a static one holds `max_cache_len` tokens, by default
        the first sequence's prompt + max_new_tokens + D rounded up to 256 (regrown when a
        later one needs more). `compile` (static cache only) compiles the verify forward."""
        self.target = target
        self.proposer = proposer
        self.num_draft = default_num_draft(target.config) if num_draft is None else int(num_draft)
        if self.num_draft < 0:
            raise DraftsmithError(f"num_draft must be >= 0, got {num_draft}")
        if cache_kind not in CACHE_KINDS:
            raise DraftsmithError(f"cache_kind must be one of {', '.join(CACHE_KINDS)}, got {cache_kind!r}")
        if compile and cache_kind != "static":
            raise DraftsmithError("compile needs the static cache: a compiled graph replays fixed shapes "
                                  "at fixed addresses")
        if max_cache_len is not None and cache_kind != "static":
            raise DraftsmithError("max_cache_len sizes the static cache; the dynamic cache grows as needed")
        self.cache_kind, self.max_cache_len, self.compile = cache_kind, max_cache_len, bool(compile)
        self._static = None  # the static cache, made by the first `start`
        if eos_token_id is None:
            gen = getattr(target, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None) or getattr(target.config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = ()
        self.eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.device = next(target.parameters()).device
        self._capture = tuple(sorted(set(proposer.capture_layers)))
        check_capturable(target, self._capture, f"drafter {proposer.name}")
        self._tree_mask = _TreeMask(next(target.parameters()).dtype, self.device)
        self._plain: SpeculativeDecoder | None = None
        self._compiled = CompiledVerify(target, self._capture) if self.compile else None

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ---- the public loop ----------------------------------------------------------

    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        state = self.start(prompt_ids, max_new_tokens, sampling, generator)
        while not state.done:
            self.step(state)
        state.stats.total_s = self._clock() - state.started
        return DecodeResult(torch.tensor(state.generated, dtype=torch.long), state.stats)

    def generate_plain(self, prompt_ids, max_new_tokens, sampling=GREEDY, generator=None) -> DecodeResult:
        """Plain autoregressive decoding through the same cache code (tau = 1 exactly);
        its verify time per pass is T_target."""
        if self._plain is None:
            self._plain = SpeculativeDecoder(self.target, NoProposer(), num_draft=0, eos_token_id=tuple(self.eos),
                                             cache_kind=self.cache_kind, max_cache_len=self.max_cache_len,
                                             compile=self.compile)
        return self._plain.generate(prompt_ids, max_new_tokens, sampling, generator)

    @torch.no_grad()
    def start(self, prompt_ids, max_new_tokens, sampling=GREEDY, generator=None) -> DecodeState:
        """Prefill the prompt, choose the first token, hand both to the drafter."""
        t0 = self._clock()
        prompt = self._single_sequence(prompt_ids).to(self.device)
        stats = DecodeStats(self.num_draft)
        cache = self._new_sequence_cache(len(prompt) + max_new_tokens)
        state = DecodeState(cache, prompt[-1:], [], max_new_tokens, sampling, generator, stats, started=t0)
        if max_new_tokens <= 0:
            state.done = True
            return state
        out = target_forward(self.target, prompt[None], cache=cache, capture=self._capture, logits_to_keep=1)
        first = next_token(out.logits[0, -1], sampling, generator).reshape(1)
        hidden = {i: h[0] for i, h in out.hidden.items()}
        self.proposer.begin(prompt, TargetContext(hidden, prompt, 0))
        state.last = first
        state.generated.append(int(first))
        state.done = state.generated[-1] in self.eos or max_new_tokens == 1
        if not state.done:
            nothing = {i: h[:0] for i, h in hidden.items()}
            self.proposer.commit(first, TargetContext(nothing, prompt[:0], len(prompt)))
        stats.prefill_s = self._clock() - t0
        return state

    @torch.no_grad()
    def step(self, state: DecodeState) -> list[int]:
        """One draft + verify step; returns the tokens it committed."""
        stats = state.stats
        t0 = self._clock()
        prefix = cache_length(state.cache)
        # The full budget even near the token limit: a tree's depth, not its size, bounds
        # what it can commit, and the tokens past the limit are simply not kept.
        draft = self.proposer.propose(self.num_draft, state.sampling, state.generator)
        if len(draft) > self.num_draft:
            raise DraftsmithError(
                f"drafter {self.proposer.name} proposed {len(draft)} nodes, more than {self.num_draft}"
            )
        t1 = self._clock()

        draft_list = draft.tokens.tolist()
        drafts = draft.tokens.to(self.device)
        inputs = torch.cat([state.last, drafts])[None]
        out, children = self._verify(state, inputs, draft.parents)
        t2 = self._clock()

        path, bonus = self._accept(out.logits[0], drafts, draft_list, draft.probs, children, state)
        if children is None:
            crop_cache(state.cache, prefix + 1 + len(path))
            rows = slice(0, 1 + len(path))
        else:
            keep_cache_rows(state.cache, prefix + 1, [prefix + 1 + c for c in path])
            rows = torch.tensor([0] + [c + 1 for c in path], device=self.device)
        new = [draft_list[c] for c in path] + [int(bonus)]
        keep = self._keep(new, state)
        stats.record_step(min(len(path), keep), keep)
        state.generated.extend(new[:keep])
        t3 = self._clock()
        if not state.done:
            kept = drafts[: len(path)] if children is None else drafts[path]
            committed = torch.cat([kept, bonus.reshape(1)])
            hidden = {i: h[0, rows] for i, h in out.hidden.items()}
            self.proposer.commit(committed, TargetContext(hidden, inputs[0, rows], prefix))
            state.last = committed[-1:]
        t4 = self._clock()
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.verify_s += t2 - t1
        return new[:keep]

    # ---- pieces of a step -----------------------------------------------------------

    def _new_sequence_cache(self, tokens: int):
        """An empty target cache with room for `tokens` committed ones plus a last verify."""
        if self.cache_kind == "dynamic":
            return new_cache(self.target, rollback=1 + self.num_draft)
        # The last verify writes 1 + D rows from slot tokens - 2 at the latest.
        need = tokens + self.num_draft
        if self.max_cache_len is not None and need > self.max_cache_len:
            raise DraftsmithError(f"static cache of {self.max_cache_len} tokens: this sequence needs {need} "
                                  f"(prompt + max_new_tokens + {self.num_draft} drafts)")
        if self._static is None or self._static.get_max_length() < need:
            self._static = new_static_cache(self.target, self.max_cache_len or -(-need // 256) * 256)
        crop_cache(self._static, 0)
        return self._static

    def _verify(self, state: DecodeState, inputs: torch.Tensor, parents: torch.Tensor | None):
        """The target forward over `[last, drafts]`: causal for a chain; for a tree, each
        node sees the prefix and its ancestors, at position prefix + depth."""
        if parents is None:
            if self._compiled is not None:
                return self._verify_compiled(state, inputs), None
            return target_forward(self.target, inputs, cache=state.cache, capture=self._capture), None
        if not state.tree_checked:
            self._check_tree_support(state.cache)
            state.tree_checked = True
        prefix = cache_length(state.cache)
        depth, ancestors, children = _tree_layout(parents.tolist())
        width = None if self.cache_kind == "dynamic" else state.cache.get_max_length()
        if self._compiled is not None:  # pad rows after the tree: they see the prefix and themselves
            pad = 1 + self.num_draft - len(depth)
            depth = depth + list(range(len(depth), len(depth) + pad))
            ancestors = torch.block_diag(ancestors, torch.eye(pad, dtype=torch.bool))
        positions = torch.tensor(depth, device=self.device).add_(prefix)[None]
        mask = self._tree_mask.build(prefix, ancestors.to(self.device), width)
        try:
            if self._compiled is not None:
                out = self._verify_compiled(state, inputs, positions, mask)
            else:
                out = target_forward(self.target, inputs, cache=state.cache, position_ids=positions,
                                     attention_mask=mask, capture=self._capture)
        finally:
            self._tree_mask.clear()
        return out, children

    def _verify_compiled(self, state: DecodeState, inputs, positions=None, mask=None):
        """The compiled forward on `inputs` padded to 1 + D rows, cut back to the real rows.
        Chains leave positions and mask to transformers (from the cache's write position)."""
        q = inputs.shape[1]  # any token will do for the pad rows: their results are cut off
        padded = torch.cat([inputs, inputs[:, :1].expand(1, 1 + self.num_draft - q)], dim=1)
        out = self._compiled(padded, state.cache, position_ids=positions, attention_mask=mask)
        out.logits = out.logits[:, :q]
        out.hidden = {i: h[:, :q] for i, h in out.hidden.items()}
        return out

    def _accept(self, logits, drafts, draft_list, probs, children, state) -> tuple[list[int], torch.Tensor]:
        """(accepted draft node indices in order, the target's next token)."""
        if state.sampling.greedy:
            top = logits.argmax(-1)
            top_list = top.tolist()
            if children is None:
                path = list(range(accept_chain_greedy(top_list, draft_list)))
            else:
                path = accept_tree_greedy(top_list, draft_list, children)
            return path, top[path[-1] + 1 if path else 0]
        p = process_logits(logits, state.sampling)
        q = None if probs is None else probs.to(self.device, torch.float32)
        if q is not None and q.shape[-1] != p.shape[-1]:
            raise DraftsmithError(
                f"drafter {self.proposer.name} gives probabilities over {q.shape[-1]} tokens, "
                f"the target over {p.shape[-1]}"
            )
        if children is None:
            a, bonus = accept_chain_sampled(p, drafts, q, state.generator)
            return list(range(a)), bonus
        return accept_tree_sampled(p, draft_list, children, q, state.generator)

    def _keep(self, new: list[int], state: DecodeState) -> int:
        """How many of this step's tokens count: up to the first EOS and the token limit."""
        eos_at = next((i for i, t in enumerate(new) if t in self.eos), None)
        budget = state.max_new_tokens - len(state.generated)
        state.done = eos_at is not None or len(new) >= budget
        return min(len(new) if eos_at is None else eos_at + 1, budget)

    def _check_tree_support(self, cache) -> None:
        impl = getattr(self.target.config, "_attn_implementation", "") or ""
        if "flash" in impl:
            raise DraftsmithError(
                f"tree drafts need a 4D attention mask, which attn_implementation={impl!r} ignores; "
                "use 'sdpa' or 'eager'"
            )
        problem = tree_cache_problem(cache)
        if problem:
            raise DraftsmithError(f"tree drafts need a full-attention KV cache; {problem}")

    @staticmethod
    def _single_sequence(prompt_ids) -> torch.Tensor:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
        if prompt.dim() == 2:
            if prompt.shape[0] != 1:
                raise DraftsmithError(
                    f"prompt batch of {prompt.shape[0]}: the speculative decoder runs one sequence at a time"
                )
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise DraftsmithError(
                f"prompt must be a non-empty 1D (or [1, T]) tensor of token ids, got shape {tuple(prompt.shape)}"
            )
        return prompt
