"""DSpark: the refiner (off == backbone, teacher-forced == left to right), building on a
DFlash backbone, the loss, the confidence head's early stop, exports and lossless decoding."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from decoding_helpers import begin_like_decoder
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.base import GREEDY, SamplingParams
from draftsmith.eval.proposers.dflash import DFlashProposer
from draftsmith.eval.proposers.dflash import load_proposer as load_dflash
from draftsmith.eval.proposers.dspark import DSparkProposer
from draftsmith.eval.proposers.dspark import load_proposer as load_dspark
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter, concat_layers
from draftsmith.models.dspark import (
    ANCHOR_IS_CONTEXT,
    ANCHOR_IS_FIRST_PREDICTION,
    DSparkConfig,
    DSparkDrafter,
)
from draftsmith.models.formats import dflash as dflash_formats
from draftsmith.models.formats import dspark as dspark_formats
from draftsmith.models.formats.dflash import export_dflash_zlab
from draftsmith.models.formats.dspark import export_dspark_deepspec, export_dspark_specforge
from draftsmith.models.native import load_drafter, save_drafter
from draftsmith.models.target import build_tiny_target, target_forward
from tiny_models import MASK, VOCAB, dspark_for, tiny_target


def with_trained_refiner(drafter: DSparkDrafter) -> DSparkDrafter:
    """Give W1 and W2 weights large enough (they start at N(0, 0.02)) that the refiner changes drafts."""
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_(std=1.0)
        drafter.markov_head.markov_w2.weight.normal_(std=0.5)
    return drafter


def features(target, ids, layer_ids):
    out = target_forward(target, ids, capture=layer_ids)
    return concat_layers(out.hidden, layer_ids), out.logits


def first_block(adapter, target, prompt):
    """Start `adapter` on `prompt` the way the decoder does; the prediction-slot hidden
    states and head logits of its first block."""
    begin_like_decoder(adapter, target, prompt)
    with torch.no_grad():
        return adapter.draft_block(adapter.drafter.drafts_per_block)


def test_config_convention_and_block_size():
    qwen3_8b = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, num_hidden_layers=36,
                               vocab_size=151936, intermediate_size=12288)
    config = DSparkConfig.from_target(qwen3_8b, mask_token_id=151669)
    assert config.block_convention == ANCHOR_IS_FIRST_PREDICTION and config.first_prediction_slot == 0
    # D = 31 by the tile rule, the anchor predicting; auto stops at 16, the largest published block.
    assert config.block_size == config.drafts_per_block == 16 and config.gamma == 7.0
    assert config.markov_rank == 256 and (config.ce_weight, config.tv_weight, config.bce_weight) == (0.1, 0.9, 1.0)
    with pytest.raises(DraftsmithError, match="block_convention 'anchor_last'"):
        DSparkConfig.from_target(qwen3_8b, mask_token_id=0, block_convention="anchor_last")
    with pytest.warns(UserWarning, match="block_size 32 gives 32 drafts"):
        DSparkConfig.from_target(qwen3_8b, mask_token_id=0, block_size=32)


def test_refiner_off_gives_the_backbone_drafts(target):
    drafter = with_trained_refiner(dspark_for(target))
    hidden, base = first_block(DSparkProposer(drafter, target), target, torch.arange(3, 14))
    anchor = torch.tensor([13])
    pick = lambda logits, k: logits.argmax(-1)  # noqa: E731
    off, off_logits, _ = drafter.refine(hidden, base, anchor, pick, refiner=False)
    on, _, _ = drafter.refine(hidden, base, anchor, pick, refiner=True)
    assert torch.equal(off[0], base[0].argmax(-1)) and torch.equal(off_logits, base)
    assert not torch.equal(on, off)


def test_a_dspark_on_a_frozen_dflash_backbone_starts_with_its_drafts(target):
    dflash = DFlashDrafter(DFlashConfig.from_target(target.config, mask_token_id=MASK, num_layers=2, block_size=6))
    dspark = DSparkDrafter.from_dflash(dflash, freeze_backbone=True, markov_rank=8)
    assert dspark.config.block_convention == ANCHOR_IS_CONTEXT and dspark.drafts_per_block == dflash.drafts_per_block
    trainable = {name for name, p in dspark.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith(("markov_head.", "confidence_head.")) for name in trainable)
    prompt = torch.arange(5, 17)
    expected = first_block(DFlashProposer(dflash, target), target, prompt)[1][0].argmax(-1)
    adapter = DSparkProposer(dspark, target, confidence_threshold=0.0)
    first_block(adapter, target, prompt)
    assert torch.equal(adapter.propose(5, GREEDY, None).tokens, expected)  # W2 = 0: the refiner is a no-op
    with pytest.raises(DraftsmithError, match="frozen DFlash backbone"):
        DSparkDrafter.from_dflash(dflash, freeze_backbone=True, block_convention=ANCHOR_IS_FIRST_PREDICTION)
    unfrozen = DSparkDrafter.from_dflash(dflash)
    assert unfrozen.config.block_size == dflash.drafts_per_block  # same drafts, the anchor predicting
    assert torch.equal(unfrozen.fc.weight, dflash.fc.weight)


def test_teacher_forced_training_logits_equal_left_to_right_decoding(target):
    drafter = with_trained_refiner(dspark_for(target))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    ids = torch.randint(0, MASK, (2, 20), generator=torch.Generator().manual_seed(0))
    feats, _ = features(target, ids, drafter.config.target_layer_ids)
    blocks = drafter.sample_blocks(ids, torch.ones_like(ids), torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = drafter.training_hidden(feats, blocks, embed)  # [B, N, drafts, H]
        base = head(hidden)
        parallel = drafter.refined_logits(base, blocks.prev_tokens)
        flat = lambda t: t.flatten(0, 1)  # noqa: E731
        true_tokens = flat(blocks.labels)
        tokens, serial, _ = drafter.refine(flat(hidden), flat(base), flat(blocks.prev_tokens)[:, 0],
                                           lambda logits, k: true_tokens[:, k])
    assert torch.equal(tokens, true_tokens)
    torch.testing.assert_close(serial, flat(parallel), rtol=0, atol=1e-6)


def test_loss_parts_and_a_frozen_backbone_training_only_the_heads(target):
    dflash = DFlashDrafter(DFlashConfig.from_target(target.config, mask_token_id=MASK, num_layers=2, block_size=5,
                                                    num_anchors=8))
    drafter = DSparkDrafter.from_dflash(dflash, freeze_backbone=True, markov_rank=8).train()
    backbone = {k: v.clone() for k, v in drafter.state_dict().items() if not k.startswith(("markov", "confidence"))}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    data, anchors = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    losses = []
    for _ in range(12):
        pair = torch.randint(0, MASK, (4, 2), generator=data)
        ids = pair[:, torch.arange(24) % 2]
        with torch.no_grad():
            feats, logits = features(target, ids, drafter.config.target_layer_ids)
        loss, metrics = drafter.loss(feats, ids, torch.ones_like(ids), target.get_input_embeddings(),
                                     target.get_output_embeddings(), logits, anchors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    expected = 0.1 * metrics["ce"] + 0.9 * metrics["tv"] + 1.0 * metrics["bce"]
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert {"acc_1", "acc_4", "tau_est", "tau_prob", "conf_err"} <= set(metrics)
    assert 0.0 <= metrics["tv"] <= 2.0 and 1.0 <= metrics["tau_prob"] <= 5.0
    assert sum(losses[-3:]) < sum(losses[:3])
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in backbone.items())
    assert drafter.markov_head.markov_w2.weight.abs().sum() > 0


def test_joint_training_reaches_the_backbone_and_heads_start_as_deepspec(target):
    """DeepSpec trains backbone and heads together from scratch; its post_init leaves W1 and W2
    at N(0, 0.02) (nn.Embedding alone would give W1 N(0, 1)). On a trained backbone the
    refiner starts at W2 = 0 instead, leaving the backbone's drafts as they were."""
    torch.manual_seed(0)
    drafter = dspark_for(target, markov_rank=64, num_anchors=8).train()
    assert drafter.markov_head.markov_w1.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert drafter.markov_head.markov_w2.weight.std().item() == pytest.approx(0.02, rel=0.1)
    ids = torch.randint(0, MASK, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats, logits = features(target, ids, drafter.config.target_layer_ids)
    loss, _ = drafter.loss(feats, ids, torch.ones_like(ids), target.get_input_embeddings(),
                           target.get_output_embeddings(), logits, torch.Generator().manual_seed(2))
    loss.backward()
    assert drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0  # the TV and CE terms reach it
    dflash = DFlashDrafter(DFlashConfig.from_target(target.config, mask_token_id=MASK, num_layers=2, block_size=5))
    assert DSparkDrafter.from_dflash(dflash, markov_rank=8).markov_head.markov_w2.weight.abs().sum() == 0


def test_markov_rank_0_is_deepspecs_dflash(target, tmp_path):
    """DeepSpec's config/dflash/dflash_qwen3_8b.py: markov_rank 0, CE only, the anchor slot
    predicting draft 1. No refiner; it trains, decodes losslessly and round-trips its export."""
    drafter = dspark_for(target, markov_rank=0, tv_weight=0.0, bce_weight=0.0, ce_weight=1.0, num_anchors=8)
    assert drafter.markov_head is None and drafter.drafts_per_block == 5
    ids = torch.randint(0, MASK, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats, logits = features(target, ids, drafter.config.target_layer_ids)
    loss, metrics = drafter.train().loss(feats, ids, torch.ones_like(ids), target.get_input_embeddings(),
                                         target.get_output_embeddings(), logits, torch.Generator().manual_seed(2))
    assert loss.item() == pytest.approx(metrics["ce"], rel=1e-6)
    drafter.eval()
    prompt = torch.randint(0, MASK, (10,), generator=torch.Generator().manual_seed(4))
    expected = target.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    decoder = SpeculativeDecoder(target, DSparkProposer(drafter, target), num_draft=5, eos_token_id=())
    assert decoder.generate(prompt, 20).tokens.tolist() == expected[0, 10:].tolist()
    export_dspark_deepspec(drafter, tmp_path / "ds", target)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["markov_rank"] == 0 and config["confidence_head_with_markov"] is False
    again = load_dspark(tmp_path / "ds", target)
    assert again.drafter.markov_head is None
    hidden, base = first_block(DSparkProposer(drafter, target), target, prompt)
    hidden2, base2 = first_block(again, target, prompt)
    assert torch.equal(base.argmax(-1), base2.argmax(-1))


def test_stop_rule_on_a_hand_worked_block(target):
    """DeepSpec's rule: keep the drafts before the first position whose *own* confidence is
    below the threshold. Confidences .9 .6 .7 .2 at threshold .5 keep 3 drafts (the old
    running product .9 .54 .378 would have kept 2); threshold 0 keeps all; 1 keeps none."""
    drafter = dspark_for(target, block_size=6)
    prompt = torch.randint(0, MASK, (8,), generator=torch.Generator().manual_seed(3))
    for threshold, kept in ((0.5, 3), (0.65, 1), (0.0, 5), (1.0, 0)):
        proposer = scripted_confidence(DSparkProposer(drafter, target, confidence_threshold=threshold),
                                       [0.9, 0.6, 0.7, 0.2, 0.95])
        first_block(proposer, target, prompt)
        assert len(proposer.propose(5, GREEDY, None)) == kept, threshold
    assert DSparkConfig.confidence_threshold == 0.0  # the reference's default: the full block


def scripted_confidence(proposer, sigmoids):
    """Make the confidence head say `sigmoids[k]` at position k of every block."""
    logits, position = torch.logit(torch.tensor(sigmoids)), [0]
    block = proposer.draft_block

    def draft_block(max_nodes):
        position[0] = 0
        return block(max_nodes)

    def confidence(hidden, prev):
        position[0] += 1
        return logits[position[0] - 1].expand(hidden.shape[0])

    proposer.draft_block, proposer.drafter.confidence_logits = draft_block, confidence
    return proposer


def test_confidence_head_ends_drafts_early_and_counts_the_rows_saved(target):
    drafter = dspark_for(target, block_size=6)
    prompt = torch.randint(0, MASK, (8,), generator=torch.Generator().manual_seed(3))
    expected = target.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    script = [0.9, 0.6, 0.7, 0.2, 0.95, 0.9]
    stopping = scripted_confidence(DSparkProposer(drafter, target, confidence_threshold=0.5), script)
    first_block(stopping, target, prompt)
    assert len(stopping.propose(6, GREEDY, None)) == 3  # the hand-worked block above
    stopping = scripted_confidence(DSparkProposer(drafter, target, confidence_threshold=0.5), script)
    decoder = SpeculativeDecoder(target, stopping, num_draft=6, eos_token_id=())
    result = decoder.generate(prompt, 20)
    assert result.tokens.tolist() == expected[0, 8:].tolist()
    stats = stopping.report_extra()
    assert stats["confidence_threshold"] == 0.5
    # Every block of 6 ends after 3 drafts; near the token limit the decoder asks for fewer.
    assert stats["early_stops"] == stats["proposals"] > 0
    assert 3 * (stats["proposals"] - 2) <= stats["verify_rows_saved"] <= 3 * stats["proposals"]
    full = scripted_confidence(DSparkProposer(drafter, target), script)  # the checkpoint's threshold, 0: never stops
    SpeculativeDecoder(target, full, num_draft=6, eos_token_id=()).generate(prompt, 20)
    assert full.report_extra()["early_stops"] == 0 and full.report_extra()["verify_rows_saved"] == 0


def test_calibration_records_pair_each_verified_draft_with_its_accepted_drafts(target):
    """`eval --num-draft auto` records, per verify pass, the whole block's confidences (the
    checkpoint's threshold set aside) and the drafts the pass kept; a sequence's last draft,
    never committed (the token limit ended it), is dropped, not paired with the next
    sequence's prefill."""
    proposer = DSparkProposer(with_trained_refiner(dspark_for(target, block_size=6)), target,
                              confidence_threshold=0.9)
    proposer.confidence_records = records = []
    decoder = SpeculativeDecoder(target, proposer, num_draft=6, eos_token_id=())
    results = [decoder.generate(torch.randint(0, MASK, (8,), generator=torch.Generator().manual_seed(seed)), 20)
               for seed in (3, 4)]
    passes = sum(r.stats.verify_passes for r in results)
    assert len(records) == passes - len(results)  # every pass but each sequence's last
    block = proposer.drafter.drafts_per_block
    assert block == 6 and all(len(confidences) == block for confidences, _ in records)  # whole blocks, not cut at 0.9
    assert sum(kept for _, kept in records) <= sum(r.stats.committed - r.stats.verify_passes for r in results)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan")])
def test_a_threshold_outside_0_1_is_one_line(target, threshold):
    drafter = dspark_for(target)
    for call in (lambda: DSparkProposer(drafter, target, confidence_threshold=threshold),
                 lambda: DSparkConfig.from_target(target.config, mask_token_id=MASK, confidence_threshold=threshold)):
        with pytest.raises(DraftsmithError, match="must be in \\[0, 1\\], got") as caught:
            call()
        assert "\n" not in str(caught.value)


def test_dspark_export_layout_reload_and_confusion_errors(target, tmp_path):
    drafter = with_trained_refiner(dspark_for(target))
    export_dspark_specforge(drafter, tmp_path / "dspark")
    config = json.loads((tmp_path / "dspark" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"]
    assert config["draftsmith"]["block_convention"] == ANCHOR_IS_FIRST_PREDICTION
    nested = config["dflash_config"]  # SpecForge reads the heads' settings here (tests/test_exports.py)
    assert nested["target_layer_ids"] == [1, 3] and nested["mask_token_id"] == MASK and nested["block_size"] == 5
    assert nested["markov_rank"] == 8 and nested["markov_head_type"] == "vanilla"
    assert nested["enable_confidence_head"] and nested["confidence_head_with_markov"]
    with safe_open(str(tmp_path / "dspark" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: v for k, v in shapes.items() if k.startswith(("markov", "confidence"))} == {
        "markov_head.markov_w1.weight": (VOCAB, 8), "markov_head.markov_w2.weight": (VOCAB, 8),
        "confidence_head.proj.weight": (1, 64 + 8), "confidence_head.proj.bias": (1,)}
    assert "fc.weight" in shapes and "layers.1.self_attn.k_norm.weight" in shapes and len(shapes) == 4 + 3 + 2 * 11

    prompt = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2))

    def drafts(model):
        adapter = DSparkProposer(model, target, confidence_threshold=0.0)
        first_block(adapter, target, prompt)
        return adapter.propose(5, GREEDY, None).tokens, adapter.draft_block(5)[1]

    save_drafter(drafter, tmp_path / "native")
    before = drafts(drafter)
    for reloaded in (dspark_formats.read(tmp_path / "dspark"), load_drafter(tmp_path / "native", "dspark"),
                     load_dspark(tmp_path / "dspark", target).drafter):
        after = drafts(reloaded)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])

    dflash = DFlashDrafter(DFlashConfig.from_target(target.config, mask_token_id=MASK, num_layers=2, block_size=6))
    export_dflash_zlab(dflash, tmp_path / "dflash")
    save_drafter(dflash, tmp_path / "dflash-native")
    narrow = build_tiny_target(vocab_size=VOCAB, num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=2)
    for call, match in (
        (lambda: dflash_formats.read(tmp_path / "dspark"), "holds a dspark drafter, not dflash .*as dspark:"),
        (lambda: dspark_formats.read(tmp_path / "dflash"), "holds a dflash drafter, not dspark .*as dflash:"),
        (lambda: load_drafter(tmp_path / "native", "dflash"), "holds a dspark drafter, not dflash"),
        (lambda: load_drafter(tmp_path / "dflash-native", "dspark"), "holds a dflash drafter, not dspark"),
        (lambda: load_dflash(tmp_path / "native", target), "holds a dspark drafter, not dflash"),
        (lambda: load_dspark(tmp_path / "dflash", target), "holds a dflash drafter, not dspark"),
        (lambda: load_dflash(tmp_path / "dflash", narrow), "hidden size 64, the target has 32"),
        (lambda: export_dflash_zlab(drafter, tmp_path / "x"), "this is a dspark drafter"),
        (lambda: export_dspark_specforge(dflash, tmp_path / "x"), "this is a dflash drafter"),
    ):
        with pytest.raises(DraftsmithError, match=match) as caught:
            call()
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_speculative_output_equals_target_generate(arch):
    target = tiny_target(arch)
    prompt = torch.randint(0, MASK, (10,), generator=torch.Generator().manual_seed(4))
    expected = target.generate(prompt[None], max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    for convention in (ANCHOR_IS_FIRST_PREDICTION, ANCHOR_IS_CONTEXT):
        drafter = with_trained_refiner(dspark_for(target, block_convention=convention))
        decoder = SpeculativeDecoder(target, DSparkProposer(drafter, target), num_draft=5, eos_token_id=())
        assert decoder.generate(prompt, 30).tokens.tolist() == expected[0, 10:].tolist()
    sampled = decoder.generate(prompt, 30, SamplingParams(temperature=0.8, top_p=0.9), torch.Generator().manual_seed(0))
    assert len(sampled.tokens) == 30


def test_eval_sets_the_threshold_per_run_and_refuses_one_outside_0_1(target, tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.eval.proposers import proposer_from_arg

    drafter = dspark_for(target, confidence_threshold=0.2)
    save_drafter(drafter, tmp_path / "native")
    assert proposer_from_arg(f"dspark:{tmp_path / 'native'}", target).confidence_threshold == 0.2  # the checkpoint's
    chosen = proposer_from_arg(f"dspark:{tmp_path / 'native'}", target, {"dspark": {"confidence_threshold": 0.0}})
    assert chosen.confidence_threshold == 0.0 and chosen.report_extra()["confidence_threshold"] == 0.0
    code = main(["eval", "--target", str(tmp_path), "--drafter", f"dspark:{tmp_path / 'native'}",
                 "--confidence-threshold", "1.5", "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "draftsmith: error: --confidence-threshold must be in [0, 1], got 1.5"
    assert not (tmp_path / "report").exists()
