"""Logits processing and the lossless acceptance rules of speculative decoding.

Target and drafter distributions go through the same `process_logits`, so "p" and "q"
below are always the *processed* distributions (temperature, top-k, top-p applied).

Layout used by the acceptance functions: `p` has one row per verify position, row 0 the
target's distribution after the last committed token and row i + 1 the one after draft
node i. Greedy verification compares against the target's argmax at each row.

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft x ~ q with probability
min(1, p(x) / q(x)); on rejection draw from norm(max(0, p - q)). The committed token is
then distributed exactly as p. For a tree (SpecInfer's multi-step speculative sampling,
as used by EAGLE), the children of the current node are tried in turn, each against the
residual left by the siblings rejected before it; the result is exact as long as each
child's token was drawn from the q recorded for it, given the earlier siblings (i.i.d.
siblings: the same q; without replacement: q without the earlier ones; deterministic
drafts: one-hot q, for which the residual is p with the rejected token removed).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import SamplingParams


def process_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (in that order, as transformers).

    Only the few tokens that can survive are sorted (topk), never the whole vocabulary:
    a sort of 49k scores cost a CPU 2 ms a row, paid on every verify row and sampled draft."""
    scores = logits.float() / sampling.temperature
    survivors, mass = None, None  # the only tokens that can stay, by descending score; their probabilities
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        survivors = torch.topk(scores, sampling.top_k, dim=-1)
        kth = survivors.values[..., -1:]
        if bool(((scores >= kth).sum(-1) == sampling.top_k).all()):
            mass = survivors.values.softmax(-1)  # top-p reads the distribution top-k left
        else:  # a tie at the k-th score: every tied token stays, as in transformers
            scores, survivors = scores.masked_fill(scores < kth, float("-inf")), None
    if sampling.top_p < 1.0 and survivors is None:
        survivors, mass = _nucleus_candidates(scores, sampling.top_p)
    if survivors is None:
        return scores.softmax(-1)
    kept = survivors.values  # top_p 1 drops nothing (a cumsum rounded up to 1.0 must not drop a tail token)
    if sampling.top_p < 1.0:
        kept = kept.masked_fill(_beyond_nucleus(mass, sampling.top_p), float("-inf"))
    return torch.zeros_like(scores).scatter_(-1, survivors.indices, kept.softmax(-1))


def _nucleus_candidates(scores: torch.Tensor, top_p: float):
    """Top tokens (topk, sorted), enough to hold every token top-p keeps in every row, and
    their probabilities (over the whole vocabulary, as top-p reads them)."""
    probs = scores.softmax(-1)
    k = min(64, scores.shape[-1])
    while True:
        top = torch.topk(scores, k, dim=-1)
        mass = probs.gather(-1, top.indices)
        # Done once top-p drops the last candidate (decided by the same cumsum that decides
        # the rest): every token past it has at least as much mass before it.
        if k == scores.shape[-1] or bool(_beyond_nucleus(mass, top_p)[..., -1].all()):
            return top, mass
        k = min(4 * k, scores.shape[-1])


def _beyond_nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per probability (sorted descending), whether top-p drops it: once the more likely
    tokens already cover top_p; the top one always stays."""
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop[..., 0] = False
    return drop


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` ([..., V] -> [...]), by inverting the cumulative sum
    (in float64, so a token's share is exact to ~1e-16): torch.multinomial took 2 ms a row
    over a 49k vocabulary on a CPU, this 0.07 ms. A token of probability 0 is never drawn
    (its cumulative sum equals its predecessor's, which searchsorted finds first)."""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool((total > 0).all() and torch.isfinite(total).all()):  # multinomial refused these too
        raise DraftsmithError("cannot sample: a distribution is NaN, infinite or all zero (a diverged drafter?)")
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=torch.float64) * total
    token = torch.searchsorted(cdf, u, right=True).clamp_max_(flat.shape[-1] - 1)
    return token.reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, sampling: SamplingParams, generator=None) -> torch.Tensor:
    """The target's own choice from `logits` [..., V]: argmax when greedy, else a sample."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(process_logits(logits, sampling), generator)


def draw(logits: torch.Tensor, sampling: SamplingParams, generator=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's pick from `logits` [..., V], and the distribution q it was drawn from
    (None when greedy: the draft is deterministic, q is one-hot)."""
    if sampling.greedy:
        return logits.argmax(-1), None
    q = process_logits(logits, sampling)
    return sample(q, generator), q


def draw_without_replacement(q: torch.Tensor, k: int, generator=None) -> tuple[list[int], torch.Tensor]:
    """Up to `k` distinct tokens drawn from q [V] in turn (Gumbel top-k; fewer when q has
    fewer tokens), and per token the distribution it was drawn from [m, V]: q without the
    tokens drawn before it, renormalised, which multi-draft rejection sampling needs."""
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(1e-20, 1.0)
    keys = q.log() - (-u.log()).log()  # log q + Gumbel noise; -inf where q is 0
    tokens = keys.topk(min(k, int((q > 0).sum()))).indices
    rows = q.expand(len(tokens), -1).clone()
    for i in range(1, len(tokens)):
        rows[i:, tokens[i - 1]] = 0.0
    return tokens.tolist(), rows / rows.sum(-1, keepdim=True)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself when the residual is all zero (p == q), never NaN.

    With p == q a rejection has probability 0, so which distribution we fall back to only
    matters for float round-off; p is the one that keeps the output distributed as p.
    """
    r = (p - q).clamp_min_(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def _one_hot(token, like: torch.Tensor) -> torch.Tensor:
    hot = torch.zeros_like(like)
    hot[token] = 1.0
    return hot


def accept_chain_greedy(target_top: list[int], drafts: list[int]) -> int:
    """Number of drafts equal to the target's argmax at their position."""
    a = 0
    while a < len(drafts) and drafts[a] == target_top[a]:
        a += 1
    return a


def accept_chain_sampled(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, generator=None
) -> tuple[int, torch.Tensor]:
    """Speculative sampling along a chain: (number accepted, the next token to commit).

    p: [k + 1, V] target, drafts: [k], q: [k, V] or None (one-hot drafts).
    All k accept tests are drawn at once; only the first rejection matters.
    """
    k = drafts.shape[0]
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, drafts]
    q_x = q[rows, drafts] if q is not None else torch.ones_like(p_x)
    u = torch.rand(k, device=p.device, generator=generator)
    # u * q < p  <=>  u < p / q without dividing; accepts surely when p >= q.
    accepted = int((u * q_x < p_x).long().cumprod(0).sum())
    if accepted == k:
        return k, sample(p[k], generator)
    q_a = q[accepted] if q is not None else _one_hot(drafts[accepted], p[accepted])
    return accepted, sample(residual(p[accepted], q_a), generator)


def accept_tree_greedy(target_top: list[int], tokens: list[int], children: list[list[int]]) -> list[int]:
    """The accepted path (draft node indices, root excluded) under greedy verification.

    children[0] are the root's children, children[i + 1] those of draft node i.
    """
    path: list[int] = []
    row = 0
    while True:
        want = target_top[row]
        match = next((c for c in children[row] if tokens[c] == want), None)
        if match is None:
            return path
        path.append(match)
        row = match + 1


def accept_tree_sampled(
    p: torch.Tensor, tokens: list[int], children: list[list[int]], q: torch.Tensor | None, generator=None
) -> tuple[list[int], torch.Tensor]:
    """Multi-draft recursive rejection sampling down a tree: (accepted path, next token)."""
    path: list[int] = []
    row = 0
    while True:
        dist = p[row]
        kids = children[row]
        u = torch.rand(len(kids), device=p.device, generator=generator).tolist() if kids else []
        chosen = None
        for c, u_c in zip(kids, u):
            x = tokens[c]
            q_c = q[c] if q is not None else _one_hot(x, dist)
            if u_c * float(q_c[x]) < float(dist[x]):
                chosen = c
                break
            dist = residual(dist, q_c)
        if chosen is None:
            return path, sample(dist, generator)
        path.append(chosen)
        row = chosen + 1
