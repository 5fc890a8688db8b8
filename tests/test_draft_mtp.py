"""MTP heads as a drafter: exact depth semantics, and lossless decoding."""

import pytest
import torch
from torch import nn

from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.mtp import MTPProposer
from draftsmith.eval.proposers.base import GREEDY, TargetContext
from draftsmith.models.mtp import MTPDrafter, mtp_forward
from draftsmith.models.target import build_tiny_target, target_forward


def tiny(arch):
    target = build_tiny_target(arch=arch, vocab_size=61, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=1)
    heads = MTPDrafter.for_target(target, 2)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target.eval(), heads


def reference_drafts(heads, target, committed, drafts):
    """Each draft recomputed from scratch over the whole sequence; depths past K reuse
    the last module, as the drafter does."""
    chained = MTPDrafter.__new__(MTPDrafter)
    nn.Module.__init__(chained)
    chained.layers = nn.ModuleList([heads.layers[min(m, 2) - 1] for m in range(1, len(drafts) + 1)])
    seq = torch.cat([committed, drafts[:-1]])[None]
    h0 = target_forward(target, seq, capture=[1]).hidden[1]
    logits = mtp_forward(chained, target, seq, h0)
    n = len(committed)
    return [int(lg[0, n - 2].argmax()) for lg in logits]  # depth m at position n - 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafts_follow_deepseek_depth_semantics_across_steps(arch):
    target, heads = tiny(arch)
    drafter = MTPProposer(heads, target)
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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mtp_decoding_is_lossless(arch):
    target, heads = tiny(arch)
    decoder = SpeculativeDecoder(target, MTPProposer(heads, target), num_draft=4, eos_token_id=())
    for seed in range(3):
        prompt = torch.randint(0, 61, (5 + seed,), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=20, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):]
        result = decoder.generate(prompt, max_new_tokens=20)
        assert result.tokens.tolist() == expected.tolist()
        assert 1.0 <= result.stats.tau <= 5.0
