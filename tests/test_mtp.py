"""MTP modules: a hand-written reference computation, the hidden state the engines feed them,
and the DeepSeek-style save/load."""

import math

import torch
import torch.nn.functional as F

from draftsmith.models.mtp import MTP_DIR, MTPDrafter, deepseek_names, engine_hidden, final_norm, mtp_dir, mtp_forward
from draftsmith.models.native import load_drafter, save_drafter
from draftsmith.models.target import build_tiny_target, target_forward


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    # x: [heads, T, d]; rotate-half convention of Llama/Qwen.
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference_depth1(layer, target, ids, h0):
    """Depth 1 written out by hand from docs/design.md section 7 (one sequence); h0 is the
    last layer's output, which the engines pass through the target's final norm first."""
    cfg = target.config
    eps, H = cfg.rms_norm_eps, cfg.hidden_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = H // heads
    emb = target.get_input_embeddings().weight[ids[1:]]  # t_{i+1}
    prev = rms(h0[:-1], target.model.norm.weight, eps)
    x = torch.cat([rms(emb, layer.enorm.weight, eps), rms(prev, layer.hnorm.weight, eps)], -1)
    x = x @ layer.eh_proj.weight.T
    b = layer.block
    T = x.shape[0]
    pos = torch.arange(T)
    n = rms(x, b.input_layernorm.weight, eps)
    q = (n @ b.self_attn.q_proj.weight.T).view(T, heads, d).transpose(0, 1)
    k = (n @ b.self_attn.k_proj.weight.T).view(T, kv, d).transpose(0, 1)
    v = (n @ b.self_attn.v_proj.weight.T).view(T, kv, d).transpose(0, 1)
    q, k = rope(q, pos, cfg.rope_parameters["rope_theta"]), rope(k, pos, cfg.rope_parameters["rope_theta"])
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H)
    x = x + attn @ b.self_attn.o_proj.weight.T
    n = rms(x, b.post_attention_layernorm.weight, eps)
    mlp = (F.silu(n @ b.mlp.gate_proj.weight.T) * (n @ b.mlp.up_proj.weight.T)) @ b.mlp.down_proj.weight.T
    x = x + mlp
    return rms(x, layer.shared_head.norm.weight, eps) @ target.get_output_embeddings().weight.T


def _randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_depth1_matches_hand_written_reference():
    target = build_tiny_target(vocab_size=97, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    heads = MTPDrafter.from_target(target, num_depths=2)
    _randomise(heads)  # norms start at 1: perturb them so the test sees every weight
    _randomise(target.model.norm)  # and the target's final norm, which h^0 passes through
    ids = torch.randint(0, 97, (1, 12))
    h0 = target_forward(target, ids, capture=[1]).hidden[1]
    ours = mtp_forward(heads, target, ids, h0)[0][0]
    ref = reference_depth1(heads.layers[0], target, ids[0], h0[0])
    assert ours.shape == ref.shape == (11, 97)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_save_uses_deepseek_names_and_reloads(tmp_path):
    target = build_tiny_target(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4)
    heads = MTPDrafter.from_target(target, num_depths=2)
    _randomise(heads)
    save_drafter(heads, tmp_path / MTP_DIR)
    names = set(deepseek_names(heads.state_dict()))
    for k in (0, 1):
        for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert f"layers.{k}.{part}" in names
    assert not any("block" in n or "embed_tokens" in n for n in names)
    loaded = load_drafter(mtp_dir(tmp_path), "mtp", target)
    config = loaded.config
    assert config.num_depths == 2
    ids = torch.randint(0, 64, (1, 9))
    h0 = target_forward(target, ids, capture=[1]).hidden[1]
    for a, b in zip(mtp_forward(heads, target, ids, h0), mtp_forward(loaded, target, ids, h0)):
        assert torch.equal(a, b)


def test_eager_attention_trains_the_same_causal_modules():
    """transformers' eager attention reads a missing mask as full attention, so the training
    forward passes an explicit causal mask: eager and SDPA give the same logits, and under
    eager a later token changes no earlier position."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for impl in ("sdpa", "eager"):
        target = build_tiny_target(vocab_size=97, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                   attn_implementation=impl)
        assert target.config._attn_implementation == impl
        torch.manual_seed(1)
        heads = MTPDrafter.from_target(target, num_depths=2)
        _randomise(heads)
        h0 = target_forward(target, ids, capture=[1]).hidden[1]
        logits[impl] = mtp_forward(heads, target, ids, h0)
    for a, b in zip(logits["sdpa"], logits["eager"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97
    h0 = target_forward(target, changed, capture=[1]).hidden[1]
    for a, b in zip(logits["eager"], mtp_forward(heads, target, changed, h0)):
        # Depth k at position i reads t_{i+k}: the last token only at its last position, T - 1 - k.
        torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(a[:, -1], b[:, -1])


def test_modules_read_the_state_the_engines_pass():
    """vLLM's DeepSeekMTP (vllm/model_executor/models/deepseek_mtp.py @ 4f7c14402630) hands
    module k `previous_hidden_states`, and SGLang's NextN (deepseek_nextn.py @ c28bdc9012d2)
    `spec_info.hidden_states`: both the target model's output, and `DeepseekV2Model.forward`
    ends in `self.norm`. That is transformers' last `hidden_states` entry, the input of the
    head; h^0 here is the same tensor, not the last layer's pre-norm output."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=64)
    torch.manual_seed(0)
    for target in (build_tiny_target(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4),
                   DeepseekV3ForCausalLM(config).eval()):
        with torch.no_grad():
            for p in target.parameters():  # MoE experts are built uninitialised
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
            _randomise(final_norm(target))
        ids = torch.randint(0, 64, (1, 9))
        last = target.config.num_hidden_layers - 1
        layer_out = target_forward(target, ids, capture=[last]).hidden[last]
        with torch.no_grad():
            fed = target(ids, output_hidden_states=True).hidden_states[-1]
            torch.testing.assert_close(engine_hidden(target, layer_out), fed)
            assert not torch.allclose(layer_out, fed, atol=1e-3)


def test_mtp_loss_trains_the_final_norm():
    """The MTP loss reads the post-norm state, so its gradient reaches the final norm."""
    target = build_tiny_target(vocab_size=61, num_layers=2, hidden_size=32, num_heads=4)
    heads = MTPDrafter.from_target(target, num_depths=2)
    ids = torch.randint(0, 61, (2, 10))
    h = target_forward(target, ids, capture=[1]).hidden[1]
    sum(lg.sum() for lg in mtp_forward(heads, target, ids, h)).backward()
    grad = final_norm(target).weight.grad
    assert grad is not None and grad.abs().sum() > 0
