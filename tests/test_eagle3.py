"""EAGLE-3: parity with the transformers Llama modules it mirrors, training (TTT) that
computes exactly what chain decoding computes, export for SGLang and vLLM, native
save/load, and lossless speculative decoding (chain and tree) on Llama and Qwen3 targets."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention

from draftsmith.data.draft_vocab import build_draft_vocab
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers import proposer_from_arg
from draftsmith.eval.proposers.base import SamplingParams
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.models.eagle3 import (
    DraftKV,
    Eagle3Config,
    Eagle3Drafter,
    default_layer_ids,
)
from draftsmith.models.formats.eagle3 import export_eagle3, load_eagle3_export
from draftsmith.models.native import config_from_dict, load_drafter, save_drafter
from draftsmith.models.target import build_tiny_target, target_forward
from draftsmith.recipe import recipe_from_dict
from tiny_models import PEAKY_ARCHS, PEAKY_VOCAB, peaky_target

VOCAB, ARCHS = PEAKY_VOCAB, PEAKY_ARCHS  # peaky_target's
PROMPT, NEW = 8, 40
EXPORT_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
}


def features(target, drafter, ids):
    """Captured online from the one target: the three layers concatenated, and logits."""
    with torch.no_grad():
        out = target_forward(target, ids, capture=drafter.config.target_layer_ids)
    return torch.cat([out.hidden[i] for i in drafter.config.target_layer_ids], dim=-1), out.logits


def train_on_continuations(target, drafter, prompts: int, new: int, steps: int):
    """`steps` AdamW steps of `drafter` on the target's own greedy continuations of random
    prompts: (sequences, features, logits, loss mask, [(loss, metrics)] per step)."""
    seqs = target.generate(torch.randint(0, VOCAB, (prompts, PROMPT)), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    hidden, logits = features(target, drafter, seqs)
    # The most frequent tokens of the data and of the target's argmaxes: all reachable.
    drafter.set_draft_vocab(*build_draft_vocab([seqs, logits.argmax(-1)], None, VOCAB, 192))
    mask = torch.ones_like(seqs)
    mask[:, :PROMPT] = 0
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=2e-3)
    history = []
    for _ in range(steps):
        loss, metrics = drafter.loss(hidden, seqs, logits, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.item(), metrics))
    return seqs, hidden, logits, mask, history


@pytest.fixture(scope="module", params=list(ARCHS))
def trained(request):
    """A drafter trained 30 steps on the target's own greedy continuations of 4 prompts."""
    torch.manual_seed(0)
    target = peaky_target(request.param)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=192)
    embed_before = drafter.embed_tokens.weight.clone()
    seqs, _, _, _, history = train_on_continuations(target, drafter, 4, NEW + 16, 30)
    assert torch.equal(drafter.embed_tokens.weight, embed_before)  # frozen
    return request.param, target, drafter.eval(), seqs, history


# ---- configuration ----------------------------------------------------------------------


def test_layer_ids_follow_the_reference_and_fit_tiny_targets():
    assert default_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B: SpecForge's [1, N//2 - 1, N - 4]
    assert default_layer_ids(8) == [1, 3, 4]
    assert default_layer_ids(6) == [0, 2, 4] and default_layer_ids(4) == [0, 1, 2]
    target = build_tiny_target(vocab_size=VOCAB, **ARCHS["llama"])
    config = Eagle3Config.from_target(target)
    assert config.target_layer_ids == [0, 2, 4] and config.draft_vocab_size == VOCAB
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (64, 4, 1, 16)
    again = config_from_dict(Eagle3Config, json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config
    # A recipe names a few keys; the rest comes from the target.
    method = recipe_from_dict({"method": {"name": "eagle3", "ttt_length": 3, "draft_vocab_size": 100}}).method
    config = Eagle3Config.from_target(target, **method.params)
    assert (config.ttt_length, config.draft_vocab_size, config.hidden_size) == (3, 100, 64)
    with pytest.raises(DraftsmithError, match="hidden_size, .* not set"):
        Eagle3Drafter(Eagle3Config(ttt_length=3))


def test_bad_inputs_are_one_line_errors():
    target = build_tiny_target(vocab_size=VOCAB, **ARCHS["llama"])
    for ids, pattern in (([1, 2, 40], r"has 6 layers.*\[40\] cannot be captured"),
                         ([1, 2, 5], r"\[5\] cannot be captured"),  # the last layer: engines cannot read it
                         ([1, 1, 2], "3 distinct layer ids")):
        with pytest.raises(DraftsmithError, match=pattern) as err:
            Eagle3Config.from_target(target, target_layer_ids=ids)
        assert "\n" not in str(err.value)
    with pytest.raises(DraftsmithError, match="at least 4 decoder layers"):
        Eagle3Config.from_target(build_tiny_target(vocab_size=VOCAB, arch="llama", num_layers=3, hidden_size=32,
                                                   num_heads=2, num_kv_heads=1))
    with pytest.raises(DraftsmithError, match="unknown key"):
        Eagle3Config.from_target(target, layers=[1, 2, 3])
    drafter = Eagle3Drafter.from_target(target)
    other = build_tiny_target(vocab_size=VOCAB, arch="llama", num_layers=6, hidden_size=32, num_heads=4,
                              num_kv_heads=1)
    with pytest.raises(DraftsmithError, match="hidden size 64, this target has 256 and 32"):
        drafter.copy_target_embedding(other)


def test_parameters_carry_the_engine_names():
    target = build_tiny_target(vocab_size=VOCAB, **ARCHS["llama"])
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=100)
    assert set(drafter.state_dict()) == EXPORT_NAMES | {"embed_tokens.weight"}
    assert not drafter.embed_tokens.weight.requires_grad
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    assert drafter.d2t.dtype == torch.int64 and drafter.d2t.shape == (100,)
    assert drafter.t2d.dtype == torch.bool and drafter.t2d.shape == (VOCAB,)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (64, 128)  # reads the 2H concat
    assert drafter.fc.weight.shape == (64, 192)


# ---- parity with transformers --------------------------------------------------------------


def test_layer_matches_transformers_llama_attention():
    """q/k/v over the 2H concat are Llama attention at width 2H; o_proj writes the first H."""
    torch.manual_seed(0)
    target = build_tiny_target(vocab_size=VOCAB, **ARCHS["llama"])
    drafter = Eagle3Drafter.from_target(target)
    c, ours = drafter.config, drafter.midlayer
    wide = LlamaConfig(hidden_size=2 * c.hidden_size, num_attention_heads=c.num_heads, head_dim=c.head_dim,
                       num_key_value_heads=c.num_kv_heads, rope_theta=c.rope_theta, attention_bias=False,
                       attn_implementation="eager")
    reference = LlamaAttention(wide, layer_idx=0).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(reference, name).weight.copy_(getattr(ours.self_attn, name).weight)
        o = ours.self_attn.o_proj.weight
        reference.o_proj.weight.copy_(torch.cat([o, torch.zeros_like(o)]))
        for norm in (ours.hidden_norm, ours.input_layernorm, ours.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)

    T = 9
    ids, hidden = torch.randint(0, VOCAB, (1, T)), torch.randn(1, T, c.hidden_size)
    positions = torch.arange(T)[None]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos, sin = drafter.rotary_emb(hidden, positions)
        x = torch.cat([ours.input_layernorm(drafter.embed_tokens(ids)), ours.hidden_norm(hidden)], -1)
        attn, _ = reference(x, position_embeddings=(cos, sin), attention_mask=causal)
        h = hidden + attn[..., : c.hidden_size]
        expected = h + ours.mlp(ours.post_attention_layernorm(h))  # LlamaMLP itself
        got = drafter.step(ids, hidden, positions, DraftKV())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 4])
def test_training_computes_what_chain_decoding_computes(window):
    """TTT step i at index c == the (i+1)-th chain draft from context c, with the cache; with
    a sliding window (method.sliding_window) too, counted from c in both, and flex reads the same."""
    torch.manual_seed(0)
    target = peaky_target("qwen3")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=128, sliding_window=window).eval()
    ids = torch.randint(0, VOCAB, (2, 20))
    hidden, _ = features(target, drafter, ids)
    with torch.no_grad():
        steps = drafter.ttt_logits(hidden, ids)
        drafter.config.attention_backend = "flex"
        for dense, flex in zip(steps, drafter.ttt_logits(hidden, ids)):
            torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
        if window:  # the window hides what full attention reads
            assert not torch.allclose(steps[2], Eagle3Drafter.from_native(
                dataclasses.replace(drafter.config, sliding_window=0), drafter.native_state(), target,
                source="full").ttt_logits(hidden, ids)[2])
        fused = drafter.fuse(hidden)
        for b, c in ((0, 0), (1, 6), (0, 11)):
            cache = DraftKV()
            out = drafter.step(ids[b : b + 1, 1 : c + 2], fused[b : b + 1, : c + 1], torch.arange(c + 1)[None], cache)
            out = out[:, -1:]
            for i in range(drafter.config.ttt_length):
                if i:
                    out = drafter.step(ids[b : b + 1, c + 1 + i : c + 2 + i], out, torch.tensor([[c + i]]), cache,
                                       committed=c + 1)
                torch.testing.assert_close(drafter.logits(out)[0, 0], steps[i][b, c], rtol=1e-4, atol=1e-5)


def test_padded_positions_are_invisible():
    """Left padding: real positions do not depend on what the pads hold."""
    torch.manual_seed(0)
    target = peaky_target("llama")
    drafter = Eagle3Drafter.from_target(target).eval()
    ids = torch.randint(0, VOCAB, (1, 14))
    hidden, _ = features(target, drafter, ids)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    other_ids, other_hidden = ids.clone(), hidden.clone()
    other_ids[:, :4] = torch.randint(0, VOCAB, (1, 4))
    other_hidden[:, :4] = torch.randn(1, 4, hidden.shape[-1])
    with torch.no_grad():
        a = drafter.ttt_logits(hidden, ids, mask)
        b = drafter.ttt_logits(other_hidden, other_ids, mask)
    for x, y in zip(a, b):
        torch.testing.assert_close(x[:, 4:], y[:, 4:])


# ---- training ------------------------------------------------------------------------------


def test_loss_goes_down_and_metrics_are_sane(trained):
    _, _, drafter, _, history = trained
    k = drafter.config.ttt_length
    first, last = history[0], history[-1]
    assert last[0] < 0.95 * first[0]
    metrics = last[1]
    assert set(metrics) == {*(f"loss_{j}" for j in range(1, k + 1)), *(f"acc_{j}" for j in range(1, k + 1)),
                            "tau_est", "vocab_coverage"}
    accs = [metrics[f"acc_{j}"] for j in range(1, k + 1)]
    assert all(0.0 <= a <= 1.0 for a in accs) and metrics["vocab_coverage"] == 1.0
    tau, run = 1.0, 1.0
    for a in accs:
        run *= a
        tau += run
    assert metrics["tau_est"] == pytest.approx(tau)
    assert metrics["tau_est"] > first[1]["tau_est"] and metrics["tau_est"] > 1.3


@pytest.mark.parametrize("loss", ["lk_lambda", "lk_alpha"])
def test_lk_losses_train(loss):
    """method.loss lk_lambda / lk_alpha (SpecForge's LK losses, tests/test_loss_parity.py):
    a few steps raise the expected acceptance they train and lower the loss; the greedy
    metrics still come; the teacher pair a feature cache stores gives the same loss."""
    torch.manual_seed(0)
    target = peaky_target("llama")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=192, ttt_length=3, loss=loss)
    seqs, hidden, logits, mask, history = train_on_continuations(target, drafter, 2, 24, 12)
    (first_loss, first), (last_loss, last) = history[0], history[-1]
    assert last_loss < 0.9 * first_loss
    assert set(last) == {*(f"{m}_{j}" for m in ("loss", "acc", "accept") for j in (1, 2, 3)), "tau_est",
                         "vocab_coverage"}
    assert last["accept_1"] > first["accept_1"] + 0.1 and all(0.0 <= last[f"accept_{j}"] <= 1.0 for j in (1, 2, 3))
    assert last["tau_est"] > first["tau_est"]
    with torch.no_grad():
        cached = drafter.loss(hidden, seqs, *drafter.teacher(logits)[:1], mask, target_top=logits.argmax(-1))
        online = drafter.loss(hidden, seqs, logits, mask)
    assert float(cached[0]) == pytest.approx(float(online[0]), rel=1e-6) and cached[1] == pytest.approx(online[1])


def test_bad_loss_options_are_refused():
    """method.loss and LK's hyperparameters: one line naming the key, from the recipe's check
    (before any data is prepared) and from the config itself."""
    from draftsmith.recipe import validate

    for params, pattern in (({"loss": "kl"}, r"method\.loss: 'kl' is not one of ce, lk_lambda, lk_alpha"),
                            ({"loss": "lk_lambda", "kl_scale": 1.5}, r"method\.kl_scale: .* in \[0, 1\], got 1\.5"),
                            ({"kl_decay": -1.0}, r"method\.kl_decay: must be >= 0")):
        with pytest.raises(DraftsmithError, match=pattern) as err:
            validate(recipe_from_dict({"method": {"name": "eagle3", **params}}))
        assert "\n" not in str(err.value)
        with pytest.raises(DraftsmithError, match=pattern):
            Eagle3Config.from_target(build_tiny_target(vocab_size=VOCAB, **ARCHS["llama"]), **params)
    config = Eagle3Config.from_target(build_tiny_target(vocab_size=VOCAB, **ARCHS["llama"]))
    assert (config.loss, config.kl_scale, config.kl_decay) == ("ce", 1.0, 1.0)  # SpecForge's defaults


def test_draft_vocab_restricts_training_and_drafting():
    target = peaky_target("llama")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=16)
    ids = torch.randint(0, VOCAB, (1, 12))
    hidden, logits = features(target, drafter, ids)
    loss, metrics = drafter.loss(hidden, ids, logits, torch.ones_like(ids))
    assert torch.isfinite(loss) and metrics["vocab_coverage"] < 1.0
    proposer = Eagle3Proposer(drafter)
    decoder = SpeculativeDecoder(target, proposer, num_draft=4, eos_token_id=())
    state = decoder.start(ids[0], 8, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    draft = proposer.propose(4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.probs.shape == (4, VOCAB)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4))
    assert float(draft.probs[:, ~drafter.t2d].sum()) == 0.0 and bool(drafter.t2d[draft.tokens].all())
    assert state.generated  # the prefill's token


# ---- export and reload -----------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_layout(trained, tmp_path, engine):
    _, target, drafter, _, _ = trained
    out = export_eagle3(drafter, tmp_path / engine, engine)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    c = drafter.config
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"]) == (VOCAB, 192, c.hidden_size)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        c.num_heads, c.num_kv_heads, c.head_dim)
    assert "target_hidden_size" not in cfg  # equal to hidden_size
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": c.target_layer_ids,
                                   "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in c.target_layer_ids]
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == EXPORT_NAMES
    H, Ht = c.hidden_size, c.target_hidden_size
    assert tensors["fc.weight"].shape == (H, 3 * Ht)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (c.num_heads * c.head_dim, 2 * H)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (c.num_kv_heads * c.head_dim, 2 * H)
    assert tensors["midlayer.self_attn.o_proj.weight"].shape == (H, c.num_heads * c.head_dim)
    assert tensors["lm_head.weight"].shape == (192, H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(192) + tensors["d2t"], tensors["t2d"].nonzero().flatten())


def _drafts(target, drafter, seqs, mode):
    decoder = SpeculativeDecoder(target, Eagle3Proposer(drafter, mode=mode), num_draft=6, eos_token_id=())
    state = decoder.start(seqs[0, :PROMPT], 16)
    return decoder.proposer.propose(6, SamplingParams(), None), state


def test_reload_gives_identical_drafts(trained, tmp_path):
    _, target, drafter, seqs, _ = trained
    hidden, _ = features(target, drafter, seqs[:1])
    with torch.no_grad():
        expected = drafter.ttt_logits(hidden, seqs[:1])
    save_drafter(drafter, tmp_path / "run" / "model")
    export_eagle3(tmp_path / "run", tmp_path / "vllm", "vllm")  # from a training run's native model/
    export_eagle3(drafter, tmp_path / "sglang", "sglang")
    reloaded = {
        "native": load_drafter(tmp_path / "run" / "model", "eagle3", target),
        "sglang": load_eagle3_export(tmp_path / "sglang", target),
        "vllm": load_eagle3_export(tmp_path / "vllm", target),
    }
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    for name, again in reloaded.items():
        assert again.config == drafter.config, name
        with torch.no_grad():
            got = again.ttt_logits(hidden, seqs[:1])
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), name
        for mode in ("chain", "tree"):
            a, _ = _drafts(target, drafter, seqs, mode)
            b, _ = _drafts(target, again, seqs, mode)
            assert torch.equal(a.tokens, b.tokens), (name, mode)


def test_eval_specs_load_native_runs_and_exports(trained, tmp_path):
    _, target, drafter, seqs, _ = trained
    save_drafter(drafter, tmp_path / "run" / "model")
    export_eagle3(drafter, tmp_path / "vllm", "vllm")
    for spec, mode in (("eagle3:{}/run", "chain"), ("eagle3_tree:{}/vllm", "tree")):
        proposer = proposer_from_arg(spec.format(tmp_path), target)
        assert proposer.mode == mode and proposer.name == spec.split(":")[0]
        decoder = SpeculativeDecoder(target, proposer, num_draft=5, eos_token_id=())
        assert torch.equal(decoder.generate(seqs[3, :PROMPT], 12).tokens, seqs[3, PROMPT : PROMPT + 12])
    save_drafter(drafter, tmp_path / "other")
    meta = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**meta, "method": "dflash"}))
    with pytest.raises(DraftsmithError, match="holds a dflash drafter, not eagle3"):
        proposer_from_arg(f"eagle3:{tmp_path}/other", target)


def test_reload_refuses_disagreeing_layer_ids(trained, tmp_path):
    _, target, drafter, _, _ = trained
    out = export_eagle3(drafter, tmp_path / "x", "sglang")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="vLLM's must be SGLang's \\+ 1"):
        load_eagle3_export(out, target)
    with pytest.raises(DraftsmithError, match="unknown engine"):
        export_eagle3(drafter, tmp_path / "y", "trtllm")
    assert not (tmp_path / "y").exists()


# ---- lossless decoding -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculative_output_equals_generate(trained, mode):
    arch, target, drafter, seqs, _ = trained
    decoder = SpeculativeDecoder(target, Eagle3Proposer(drafter, mode=mode), num_draft=7, eos_token_id=())
    passes = committed = 0
    for row in seqs:
        result = decoder.generate(row[:PROMPT], NEW)
        assert torch.equal(result.tokens, row[PROMPT : PROMPT + NEW]), (arch, mode)
        passes += result.stats.verify_passes
        committed += result.stats.committed
    assert committed > passes  # drafts were accepted, so acceptance and rollback both ran


def _context_entries(target, drafter, prompt, first):
    """The drafter's cache over a prompt and its output at the last prompt position."""
    hidden, _ = features(target, drafter, prompt[None])
    cache = DraftKV()
    out = drafter.step(torch.cat([prompt[1:], first])[None], drafter.fuse(hidden), torch.arange(len(prompt))[None],
                       cache)
    return cache, out[:, -1:]


def test_chain_drafts_follow_the_drafter_step_by_step(trained):
    """Sampled chain drafts: each recorded q equals the drafter's distribution after the
    drafts before it, recomputed by hand (positions, cache and hidden threading)."""
    _, target, drafter, seqs, _ = trained
    proposer = Eagle3Proposer(drafter)
    decoder = SpeculativeDecoder(target, proposer, num_draft=6, eos_token_id=())
    first = decoder.start(seqs[2, :PROMPT], 16).last
    draft = proposer.propose(6, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache, out = _context_entries(target, drafter, seqs[2, :PROMPT], first)
        for d, token in enumerate(draft.tokens):
            q = torch.zeros(VOCAB).index_copy_(0, drafter.draft_to_target, drafter.logits(out)[0, -1].softmax(-1))
            torch.testing.assert_close(draft.probs[d], q)
            out = drafter.step(token.view(1, 1), out, torch.tensor([[PROMPT + d]]), cache)


def test_tree_scores_are_path_log_probabilities(trained):
    """Every tree node's score, recomputed by decoding its path as a chain from scratch:
    checks positions, tree attention masks and hidden-state threading of the expansion."""
    _, target, drafter, seqs, _ = trained
    proposer = Eagle3Proposer(drafter, mode="tree", topk=3, depth=4)
    decoder = SpeculativeDecoder(target, proposer, num_draft=12, eos_token_id=())
    prompt = seqs[1, :PROMPT]
    first = decoder.start(prompt, 16).last
    nodes = proposer.grow_tree(12)
    # Depth 4 (the cap), 3 + 3 * 9 nodes at most: expansion stops under hopeless nodes; and
    # deep and branching enough that the masks and positions below are really exercised.
    assert len(nodes) <= 3 + 3 * 9 and max(nodes.depth) <= 4
    assert max(nodes.depth) >= 3 and any(nodes.parent.count(p) > 1 for p in set(nodes.parent) - {-1})
    draft_index = torch.cumsum(drafter.t2d.long(), 0) - 1
    with torch.no_grad():
        context, root = _context_entries(target, drafter, prompt, first)
        for n in range(len(nodes)):
            path = [n]
            while nodes.parent[path[-1]] >= 0:
                path.append(nodes.parent[path[-1]])
            cache, out, total = DraftKV(), root, 0.0
            cache.keys, cache.values = context.keys, context.values
            for d, m in enumerate(reversed(path)):
                total += drafter.logits(out)[0, -1].float().log_softmax(-1)[draft_index[nodes.token[m]]].item()
                out = drafter.step(torch.tensor([[nodes.token[m]]]), out, torch.tensor([[PROMPT + d]]), cache)
            assert total == pytest.approx(nodes.score[n], abs=1e-4)


def test_tree_is_a_bfs_tree_within_budget(trained):
    _, target, drafter, seqs, _ = trained
    draft, _ = _drafts(target, drafter, seqs, "tree")
    parents = draft.parents.tolist()
    assert len(draft) == 6 and all(p < i for i, p in enumerate(parents))
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    assert depth == sorted(depth)
    for p in set(parents):  # siblings are distinct tokens
        kids = [int(draft.tokens[i]) for i, q in enumerate(parents) if q == p]
        assert len(kids) == len(set(kids))


def certain(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """The same drafter made certain: its head scaled until every argmax has probability ~1."""
    sure = Eagle3Drafter(drafter.config)
    sure.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        sure.lm_head.weight.mul_(1e4)
    return sure.eval()


def test_a_tree_whose_drafter_is_certain_is_a_chain(trained):
    """Nodes are chosen by cumulative draft probability and the depth follows the budget,
    so a certain drafter spends all 7 nodes on one path: the chain it would draft."""
    _, target, drafter, seqs, _ = trained
    sure = certain(drafter)
    decoder = SpeculativeDecoder(target, Eagle3Proposer(sure, mode="tree"), num_draft=7, eos_token_id=())
    decoder.start(seqs[0, :PROMPT], 16)
    tree = decoder.proposer.propose(7, SamplingParams(), None)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]  # one path, 7 deep (the old depth cap was 6)
    chain = Eagle3Proposer(sure, mode="chain")
    SpeculativeDecoder(target, chain, num_draft=7, eos_token_id=()).start(seqs[0, :PROMPT], 16)
    assert tree.tokens.tolist() == chain.propose(7, SamplingParams(), None).tokens.tolist()


def test_tree_depth_follows_the_node_budget(trained):
    """Budget 15: the tree may reach depth 15 (EAGLE-2 sizes depth by the token budget)
    and stays within budget; a `budget` option below the decoder's caps it."""
    _, target, drafter, seqs, _ = trained
    proposer = Eagle3Proposer(certain(drafter), mode="tree", budget=5)
    decoder = SpeculativeDecoder(target, proposer, num_draft=15, eos_token_id=())
    decoder.start(seqs[1, :PROMPT], 24)
    assert proposer.propose(15, SamplingParams(), None).parents.tolist() == [-1, 0, 1, 2, 3]
    proposer.budget = None
    assert len(proposer.propose(15, SamplingParams(), None)) == 15
    assert max(proposer.grow_tree(15).depth) == 15


@pytest.mark.parametrize("trained", ["llama"], indirect=True)  # a config check
@pytest.mark.parametrize("options, match", [
    ({"budget": 0}, "node budget must be at least one node, got 0"),
    ({"depth": 0}, "topk and depth must be >= 1"),
    ({"mode": "forest"}, "drafting mode 'forest'"),
])
def test_bad_tree_options_are_one_line(trained, options, match):
    with pytest.raises(DraftsmithError, match=match) as caught:
        Eagle3Proposer(trained[2], **{"mode": "tree", **options})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("trained", ["llama"], indirect=True)  # the property is the decoder's, not a family's
def test_sampled_tree_decoding_is_lossless(trained):
    """Through the decoder: the first verified token of a sampled tree is distributed as
    the target's processed p (the decoder rewound to the same prefix for every sample)."""
    from decoding_helpers import chi2_pvalue
    from draftsmith.eval.sampling import process_logits
    from draftsmith.models.target_cache import crop_cache

    _, target, drafter, seqs, _ = trained
    sampling = SamplingParams(temperature=1.0, top_k=8)
    prompt = seqs[0, :PROMPT]
    proposer = Eagle3Proposer(drafter, mode="tree", topk=3)
    decoder = SpeculativeDecoder(target, proposer, num_draft=5, eos_token_id=())
    generator = torch.Generator().manual_seed(0)
    state = decoder.start(prompt, 100, sampling, generator)
    first = state.generated[0]
    with torch.no_grad():
        p = process_logits(target(torch.cat([prompt, torch.tensor([first])])[None]).logits[0, -1], sampling)
    started = (proposer.context, proposer.tokens, list(proposer.pending), proposer.last_out)
    seconds = []
    for _ in range(800):
        crop_cache(state.cache, PROMPT)  # rewind target and drafter to just after the prefill
        state.last, state.generated, state.done = torch.tensor([first]), [first], False
        proposer.context, proposer.tokens, proposer.pending, proposer.last_out = started[0], started[1], \
            list(started[2]), started[3]
        proposer.cache.crop(proposer.context)
        decoder.step(state)
        seconds.append(state.generated[1])
    assert chi2_pvalue(seconds, p) > 1e-3


@pytest.mark.parametrize("trained", ["llama"], indirect=True)
@pytest.mark.parametrize("budget", [2, 5])
def test_sampled_tree_first_token_is_distributed_as_the_target(trained, budget):
    """Whatever nodes the budget keeps, the first committed token is distributed as the
    target's processed p. A sampled tree whose kept nodes depended on their own drawn tokens
    (the best-scoring draws of 4) would commit the drafter's favourites too often."""
    from decoding_helpers import begin_like_decoder, chi2_pvalue
    from draftsmith.eval.sampling import accept_tree_sampled, process_logits

    _, target, drafter, seqs, _ = trained
    sampling = SamplingParams(temperature=1.0, top_k=8)
    proposer = Eagle3Proposer(drafter, mode="tree", topk=4)
    p = process_logits(begin_like_decoder(proposer, target, seqs[1, :PROMPT + 4]).logits[0, -1], sampling)
    generator = torch.Generator().manual_seed(0)
    firsts = []
    for _ in range(3000):
        draft = proposer.propose(budget, sampling, generator)
        proposer.cache.crop(proposer.context)
        children = [[] for _ in range(len(draft.tokens) + 1)]
        for c, parent in enumerate(draft.parents.tolist()):
            children[parent + 1].append(c)
        # Only the first committed token is checked, so every row verifies against p.
        path, bonus = accept_tree_sampled(p.expand(len(draft.tokens) + 1, -1), draft.tokens.tolist(), children,
                                          draft.probs, generator)
        firsts.append(int(draft.tokens[path[0]]) if path else int(bonus))
    assert chi2_pvalue(firsts, p) > 1e-3


# ---- --num-draft auto for trees (eval/proposers/eagle3_tree_tuning.py) ------------------


def _top(nodes, n: int, depth: int) -> list[tuple[int, ...]]:
    """The token paths of the n best nodes of depth <= depth, in TreeCandidates.select's order."""
    keep = sorted((i for i in range(len(nodes)) if nodes.depth[i] <= depth),
                  key=lambda i: (-nodes.score[i], nodes.depth[i], i))[:n]

    def path(i):
        return (*path(nodes.parent[i]), nodes.token[i]) if i >= 0 else ()
    return sorted(path(i) for i in keep)


def _paths(draft) -> list[tuple[int, ...]]:
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()

    def path(i):
        return (*path(parents[i]), tokens[i]) if i >= 0 else ()
    return sorted(path(i) for i in range(len(tokens)))


@pytest.mark.parametrize("trained", ["llama"], indirect=True)
def test_an_unpruned_tree_holds_every_pruned_tree_it_prices(trained):
    """The tuning grows each width once, unpruned, and reads the tree of every (depth, budget)
    off it: the n best nodes of depth <= depth are exactly what the pruned expansion drafts."""
    _, target, drafter, seqs, _ = trained
    for topk in (1, 2, 3, 5):
        proposer = Eagle3Proposer(drafter, mode="tree", topk=topk)
        decoder = SpeculativeDecoder(target, proposer, num_draft=9, eos_token_id=())
        state = decoder.start(seqs[2, :PROMPT], 30)
        for _ in range(3):  # three contexts, each after a real verify
            full = proposer.grow_tree(9, topk=topk, prune=False)
            for depth in range(1, 10):
                proposer.depth = depth
                for n in range(depth, 10):
                    assert _paths(proposer.propose(n, SamplingParams(), None)) == _top(full, n, depth), (topk, depth, n)
            proposer.depth = None
            decoder.step(state)


@pytest.mark.parametrize("trained", ["llama"], indirect=True)
def test_the_tree_tuning_prices_each_pass_as_the_decoder_accepts_it(trained):
    """Recording while a tree of (topk 3, depth 4, 6 nodes) decodes: read off the recorded trees,
    every pass's accepted drafts at those settings are the decoder's, pass by pass."""
    from draftsmith.eval.proposers.eagle3_tree_tuning import price

    _, target, drafter, seqs, _ = trained
    proposer = Eagle3Proposer(drafter, mode="tree", topk=3, depth=4)
    tuning = proposer.tuning()
    tuning.record(6)
    decoder = SpeculativeDecoder(target, proposer, num_draft=6, eos_token_id=())
    accepted = []
    for row in (0, 3):
        steps = decoder.generate(seqs[row, :PROMPT], 40).stats.accepted_steps
        accepted += steps[:-1]  # a sequence's last pass is cut at the token limit
    tuning._stop()
    recorder = tuning.recorders[6]
    assert sum(accepted) > len(accepted)  # the drafter is accepted, so the check has teeth
    predicted = []
    for sequence in (0, 1):
        passes = [p for p in recorder.passes if p.sequence == sequence]
        for p in passes[:-1]:
            grown = p.grown[3]
            path = grown.path(recorder.texts[sequence][p.start:])
            predicted.append(sum(r < 6 for r in grown.ranks(path, 4)[3]))
            assert len(grown.level_ms) == 6
    assert predicted == accepted
    curve = price(recorder, lambda d: 1.0 + d, 6)
    point = next(c for c in curve if (c["topk"], c["depth"], c["d"]) == (3, 4, 6))
    assert point["expected_tokens"] > 1.5 and curve[0] == {**curve[0], "d": 0, "expected_tokens": 1.0}
    assert {(c["topk"], c["depth"]) for c in curve[1:]} == {(k, dep) for k in (1, 2, 3, 4, 8) for dep in range(1, 7)}
