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

Every proposer subclasses `Proposer`, which also declares what eval reads of a drafter, each
with a default: `name` and `weights` (its report row), `report_extra()` (method-specific
report columns) and `tuning()` (a `Tuning`: per-run options `--num-draft auto` chooses with
D, set through `set_options`, and their report columns).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
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


class Proposer(ABC):
    """What every drafter is to the decoder and to eval: the three calls of the module doc, and
    the faces eval reads, each with its default here (a method overrides what it offers)."""

    name: str = ""  # the report's row name (eval sets the --drafter argument's LABEL or NAME)
    weights: str | None = None  # which of a run's weights it reads (best, a checkpoint, last; eval sets it)
    # Target layers (ids: output of decoder layer i, 0-based; the last one is pre-norm)
    # whose hidden states this drafter wants in every TargetContext. Empty: none.
    capture_layers: tuple[int, ...] = ()
    # Attributes a run may set after construction (`set_options`): those its tuning chooses.
    run_options: tuple[str, ...] = ()

    @abstractmethod
    def begin(self, prompt_ids: torch.Tensor, ctx: TargetContext) -> None: ...

    @abstractmethod
    def propose(self, max_nodes: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft: ...

    @abstractmethod
    def commit(self, accepted: torch.Tensor, ctx: TargetContext) -> None: ...

    def set_options(self, **options: Any) -> None:
        """Set per-run options chosen for this drafter (`Tuned.options`); one it does not declare
        in `run_options` is refused in one line."""
        unknown = sorted(set(options) - set(self.run_options))
        if unknown:
            raise DraftsmithError(f"drafter {self.name}: no per-run option {', '.join(unknown)} "
                                  f"(it has: {', '.join(self.run_options) or 'none'})")
        for option, value in options.items():
            setattr(self, option, value)

    def report_extra(self) -> dict[str, Any]:
        """Method-specific report columns, name -> value (the report's `extra`); none by default."""
        return {}

    def tuning(self) -> Tuning | None:
        """What `eval --num-draft auto` chooses together with D for this drafter, or None (D alone)."""
        return None


@dataclass
class Tuned:
    """A tuning's choice: D and the options with it, and what the report shows of them."""

    num_draft: int
    tokens_per_s: float  # predicted on the calibration passes
    options: dict[str, Any]  # set on the evaluated drafter (Proposer.set_options)
    record: dict[str, Any]  # kept in the report.json row beside the choice (curves, the values chosen)
    columns: dict[str, Any]  # the report's --num-draft auto table: column heading -> this drafter's value
    note: str  # the report's line saying how they were chosen


class Tuning(ABC):
    """Per-run options `eval --num-draft auto` (eval/auto_draft.py) chooses together with D:
    the tuning records the calibration decodes' passes, then prices every setting of its
    options at every d with the pass cost."""

    # False: choose's pass_ms(d) is the whole pass (verify, drafting timed by the decoder,
    # host). True: verify and host only, the tuning timing its drafting itself (its recording
    # does work the verified draft does not, which the decoder's timing would count).
    prices_own_drafting: bool = False

    @abstractmethod
    def record(self, num_draft: int) -> None:
        """A calibration decode at `num_draft` drafts begins (its warm-up first): record its passes."""

    @abstractmethod
    def choose(self, pass_ms: Callable[[int], float], max_draft: int) -> Tuned:
        """The D (at most `max_draft`) and options of most expected tokens/s, from the passes
        recorded at `max_draft`; `pass_ms(d)`: milliseconds of one pass at d drafts."""


class NoProposer(Proposer):
    """Proposes nothing: the decoder then runs plain autoregressive decoding (tau = 1)."""

    name = "plain"

    def begin(self, prompt_ids, ctx) -> None:
        pass

    def propose(self, max_nodes, sampling, generator) -> Draft:
        return Draft.empty()

    def commit(self, accepted, ctx) -> None:
        pass
