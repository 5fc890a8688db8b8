"""EAGLE-3 drafting for the speculative decoder: a chain, or an EAGLE-2 dynamic tree.

Drafter position p holds the entry (fused target features at p, token x_{p+1}). After a
commit the decoder has handed over every committed token and the features of every
committed position but the last, so every position with features can have its entry;
the output of the last one (position c) predicts the token after the last committed one.

The drafter's KV cache keeps these context entries only. A proposal appends entries for
its own drafts, computed from the drafter's own hidden states; the next commit crops them
away, because accepted positions come back with the target's features and are recomputed
from those (SGLang's draft-extend does the same). Context entries are computed lazily in
`propose`, so a commit costs nothing and a sequence that ends never pays for them.
"""

from __future__ import annotations

import heapq
import time
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import Draft, Proposer, SamplingParams
from draftsmith.eval.sampling import draw_without_replacement, process_logits, sample
from draftsmith.models.eagle3 import DraftKV, Eagle3Drafter
from draftsmith.models.formats.eagle3 import read


def load_proposer(path: str | Path, target, tree: bool = False, **options) -> "Eagle3Proposer":
    """A native EAGLE-3 folder (a training run's model/) or an SGLang/vLLM/SpecForge one, as
    a chain drafter or, with `tree`, an EAGLE-2 tree drafter (`topk`, `depth` in options)."""
    drafter = read(path, target)
    return Eagle3Proposer(drafter, mode="tree" if tree else "chain", **options)


class Eagle3Proposer(Proposer):
    """`mode="chain"`: max_nodes autoregressive drafts. `mode="tree"`: EAGLE-2's dynamic tree,
    `topk` children per expanded node and `topk` nodes expanded per depth, then the nodes of
    highest cumulative draft log-probability, as many as the node budget (always a tree: a
    child never scores above its parent). The budget is the decoder's max_nodes, or
    `budget` when smaller; the depth follows from it (up to `budget` levels, as EAGLE-2's
    depth follows its total-token budget; `depth` caps it), so a chain is one possible
    tree and a confident drafter grows a deep, narrow one. Greedy tree drafts are EAGLE-2's
    deterministic top-k; sampled ones take that tree's shape and draw its children without
    replacement (`sampled_children`, see `fill_tree`; False keeps EAGLE-2's top-k, the
    `eagle3_tree_topk` variant), and the
    decoder's tree sampling accepts either losslessly."""

    run_options = ("topk", "depth")  # the tree's, chosen with D by `eval --num-draft auto` (TreeTuning)

    def __init__(self, drafter: Eagle3Drafter, mode: str = "chain", topk: int = 4, depth: int | None = None,
                 budget: int | None = None, name: str | None = None, sampled_children: bool = True):
        if mode not in ("chain", "tree"):
            raise DraftsmithError(f"EAGLE-3 drafting mode {mode!r}: expected 'chain' or 'tree'")
        if topk < 1 or (depth is not None and depth < 1):
            raise DraftsmithError(f"EAGLE-3 tree: topk and depth must be >= 1, got {topk} and {depth}")
        if budget is not None and budget < 1:
            raise DraftsmithError(f"EAGLE-3 tree: the node budget must be at least one node, got {budget}")
        self.drafter = drafter.eval()
        self.mode, self.topk, self.depth, self.budget = mode, topk, depth, budget
        self.sampled_children = sampled_children
        self.name = name or f"eagle3-{mode}"
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.device = drafter.fc.weight.device
        self.draft_ids = drafter.draft_to_target
        # `eval --num-draft auto` (TreeTuning): with a recorder here, each tree proposal also
        # grows every width the tuning prices, to price every (topk, depth, D) from one calibration.
        self.recorder = None
        self.tokens: torch.Tensor | None = None  # the sequence's tokens, prompt and committed (set by begin)

    # ---- the Proposer protocol ---------------------------------------------------------

    def begin(self, prompt_ids, ctx) -> None:
        if self.recorder is not None:
            self.recorder.end_sequence(self)
        self.cache = DraftKV()
        self.tokens = prompt_ids.to(self.device)
        self.context = 0  # positions whose entry is in the cache
        self.pending: list[torch.Tensor] = []  # captured features of the positions after those
        self.last_out: torch.Tensor | None = None  # drafter output at the last context position
        self._take(ctx)

    def commit(self, accepted, ctx) -> None:
        self.cache.crop(self.context)
        self.tokens = torch.cat([self.tokens, accepted.to(self.device)])
        self._take(ctx)

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator) -> Draft:
        if max_nodes <= 0:
            return Draft.empty(self.device)
        self._catch_up()
        if self.mode == "chain":
            return self._chain(max_nodes, sampling, generator)
        return self._tree(max_nodes, sampling, generator)

    def tuning(self):
        """A tree's width and depth are chosen with D (eval/proposers/eagle3_tree_tuning.py); a chain has D alone."""
        if self.mode != "tree":
            return None
        from draftsmith.eval.proposers.eagle3_tree_tuning import TreeTuning

        return TreeTuning(self)

    # ---- context ---------------------------------------------------------------------

    def _take(self, ctx) -> None:
        if not len(ctx):
            return
        known = self.context + sum(len(f) for f in self.pending)
        if ctx.start != known:
            raise DraftsmithError(f"EAGLE-3 drafter: features start at position {ctx.start}, expected {known}")
        features = torch.cat([ctx.hidden[i] for i in self.capture_layers], dim=-1)
        self.pending.append(features.to(self.device))

    def _catch_up(self) -> None:
        if not self.pending:
            return
        features = torch.cat(self.pending)
        start, count = self.context, len(features)
        positions = torch.arange(start, start + count, device=self.device)[None]
        tokens = self.tokens[start + 1 : start + count + 1][None]  # x_{p+1} for each position p
        out = self.drafter.step(tokens, self.drafter.fuse(features)[None], positions, self.cache)
        self.last_out = out[:, -1:]
        self.context += count
        self.pending = []

    # ---- chain -----------------------------------------------------------------------

    def _chain(self, max_nodes: int, sampling: SamplingParams, generator) -> Draft:
        hidden, tokens, probs = self.last_out, [], []
        for k in range(max_nodes):
            logits = self.drafter.logits(hidden)[0, -1]
            if sampling.greedy:
                token = self.draft_ids[logits.argmax()]
            else:
                q = process_logits(self._on_target_vocab(logits), sampling)
                token = sample(q, generator)
                probs.append(q)
            tokens.append(token)
            if k + 1 < max_nodes:  # the last draft is never fed back
                position = torch.tensor([[self.context + k]], device=self.device)
                hidden = self.drafter.step(token.view(1, 1), hidden, position, self.cache, committed=self.context)
        return Draft(torch.stack(tokens), None, torch.stack(probs) if probs else None)

    def _on_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., d] spread over the target vocabulary [..., V]."""
        full = logits.new_full((*logits.shape[:-1], self.drafter.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)

    # ---- EAGLE-2 dynamic tree ------------------------------------------------------------

    def _tree(self, max_nodes: int, sampling: SamplingParams, generator) -> Draft:
        budget = max_nodes if self.budget is None else min(max_nodes, self.budget)
        if self.recorder is not None:
            self.recorder.record_pass(self, max_nodes, sampled=not sampling.greedy)
        root = self.drafter.logits(self.last_out)[0, -1]
        shape = self.grow_tree(budget, root).select(budget)
        if sampling.greedy or not self.sampled_children:
            return shape
        self.cache.crop(self.context)  # the shape's rows: the drawn tree never reads them
        return self.fill_tree(shape.parents.tolist(), sampling, generator, root)

    def fill_tree(self, shape: list[int], sampling: SamplingParams, generator,
                  root: torch.Tensor | None = None) -> Draft:
        """A tree of the given shape (BFS parents, -1: the root) whose children are drawn
        from the drafter's processed q without replacement, level by level.

        Why the shape comes first: multi-draft rejection sampling is exact only if whether a
        node is drafted does not depend on the token drawn into it. Keeping the best-scoring
        of the drawn nodes (EAGLE-2's rerank applied to draws) favours the drafter's likely
        tokens, and the committed tokens drift from the target's distribution (the test
        `test_sampled_tree_first_token_is_distributed_as_the_target` catches it). The shape
        is EAGLE-2's top-k tree for this context, chosen before anything is drawn; a
        node's first child is then distributed as the chain's draft from it. It costs a
        second pass of drafter steps, one per level.

        Why drawn children rather than EAGLE-2's top-k under sampling: a deterministic child
        is accepted with probability p(x), so `k` of them catch at most the target's top-k
        mass, while a child drawn from q is accepted with probability sum min(p, q) -- more
        when the target's sampling distribution is flat. Measured on the demo's EAGLE-3
        (seed 0) over 16 held-out prompts at temperature 0.7, top-p 0.8, top-k 20 (15
        nodes): tau 2.19 drawn, 1.96 top-4 (`eagle3_tree_topk`), 2.04 for the chain."""
        slots: dict[int, list[int]] = {}
        for node, parent in enumerate(shape):
            slots.setdefault(parent, []).append(node)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []
        made = {-1: -1}  # shape node -> drawn node; the drawn nodes are in BFS order too
        above: dict[int, list[int]] = {-1: []}
        outputs = {-1: self.last_out}
        root = self.drafter.logits(self.last_out)[0, -1] if root is None else root
        qs = process_logits(self._on_target_vocab(root[None]), sampling)  # one row per frontier node
        frontier = [-1]
        for level in range(1, len(shape) + 1):
            grown = []
            for n, q in zip(frontier, qs):
                drawn, rows = draw_without_replacement(q, len(slots[n]), generator)
                # a q with fewer tokens than slots drops the rest, and the subtrees under them
                for slot, token in zip(slots[n], drawn):
                    made[slot] = len(tokens)
                    tokens.append(token)
                    parents.append(made[n])
                    grown.append(slot)
                probs.append(rows)
            frontier = [n for n in grown if n in slots]
            if not frontier:
                break
            out = self._step_nodes(tokens, parents, [made[n] for n in frontier], level, above, outputs)
            qs = process_logits(self._on_target_vocab(self.drafter.logits(out)[0]), sampling)
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.cat(probs))

    def _step_nodes(self, tokens: list[int], parents: list[int], frontier: list[int], level: int,
                    above: dict[int, list[int]], outputs: dict) -> torch.Tensor:
        """One drafter step over the tree nodes `frontier` (all at depth `level`; `tokens`
        and `parents` of every node so far): each sees the context, its ancestors' entries
        and itself. Records each node's cache rows in `above` and its output in `outputs`;
        returns the outputs [1, n, H]."""
        rows = len(self.cache)
        ids = torch.tensor([tokens[n] for n in frontier], device=self.device)[None]
        hidden = torch.cat([outputs[parents[n]] for n in frontier], dim=1)
        visible = torch.zeros(len(frontier), rows + len(frontier), dtype=torch.bool)  # built here, moved once
        visible[:, : self.context] = True
        for j, n in enumerate(frontier):
            above[n] = above[parents[n]] + [rows + j]
            visible[j, above[n]] = True
        positions = torch.full((1, len(frontier)), self.context + level - 1, device=self.device)
        out = self.drafter.step(ids, hidden, positions, self.cache, visible.to(self.device), committed=self.context)
        for j, n in enumerate(frontier):
            outputs[n] = out[:, j : j + 1]
        return out

    def grow_tree(self, budget: int, root: torch.Tensor | None = None, topk: int | None = None,
                  prune: bool = True, level_ms: list[float] | None = None) -> "TreeCandidates":
        """EAGLE-2's expansion: the `topk` best nodes of each depth get their `topk` best
        children, one depth after another, until the budget's depth (`budget` levels, or
        `depth`) or until no node of the newest depth can still be among the `budget` best
        (a child never scores above its parent, so the nodes below such a node cannot
        either). Deterministic: a function of the context alone. `root`: the drafter's
        logits after the last committed token, when the caller has them.

        A node at depth d is the drafter entry (its token, its parent's output) at position
        context + d - 1; it sees the context entries, its ancestors' entries and itself.

        `topk` overrides the proposer's; `prune=False` (the tuning's recording) expands every
        level's `topk` best to `budget` levels, `depth` ignored, whose `select(n)` over the nodes
        of depth <= d is the pruned tree's of budget n and depth d (pruning skips only nodes
        below the n-th best, whose subtrees are never selected; tested), and `level_ms` gets
        each level's milliseconds.
        """
        self._catch_up()
        k = min(topk or self.topk, self.draft_ids.numel())
        nodes = TreeCandidates()
        above: dict[int, list[int]] = {-1: []}  # expanded node -> cache rows of its ancestors and itself
        outputs = {-1: self.last_out}  # expanded node -> its drafter output (its children's hidden)
        clock = time.perf_counter()
        nodes.add_children(-1, self.drafter.logits(self.last_out)[0, -1] if root is None else root, k,
                           self.draft_ids)
        frontier = list(range(len(nodes)))
        levels = budget if self.depth is None or not prune else min(self.depth, budget)
        for level in range(1, levels):
            if level_ms is not None:
                clock = _lap(level_ms, clock)
            bar = nodes.cutoff(budget) if prune else float("-inf")
            frontier = [n for n in frontier if nodes.score[n] >= bar]
            if not frontier:
                break
            out = self._step_nodes(nodes.token, nodes.parent, frontier, level, above, outputs)
            logits = self.drafter.logits(out)[0]
            first_child = len(nodes)
            for j, n in enumerate(frontier):
                nodes.add_children(n, logits[j], k, self.draft_ids)
            frontier = sorted(range(first_child, len(nodes)), key=lambda n: -nodes.score[n])[:k]
        if level_ms is not None:
            _lap(level_ms, clock)
        return nodes


def _lap(laps: list[float], since: float) -> float:
    now = time.perf_counter()
    laps.append(1000.0 * (now - since))
    return now


class TreeCandidates:
    """Every node a tree expansion scored: target token, parent (-1: the last committed
    token), depth, and cumulative draft log-probability of the path to it."""

    def __init__(self):
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.score: list[float] = []

    def _add(self, node: int, token: int, logprob: float) -> None:
        base, level = (self.score[node], self.depth[node] + 1) if node >= 0 else (0.0, 1)
        self.token.append(token)
        self.parent.append(node)
        self.depth.append(level)
        self.score.append(base + logprob)

    def __len__(self) -> int:
        return len(self.token)

    def add_children(self, node: int, logits: torch.Tensor, k: int, draft_ids: torch.Tensor) -> None:
        top = logits.float().log_softmax(-1).topk(k)
        for logprob, token in zip(top.values.tolist(), draft_ids[top.indices].tolist()):
            self._add(node, token, logprob)

    def cutoff(self, budget: int) -> float:
        """The `budget`-th best score so far (-inf while there are fewer nodes): a node
        scoring below it, and so every node under it, is never selected."""
        if len(self) < budget:
            return float("-inf")
        return heapq.nlargest(budget, self.score)[-1]

    def ranked(self) -> list[int]:
        """Every node, best first: by score, then the shallower (a parent ties before its child)."""
        return sorted(range(len(self)), key=lambda n: (-self.score[n], self.depth[n], n))

    def select(self, budget: int) -> Draft:
        """The `budget` best nodes whose parents are also kept, in BFS order. A child never
        scores above its parent (log-probabilities are <= 0), so this is the top `budget`."""
        kept: list[int] = []
        chosen = {-1}
        for n in self.ranked():
            if self.parent[n] in chosen:
                kept.append(n)
                chosen.add(n)
                if len(kept) == budget:
                    break
        kept.sort(key=lambda n: (self.depth[n], n))
        index = {n: i for i, n in enumerate(kept)}
        index[-1] = -1
        tokens = torch.tensor([self.token[n] for n in kept], dtype=torch.long)
        parents = torch.tensor([index[self.parent[n]] for n in kept], dtype=torch.long)
        return Draft(tokens, parents)
