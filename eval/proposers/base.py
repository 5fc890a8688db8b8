"""The contract between the speculative decoder and every drafter.

The decoder owns the target and its KV cache; a drafter only sees what the decoder hands
it. The life of one sequence:

    begin(prompt_ids, ctx)        ctx: the target's hidden states of the prompt (prefill)
    commit(first_token, ctx)      the token the prefill produced; ctx is empty (T = 0)
    repeat:
        propose(max_nodes, sampling, generator) -> Draft
        commit(accepted, ctx)     accepted = accepted drafts + the target's own next token

Invariant after every `commit`: the drafter has been told every committed token, and the
target hidden states of all committed positions except the last one (the target computes
a position's hidden state only when that token is fed to it, i.e. at the next verify).
`ctx` of a commit covers the positions the verify pass just computed and kept: for a
verify of `[last, d1 .. dk]` with `a` drafts accepted, that is `last, d1 .. da`.

Anything a drafter advanced during `propose` (its own KV cache, scratch state) it rolls
back in `commit`, which is the only place it learns what was kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from draftsmith.sampling_params import GREEDY, SamplingParams  # noqa: F401 (the proposers import them here)


@dataclass
class Draft:
    """Proposed tokens: a chain (`parents is None`) or a tree in BFS order.

    `parents[i]` is the index of node i's parent, -1 for a child of the last committed
    token; BFS order means `parents[i] < i`. `probs[i]` is the distribution node i's token
    was drawn from, given its path and its earlier siblings (siblings drawn i.i.d. all
    carry the same q; siblings drawn without replacement carry q renormalised without the
    earlier ones). `probs is None` means deterministic drafts (q is one-hot), which is
    also what greedy drafters return.
    """

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor | None = None  # [N] long
    probs: torch.Tensor | None = None  # [N, V] float

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @staticmethod
    def empty(device: torch.device | str | None = None) -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long, device=device))


@dataclass
class TargetContext:
    """Target hidden states of consecutive committed positions `start .. start + T - 1`."""

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [T, H]
    tokens: torch.Tensor | None = None  # [T] the tokens fed at those positions
    start: int = 0

    def __len__(self) -> int:
        return 0 if self.tokens is None else int(self.tokens.shape[0])


@runtime_checkable
class Proposer(Protocol):
    name: str
    # Target layers (ids: output of decoder layer i, 0-based; the last one is pre-norm)
    # whose hidden states this drafter wants in every TargetContext. Empty: none.
    capture_layers: tuple[int, ...]

    def begin(self, prompt_ids: torch.Tensor, ctx: TargetContext) -> None: ...

    def propose(self, max_nodes: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft: ...

    def commit(self, accepted: torch.Tensor, ctx: TargetContext) -> None: ...


class NoProposer:
    """Proposes nothing: the decoder then runs plain autoregressive decoding (tau = 1)."""

    name = "baseline"
    capture_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids, ctx) -> None:
        pass

    def propose(self, max_nodes, sampling, generator) -> Draft:
        return Draft.empty()

    def commit(self, accepted, ctx) -> None:
        pass
