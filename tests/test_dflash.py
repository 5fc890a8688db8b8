"""DFlash: layer parity with transformers, the training mask, training against decoding,
the loss, exports, errors, and lossless greedy decoding on two architectures."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3DecoderLayer

from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.base import SamplingParams
from draftsmith.eval.proposers.dflash import DFlashProposer, load_proposer
from draftsmith.models.dflash import ContextCache, DFlashConfig, DFlashDrafter, concat_layers
from draftsmith.models.dflash_blocks import block_visibility, make_blocks, sample_anchors
from draftsmith.models.dflash_loss import greedy_metrics, position_means
from draftsmith.models.dflash_reference import auto_block_size, default_gamma, spread_layer_ids
from draftsmith.models.formats.dflash import export_dflash_zlab, read
from draftsmith.models.native import load_drafter, save_drafter
from draftsmith.models.target import target_forward
from tiny_models import MASK, drafter_for, tiny_target

QWEN3_8B = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, num_hidden_layers=36,
                           vocab_size=151936, intermediate_size=12288, head_dim=128, rms_norm_eps=1e-6,
                           rope_parameters={"rope_theta": 1e6}, max_position_embeddings=40960)


def features(target, ids, layer_ids):
    return concat_layers(target_forward(target, ids, capture=layer_ids).hidden, layer_ids)


# ---------------------------------------------------------------- config

def test_defaults_follow_the_reference_and_the_tile_rule():
    assert spread_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B drafter
    assert spread_layer_ids(36, 1) == [18]
    assert [default_gamma(d) for d in (15, 9, 7)] == [7.0, 5.0, 4.0]  # B = 16, 10, 8
    assert default_gamma(8) == 4.5
    assert default_gamma(31) == 7.0  # capped at the largest published gamma
    config = DFlashConfig.from_target(QWEN3_8B, mask_token_id=151669)
    assert config.num_layers == 5 and config.target_layer_ids == [1, 9, 17, 25, 33]
    # G = 4: D = 31, but auto stops at B = 16, the largest published DFlash block.
    assert config.block_size == auto_block_size(QWEN3_8B) == 16 and config.gamma == 7.0
    assert auto_block_size(QWEN3_8B, first_prediction_slot=0) == 16  # DSpark: 16 drafts
    g8 = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4)  # G = 8: D = 15, under the cap
    assert auto_block_size(g8) == 16 and auto_block_size(g8, first_prediction_slot=0) == 15
    g16 = SimpleNamespace(num_attention_heads=32, num_key_value_heads=2)  # G = 16: D = 7
    assert auto_block_size(g16) == 8
    # A recipe that sets them gets what it sets, past the cap included.
    wide = DFlashConfig.from_target(QWEN3_8B, mask_token_id=0, block_size=32, gamma=12.0)
    assert (wide.block_size, wide.gamma) == (32, 12.0)
    assert config.hidden_size == 4096 and config.rope_theta == 1e6


def test_bad_values_are_one_line_errors():
    with pytest.raises(DraftsmithError, match="mask_token_id 151936 is outside"):
        DFlashConfig.from_target(QWEN3_8B, mask_token_id=151936)
    with pytest.raises(DraftsmithError, match="layer 36 is beyond the target's depth"):
        DFlashConfig.from_target(QWEN3_8B, mask_token_id=0, target_layer_ids=[1, 36])
    with pytest.raises(DraftsmithError, match="mask_token_id not set"):
        DFlashConfig.from_target(QWEN3_8B)
    with pytest.raises(DraftsmithError, match="no room for drafts"):
        auto_block_size(SimpleNamespace(num_attention_heads=128, num_key_value_heads=1))
    with pytest.raises(DraftsmithError, match="repeat a layer"):
        DFlashConfig.from_target({**vars(QWEN3_8B), "num_hidden_layers": 4}, mask_token_id=0, num_context_layers=4)
    with pytest.raises(DraftsmithError, match="num_context_layers 2 disagrees with target_layer_ids"):
        DFlashConfig.from_target(QWEN3_8B, mask_token_id=0, num_context_layers=2, target_layer_ids=[1, 9, 17])


def test_block_past_the_tile_rule_warns_with_the_numbers():
    with pytest.warns(UserWarning, match=r"block_size 40 gives 39 drafts.*G = 4.*160 > tile 128.*D = 31"):
        DFlashConfig.from_target(QWEN3_8B, mask_token_id=0, block_size=40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DFlashConfig.from_target(QWEN3_8B, mask_token_id=0, block_size=40, allow_large_block=True)


def test_shape_follows_the_reference_configs_for_any_target():
    """SpecForge's qwen2.5-0.5b/qwen3-8b DFlash configs (24 and 36 layers: 5 drafter layers, 5
    context layers, the target's KV heads) and the rule's reading for shallow and MQA targets."""
    qwen25 = SimpleNamespace(**{**vars(QWEN3_8B), "num_hidden_layers": 24, "hidden_size": 896,
                                "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64})
    c = DFlashConfig.from_target(qwen25, mask_token_id=0)
    assert (c.num_layers, c.num_kv_heads, c.target_layer_ids) == (5, 2, [1, 6, 11, 16, 21])
    c = DFlashConfig.from_target(QWEN3_8B, mask_token_id=0)
    assert (c.num_layers, c.num_kv_heads, c.num_context_layers) == (5, 8, 5)
    # The demo target: 4 layers, 8 query heads over 1 KV head. Half its depth, 3 context
    # layers spread over all but the last (the reference spread repeats layer 1 there), and
    # 2 KV heads: 4 query heads each, as the Qwen3 and Llama drafters group.
    demo = SimpleNamespace(**{**vars(QWEN3_8B), "num_hidden_layers": 4, "hidden_size": 256,
                              "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 32})
    c = DFlashConfig.from_target(demo, mask_token_id=0)
    assert (c.num_layers, c.num_kv_heads, c.target_layer_ids) == (2, 2, [0, 1, 2])
    assert spread_layer_ids(4, 3) == [0, 1, 2] and spread_layer_ids(16, 5) == [1, 4, 7, 10, 13]  # LFM's
    # A recipe's choice wins over the rule.
    c = DFlashConfig.from_target(demo, mask_token_id=0, num_layers=3, num_kv_heads=8, num_context_layers=1)
    assert (c.num_layers, c.num_kv_heads, c.target_layer_ids) == (3, 8, [2])


# ---------------------------------------------------------------- layers

def test_layer_without_context_is_a_bidirectional_qwen3_layer(target):
    drafter = drafter_for(target)
    layer, qc = drafter.layers[0], drafter.config.qwen3_config()
    qc._attn_implementation = "eager"
    reference = Qwen3DecoderLayer(qc, layer_idx=0).eval()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, qc.hidden_size)
    positions = torch.arange(3, 10).expand(2, -1)
    cos, sin = drafter.rotary_emb(x, positions)
    empty = torch.zeros(2, qc.num_key_value_heads, 0, qc.head_dim)
    full = torch.zeros(2, 1, 7, 7)  # additive: everything visible
    expected = reference(x, attention_mask=full, position_embeddings=(cos, sin))
    torch.testing.assert_close(layer(x, empty, empty, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_attention_over_context_matches_qwen3_attention_on_the_concatenation(target):
    # The block's rows of Qwen3 attention over [context; block] (fully visible) are
    # DFlash attention: context and block share k_proj/v_proj, k_norm and RoPE.
    drafter = drafter_for(target)
    attn, qc = drafter.layers[0].self_attn, drafter.config.qwen3_config()
    qc._attn_implementation = "eager"
    reference = Qwen3Attention(qc, layer_idx=0).eval()
    reference.load_state_dict(attn.state_dict())
    context, block = torch.randn(1, 5, qc.hidden_size), torch.randn(1, 4, qc.hidden_size)
    positions = torch.arange(9)[None]
    cos, sin = drafter.rotary_emb(context, positions)
    k, v = attn.project_kv(context, cos[:, :5], sin[:, :5])
    ours = attn(block, k, v, cos[:, 5:], sin[:, 5:])
    expected, _ = reference(torch.cat([context, block], 1), (cos, sin), torch.zeros(1, 1, 9, 9))
    torch.testing.assert_close(ours, expected[:, 5:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the training mask

def test_visibility_is_the_context_before_the_anchor_and_the_own_block():
    visible = block_visibility(torch.tensor([[2, 4]]), context_len=6, block_size=2)[0, 0]
    expected = torch.tensor([
        # context 0..5       block 0  block 1
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(visible, expected)


def test_a_block_ignores_other_blocks_and_everything_after_its_anchor(target):
    drafter = drafter_for(target)
    embed = target.get_input_embeddings()
    ids = torch.randint(0, MASK, (1, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    feats = features(target, ids, drafter.config.target_layer_ids)
    anchors = torch.tensor([[5, 9, 15]])
    base = drafter.training_hidden(feats, make_blocks(ids, mask, anchors, drafter.config), embed)

    later_ids, later_feats = ids.clone(), feats.clone()
    later_ids[:, 6:] = (later_ids[:, 6:] + 1) % MASK  # every token after block 0's anchor
    later_feats[:, 5:] += torch.randn_like(later_feats[:, 5:])  # features from the anchor on
    changed = drafter.training_hidden(later_feats, make_blocks(later_ids, mask, anchors, drafter.config), embed)
    assert torch.equal(changed[:, 0], base[:, 0])
    assert not torch.allclose(changed[:, 1:], base[:, 1:])

    earlier = feats.clone()
    earlier[:, 4] += 1.0  # the last context position block 0 may see
    moved = drafter.training_hidden(earlier, make_blocks(ids, mask, anchors, drafter.config), embed)
    assert not torch.allclose(moved[:, 0], base[:, 0])


WINDOWED = dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"])


def test_each_row_scored_against_its_own_block_is_sdpa_under_the_dense_mask():
    """own_block_attend (the dense training path) computes what SDPA computes under
    block_visibility's mask, at the cost of its own block instead of every block's keys."""
    from torch.nn import functional as F

    from draftsmith.models.dflash import own_block_attend

    g = torch.Generator().manual_seed(0)
    anchors, context, size = torch.tensor([[3, 9, 14], [5, 11, -1]]), 16, 4
    visible = block_visibility(anchors.clamp_min(0), context, size)
    q = torch.randn(2, 3, 12, 8, generator=g)
    k, v = (torch.randn(2, 3, context + 12, 8, generator=g) for _ in range(2))
    torch.testing.assert_close(own_block_attend(q, k, v, visible, size, 8**-0.5),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=8**-0.5),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", [{}, WINDOWED], ids=["full", "sliding"])
def test_training_blocks_equal_decoding_blocks(target, layers):
    # Same keys, positions and inputs: a training block of anchor a is the decode step
    # whose cache holds the context of positions 0 .. a - 1.
    drafter = drafter_for(target, **layers)
    embed = target.get_input_embeddings()
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(1))
    feats = features(target, ids, drafter.config.target_layer_ids)
    anchors = torch.tensor([[3, 11]])
    train = drafter.training_hidden(feats, make_blocks(ids, torch.ones_like(ids), anchors, drafter.config), embed)
    for i, a in enumerate(anchors[0].tolist()):
        cache = ContextCache()
        cache.extend(drafter, feats[:, :2], 0)
        cache.extend(drafter, feats[:, 2:a], 2)  # built in two commits, as the decoder does
        decode = drafter.decode_hidden(ids[:, a], cache, embed)
        torch.testing.assert_close(train[:, i], decode, rtol=1e-5, atol=1e-5)


def test_a_sliding_layer_reads_the_window_before_its_anchor_alone(target):
    """method.sliding_window: the keys more than the window before a block's anchor change
    nothing in an all-sliding drafter, and do in a full-attention one; flex reads the same."""
    embed = target.get_input_embeddings()
    ids = torch.randint(0, MASK, (1, 24), generator=torch.Generator().manual_seed(0))
    feats = features(target, ids, [1, 3])
    anchors = torch.tensor([[9, 17]])
    far, near = feats.clone(), feats.clone()
    far[:, 17 - 5 - 1] += 1.0  # one position before block 1's window of 5 (positions 12..16)
    near[:, 17 - 5] += 1.0  # its first
    for window, moved in ((5, False), (0, True)):
        drafter = drafter_for(target, sliding_window=window)
        blocks = make_blocks(ids, torch.ones_like(ids), anchors, drafter.config)
        base, changed, inside = (drafter.training_hidden(f, blocks, embed) for f in (feats, far, near))
        assert torch.equal(changed[:, 1], base[:, 1]) is not moved
        assert not torch.equal(inside[:, 1], base[:, 1])
        drafter.config.attention_backend = "flex"
        with torch.no_grad():
            torch.testing.assert_close(drafter.training_hidden(far, blocks, embed), changed, rtol=1e-5, atol=1e-5)


def test_anchors_are_random_distinct_supervised_and_reproducible():
    mask = torch.zeros(2, 30, dtype=torch.long)
    mask[0, 10:] = 1
    mask[1, 25:] = 1
    anchors = sample_anchors(mask, 8, torch.Generator().manual_seed(3))
    again = sample_anchors(mask, 8, torch.Generator().manual_seed(3))
    assert torch.equal(anchors, again) and anchors.shape == (2, 8)
    row0 = anchors[0].tolist()
    assert len(set(row0)) == 8 and all(10 <= a <= 28 for a in row0) and row0 == sorted(row0)
    assert sorted(anchors[1].tolist()) == [-1, -1, -1, -1, 25, 26, 27, 28]  # 4 valid, the rest padding


def test_labels_and_conditional_accuracy():
    config = SimpleNamespace(drafts_per_block=3, block_size=4, mask_token_id=MASK)
    ids = torch.arange(10)[None]
    mask = torch.ones_like(ids)
    mask[0, 8] = 0  # a label that leaves the data ends the supervised prefix
    blocks = make_blocks(ids, mask, torch.tensor([[1, 5, -1]]), config)
    assert blocks.labels[0, 0].tolist() == [2, 3, 4] and blocks.input_ids[0, 0].tolist() == [1, MASK, MASK, MASK]
    assert blocks.label_mask[0].tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert blocks.positions[0, 1].tolist() == [5, 6, 7, 8]
    predicted = blocks.labels.clone()
    predicted[0, 0, 1] = 0  # block 0 misses draft 2
    metrics = greedy_metrics(predicted, blocks)
    # acc_1 = 2/2, acc_2 = 1/2 (block 1), acc_3: no block reached draft 3 with a match
    assert metrics["acc_1"] == 1.0 and metrics["acc_2"] == 0.5 and metrics["acc_3"] == 0.0
    assert metrics["tau_est"] == 2.5


# ---------------------------------------------------------------- training

def alternating_batch(generator, batch=8, length=32):
    """a b a b ...: each draft is the token two places back, which the context holds."""
    pair = torch.randint(0, MASK, (batch, 2), generator=generator)
    ids = pair[:, torch.arange(length) % 2]
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    return ids, mask


def test_position_ce_is_the_mean_of_each_draft_positions_loss():
    ce = torch.tensor([[[1.0, 2.0, 4.0], [3.0, 6.0, 0.0]]])  # [B=1, N=2, drafts=3]
    mask = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]])  # the second block's last draft is unsupervised
    assert position_means("ce", ce, mask) == {"ce_1": 2.0, "ce_2": 4.0, "ce_3": 4.0}


def test_loss_goes_down_on_online_features():
    target = tiny_target()
    with torch.no_grad():  # a head that reads the embedding space, as a trained LM's does
        target.lm_head.weight.copy_(target.model.embed_tokens.weight * 5)
    drafter = drafter_for(target, num_anchors=16, block_size=4).train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    data, anchors = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    losses, acc = [], []
    for _ in range(30):
        ids, mask = alternating_batch(data)
        with torch.no_grad():
            feats = features(target, ids, drafter.config.target_layer_ids)
        loss, metrics = drafter.loss(feats, ids, mask, target.get_input_embeddings(),
                                     target.get_output_embeddings(), anchors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        acc.append(metrics["acc_1"])
        if len(losses) == 1:
            first = metrics
    assert set(metrics) == {"ce", "acc_1", "acc_2", "acc_3", "tau_est", "ce_1", "ce_2", "ce_3"}
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5])
    assert metrics["ce_1"] < 0.8 * first["ce_1"]  # per position too
    assert sum(acc[-5:]) > sum(acc[:5]) + 0.5


# ---------------------------------------------------------------- formats

def block_logits(drafter, target, prompt):
    """The head's logits of the first block after `prompt`: equal logits, equal drafts."""
    feats = features(target, prompt[None, :-1], drafter.config.target_layer_ids)
    cache = ContextCache()
    cache.extend(drafter, feats, 0)
    with torch.no_grad():
        return target.get_output_embeddings()(drafter.decode_hidden(prompt[-1:], cache, target.get_input_embeddings()))


def test_zlab_export_has_the_reference_layout_and_reloads_bit_identical(target, tmp_path):
    drafter = drafter_for(target)
    export_dflash_zlab(drafter, tmp_path / "zlab")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": MASK, "block_size": 6}
    assert config["block_size"] == 6 and config["num_target_layers"] == 6 and config["num_hidden_layers"] == 2
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_parameters", "vocab_size", "tie_word_embeddings"):
        assert key in config
    H, hd = 64, 16
    expected = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        p = f"layers.{i}."
        expected.update({p + "self_attn.q_proj.weight": (4 * hd, H), p + "self_attn.k_proj.weight": (2 * hd, H),
                         p + "self_attn.v_proj.weight": (2 * hd, H), p + "self_attn.o_proj.weight": (H, 4 * hd),
                         p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                         p + "mlp.gate_proj.weight": (192, H), p + "mlp.up_proj.weight": (192, H),
                         p + "mlp.down_proj.weight": (H, 192), p + "input_layernorm.weight": (H,),
                         p + "post_attention_layernorm.weight": (H,)})
    with safe_open(str(tmp_path / "zlab" / "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected

    prompt = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2))
    before = block_logits(drafter, target, prompt)
    save_drafter(drafter, tmp_path / "native")
    for reloaded in (read(tmp_path / "zlab"), load_drafter(tmp_path / "native", "dflash"),
                     load_proposer(tmp_path / "native", target).drafter):
        assert type(reloaded) is DFlashDrafter
        assert torch.equal(block_logits(reloaded, target, prompt), before)


# ---------------------------------------------------------------- lossless decoding

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_speculative_output_equals_target_generate(arch):
    target = tiny_target(arch)
    drafter = drafter_for(target)
    prompt = torch.randint(0, MASK, (10,), generator=torch.Generator().manual_seed(4))
    expected = target.generate(prompt[None], max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    decoder = SpeculativeDecoder(target, DFlashProposer(drafter, target), num_draft=5, eos_token_id=())
    result = decoder.generate(prompt, 30)
    assert result.tokens.tolist() == expected[0, 10:].tolist()
    sampled = decoder.generate(prompt, 30, SamplingParams(temperature=0.8, top_k=20), torch.Generator().manual_seed(0))
    assert len(sampled.tokens) == 30 and sampled.stats.tau >= 1.0
