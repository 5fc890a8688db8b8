"""Every causal-LM family as a target, on tiny models built from transformers' own configs.

The parts are found through transformers' accessors (models/target.py), not one attribute
path: the captured layer outputs must be HF's `hidden_states`, the final norm must turn the
last one into HF's normed last state. Greedy speculative output must equal the target's own
`generate` token for token with every name `eval --drafter` accepts (each registered method
and decode variant: n-gram, a draft model, untrained MTP heads, EAGLE-3 chain and trees,
DFlash, DSpark) and a tree around the target's own path: untrained drafts are rejected,
never let through; the hidden-state drafters also learn from each family's features. `draftsmith plan` must read each family's spelling
of its heads. A sliding-window cache rolls back past its window; trees on it, and targets
with only a recurrent state, are refused in one line. A target whose layers cannot be found
still decodes with n-gram, and a hidden-state drafter on it is refused in one line.
"""

import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, MambaConfig, Qwen3NextConfig

from decoding_helpers import TreeAroundOracle, noisy_copy
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.dflash import DFlashProposer
from draftsmith.eval.proposers.draft_lm import DraftLMProposer
from draftsmith.eval.proposers.dspark import DSparkProposer
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.mtp import MTPProposer
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter
from draftsmith.models.dspark import DSparkConfig, DSparkDrafter
from draftsmith.models.eagle3 import Eagle3Drafter
from draftsmith.models.mtp import MTPDrafter
from draftsmith.models.target import (
    _layer_path,
    _pp_plan,
    build_tiny_target,
    decoder_layers,
    target_forward,
    tiny_config,
)
from draftsmith.registry import proposer_names

VOCAB = 256
NEW = 20
MASK = VOCAB - 1  # DFlash's mask token
# No EOS: every decode runs to NEW tokens, on both sides of the comparison. Weights drawn
# wide (0.02, the families' default, makes several of them repeat one token forever, which
# any drafter matches) and seed 3: every family's greedy text has more than 5 distinct
# tokens in 20 (`varied`). OPT spells the width `init_std`.
SHAPE = dict(vocab_size=VOCAB, num_layers=4, hidden_size=32, num_heads=4, intermediate_size=64,
             max_position_embeddings=128, eos_token_id=None, initializer_range=0.5, init_std=0.5)
SEED = 3
# name -> tiny_config arguments, and G (query heads per KV head) as `draftsmith plan` reads it.
ARCHS = {
    "llama": (dict(arch="llama", num_kv_heads=2), 2),
    "qwen2": (dict(arch="qwen2", num_kv_heads=2), 2),
    "qwen3": (dict(arch="qwen3", num_kv_heads=1), 4),
    "mistral": (dict(arch="mistral", num_kv_heads=2), 2),
    "gemma": (dict(arch="gemma", num_kv_heads=1), 4),
    "mixtral": (dict(arch="mixtral", num_kv_heads=2), 2),  # MoE
    "deepseek_v3": (dict(arch="deepseek_v3", num_kv_heads=4), 4),  # MLA (one latent KV) and MoE
    "phi": (dict(arch="phi", num_kv_heads=4), 1),
    "gpt2": (dict(arch="gpt2", num_kv_heads=4), 1),  # learned absolute positions, tied head
    "gpt_neox": (dict(arch="gpt_neox", num_kv_heads=4), 1),
    "opt": (dict(arch="opt", num_kv_heads=4), 1),  # learned positions with an offset of 2
    "falcon": (dict(arch="falcon", num_kv_heads=1), 4),  # multi-query (Falcon-7B)
    "falcon_grouped": (dict(arch="falcon", num_kv_heads=2), 2),  # new decoder architecture (Falcon-40B)
}
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],  # repetitive: prompt lookup finds matches
    [17, 200, 3, 45, 99, 180, 7, 64],
]


def varied_refs(target) -> list[list[int]]:
    """The target's own greedy continuations of PROMPTS, checked to be worth comparing
    against: full length, and not a stream of one or two tokens any drafter would match."""
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
    assert all(len(r) == NEW and len(set(r)) > 5 for r in refs), refs
    return refs


@pytest.fixture(scope="module", params=sorted(ARCHS))
def world(request):
    kwargs, group = ARCHS[request.param]
    target = build_tiny_target(seed=SEED, **SHAPE, **kwargs).eval()
    refs = varied_refs(target)
    return SimpleNamespace(name=request.param, target=target, refs=refs, group=group, kwargs=kwargs)


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(m).__name__.lower()


def final_norm(model: nn.Module) -> nn.Module:
    """The norm between the last decoder layer and the head, in the module that holds the
    layers: the pipeline plan's last stage when it is a norm, else the one norm registered
    after the layers (Bloom has one before them too), else the only norm (OPT registers its
    final norm first). Only the test needs it: HF hands back the last layer's output normed."""
    path = _layer_path(model)
    holder = model.get_submodule(path.rpartition(".")[0])
    plan = _pp_plan(model)
    last = getattr(holder, plan[-1], None) if plan else None
    if isinstance(last, nn.Module) and _is_norm(last):
        return last
    children = list(holder.children())
    at = next((i for i, m in enumerate(children) if m is model.get_submodule(path)), len(children))
    for group in (children[at + 1:], children):
        norms = [m for m in group if _is_norm(m)]
        if len(norms) == 1:
            return norms[0]
    raise AssertionError(f"{type(model).__name__}: no final norm beside its decoder layers")


def test_parts_are_found_and_capture_what_transformers_reports(world):
    target = world.target
    n = target.config.num_hidden_layers
    assert len(decoder_layers(target)) == n
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ours = target_forward(target, ids, capture=range(n))
        theirs = target(input_ids=ids, output_hidden_states=True)
        for i in range(n - 1):  # HF's hidden_states[i + 1] is the output of layer i ...
            torch.testing.assert_close(ours.hidden[i], theirs.hidden_states[i + 1])
        # ... except the last, which HF hands back after the final norm.
        torch.testing.assert_close(final_norm(target)(ours.hidden[n - 1]), theirs.hidden_states[-1])
    torch.testing.assert_close(ours.logits, theirs.logits)


def _eagle3(w, tree=False, **options):
    # `tree` as eval/proposers/eagle3.py's load_proposer reads it (the eagle3_tree variants)
    drafter = Eagle3Drafter.from_target(w.target, draft_vocab_size=200)
    return Eagle3Proposer(drafter, **({"mode": "tree", "topk": 2, "depth": 3} if tree else {}), **options)


def _dspark(w, **options):
    config = DSparkConfig.from_target(w.target.config, mask_token_id=MASK, num_layers=1, block_size=5, markov_rank=8)
    drafter = DSparkDrafter(config)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(std=0.5)  # W2 starts at zero: let the refiner change logits
    return DSparkProposer(drafter, w.target, **options)


# One untrained (or test-only) proposer per registered method, built with a decode variant's
# registered options; the lossless check runs every name `eval --drafter` accepts.
METHOD_PROPOSERS = {
    "ngram": lambda w, **o: NgramProposer(**o),
    "draft_lm": lambda w, **o: DraftLMProposer(noisy_copy(w.target, scale=0.3, seed=1), w.target, **o),
    "mtp": lambda w, **o: MTPProposer(MTPDrafter.from_target(w.target, num_depths=2), w.target, **o),
    "eagle3": _eagle3,
    "dflash": lambda w, **o: DFlashProposer(DFlashDrafter(DFlashConfig.from_target(
        w.target.config, mask_token_id=MASK, num_layers=1, block_size=5)), w.target, **o),
    "dspark": _dspark,
}


def registered_proposer(name: str):
    method, options = proposer_names()[name]
    if method.name not in METHOD_PROPOSERS:
        pytest.fail(f"method {method.name!r} is registered but tests/test_architectures.py builds no proposer for it: "
                    "add it to METHOD_PROPOSERS so it is checked losslessly on every family")
    return lambda w: METHOD_PROPOSERS[method.name](w, **options)


DRAFTERS = {
    **{name: registered_proposer(name) for name in proposer_names()},
    "tree-oracle": lambda w: TreeAroundOracle(w.target, depth=4, width=3, break_prob=0.3, seed=1),
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_output_equals_generate(world, drafter, request):
    if drafter in proposer_names() and proposer_names()[drafter][0].name == "mtp" \
            and not hasattr(world.target.config, "rms_norm_eps"):
        # MTP heads are RMSNorm (Llama-family) blocks: a LayerNorm family is refused in one line.
        with pytest.raises(DraftsmithError, match="MTP heads need a target with RMSNorm layers") as refused:
            DRAFTERS[drafter](world)
        assert "\n" not in str(refused.value)
        return
    torch.manual_seed(0)  # the untrained drafters' initial weights
    proposer = DRAFTERS[drafter](world)
    decoder = SpeculativeDecoder(world.target, proposer, num_draft=4)
    verify_passes = 0
    for prompt, ref in zip(PROMPTS, world.refs):
        result = decoder.generate(torch.tensor(prompt), NEW)
        assert result.tokens.tolist() == ref, f"{drafter} on {world.name}, prompt {prompt}"
        verify_passes += result.stats.verify_passes
    if drafter == "tree-oracle":  # the true path is in every tree: accepted drafts were checked too
        assert verify_passes < 2 * (NEW - 1)


def test_hidden_state_drafters_learn_from_the_target(world):
    """A few steps on one batch of the target's own features lower each drafter's loss."""
    target = world.target
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    mask = torch.ones_like(ids)
    eagle3 = Eagle3Drafter.from_target(target, draft_vocab_size=VOCAB, ttt_length=2)
    dflash = DFlashDrafter(DFlashConfig.from_target(target.config, mask_token_id=MASK, num_layers=1, block_size=4,
                                                    num_anchors=8))
    capture = sorted({*eagle3.config.target_layer_ids, *dflash.config.target_layer_ids})
    with torch.no_grad():
        out = target_forward(target, ids, capture=capture)

    def features(layer_ids):
        return torch.cat([out.hidden[i] for i in layer_ids], dim=-1)

    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    losses = {
        "eagle3": lambda: eagle3.loss(features(eagle3.config.target_layer_ids), ids, out.logits, mask)[0],
        "dflash": lambda: dflash.loss(features(dflash.config.target_layer_ids), ids, mask, embed, head,
                                      generator=torch.Generator().manual_seed(0))[0],
    }
    for name, drafter in (("eagle3", eagle3), ("dflash", dflash)):
        opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
        first = None
        for _ in range(4):
            loss = losses[name]()
            first = float(loss.detach()) if first is None else first
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert float(losses[name]().detach()) < first, f"{name} on {world.name}"


def test_plan_reads_each_familys_heads(world, tmp_path, capsys):
    tiny_config(**SHAPE, **world.kwargs).save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^G +(\d+)$", out, re.M).group(1) == str(world.group)
    assert re.search(r"^D +(\d+) ", out, re.M).group(1) == str(128 // world.group - 1)
    if world.name == "deepseek_v3":
        assert "KV = 1 (multi-latent attention" in out


# ---- caches that are not plain full-attention KV --------------------------------------------


@pytest.fixture(scope="module")
def windowed():
    """Mistral v0.1-style: every layer attends to a sliding window, here of 8 tokens, so the
    cache drops rows as it goes and a rejected draft must still be rolled back."""
    target = build_tiny_target(seed=SEED, **SHAPE, arch="mistral", num_kv_heads=2, sliding_window=8).eval()
    refs = varied_refs(target)
    return SimpleNamespace(name="mistral-window", target=target, refs=refs)


@pytest.mark.parametrize("drafter", ["ngram", "draft_lm", "eagle3"])
def test_sliding_window_target_rolls_back_past_its_window(windowed, drafter):
    torch.manual_seed(0)
    decoder = SpeculativeDecoder(windowed.target, DRAFTERS[drafter](windowed), num_draft=4)
    for prompt, ref in zip(PROMPTS, windowed.refs):
        assert len(prompt) + NEW > 2 * 8  # well past the window
        assert decoder.generate(torch.tensor(prompt), NEW).tokens.tolist() == ref


def test_tree_drafts_on_a_sliding_window_target_are_refused_in_one_line(windowed):
    decoder = SpeculativeDecoder(windowed.target, DRAFTERS["tree-oracle"](windowed), num_draft=4)
    with pytest.raises(DraftsmithError, match="^tree drafts need a full-attention KV cache; this target has "
                                              "sliding-window layers$"):
        decoder.generate(torch.tensor(PROMPTS[0]), NEW)


# Mamba keeps only a recurrent state; Qwen3-Next interleaves gated delta-net layers with full
# attention. transformers records the recurrent states of a forward's last tokens, so a
# rejected draft rolls back.
RECURRENT = {
    "mamba": lambda: MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4,
                                 initializer_range=0.5, eos_token_id=None),
    "qwen3_next": lambda: Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, full_attention_interval=2,
        initializer_range=0.2, eos_token_id=None),
}


@pytest.fixture(scope="module", params=sorted(RECURRENT))
def recurrent(request):
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(RECURRENT[request.param]()).eval()
    refs = varied_refs(target)
    return SimpleNamespace(name=request.param, target=target, refs=refs)


def test_recurrent_target_rolls_back_rejected_drafts(recurrent):
    # A close copy of the target: some drafts accepted, the rest rolled back out of the state.
    decoder = SpeculativeDecoder(recurrent.target, DraftLMProposer(noisy_copy(recurrent.target, scale=0.02, seed=1),
                                                                   recurrent.target), num_draft=4)
    results = [decoder.generate(torch.tensor(p), NEW) for p in PROMPTS]
    assert [r.tokens.tolist() for r in results] == recurrent.refs
    # Some verifies kept part of the drafts: the state was rolled back to inside the verify.
    assert sum(r.stats.accepted_hist[k] for r in results for k in (1, 2, 3)) > 0
    ngram = SpeculativeDecoder(recurrent.target, NgramProposer(), num_draft=4)
    assert ngram.generate(torch.tensor(PROMPTS[0]), NEW).tokens.tolist() == recurrent.refs[0]


def test_tree_drafts_on_a_recurrent_target_are_refused_in_one_line(recurrent):
    decoder = SpeculativeDecoder(recurrent.target, DRAFTERS["tree-oracle"](recurrent), num_draft=4)
    with pytest.raises(DraftsmithError, match="^tree drafts need a full-attention KV cache; this target's cache "
                                              "has .*LinearAttention"):
        decoder.generate(torch.tensor(PROMPTS[0]), NEW)


def test_hidden_state_drafter_on_a_target_without_attention_is_refused_in_one_line():
    mamba = AutoModelForCausalLM.from_config(RECURRENT["mamba"]())
    with pytest.raises(DraftsmithError, match="^target MambaConfig has no attention heads"):
        Eagle3Drafter.from_target(mamba, draft_vocab_size=200)


# ---- a target whose layers cannot be found ------------------------------------------------


@pytest.fixture(scope="module")
def opaque():
    """GPT-2 with its blocks moved out of the ModuleList into an nn.Sequential, which its
    forward still iterates: a model that keeps its layers where nothing says they are."""
    target = build_tiny_target(seed=SEED, **SHAPE, arch="gpt2", num_kv_heads=4).eval()
    ref = varied_refs(target)[0]
    target.transformer.h = nn.Sequential(*target.transformer.h)
    return SimpleNamespace(target=target, ref=ref)


def test_target_without_findable_layers_still_decodes_with_ngram(opaque):
    decoder = SpeculativeDecoder(opaque.target, NgramProposer(), num_draft=4)
    assert decoder.generate(torch.tensor(PROMPTS[0]), NEW).tokens.tolist() == opaque.ref


def test_hidden_state_drafter_on_such_a_target_is_refused_in_one_line(opaque):
    proposer = Eagle3Proposer(Eagle3Drafter.from_target(opaque.target, draft_vocab_size=200))
    with pytest.raises(DraftsmithError) as info:
        SpeculativeDecoder(opaque.target, proposer, num_draft=4)
    message = str(info.value)
    assert "\n" not in message
    assert "eagle3" in message and "hidden states" in message
    assert "GPT2LMHeadModel: no decoder layers found" in message and "GPT2Model" in message


# ---- the case end to end: `draftsmith eval` on a GPT-2 target ----------------------


def test_eval_cli_on_a_gpt2_target_with_ngram(tmp_path, capsys):
    from draftsmith.data.tokenizer import train_tokenizer

    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=270, out_dir=tmp_path / "gpt2")
    shape = {**SHAPE, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    target = build_tiny_target(seed=SEED, **shape, arch="gpt2", num_kv_heads=4)
    target.save_pretrained(tmp_path / "gpt2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["print(1)", "def f(x):"]))
    out = tmp_path / "report"
    code = main(["eval", "--target", str(tmp_path / "gpt2"), "--drafter", "ngram", "--dataset", str(prompts),
                 "--num-prompts", "2", "--max-new-tokens", "12", "--num-draft", "3", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["G"] == 1  # multi-head attention
    for prompt in report["prompts"]:
        assert prompt["outputs"]["ngram"] == prompt["outputs"]["plain"]


def test_tiny_config_refuses_kv_heads_a_family_cannot_have():
    with pytest.raises(DraftsmithError, match="^tiny target gpt2: num_kv_heads 1 must equal num_heads 4"):
        tiny_config(**SHAPE, arch="gpt2", num_kv_heads=1)
    with pytest.raises(DraftsmithError, match="^tiny target: unknown architecture 'bloom' \\(expected one of llama, "):
        tiny_config(**SHAPE, arch="bloom", num_kv_heads=4)
