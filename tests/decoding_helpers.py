"""Test-only drafters and a chi-square helper for the decoder and sampling tests."""

from __future__ import annotations

import copy
import random

import torch
from scipy.stats import chisquare

from draftsmith.eval.proposers.base import Draft, TargetContext
from draftsmith.eval.proposers.draft_lm import DraftLMProposer
from draftsmith.models.target import target_forward


class OracleProposer(DraftLMProposer):
    """The target as its own drafter: greedy drafts are exactly what the target would say, so
    every draft is accepted and tau = 1 + D. A correctness probe for the decoder, and the upper
    bound a drafter could reach at a given D (scripts/bench_verify.py builds its own through the
    registry: `oracle=draft_lm:<the target's folder>`)."""

    def __init__(self, target):
        super().__init__(target, target, name="oracle")


def chi2_pvalue(samples: list[int], probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of `samples` (category ids) under `probs`; categories expected fewer than
    `min_expected` times are pooled. A sample of a probability-0 category returns 0."""
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * len(samples)
    big = expected >= min_expected
    observed = counts[big].tolist()
    wanted = expected[big].tolist()
    if (~big).any() and expected[~big].sum() > 0:
        observed.append(counts[~big].sum().item())
        wanted.append(expected[~big].sum().item())
    return float(chisquare(observed, wanted).pvalue)


def _bfs_tree(levels: list[list[tuple[int, int]]]) -> Draft:
    """levels[d] = [(token, parent index or -1)] in BFS order -> Draft."""
    nodes = [node for level in levels for node in level]
    tokens = torch.tensor([t for t, _ in nodes], dtype=torch.long)
    parents = torch.tensor([p for _, p in nodes], dtype=torch.long)
    return Draft(tokens, parents)


class TreeAroundOracle:
    """A tree whose true greedy path (from the target itself) hides among decoy siblings
    at a random slot at every depth; decoys get decoy children of their own. With
    `break_prob` the true token at a depth is left out, so acceptance stops there."""

    name = "tree-oracle"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, target, depth: int, width: int = 3, break_prob: float = 0.0, seed: int = 0):
        self.oracle = OracleProposer(target)
        self.vocab = target.config.vocab_size
        self.depth, self.width, self.break_prob = depth, width, break_prob
        self.rng = random.Random(seed)

    def begin(self, prompt_ids, ctx):
        self.oracle.begin(prompt_ids, ctx)

    def commit(self, accepted, ctx):
        self.oracle.commit(accepted, ctx)

    def _decoys(self, avoid: int, n: int) -> list[int]:
        return self.rng.sample([t for t in range(self.vocab) if t != avoid], n)

    def propose(self, max_nodes, sampling, generator) -> Draft:
        depth = min(self.depth, max_nodes)
        if depth == 0:
            return Draft.empty()
        truth = self.oracle.propose(depth, sampling, generator).tokens.tolist()
        levels: list[list[tuple[int, int]]] = []
        frontier = [(-1, True)]  # (node index, on the true path)
        count = 0
        for d in range(depth):
            level, next_frontier = [], []
            broken = self.rng.random() < self.break_prob
            for parent, is_true in frontier:
                kids = self._decoys(truth[d], self.width if not is_true or broken else self.width - 1)
                flags = [False] * len(kids)
                if is_true and not broken:
                    slot = self.rng.randrange(self.width)
                    kids.insert(slot, truth[d])
                    flags.insert(slot, True)
                for token, flag in zip(kids, flags):
                    if count == max_nodes:
                        break
                    level.append((token, parent))
                    if flag or self.rng.random() < 0.3:
                        next_frontier.append((count, flag))
                    count += 1
            levels.append(level)
            frontier = next_frontier
        return _bfs_tree(levels)


class IIDTreeDrafter:
    """Stateless sampling drafter: `shape[d]` children per node at depth d, every token
    drawn i.i.d. from one fixed distribution q, which is what `probs` records."""

    name = "iid-tree"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, q: torch.Tensor, shape: tuple[int, ...] = (3, 2)):
        self.q, self.shape = q, shape

    def begin(self, prompt_ids, ctx):
        pass

    def commit(self, accepted, ctx):
        pass

    def propose(self, max_nodes, sampling, generator) -> Draft:
        levels, frontier, count = [], [-1], 0
        for width in self.shape:
            level = []
            for parent in frontier:
                for token in torch.multinomial(self.q, width, replacement=True, generator=generator).tolist():
                    level.append((token, parent))
            frontier = list(range(count, count + len(level)))
            count += len(level)
            levels.append(level)
        draft = _bfs_tree(levels)
        draft.probs = self.q.expand(len(draft), -1)
        return draft


class RandomTreeDrafter:
    """Random tokens in a random tree: almost never accepted, always a valid BFS tree."""

    name = "random-tree"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def begin(self, prompt_ids, ctx):
        pass

    def commit(self, accepted, ctx):
        pass

    def propose(self, max_nodes, sampling, generator) -> Draft:
        n = self.rng.randint(0, max_nodes)
        parents = [self.rng.randint(-1, i - 1) for i in range(n)]
        parents.sort()  # sorted parents keep BFS order: depth never decreases
        tokens = [self.rng.randrange(self.vocab) for _ in range(n)]
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def noisy_copy(model, scale: float, seed: int):
    """A draft model that agrees with `model` often but not always (a stand-in for a
    distilled draft): the same weights, each perturbed by `scale` of its own spread."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().nan_to_num(0.0))
    return twin


def begin_like_decoder(proposer, target, prompt: torch.Tensor):
    """Start `proposer` on `prompt` [T] the way the decoder does after its prefill: begin on
    all but the last token (with their target features), then commit the last one, whose
    features are not known yet. Returns the target's forward over the whole prompt."""
    with torch.no_grad():
        out = target_forward(target, prompt[None], capture=proposer.capture_layers)
        proposer.begin(prompt[:-1], TargetContext({i: h[0, :-1] for i, h in out.hidden.items()}, prompt[:-1], 0))
        proposer.commit(prompt[-1:], TargetContext({i: h[0, :0] for i, h in out.hidden.items()}, prompt[:0],
                                                   len(prompt) - 1))
    return out
