"""MTP heads as a drafter: the engines' chain and DeepSeek's exact depths, where they must
agree, what each costs in block rows, and lossless decoding in both modes."""

import pytest
import torch
from torch import nn

from decoding_helpers import begin_like_decoder
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.base import GREEDY, SamplingParams, TargetContext
from draftsmith.eval.proposers.mtp import MTPProposer
from draftsmith.models.mtp import MTPDrafter, mtp_forward
from draftsmith.models.target import build_tiny_target, target_forward


def tiny(arch, depths=2, chain_input="hidden"):
    target = build_tiny_target(arch=arch, vocab_size=61, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=1)
    heads = MTPDrafter.from_target(target, num_depths=depths)
    heads.config.chain_input = chain_input
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target.eval(), heads


def reference_drafts(heads, target, committed, drafts):
    """Each draft recomputed from scratch over the whole sequence; depths past K reuse
    the last module, as the drafter does."""
    chained = MTPDrafter.__new__(MTPDrafter)
    nn.Module.__init__(chained)
    chained.config = heads.config  # chain_input: what each depth passes on
    chained.layers = nn.ModuleList([heads.layers[min(m, 2) - 1] for m in range(1, len(drafts) + 1)])
    seq = torch.cat([committed, drafts[:-1]])[None]
    h0 = target_forward(target, seq, capture=[1]).hidden[1]
    logits = mtp_forward(chained, target, seq, h0)
    n = len(committed)
    return [int(lg[0, n - 2].argmax()) for lg in logits]  # depth m at position n - 2


@pytest.mark.parametrize("arch, chain_input", [("llama", "hidden"), ("qwen3", "hidden"), ("qwen3", "normed")])
def test_drafts_follow_deepseek_depth_semantics_across_steps(arch, chain_input):
    target, heads = tiny(arch, chain_input=chain_input)
    drafter = MTPProposer(heads, target, mode="exact")
    ids = torch.randint(0, 61, (14,))
    prompt = ids[:6]
    out = target_forward(target, prompt[None], capture=[1])
    drafter.begin(prompt, TargetContext({1: out.hidden[1][0]}, prompt, 0))
    drafter.commit(ids[6:7], TargetContext({1: out.hidden[1][0, :0]}, prompt[:0], 6))
    n = 7
    for accepted in (2, 0, 3):  # commit a few tokens per step, as a verify would
        drafts = drafter.propose(9, GREEDY, None).tokens  # deeper than the sequence is long
        assert drafts.tolist() == reference_drafts(heads, target, ids[:n], drafts)
        new = ids[n:n + accepted + 1]
        h = target_forward(target, ids[None, :n + accepted], capture=[1]).hidden[1][0, n - 1:]
        drafter.commit(new, TargetContext({1: h}, ids[n - 1:n + accepted], n - 1))
        n += accepted + 1


@pytest.mark.parametrize("mode,modules", [("engine", None), ("engine", 1), ("exact", None)])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mtp_decoding_is_lossless(arch, mode, modules):
    target, heads = tiny(arch)
    proposer = MTPProposer(heads, target, mode=mode, modules=modules)
    decoder = SpeculativeDecoder(target, proposer, num_draft=4, eos_token_id=())
    for seed in range(3):
        prompt = torch.randint(0, 61, (5 + seed,), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=20, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):]
        result = decoder.generate(prompt, max_new_tokens=20)
        assert result.tokens.tolist() == expected.tolist()
        assert 1.0 <= result.stats.tau <= 5.0


def start(proposer, target, ids, n):
    """Begin on ids[:n - 1] and commit ids[n - 1], as the decoder does after the prefill."""
    begin_like_decoder(proposer, target, ids[:n])


def commit(proposer, target, ids, n, accepted):
    h = target_forward(target, ids[None, :n + accepted], capture=[1]).hidden[1][0, n - 1:]
    proposer.commit(ids[n:n + accepted + 1], TargetContext({1: h}, ids[n - 1:n + accepted], n - 1))
    return n + accepted + 1


@pytest.mark.parametrize("arch, chain_input", [("llama", "hidden"), ("qwen3", "hidden"), ("qwen3", "normed")])
def test_engine_chain_agrees_with_exact_depths_where_it_must(arch, chain_input):
    """K = 3, six drafts, sampled (each q compared), over the same commits in both modes.

    Draft 1: both read the target's hidden state h^0_{n-2} and t_{n-1} through depth 1's
    cache of settled rows, so they must agree. Draft 2: both run module 2 at position n - 2
    on h^1_{n-2} (draft 1's output) and draft 1, over depth 2's settled rows; exact mode's
    only draft-reading row at depth 2 is that query row itself, so they must agree too.
    Draft 3 (still <= K): exact depth 3 also attends to its row at n - 3, which reads draft
    1; the engine never computes it, so the two differ, as they may past K."""
    target, heads = tiny(arch, depths=3, chain_input=chain_input)
    ids = torch.randint(0, 61, (30,), generator=torch.Generator().manual_seed(1))
    engine, exact = MTPProposer(heads, target), MTPProposer(heads, target, mode="exact")
    sampling = SamplingParams(temperature=1.0)
    n = 9
    for p in (engine, exact):
        start(p, target, ids, n)
    for accepted in (2, 0, 4, 1):
        a = engine.propose(6, sampling, torch.Generator().manual_seed(n))
        b = exact.propose(6, sampling, torch.Generator().manual_seed(n))
        assert torch.equal(a.tokens[:2], b.tokens[:2])
        torch.testing.assert_close(a.probs[:2], b.probs[:2], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a.probs[2], b.probs[2], rtol=1e-3, atol=1e-5)
        for p in (engine, exact):
            commit(p, target, ids, n, accepted)
        n += accepted + 1


def test_engine_runs_one_row_per_draft_exact_a_triangle():
    """Block rows of one proposal of D = 8 far into a sequence: the engine chain runs D - 1
    (draft 1 is a settled row); exact depths run 1 + 2 + ... + 7 = 28, and cost a settled
    row per committed token at each of the D depths instead of the K modules."""
    target, heads = tiny("llama")
    ids = torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(2))
    rows = {}
    for mode in ("engine", "exact"):
        p = MTPProposer(heads, target, mode=mode)
        start(p, target, ids, 20)
        p.propose(8, GREEDY, None)  # every depth made and settled
        n = commit(p, target, ids, 20, 3)
        before = p.rows
        p.propose(8, GREEDY, None)
        drafting = p.rows - before
        commit(p, target, ids, n, 3)
        rows[mode] = (drafting, p.rows - before - drafting)
    assert rows["engine"] == (7, 2 * 4)  # K = 2 modules settle 4 committed tokens each
    assert rows["exact"] == (28, 8 * 4)  # 8 virtual depths settle them


def test_an_unknown_mode_is_one_line():
    target, heads = tiny("llama")
    with pytest.raises(DraftsmithError, match="MTP drafting mode 'tree' does not exist \\(modes: engine, exact\\)"):
        MTPProposer(heads, target, mode="tree")


def test_module_one_chain_is_what_a_one_module_export_drafts():
    """`mtp_nextn` (modules=1): module 1 for every draft, as SGLang's NextN and vLLM's
    EAGLE-style proposer run it: the same drafts as the heads cut to module 1, and from
    draft 2 on not the K-module chain's (which runs module 2 there)."""
    target, heads = tiny("llama", depths=2)
    one = MTPDrafter.__new__(MTPDrafter)
    nn.Module.__init__(one)
    one.config, one.layers = heads.config, nn.ModuleList([heads.layers[0]])
    ids = torch.randint(0, 61, (30,), generator=torch.Generator().manual_seed(3))
    nextn, cut, chain = (MTPProposer(heads, target, modules=1), MTPProposer(one, target),
                         MTPProposer(heads, target))
    sampling = SamplingParams(temperature=1.0)
    n = 9
    for p in (nextn, cut, chain):
        start(p, target, ids, n)
    for accepted in (2, 0, 3):
        a, b, c = (p.propose(5, sampling, torch.Generator().manual_seed(n)) for p in (nextn, cut, chain))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)
        torch.testing.assert_close(a.probs[0], c.probs[0])
        assert not torch.allclose(a.probs[1], c.probs[1], rtol=1e-3, atol=1e-5)
        for p in (nextn, cut, chain):
            commit(p, target, ids, n, accepted)
        n += accepted + 1
    assert nextn.report_extra()["mtp_modules"] == 1
    with pytest.raises(DraftsmithError, match="modules=3: the engine mode chains modules 1..m of the 2 trained"):
        MTPProposer(heads, target, modules=3)
