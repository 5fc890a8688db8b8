"""The EAGLE-2 tree's width, depth and node budget chosen together by `eval --num-draft auto`
(eval/auto_draft.py), as the chain's D is chosen: from the latency table and what the tree
is measured to accept on the calibration prompts.

While it records (the calibration decode at the cap), every tree proposal also grows, for
each width `topk` in TOPKS and the drafter's own, EAGLE-2's expansion to the cap's depth (MAX_DEPTH at most)
without pruning, timing
each level's drafter step; the proposal the decoder verifies is the proposer's own. When the
sequence ends its committed tokens are the target's greedy text, so every recorded tree can
be scored at every (topk, depth, budget n): the tree EAGLE-2 drafts at those settings is the
n best of its nodes of depth <= depth (EAGLE3Proposer.grow_tree says why pruning does not
change them), and it accepts the longest root path that spells the text. Each setting's
expected tokens per second is the recorded passes' committed tokens (1 + accepted) over
their cost: the table's verify at n rows, the decoder's host work, and the drafter's catch-up
and `depth` levels at that width as timed.

At a sampled temperature the tree's children are drawn (Eagle3Proposer.fill_tree), not
EAGLE-2's top-k, and the text depends on them: the prices are then the top-k tree's on the
realised text, an estimate, and the note says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from draftsmith.eval.proposers.base import Tuned, Tuning
from draftsmith.eval.proposers.eagle3 import TreeCandidates

TOPKS = (1, 2, 4, 8)  # the widths priced; 1 is a chain
# The deepest tree priced. Recording costs a drafter step per level and width on every
# calibration pass, and a CPU's cap is the latency table's largest d (48 on SmolLM2); EAGLE-2
# publishes depth 6 at 60 tokens, and a level past 10 is rarely reached by an accepted path.
MAX_DEPTH = 10
NOTE = ("The EAGLE-2 tree's width (topk), depth and node budget D are chosen together: each calibration "
        "pass's tree is grown at every width to the cap's depth and scored on the target's text at every "
        "(topk, depth, D), its drafting timed level by level.")
SAMPLED = " Sampled: the tree is drawn, so these prices are the top-k tree's on the realised text (an estimate)."


@dataclass
class _Grown:
    """One width's unpruned tree of one pass and each level's milliseconds."""
    nodes: TreeCandidates
    level_ms: list[float]

    def ranks(self, path: list[int], depths: int) -> list[list[int]]:
        """For each depth limit 1..`depths`, where each node of `path` within it stands among the
        nodes within it, in the order TreeCandidates.select keeps them (one sort for all limits)."""
        order, depth = self.nodes.ranked(), self.nodes.depth
        on_path = set(path)
        out = []
        for limit in range(1, depths + 1):
            kept = [n for n in order if depth[n] <= limit]
            out.append([i for i, n in enumerate(kept) if n in on_path])
        return out

    def path(self, text: list[int]) -> list[int]:
        """The nodes spelling `text` from the root, as far as the tree follows it."""
        children: dict[int, dict[int, int]] = {}
        for n, (p, t) in enumerate(zip(self.nodes.parent, self.nodes.token)):
            children.setdefault(p, {})[t] = n
        nodes, at = [], -1
        for token in text:
            at = children.get(at, {}).get(token)
            if at is None:
                break
            nodes.append(at)
        return nodes


@dataclass
class _Pass:
    sequence: int
    start: int  # tokens committed before it: its drafts are text[start:]
    catch_up_ms: float
    grown: dict[int, _Grown]
    sampled: bool


@dataclass
class TreeRecorder:
    """The calibration's tree proposals (Eagle3Proposer.recorder while it records)."""
    passes: list[_Pass] = field(default_factory=list)
    texts: list[list[int]] = field(default_factory=list)  # each ended sequence's committed tokens

    def end_sequence(self, proposer) -> None:
        if proposer.tokens is not None and len(self.texts) < self._sequences():
            self.texts.append(proposer.tokens.tolist())

    def _sequences(self) -> int:
        return self.passes[-1].sequence + 1 if self.passes else 0

    def record_pass(self, proposer, depth: int, sampled: bool) -> None:
        start = time.perf_counter()
        proposer._catch_up()
        catch_up_ms = 1000.0 * (time.perf_counter() - start)
        grown = {}
        for k in sorted({min(k, proposer.draft_ids.numel()) for k in (*TOPKS, proposer.topk)}):
            laps: list[float] = []
            nodes = proposer.grow_tree(min(depth, MAX_DEPTH), topk=k, prune=False, level_ms=laps)
            grown[k] = _Grown(nodes, laps)
        proposer.cache.crop(proposer.context)  # the recorded trees' rows: the verified tree never reads them
        sequence = len(self.texts)
        self.passes.append(_Pass(sequence, len(proposer.tokens), catch_up_ms, grown, sampled))


class TreeTuning(Tuning):
    """`topk`, `depth` and D of an EAGLE-2 tree drafter chosen together (the module doc)."""

    prices_own_drafting = True  # choose's pass_ms is verify and host: the drafting is timed here

    def __init__(self, proposer):
        self.proposer = proposer
        self.recorders: dict[int, TreeRecorder] = {}

    def record(self, num_draft: int) -> None:
        self._stop()
        self.recorders[num_draft] = self.proposer.recorder = TreeRecorder()

    def _stop(self) -> None:
        """The recording decode is over: its last sequence ended with it."""
        if self.proposer.recorder is not None:
            self.proposer.recorder.end_sequence(self.proposer)
        self.proposer.recorder = None

    def choose(self, pass_ms, max_draft: int) -> Tuned:
        self._stop()
        recorder = self.recorders.get(max_draft) or TreeRecorder()
        kept = top_settings(price(recorder, pass_ms, max_draft))
        best = kept[0]
        options = {"topk": best["topk"], "depth": best["depth"]} if best["d"] else {}
        sampled = any(p.sampled for p in recorder.passes)
        return Tuned(best["d"], best["tokens_per_s"], options,
                     {"tree_curve": kept, "passes_priced": len(recorder.passes)},
                     {"topk": best["topk"], "depth": best["depth"]}, NOTE + (SAMPLED if sampled else ""))


def price(recorder: TreeRecorder, pass_ms, max_draft: int) -> list[dict]:
    """Every (topk, depth, d) with its expected tokens, pass milliseconds and tokens/s over
    the recorded passes; d = 0 (no tree) once, as plain decoding."""
    passes = [p for p in recorder.passes if p.sequence < len(recorder.texts)]
    curve = [{"topk": 0, "depth": 0, "d": 0, "expected_tokens": 1.0, "pass_ms": pass_ms(0),
              "tokens_per_s": 1000.0 / pass_ms(0)}]
    if not passes:
        return curve
    widths = sorted(passes[0].grown)
    for k in widths:
        scored = [(p, p.grown[k], p.grown[k].path(recorder.texts[p.sequence][p.start:])) for p in passes]
        depths = min(max_draft, MAX_DEPTH)
        ranks_by_depth = list(zip(*(g.ranks(path, depths) for _, g, path in scored)))
        for depth, ranks in enumerate(ranks_by_depth, start=1):
            draft_ms = sum(p.catch_up_ms + sum(g.level_ms[:depth]) for p, g, _ in scored) / len(scored)
            for d in range(depth, max_draft + 1):  # a depth past d is d's: d nodes reach d levels at most
                accepted = sum(sum(r < d for r in rank) for rank in ranks) / len(ranks)
                ms = pass_ms(d) + draft_ms
                curve.append({"topk": k, "depth": depth, "d": d, "expected_tokens": 1.0 + accepted,
                              "pass_ms": ms, "tokens_per_s": 1000.0 * (1.0 + accepted) / ms})
    return curve


def top_settings(curve: list[dict], count: int = 10) -> list[dict]:
    """The curve's best settings, best first (the choice; the report keeps these, not every
    width x depth x d): most tokens/s, then the fewest nodes, the shallowest, the narrowest."""
    return sorted(curve, key=lambda p: (-p["tokens_per_s"], p["d"], p["depth"], p["topk"]))[:count]
