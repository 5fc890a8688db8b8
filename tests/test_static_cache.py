"""The decoder over a static target cache, and its compiled verify, on tiny Llama and Qwen3.

A static cache is rolled back by moving its write position, so the slots past the committed
length keep the KV of rejected drafts: every test here runs drafters that get rejected, so a
mask that let those slots through would change the output. Greedy output must equal
`target.generate` and the dynamic-cache path token for token, with the same tau.

The compiled tests trace with dynamo's eager backend (the graph capture, guards and
padding are what can go wrong; codegen is torch's business), so they run in seconds; the
one with inductor, the real CPU path, is marked slow.
"""

import random
from types import SimpleNamespace

import pytest
import torch

import draftsmith.models.compiled_verify as compiled_verify
from decoding_helpers import OracleProposer, TreeAroundOracle
from draftsmith.cli import build_parser, main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.evaluate import _run
from draftsmith.eval.proposers.base import GREEDY, Draft
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.eval.settings import EvalSettings
from draftsmith.models.target import build_tiny_target, target_forward
from draftsmith.models.target_cache import is_static_cache, new_cache
from test_decoder import ARCHS, NEW, PROMPTS, VOCAB  # the decoder tests' tiny targets and prompts

D = 6


@pytest.fixture(scope="module", params=sorted(ARCHS))
def world(request):
    target = build_tiny_target(seed=0, vocab_size=VOCAB, **ARCHS[request.param]).eval()
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
    return SimpleNamespace(name=request.param, target=target, refs=refs)


class CorruptedOracle:
    """The target's own greedy chain with one token changed at a random depth: accepted up
    to there, so most steps reject a tail. Keeps the hidden states it is handed."""

    name = "corrupted-oracle"

    def __init__(self, target, capture_layers=(), seed=0):
        self.oracle, self.vocab = OracleProposer(target), target.config.vocab_size
        self.capture_layers = tuple(capture_layers)
        self.rng = random.Random(seed)
        self.hidden = {i: [] for i in self.capture_layers}

    def begin(self, prompt_ids, ctx):
        self.oracle.begin(prompt_ids, ctx)
        self._keep(ctx)

    def commit(self, accepted, ctx):
        self.oracle.commit(accepted, ctx)
        self._keep(ctx)

    def _keep(self, ctx):
        for i in self.capture_layers:
            self.hidden[i].append(ctx.hidden[i].clone())

    def propose(self, max_nodes, sampling, generator):
        draft = self.oracle.propose(max_nodes, sampling, generator)
        if len(draft):
            tokens = draft.tokens.clone()
            k = self.rng.randrange(len(tokens))
            tokens[k] = (tokens[k] + 1) % self.vocab
            draft = Draft(tokens)
        return draft


DRAFTERS = {
    "ngram": lambda w: NgramProposer(),
    "oracle": lambda w: OracleProposer(w.target),
    "corrupted-oracle": lambda w: CorruptedOracle(w.target, seed=3),
    "tree-oracle": lambda w: TreeAroundOracle(w.target, depth=4, width=3, break_prob=0.3, seed=1),
}


def _decode_all(decoder):
    return [decoder.generate(torch.tensor(p), NEW) for p in PROMPTS]


def _same_stats(a, b):
    assert (a.verify_passes, a.committed, a.accepted_hist, a.position_accepted) == \
           (b.verify_passes, b.committed, b.accepted_hist, b.position_accepted)


@pytest.mark.parametrize("drafter", ["ngram", "oracle", "tree-oracle"])
def test_static_cache_equals_generate_and_the_dynamic_cache(world, drafter):
    dynamic = SpeculativeDecoder(world.target, DRAFTERS[drafter](world), num_draft=D)
    static = SpeculativeDecoder(world.target, DRAFTERS[drafter](world), num_draft=D, cache_kind="static")
    # one decoder, one cache for all three prompts: each start rewinds it
    for prompt, ref, ours, theirs in zip(PROMPTS, world.refs, _decode_all(static), _decode_all(dynamic)):
        assert ours.tokens.tolist() == ref == theirs.tokens.tolist(), f"{drafter} on {world.name}, prompt {prompt}"
        _same_stats(ours.stats, theirs.stats)
        assert ours.stats.tau == theirs.stats.tau
    assert is_static_cache(static._static) and static._static.get_max_length() == 256


def _committed_rows_equal_a_fresh_prefill(target, cache, tokens):
    fresh = new_cache(target)
    with torch.no_grad():
        target_forward(target, torch.tensor([tokens]), cache=fresh)
    n = len(tokens)
    assert int(cache.get_seq_length()) == n
    for ours, theirs in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys[:, :, :n], theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values[:, :, :n], theirs.values, atol=1e-5, rtol=1e-4)
    # the next slot holds a rejected draft's KV, left for the next verify to overwrite
    return bool(cache.layers[0].keys[:, :, n].abs().sum() > 0)


def _check_rows_after_every_step(decoder, prompt):
    state = decoder.start(torch.tensor(prompt), 40)
    stale = 0
    while not state.done:
        decoder.step(state)
        if state.done:  # the last step's cache may hold drafts past the limit; unused
            break
        stale += _committed_rows_equal_a_fresh_prefill(decoder.target, state.cache, prompt + state.generated[:-1])
    assert stale > 0, "no rejected KV was ever left behind: the stale slots were not exercised"
    return state


@pytest.mark.parametrize("drafter", ["corrupted-oracle", "tree-oracle"])
def test_static_cache_rows_equal_a_fresh_prefill(world, drafter):
    decoder = SpeculativeDecoder(world.target, DRAFTERS[drafter](world), num_draft=D, eos_token_id=(),
                                 cache_kind="static")
    _check_rows_after_every_step(decoder, PROMPTS[1])


@pytest.fixture
def traced(monkeypatch):
    """Compile with dynamo's eager backend, from an empty dynamo cache; yields the graph counter."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled_verify, "compile_options",
                        lambda device: {"backend": "eager", "fullgraph": True, "dynamic": False})
    torch._dynamo.reset()
    yield lambda: counters["stats"]["unique_graphs"]
    torch._dynamo.reset()


@pytest.mark.parametrize("drafter", ["corrupted-oracle", "tree-oracle"])
def test_compiled_verify_equals_the_uncompiled_one(world, traced, drafter):
    last = world.target.config.num_hidden_layers - 1
    make = (lambda: CorruptedOracle(world.target, capture_layers=(0, last), seed=3)) \
        if drafter == "corrupted-oracle" else (lambda: DRAFTERS[drafter](world))
    plain, compiled = make(), make()
    eager = SpeculativeDecoder(world.target, plain, num_draft=D, cache_kind="static")
    graphs = traced()
    fast = SpeculativeDecoder(world.target, compiled, num_draft=D, cache_kind="static", compile=True)
    for prompt, ref, ours, theirs in zip(PROMPTS, world.refs, _decode_all(fast), _decode_all(eager)):
        assert ours.tokens.tolist() == ref == theirs.tokens.tolist(), f"{drafter} on {world.name}, prompt {prompt}"
        _same_stats(ours.stats, theirs.stats)
    for i in getattr(plain, "capture_layers", ()):  # the hidden states drafters get, pad rows cut off
        assert [h.shape for h in compiled.hidden[i]] == [h.shape for h in plain.hidden[i]]
        torch.testing.assert_close(torch.cat(compiled.hidden[i]), torch.cat(plain.hidden[i]), atol=1e-5, rtol=1e-4)
    # plain decoding through the same decoder: its own 1-row graph
    assert fast.generate_plain(torch.tensor(PROMPTS[1]), NEW).tokens.tolist() == world.refs[1]
    assert traced() - graphs == 2, "one graph for the padded verify and one for plain decoding, nothing retraced"
    # the pad rows' KV lands past the committed length only
    _check_rows_after_every_step(SpeculativeDecoder(world.target, make(), num_draft=D, eos_token_id=(),
                                                    cache_kind="static", compile=True), PROMPTS[1])


@pytest.mark.slow
def test_compiled_verify_with_inductor_on_cpu(world):
    """The real CPU path (inductor, needs a C compiler): the same tokens as uncompiled."""
    torch._dynamo.reset()
    for drafter in ("corrupted-oracle", "tree-oracle"):
        eager = SpeculativeDecoder(world.target, DRAFTERS[drafter](world), num_draft=D, cache_kind="static")
        fast = SpeculativeDecoder(world.target, DRAFTERS[drafter](world), num_draft=D, cache_kind="static", compile=True)
        for ours, theirs in zip(_decode_all(fast), _decode_all(eager)):
            assert ours.tokens.tolist() == theirs.tokens.tolist()
            _same_stats(ours.stats, theirs.stats)
    torch._dynamo.reset()


def test_static_cache_size_and_options_are_checked(world):
    prompt = PROMPTS[1]
    exact = len(prompt) + NEW + D  # the last verify may start at len + NEW - 2 and write 1 + D rows
    decoder = SpeculativeDecoder(world.target, OracleProposer(world.target), num_draft=D, eos_token_id=(),
                                 cache_kind="static", max_cache_len=exact)
    assert decoder.generate(torch.tensor(prompt), NEW).tokens.tolist() == world.refs[1]
    with pytest.raises(DraftsmithError, match=f"static cache of {exact} tokens"):
        decoder.generate(torch.tensor(prompt), NEW + 1)
    grows = SpeculativeDecoder(world.target, NgramProposer(), num_draft=D, cache_kind="static")
    grows.generate(torch.tensor(prompt), 4)
    grows.start(torch.tensor(prompt), 300)  # more than the first cache holds: a bigger one
    assert grows._static.get_max_length() == 512
    for options, message in ((dict(cache_kind="paged"), "cache_kind must be one of"),
                             (dict(compile=True), "compile needs the static cache"),
                             (dict(max_cache_len=64), "max_cache_len sizes the static cache")):
        with pytest.raises(DraftsmithError, match=message):
            SpeculativeDecoder(world.target, NgramProposer(), num_draft=D, **options)


def test_eval_runs_with_a_static_cache_and_compile(world, traced, capsys):
    settings = EvalSettings(num_prompts=len(PROMPTS), max_new_tokens=12, drafters=["ngram", "oracle"],
                            cache_kind="static", compile=True)
    drafters = [NgramProposer(), OracleProposer(world.target)]
    # `_run` stops on any greedy mismatch against plain decoding
    results = _run(world.target, drafters, [torch.tensor(p) for p in PROMPTS], settings, GREEDY, num_draft=4)
    assert results["settings"]["cache"] == "static" and results["settings"]["compile"] is True
    assert results["drafters"][1]["tau"] > 3.0  # the oracle: 1 + D but for the last step

    args = build_parser().parse_args(["eval", "--target", "t", "--drafter", "ngram", "--out", "o",
                                      "--cache", "static", "--compile"])
    assert (args.cache, args.compile) == ("static", True)
    capsys.readouterr()  # drop the progress bars
    assert main(["eval", "--target", "t", "--drafter", "ngram", "--out", "o", "--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile needs --cache static" in err[0], err
