"""Logits processing and the acceptance rules, on synthetic distributions.

The losslessness checks draw many two-token outcomes (y1, y2) from a synthetic "target"
p(y1) p(y2 | y1) through one verify step and compare their joint histogram with the
exact joint by a chi-square test. When the step commits a single token, y2 is drawn
from the target directly, as the next step would.
"""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from decoding_helpers import chi2_pvalue
from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import SamplingParams
from draftsmith.eval.sampling import (
    accept_chain_greedy,
    accept_chain_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    draw_without_replacement,
    process_logits,
    residual,
    sample,
)

V = 5
TRIALS = 6000


def _transformers_probs(logits, temperature, top_k, top_p):
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits.clone()).softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 7, 1.0), (1.0, 0, 0.8), (1.3, 20, 0.6)])
def test_process_logits_matches_transformers(temperature, top_k, top_p):
    logits = torch.randn(6, 50) * 3
    got = process_logits(logits, SamplingParams(temperature, top_k, top_p))
    torch.testing.assert_close(got, _transformers_probs(logits, temperature, top_k, top_p))
    assert (got > 0).sum(-1).min() >= 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.8), (1.0, 0, 0.95), (1.0, 5, 1.0), (1.0, 5, 0.9)])
def test_process_logits_on_a_real_sized_vocabulary_matches_transformers(temperature, top_k, top_p):
    # A flat tail (nucleus far past 64 tokens: the candidate search grows to the whole
    # vocabulary) and, in row 1, a tie at the k-th score (every tied token must stay, so
    # the top-k shortcut is off); row 2 has fewer finite scores than k.
    logits = torch.randn(3, 49152) * 0.5
    logits[0, :10] += 8.0
    logits[1, :7] = torch.tensor([9.0, 8.0, 7.0, 6.0, 4.0, 4.0, 4.0])
    logits[2, 3:] = float("-inf")
    got = process_logits(logits, SamplingParams(temperature, top_k, top_p))
    torch.testing.assert_close(got, _transformers_probs(logits, temperature, top_k, top_p))
    if (top_k, top_p) == (5, 1.0):
        assert int((got[1] > 0).sum()) == 7  # the three tied at the 5th all stay


def test_top_p_reads_only_the_top_tokens_of_a_peaked_distribution():
    from draftsmith.eval.sampling import _nucleus_candidates

    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 3  # peaked as a language model's: the nucleus is a few hundred tokens
    scores = logits / 0.9
    survivors, _ = _nucleus_candidates(scores, 0.8)
    assert survivors.indices.shape[-1] < 49152 // 4  # stopped early ...
    got = process_logits(logits, SamplingParams(0.9, 0, 0.8))
    torch.testing.assert_close(got, _transformers_probs(logits, 0.9, 0, 0.8))  # ... and exact
    assert int((got > 0).sum(-1).max()) < survivors.indices.shape[-1]


def test_sampling_a_broken_distribution_is_refused():
    for bad in (torch.tensor([[0.5, float("nan"), 0.5]]), torch.zeros(1, 3)):
        with pytest.raises(DraftsmithError, match="cannot sample"):
            sample(bad)


def test_sample_draws_each_token_at_its_probability_and_never_a_zero_one():
    probs = torch.zeros(2, 300)
    probs[0, [3, 150, 299]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 0] = 1.0
    tokens = sample(probs.expand(TRIALS, 2, 300), torch.Generator().manual_seed(0))
    assert tokens.shape == (TRIALS, 2)
    assert set(tokens[:, 1].tolist()) == {0}
    assert chi2_pvalue(tokens[:, 0].tolist(), probs[0]) > 1e-3  # 0 if a probability-0 token came out


def test_bad_sampling_params_are_refused():
    for kwargs in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(DraftsmithError):
            SamplingParams(**kwargs)


def test_residual_when_p_equals_q_falls_back_to_p():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    torch.testing.assert_close(residual(p, p.clone()), p)
    r = residual(p, torch.tensor([0.25, 0.25, 0.25, 0.25]))
    torch.testing.assert_close(r, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert not torch.isnan(residual(torch.zeros(4), torch.zeros(4))).any()


def test_chain_with_p_equal_q_accepts_every_draft():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 16, generator=gen), -1)
    for _ in range(300):
        drafts = sample(p[:3], gen)
        accepted, bonus = accept_chain_sampled(p, drafts, p[:3].clone(), gen)
        assert accepted == 3 and 0 <= int(bonus) < 16


def test_greedy_acceptance():
    assert accept_chain_greedy([4, 5, 6, 7], [4, 5, 9]) == 2
    assert accept_chain_greedy([4, 5, 6, 7], [4, 5, 6]) == 3
    assert accept_chain_greedy([4], []) == 0
    # root children: nodes 0 (tok 3), 1 (tok 4); node 1's children: 2 (tok 8), 3 (tok 9)
    tokens, children = [3, 4, 8, 9], [[0, 1], [], [2, 3], [], []]
    assert accept_tree_greedy([4, 0, 9, 0, 0], tokens, children) == [1, 3]
    assert accept_tree_greedy([4, 0, 7, 0, 0], tokens, children) == [1]
    assert accept_tree_greedy([5, 0, 9, 0, 0], tokens, children) == []


# ---- losslessness under sampling ---------------------------------------------------


def _world(seed: int, sharp: float = 2.0):
    """A target p1, p2[y1] and a different draft q1, q2[y1] over V tokens; q puts zero
    mass on a token p likes and p on one q likes, so both residual cases occur."""
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * sharp, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * sharp, -1)
    q1 = torch.softmax(torch.randn(V, generator=g) * sharp, -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * sharp, -1)
    p1[0], q1[1] = 0.0, 0.0
    return p1 / p1.sum(), p2, q1 / q1.sum(), q2


def _joint(p1, p2):
    return (p1[:, None] * p2).flatten()


def _finish(committed: list[int], p2, gen) -> int:
    y1 = committed[0]
    y2 = committed[1] if len(committed) > 1 else int(sample(p2[y1], gen))
    return y1 * V + y2


UNIFORM = torch.full((V,), 1.0 / V)


@pytest.mark.parametrize("case", ["q differs", "p equals q", "one-hot drafts"])
def test_chain_sampling_is_lossless(case):
    p1, p2, q1, q2 = _world(0)
    if case == "p equals q":
        q1, q2 = p1.clone(), p2.clone()
    gen = torch.Generator().manual_seed(2)
    outcomes = []
    for _ in range(TRIALS):
        if case == "one-hot drafts":  # a deterministic drafter: its argmax, q = None
            d1 = int(q1.argmax())
            d2 = int(q2[d1].argmax())
            q = None
        else:
            d1 = int(sample(q1, gen))
            d2 = int(sample(q2[d1], gen))
            q = torch.stack([q1, q2[d1]])
        p = torch.stack([p1, p2[d1], UNIFORM])
        a, bonus = accept_chain_sampled(p, torch.tensor([d1, d2]), q, gen)
        outcomes.append(_finish([d1, d2][:a] + [int(bonus)], p2, gen))
    assert chi2_pvalue(outcomes, _joint(p1, p2)) > 1e-3


def _tree_trial(p1, p2, q1, q2, mode: str, gen):
    """Root gets 3 children, each child 2 children, BFS; returns the (y1, y2) outcome."""

    def siblings(q, n):
        if mode == "deterministic":
            return q.topk(n).indices.tolist(), [None] * n
        if mode == "iid":
            return torch.multinomial(q, n, replacement=True, generator=gen).tolist(), [q] * n
        # without replacement: sibling j was drawn from q without the earlier ones
        tokens, dists, rest = [], [], q.clone()
        for _ in range(n):
            dist = rest / rest.sum()
            t = int(torch.multinomial(dist, 1, generator=gen))
            tokens.append(t)
            dists.append(q if mode == "lying" else dist)
            rest[t] = 0.0
        return tokens, dists

    tokens, dists = siblings(q1, 3)
    rows = [p1] + [p2[t] for t in tokens]
    children = [[0, 1, 2]]
    for t in list(tokens):
        kid_tokens, kid_dists = siblings(q2[t], 2)
        children.append([len(tokens), len(tokens) + 1])
        tokens += kid_tokens
        dists += kid_dists
    rows += [UNIFORM] * 6
    children += [[] for _ in range(6)]
    q = None if mode == "deterministic" else torch.stack(dists)
    path, bonus = accept_tree_sampled(torch.stack(rows), tokens, children, q, gen)
    return _finish([tokens[c] for c in path] + [int(bonus)], p2, gen)


@pytest.mark.parametrize("mode", ["iid", "without replacement", "deterministic"])
def test_tree_sampling_is_lossless(mode):
    p1, p2, q1, q2 = _world(3)
    gen = torch.Generator().manual_seed(4)
    outcomes = [_tree_trial(p1, p2, q1, q2, mode, gen) for _ in range(TRIALS)]
    assert chi2_pvalue(outcomes, _joint(p1, p2)) > 1e-3


def test_a_drafter_misreporting_q_is_caught():
    """The check has teeth: siblings drawn without replacement but reported as i.i.d.
    draws from q bias the output, and the chi-square test sees it."""
    p1, p2, q1, q2 = _world(3, sharp=3.0)
    gen = torch.Generator().manual_seed(4)
    outcomes = [_tree_trial(p1, p2, q1, q2, "lying", gen) for _ in range(TRIALS)]
    assert chi2_pvalue(outcomes, _joint(p1, p2)) < 1e-6


def test_draws_without_replacement_record_what_each_was_drawn_from():
    """Siblings are distinct draws from q, each recording q without the earlier ones (what
    multi-draft rejection sampling needs to stay exact); the first is distributed as q."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    generator = torch.Generator().manual_seed(0)
    firsts = []
    for _ in range(4000):
        tokens, rows = draw_without_replacement(q, 3, generator)
        assert len(tokens) == len(set(tokens)) == 3 and 4 not in tokens  # never a token of mass 0
        rest = q.clone()
        for token, row in zip(tokens, rows):
            torch.testing.assert_close(row, rest / rest.sum())
            rest[token] = 0.0
        firsts.append(tokens[0])
    assert chi2_pvalue(firsts, q) > 1e-3
    tokens, rows = draw_without_replacement(torch.tensor([0.0, 1.0, 0.0]), 3, generator)
    assert tokens == [1] and rows.tolist() == [[0.0, 1.0, 0.0]]  # fewer than k when q has fewer tokens
