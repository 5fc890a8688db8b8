"""The speculative decoder on tiny random Llama and Qwen3 targets.

Greedy output must equal `target.generate(do_sample=False)` token for token with every
drafter; tau must be exactly 1 for plain decoding and 1 + D for the target drafting for
itself; the KV cache after rejections must equal a fresh prefill; a tree verify must agree
with verifying each of its paths as a chain; sampling must reproduce the target's
distribution.
"""

from types import SimpleNamespace

import pytest
import torch

from decoding_helpers import (
    IIDTreeDrafter,
    OracleProposer,
    RandomTreeDrafter,
    TreeAroundOracle,
    chi2_pvalue,
    noisy_copy,
)
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder, default_num_draft
from draftsmith.eval.proposers.base import NoProposer, SamplingParams
from draftsmith.eval.proposers.draft_lm import DraftLMProposer
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.models.target import build_tiny_target, target_forward
from draftsmith.models.target_cache import crop_cache, new_cache

VOCAB = 256
NEW = 32
ARCHS = {
    "llama": dict(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2),
    "qwen3": dict(arch="qwen3", num_layers=3, hidden_size=48, num_heads=4, num_kv_heads=1),
}
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],  # repetitive: prompt lookup finds matches
    [17, 200, 3, 45, 99, 180, 7, 64],
    [250, 1, 33],
]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def world(request):
    target = build_tiny_target(seed=0, vocab_size=VOCAB, **ARCHS[request.param]).eval()
    draft = noisy_copy(target, scale=0.3, seed=1)
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):]
                for p in PROMPTS]
    return SimpleNamespace(name=request.param, target=target, draft=draft, refs=refs)


DRAFTERS = {
    "plain": lambda w: NoProposer(),
    "ngram": lambda w: NgramProposer(),
    "draft-lm": lambda w: DraftLMProposer(w.draft, w.target),
    "oracle": lambda w: OracleProposer(w.target),
    "tree-oracle": lambda w: TreeAroundOracle(w.target, depth=4, width=3, break_prob=0.3, seed=1),
    "random-tree": lambda w: RandomTreeDrafter(VOCAB, seed=2),
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_output_equals_generate(world, drafter):
    decoder = SpeculativeDecoder(world.target, DRAFTERS[drafter](world), num_draft=6)
    accepted = 0
    for prompt, ref in zip(PROMPTS, world.refs):
        result = decoder.generate(torch.tensor(prompt), NEW)
        assert result.tokens.tolist() == ref.tolist(), f"{drafter} on {world.name}, prompt {prompt}"
        stats = result.stats
        assert stats.committed == len(result.tokens) - 1  # the prefill's token is not counted
        assert sum(stats.accepted_hist) == stats.verify_passes
        accepted += sum(a * n for a, n in enumerate(stats.accepted_hist))
    if drafter not in ("plain", "random-tree"):
        assert accepted > 0, "no draft was ever accepted: the test would not exercise acceptance"


def test_tau_is_exactly_one_for_plain_and_one_plus_d_for_the_oracle(world):
    d, steps = 5, 4
    decoder = SpeculativeDecoder(world.target, OracleProposer(world.target), num_draft=d, eos_token_id=())
    prompt = torch.tensor(PROMPTS[1])
    plain = decoder.generate_plain(prompt, 1 + steps * (1 + d))
    assert plain.stats.tau == 1.0 and plain.stats.verify_passes == steps * (1 + d)
    oracle = decoder.generate(prompt, 1 + steps * (1 + d))
    assert oracle.tokens.tolist() == plain.tokens.tolist()
    assert oracle.stats.tau == 1 + d
    assert oracle.stats.accepted_hist == [0] * d + [steps]
    assert oracle.stats.per_position_acceptance == [1.0] * d

    depth = 3
    tree = SpeculativeDecoder(world.target, TreeAroundOracle(world.target, depth=depth, width=3), num_draft=40,
                              eos_token_id=())
    result = tree.generate(prompt, 1 + steps * (1 + depth))
    assert result.tokens.tolist() == plain.tokens[: len(result.tokens)].tolist()
    assert result.stats.tau == 1 + depth


def _cache_matches_fresh_prefill(target, cache, tokens):
    fresh = new_cache(target)
    target_forward(target, torch.tensor([tokens]), cache=fresh)
    assert cache.get_seq_length() == len(tokens)
    for ours, theirs in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("drafter", ["draft-lm", "tree-oracle"])
def test_cache_after_rejections_equals_a_fresh_prefill(world, drafter):
    made = DRAFTERS[drafter](world)
    decoder = SpeculativeDecoder(world.target, made, num_draft=6, eos_token_id=())
    prompt = PROMPTS[1]
    state = decoder.start(torch.tensor(prompt), 40)
    partial = 0
    while not state.done:
        committed = decoder.step(state)
        partial += 1 < len(committed) < 1 + len(state.stats.position_accepted)
        if state.done:  # the last step's cache may hold drafts past the limit; unused
            break
        _cache_matches_fresh_prefill(world.target, state.cache, prompt + state.generated[:-1])
        if isinstance(made, DraftLMProposer):  # its own cache is trimmed too
            cached = made.cache.get_seq_length()
            assert cached + len(made.pending) == len(prompt) + len(state.generated)
            _cache_matches_fresh_prefill(made.model, made.cache, (prompt + state.generated)[:cached])
    assert partial > 0, "no step accepted part of its draft: cropping was not exercised"


class Recorder:
    """Wraps a drafter and keeps everything the decoder hands it."""

    name = "recorder"

    def __init__(self, inner, layers):
        self.inner, self.capture_layers = inner, layers
        self.tokens, self.accepted, self.hidden = [], [], {i: [] for i in layers}

    def begin(self, prompt_ids, ctx):
        self.inner.begin(prompt_ids, ctx)
        self._take(ctx)

    def commit(self, accepted, ctx):
        self.inner.commit(accepted, ctx)
        self.accepted += accepted.tolist()
        self._take(ctx)

    def propose(self, max_nodes, sampling, generator):
        return self.inner.propose(max_nodes, sampling, generator)

    def _take(self, ctx):
        assert ctx.start == len(self.tokens), "context positions must follow on from the last ones"
        self.tokens += ctx.tokens.tolist()
        for i in self.capture_layers:
            self.hidden[i].append(ctx.hidden[i])


@pytest.mark.parametrize("drafter", ["draft-lm", "tree-oracle"])
def test_drafters_get_the_hidden_states_of_every_committed_position(world, drafter):
    last = world.target.config.num_hidden_layers - 1
    recorder = Recorder(DRAFTERS[drafter](world), (0, last))
    decoder = SpeculativeDecoder(world.target, recorder, num_draft=6, eos_token_id=())
    prompt = PROMPTS[1]
    result = decoder.generate(torch.tensor(prompt), NEW)
    sequence = prompt + result.tokens.tolist()
    # After each commit: every committed token but the last has its hidden state.
    assert recorder.accepted == result.tokens.tolist()[: len(recorder.accepted)]
    assert recorder.tokens == sequence[: len(prompt) + len(recorder.accepted) - 1]
    fresh = target_forward(world.target, torch.tensor([recorder.tokens]), capture=(0, last)).hidden
    for i in (0, last):
        torch.testing.assert_close(torch.cat(recorder.hidden[i]), fresh[i][0], atol=1e-4, rtol=1e-4)


def test_tree_verify_agrees_with_verifying_each_path_as_a_chain(world):
    decoder = SpeculativeDecoder(world.target, NoProposer(), num_draft=12)
    state = decoder.start(torch.tensor(PROMPTS[1]), 40)
    prefix = state.cache.get_seq_length()
    draft = RandomTreeDrafter(VOCAB, seed=5).propose(12, None, None)
    while len(draft) < 8 or int(draft.parents.max()) < 1:  # want some depth
        draft = RandomTreeDrafter(VOCAB, seed=len(draft) + 7).propose(12, None, None)
    parents = draft.parents.tolist()
    inputs = torch.cat([state.last, draft.tokens])[None]
    with torch.no_grad():
        tree_out, _ = decoder._verify(state, inputs, draft.parents)
    crop_cache(state.cache, prefix)

    leaves = set(range(len(parents))) - set(parents)
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        chain_inputs = torch.cat([state.last, draft.tokens[path]])[None]
        with torch.no_grad():
            chain_out, _ = decoder._verify(state, chain_inputs, None)
        crop_cache(state.cache, prefix)
        rows = [0] + [i + 1 for i in path]
        torch.testing.assert_close(tree_out.logits[0, rows], chain_out.logits[0], atol=1e-4, rtol=1e-4)


def test_eos_stops_and_nothing_past_it_counts(world):
    prompt, ref = PROMPTS[1], world.refs[1].tolist()
    # an EOS that the oracle drafts in the middle of an accepted block
    position = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    eos = ref[position]
    decoder = SpeculativeDecoder(world.target, OracleProposer(world.target), num_draft=4, eos_token_id=eos)
    result = decoder.generate(torch.tensor(prompt), NEW)
    assert result.tokens.tolist() == ref[: position + 1]
    with torch.no_grad():
        theirs = world.target.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert result.tokens.tolist() == theirs[0, len(prompt):].tolist()
    stats = result.stats
    assert stats.committed == position
    assert stats.tau == position / stats.verify_passes
    assert sum(k * n for k, n in enumerate(stats.accepted_hist)) + stats.verify_passes >= stats.committed

    # EOS as the target's own (bonus) token: plain decoding commits only those
    plain = decoder.generate_plain(torch.tensor(prompt), NEW)
    assert plain.tokens.tolist() == ref[: position + 1] and plain.stats.committed == position

    limited = SpeculativeDecoder(world.target, OracleProposer(world.target), num_draft=4, eos_token_id=())
    result = limited.generate(torch.tensor(prompt), 8)
    assert result.tokens.tolist() == ref[:8] and result.stats.committed == 7


def _exact_two_token_joint(target, prefix, sampling):
    """p(y1, y2 | prefix) over the whole vocabulary, flattened to y1 * V + y2."""
    from draftsmith.eval.sampling import process_logits

    with torch.no_grad():
        p1 = process_logits(target(torch.tensor([prefix])).logits[0, -1], sampling)
        batch = torch.tensor([prefix + [y] for y in range(VOCAB)])
        p2 = process_logits(target(batch).logits[:, -1], sampling)
    return (p1[:, None] * p2).flatten()


SAMPLES = 600


@pytest.mark.parametrize("drafter", ["draft-lm", "iid-tree"])
def test_sampling_reproduces_the_target_distribution(drafter):
    target = build_tiny_target(seed=3, vocab_size=VOCAB, arch="llama", num_layers=1, hidden_size=32, num_heads=4,
                               num_kv_heads=2).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(60)  # a peaked target: a few likely tokens per step
    sampling = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    if drafter == "draft-lm":
        made = DraftLMProposer(noisy_copy(target, scale=0.5, seed=4), target)
    else:
        made = IIDTreeDrafter(torch.softmax(torch.randn(VOCAB, generator=gen) * 4, -1), shape=(3, 2))
    decoder = SpeculativeDecoder(target, made, num_draft=9 if drafter == "iid-tree" else 2, eos_token_id=())
    prompt = PROMPTS[1]
    state = decoder.start(torch.tensor(prompt), 100, sampling, gen)
    first = state.generated[0]
    expected = _exact_two_token_joint(target, prompt + [first], sampling)

    outcomes, rejected = [], 0
    for _ in range(SAMPLES):
        # rewind to just after the prefill: the cache's prompt rows are never touched
        crop_cache(state.cache, len(prompt))
        state.last, state.generated, state.done = torch.tensor([first]), [first], False
        made.begin(torch.tensor(prompt), None)
        made.commit(torch.tensor([first]), None)
        while len(state.generated) < 3:
            rejected += len(decoder.step(state)) == 1
        outcomes.append(state.generated[1] * VOCAB + state.generated[2])
    assert rejected > SAMPLES // 10, "the draft is almost always accepted: the residual path is not exercised"
    assert chi2_pvalue(outcomes, expected) > 1e-3


def test_ngram_drafter_copies_the_latest_match():
    def proposal(context, n=5, **options):
        drafter = NgramProposer(**options)
        drafter.begin(torch.tensor(context[:3]), None)
        drafter.commit(torch.tensor(context[3:]), None)
        return drafter.propose(n, None, None).tokens.tolist()

    # tail (7, 8): the 2-gram beats the 1-gram (8 -> 3), the latest occurrence wins
    assert proposal([7, 8, 1, 2, 8, 3, 7, 8, 4, 5, 9, 7, 8]) == [4, 5, 9, 7, 8]
    assert proposal([7, 8, 1, 2, 8, 3, 7, 8, 4, 5, 9, 7, 8], latest=False, extend=False) == [1, 2, 8, 3, 7]
    # a repeat of period 3 runs into the end and continues periodically
    assert proposal([1, 2, 3, 1, 2, 3, 1], n=6) == [2, 3, 1, 2, 3, 1]
    assert proposal([1, 2, 3, 1, 2, 3, 1], n=6, extend=False) == [2, 3, 1]
    assert proposal([1, 2, 3, 4, 5, 6]) == []  # no earlier occurrence of anything
    assert proposal([1, 2, 3, 1], n=0) == []


def test_default_num_draft_follows_the_tile_rule():
    cfg = lambda **kw: SimpleNamespace(num_attention_heads=kw.pop("h"), **kw)  # noqa: E731
    assert default_num_draft(cfg(h=32, num_key_value_heads=32)) == 127
    assert default_num_draft(cfg(h=32, num_key_value_heads=8)) == 31
    assert default_num_draft(cfg(h=28, num_key_value_heads=4)) == 17
    assert default_num_draft(cfg(h=64, num_key_value_heads=8)) == 15
    assert default_num_draft(cfg(h=128, num_key_value_heads=128, kv_lora_rank=512), tp=8) == 7
    assert default_num_draft(cfg(h=128, num_key_value_heads=1)) == 0
    assert default_num_draft(cfg(h=8, multi_query=True), tile=64) == 7
    assert default_num_draft(cfg(h=8)) == 127
    with pytest.raises(DraftsmithError, match="not a multiple"):
        default_num_draft(cfg(h=12, num_key_value_heads=5))


def test_bad_input_is_refused(world):
    decoder = SpeculativeDecoder(world.target, NgramProposer(), num_draft=4)
    with pytest.raises(DraftsmithError, match="one sequence at a time"):
        decoder.generate(torch.tensor([PROMPTS[2], PROMPTS[2]]), 4)
    other = build_tiny_target(vocab_size=VOCAB + 1, arch="llama", num_layers=1, hidden_size=32, num_heads=2,
                              num_kv_heads=1)
    with pytest.raises(DraftsmithError, match="vocabulary"):
        DraftLMProposer(other, world.target)
