"""The tiny targets and drafters that several test modules build alike, and the checks they
share (plain helpers: the `target` and `target_dir` fixtures built from `tiny_target` are in
conftest.py)."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import begin_like_decoder
from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers import proposer_from_arg
from draftsmith.eval.proposers.base import GREEDY, SamplingParams
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter
from draftsmith.models.dspark import DSparkConfig, DSparkDrafter
from draftsmith.models.eagle3 import Eagle3Drafter
from draftsmith.models.mtp import MTP_DIR, MTPDrafter
from draftsmith.models.native import save_drafter
from draftsmith.models.target import build_tiny_target, freeze

VOCAB, MASK = 128, 127


def tiny_target(arch="qwen3"):
    return freeze(build_tiny_target(seed=1, arch=arch, vocab_size=VOCAB, num_layers=6, hidden_size=64,
                                    num_heads=4, num_kv_heads=2))


# ---------------------------------------------------------------- drafters on it

def drafter_for(target, **overrides):
    settings = {"mask_token_id": MASK, "num_layers": 2, "num_context_layers": 2, "block_size": 6, **overrides}
    return DFlashDrafter(DFlashConfig.from_target(target.config, **settings)).eval()


def dspark_for(target, **overrides) -> DSparkDrafter:
    config = DSparkConfig.from_target(target.config, **{"mask_token_id": MASK, "num_layers": 2, "num_context_layers": 2, "block_size": 5,
                                                       "markov_rank": 8, **overrides})
    return DSparkDrafter(config).eval()


def with_random_heads(drafter):
    with torch.no_grad():  # W2 starts at zero: give the refiner something to change
        if isinstance(drafter, DSparkDrafter):
            drafter.markov_head.markov_w2.weight.normal_(std=0.5)
    return drafter.eval()


def dflash(target, num_context_layers=2, **overrides):
    return drafter_for(target, num_context_layers=num_context_layers, **overrides)


# A sliding layer then a full one; block rows at 7..12 over a context 0..6 see from 2..7 on.
WINDOWED = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])


def dspark(target, **overrides):
    return with_random_heads(dspark_for(target, **overrides))


def eagle3(target, **overrides):
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=96, **overrides)
    with torch.no_grad():  # a draft vocabulary that is not the identity
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:96].sort().values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[ids] = True
        drafter.set_draft_vocab(ids - torch.arange(96), t2d)
    return drafter.eval()


def mtp_run(tmp_path, target, name):
    """What the mtp recipe writes: the target folder with its MTP modules in mtp/."""
    heads = MTPDrafter.from_target(target, num_depths=2)
    with torch.no_grad():  # every weight set here: MoE experts are built uninitialised (torch.empty)
        for param_name, p in heads.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if param_name.endswith("norm.weight") else 0.0))
    folder = tmp_path / name / "model"
    target.save_pretrained(folder)
    save_drafter(heads, folder / MTP_DIR, extra={"num_nextn_predict_layers": 2})
    return tmp_path / name


# ---------------------------------------------------------------- EAGLE-3's learnable target

PEAKY_VOCAB = 256
PEAKY_ARCHS = {
    "llama": dict(arch="llama", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=1),
    "qwen3": dict(arch="qwen3", num_layers=5, hidden_size=48, num_heads=4, num_kv_heads=2),
}


def peaky_target(arch: str):
    """A tiny random target whose next-token distributions are sharp enough to learn
    from in a few steps (its output head scaled up)."""
    target = build_tiny_target(seed=1, vocab_size=PEAKY_VOCAB, **PEAKY_ARCHS[arch]).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
    return target


# ---------------------------------------------------------------- shared checks

def drafts(proposer, target, prompt, n=4):
    """Greedy draft tokens and a sampled draft with its probabilities, after the prompt,
    fed the way the decoder feeds them."""
    begin_like_decoder(proposer, target, prompt)
    greedy = proposer.propose(n, GREEDY, None).tokens
    sampled = proposer.propose(n, SamplingParams(temperature=1.0), torch.Generator().manual_seed(5))
    return greedy, sampled.tokens, sampled.probs


def assert_same_drafts(spec_a, spec_b, target, prompt):
    first = drafts(proposer_from_arg(spec_a, target), target, prompt)
    second = drafts(proposer_from_arg(spec_b, target), target, prompt)
    for a, b in zip(first, second):
        assert (a is None and b is None) or torch.equal(a, b)


def one_line_error(call, match):
    with pytest.raises(DraftsmithError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)
