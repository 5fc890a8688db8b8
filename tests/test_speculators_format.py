"""The speculators layout (models/formats/speculators.py and each method's formats module) against its reference reader and writer:
vLLM's `speculators` library 0.9.0 (PyPI, pure Python, installed without its dependencies as the
Makefile's PARITY_SPEC does; its model files import on CPU with torch, transformers, pydantic and
loguru). Our export loads through its own config and model classes (`SpeculatorModelConfig`,
`SpeculatorModel.from_pretrained`: the config validates, every weight it expects is in the file
and nothing else) and its forward on identical inputs equals ours; a drafter built and saved by
its classes reads back here and drafts the same. What vLLM makes of the config is restated from
vllm 0.33.0 (PyPI wheel) vllm/transformers_utils/configs/speculators/algos.py and base.py.
Nothing of theirs is copied here; without the package these tests fail, naming the install."""

import json

import pytest
import torch

from draftsmith.eval.proposers import proposer_from_arg
from draftsmith.models.dspark import ANCHOR_IS_CONTEXT
from draftsmith.models.eagle3 import DraftKV
from draftsmith.models.export import export_notes, export_run
from draftsmith.models.native import save_drafter
from reference_impls import reference_model, speculators
from tiny_models import (
    MASK,
    VOCAB,
    WINDOWED,
    assert_same_drafts,
    dflash,
    drafts,
    dspark,
    eagle3,
    mtp_run,
    one_line_error,
)


def exported(drafter, target_dir, tmp_path, name="d"):
    native = save_drafter(drafter, tmp_path / f"{name}-native", extra={"target": str(target_dir)})
    return native, export_run(native, "speculators", tmp_path / f"{name}-spec")


# ---------------------------------------------------------------- vLLM's mapping, restated

def vllm_reads(config: dict) -> tuple[dict, dict]:
    """(the drafter's config vLLM builds, its speculative config) from a speculators
    config.json, as vllm 0.33.0 does it: base.py `extract_vllm_speculative_config` (method =
    speculators_model_type, num_speculative_tokens = proposal_methods[0].speculative_tokens)
    and algos.py's updaters (eagle3: norm_before_residual read with default True, the capture
    ids unchanged; dflash: eagle_aux = aux, dflash_config.target_layer_ids = aux - 1,
    sample_from_anchor default False; dspark: dspark_bonus_anchor = not sample_from_anchor
    (default False), eagle_aux = aux, target_layer_ids = aux - 1). transformers_utils/config.py
    takes the folder as a speculators one only when it has no top-level model_type."""
    assert "model_type" not in config and config.get("speculators_config") is not None
    kind = config["speculators_model_type"]
    spec = {"method": kind, "num_speculative_tokens": config["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"]}
    out = dict(config["transformer_layer_config"])
    aux = config.get("aux_hidden_state_layer_ids")
    if kind == "eagle3":
        out["norm_before_residual"] = config.get("norm_before_residual", True)
        out["eagle_aux_hidden_state_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
        out["architectures"] = [{"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}[
            out.get("model_type", "llama")]]
    elif kind == "dflash":
        out["eagle_aux_hidden_state_layer_ids"] = aux
        out["dflash_config"] = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                                "sample_from_anchor": config.get("sample_from_anchor", False)}
    elif kind == "dspark":
        out["dspark_bonus_anchor"] = not config.get("sample_from_anchor", False)
        out["eagle_aux_hidden_state_layer_ids"] = aux
        out["target_layer_ids"] = [i - 1 for i in aux]
        out.update({k: config[k] for k in ("markov_rank", "block_size", "mask_token_id") if k in config})
    return out, spec


def test_vllm_reads_our_exports_with_our_layers_convention_and_drafts(target, target_dir, tmp_path):
    cases = {"eagle3": eagle3(target), "dflash": dflash(target), "dspark": dspark(target),
             "dspark_context": dspark(target, block_convention=ANCHOR_IS_CONTEXT, block_size=6)}
    for name, drafter in cases.items():
        _, out = exported(drafter, target_dir, tmp_path, name)
        config = json.loads((out / "config.json").read_text())
        engine, spec = vllm_reads(config)
        ids = list(drafter.config.target_layer_ids)
        assert spec["method"] == name.split("_")[0]
        assert engine["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # captured: output of layer id
        assert config["speculators_config"]["verifier"] == {"name_or_path": str(target_dir.resolve()),
                                                            "architectures": ["Qwen3ForCausalLM"]}
        if name == "eagle3":
            assert engine["norm_before_residual"] is False  # written: vLLM's default would be True
            continue
        assert spec["num_speculative_tokens"] == drafter.drafts_per_block
        if name == "dflash":
            assert engine["dflash_config"]["target_layer_ids"] == ids and not engine["dflash_config"]["sample_from_anchor"]
        else:
            assert engine["target_layer_ids"] == ids
            assert engine["dspark_bonus_anchor"] is (drafter.config.block_convention == ANCHOR_IS_CONTEXT)


# ---------------------------------------------------------------- our exports in their classes

def block_inputs(target, drafter, anchor=7, length=16, seed=0):
    """A sequence whose one loss-masked position is the anchor (speculators' select_anchors
    then has one choice), its context features and the block's embeddings."""
    gen = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * drafter.config.target_hidden_size
    feats = torch.randn(1, length, width, generator=gen)
    ids = torch.randint(0, MASK, (1, length), generator=gen)
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, anchor] = 1
    size = drafter.config.block_size
    block = torch.tensor([[int(ids[0, anchor])] + [MASK] * (size - 1)])
    return feats, ids, loss_mask, target.get_input_embeddings()(block)


def same_backbone(model, drafter, target, size: int, anchor: int = 7):
    """speculators' block forward at one anchor against ours on the same inputs: equal hidden
    states; returns (their hidden states, their logits, ours, the input ids)."""
    feats, ids, loss_mask, embeds = block_inputs(target, drafter, anchor)
    with torch.no_grad():
        hidden, logits, _, _, _ = model._backbone_forward(
            feats, ids, loss_mask, torch.randn(1, ids.shape[1], 64), torch.zeros_like(ids), max_anchors=1)
        context, block = torch.arange(anchor)[None], torch.arange(anchor, anchor + size)[None]
        ours = drafter(embeds, block, drafter.context_kv(feats[:, :anchor], context),
                       drafter.layer_masks(None, context, block))
    torch.testing.assert_close(hidden, ours, rtol=1e-5, atol=1e-5)
    return hidden, logits, ours, ids


@pytest.mark.parametrize("kind", ["dflash", "dflash_window", "dspark", "dspark_context"])
def test_block_exports_run_in_speculators_as_ours(kind, target, target_dir, tmp_path):
    drafter = {"dflash": lambda: dflash(target), "dflash_window": lambda: dflash(target, **WINDOWED),
               "dspark": lambda: dspark(target, block_size=6),
               "dspark_context": lambda: dspark(target, block_convention=ANCHOR_IS_CONTEXT, block_size=6)}[kind]()
    _, out = exported(drafter, target_dir, tmp_path, kind)
    model = reference_model(out)
    assert list(model.target_layer_ids) == [i + 1 for i in drafter.config.target_layer_ids]
    anchor, size = 7, drafter.config.block_size
    hidden, logits, ours, ids = same_backbone(model, drafter, target, size, anchor)
    with torch.no_grad():
        head = target.get_output_embeddings()
        torch.testing.assert_close(logits, head(ours), rtol=1e-5, atol=1e-5)  # the verifier's head, reloaded
        if kind.startswith("dflash"):
            return
        # Their heads read the previous block token as their sample_from_anchor says; ours by convention.
        block_tokens = ids[:, anchor:anchor + size]
        prev = block_tokens if model.config.sample_from_anchor else torch.cat([block_tokens[:, :1],
                                                                                block_tokens[:, :-1]], 1)
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden)
        torch.testing.assert_close(logits + bias, drafter.refined_logits(head(ours), prev), rtol=1e-5, atol=1e-5)
        features = torch.cat([hidden, model.markov_head.prev_embeddings(prev)], -1)
        torch.testing.assert_close(model.confidence_head(features), drafter.confidence_logits(ours, prev),
                                   rtol=1e-5, atol=1e-5)
    assert model.config.sample_from_anchor is (drafter.first_prediction_slot == 0)


def same_eagle3_logits(model, drafter, length: int = 8) -> None:
    """speculators' EAGLE-3 forward (one TTT step) and our drafter step give the same logits."""
    feats = torch.randn(1, length, 3 * 64, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, MASK, (1, length), generator=torch.Generator().manual_seed(2))
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad():
        model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(length)[None], ttt_steps=1)
        hidden = drafter.step(ids, drafter.fuse(feats), torch.arange(length)[None], DraftKV())
        torch.testing.assert_close(captured[0], drafter.logits(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 5], ids=["full", "sliding"])
def test_eagle3_export_runs_in_speculators_as_ours(window, target, target_dir, tmp_path):
    drafter = eagle3(target, sliding_window=window)
    _, out = exported(drafter, target_dir, tmp_path, "eagle3")
    model = reference_model(out)
    assert model.config.norm_before_residual is False and model.draft_vocab_size == 96
    assert torch.equal(model.d2t, drafter.d2t) and torch.equal(model.t2d, drafter.t2d)
    same_eagle3_logits(model, drafter)


# ---------------------------------------------------------------- their folders read here

def their_config(lib, kind, target_dir, **fields):
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    layer_cls = LlamaConfig if kind == "eagle3" else Qwen3Config
    layer = layer_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1 if kind == "eagle3" else 2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      max_position_embeddings=256)
    layer._attn_implementation = "eager"
    verifier = lib.VerifierConfig(name_or_path=str(target_dir), architectures=["Qwen3ForCausalLM"])
    spec = lib.SpeculatorsConfig(algorithm=kind, verifier=verifier, default_proposal_method="greedy",
                                 proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=5)])
    cls = {"eagle3": lib.Eagle3SpeculatorConfig, "dflash": lib.DFlashSpeculatorConfig,
           "dspark": lib.DSparkSpeculatorConfig}[kind]
    return cls(transformer_layer_config=layer, speculators_config=spec, **fields)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_block_drafter_saved_by_speculators_reads_and_drafts_here(kind, target, target_dir, tmp_path):
    lib = speculators()
    fields = dict(draft_vocab_size=VOCAB, block_size=6, aux_hidden_state_layer_ids=[2, 5], mask_token_id=MASK)
    if kind == "dspark":
        fields.update(markov_rank=8)  # sample_from_anchor: the library's DSpark default (true)
    torch.manual_seed(3)
    model = {"dflash": lib.DFlashDraftModel, "dspark": lib.DSparkDraftModel}[kind](
        their_config(lib, kind, target_dir, **fields))
    model.load_verifier_weights()
    model.save_pretrained(tmp_path / "theirs")
    model.eval()
    proposer = proposer_from_arg(f"{kind}:{tmp_path / 'theirs'}", target)
    drafter = proposer.drafter
    assert drafter.config.target_layer_ids == [1, 4] and drafter.drafts_per_block == (6 if kind == "dspark" else 5)
    same_backbone(model, drafter, target, size=6)


def test_an_eagle3_drafter_saved_by_speculators_reads_and_drafts_here(target, target_dir, tmp_path):
    lib = speculators()
    torch.manual_seed(4)
    model = lib.Eagle3DraftModel(their_config(lib, "eagle3", target_dir, draft_vocab_size=VOCAB,
                                              norm_before_residual=False, eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    model.load_verifier_weights()
    with torch.no_grad():  # the library trains its own head from the verifier's: any values will do
        model.lm_head.weight.normal_(std=0.05)
    model.save_pretrained(tmp_path / "theirs")
    drafter = proposer_from_arg(f"eagle3:{tmp_path / 'theirs'}", target).drafter
    assert drafter.config.target_layer_ids == [1, 3, 4]
    same_eagle3_logits(model.eval(), drafter)


# ---------------------------------------------------------------- round trip, serve line, bad input

def test_speculators_exports_round_trip_and_print_the_vllm_line(target, target_dir, tmp_path):
    prompt = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2))
    for name, drafter in (("eagle3", eagle3(target)), ("dspark", dspark(target, block_convention=ANCHOR_IS_CONTEXT,
                                                                          block_size=6))):
        native, out = exported(drafter, target_dir, tmp_path, name)
        assert_same_drafts(f"{name}:{native}", f"{name}:{out}", target, prompt)
        notes = export_notes(native, "speculators", out)
        assert sum("local folder" in line for line in notes) == 1  # why the line names the target
        line = next(line.strip() for line in notes if line.strip().startswith("vllm serve"))
        assert line.startswith(f"vllm serve {target_dir} --dtype float32 --speculative-config")
        assert f'"method": "{name}"' in line and f'"model": "{out}"' in line
    # A verifier named by a hub id: vLLM reads the rest from the folder.
    config = json.loads((out / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-8B"
    (out / "config.json").write_text(json.dumps(config))
    assert f"  vllm serve {out} --dtype float32" in export_notes(native, "speculators", out)


def test_bad_speculators_input_is_one_line_and_writes_nothing(target, target_dir, tmp_path):
    _, out = exported(dspark(target), target_dir, tmp_path, "dspark")
    config = json.loads((out / "config.json").read_text())

    def variant(name, **changes):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").symlink_to(out / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    # An algorithm we do not train.
    peagle = variant("peagle", speculators_model_type="peagle")
    one_line_error(lambda: proposer_from_arg(f"dspark:{peagle}", target), "speculators_model_type 'peagle' is not")
    # A verifier that is not the --target.
    other = dict(config["speculators_config"], verifier={"name_or_path": "meta-llama/Llama-3.1-8B",
                                                         "architectures": ["LlamaForCausalLM"]})
    llama = variant("llama", speculators_config=other)
    one_line_error(lambda: proposer_from_arg(f"dspark:{llama}", target), "LlamaForCausalLM.*Qwen3ForCausalLM")
    # A block convention left unstated (speculators and vLLM default it two ways).
    unstated = variant("unstated")
    data = json.loads((unstated / "config.json").read_text())
    del data["sample_from_anchor"]
    (unstated / "config.json").write_text(json.dumps(data))
    one_line_error(lambda: proposer_from_arg(f"dspark:{unstated}", target), "no sample_from_anchor")
    # A method asked for a format it has no layout in: nothing written.
    native = save_drafter(dflash(target), tmp_path / "dflash-native", extra={"target": str(target_dir)})
    one_line_error(lambda: export_run(native, "deepspec", tmp_path / "x"), "--format must be one of")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- MTP

def test_mtp_export_runs_in_speculators_as_our_module_one_chained(target, tmp_path, capsys):
    """speculators' MTPDraftModel (models/mtp/core.py) chains one module for every step, fed the
    verifier's hidden state at `num_hidden_layers` (its target_layer_ids): transformers' last
    hidden state, after the final norm, which is what ours reads (the last layer's output
    through the norm). Step 1 equals our module 1; later steps read the module's normed output
    (chain_input normed), which is how the folder reads back here, and not DeepSeek's chaining."""
    from speculators.models.mtp import MTPDraftModel

    from draftsmith.cli import main
    from draftsmith.models.mtp import MTPDrafter, mtp_forward
    from draftsmith.models.target import decoder_layers

    run = mtp_run(tmp_path, target, "qwen3")  # two modules: module 1 is written, and said so
    capsys.readouterr()
    assert main(["export", str(run), "--format", "speculators", "--out", str(tmp_path / "spec")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("wrote module 1 of 2") == 1 and "no serve line" in printed and "vllm serve" not in printed
    assert "drafts past the first differ there" in printed  # this run chained DeepSeek's way
    out = tmp_path / "spec"
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["num_nextn_predict_layers"] == 1
    assert config["transformer_layer_config"]["num_hidden_layers"] == target.config.num_hidden_layers
    model = reference_model(out)
    assert isinstance(model, MTPDraftModel) and model.target_layer_ids == [target.config.num_hidden_layers]
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    last = []
    hook = decoder_layers(target)[-1].register_forward_hook(lambda m, a, o: last.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        fed = target(ids, output_hidden_states=True).hidden_states[target.config.num_hidden_layers]
        hook.remove()
        theirs, _, _ = model(input_ids=ids, hidden_states=fed)
        read = proposer_from_arg(f"mtp:{out}", target).heads
        assert read.num_depths == 1 and read.config.chain_input == "normed"
        chained = {}
        for way in ("hidden", "normed"):
            chained[way] = MTPDrafter.from_target(target, num_depths=len(theirs))
            chained[way].layers = torch.nn.ModuleList([read.layers[0]] * len(theirs))
            chained[way].config.chain_input = way
            chained[way] = mtp_forward(chained[way], target, ids, last[0])
    assert len(theirs) == 3  # the references' chain, within the tile rule
    for step, logits in enumerate(theirs):
        torch.testing.assert_close(logits, chained["normed"][step][:, : logits.shape[1]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs[0], chained["hidden"][0][:, : theirs[0].shape[1]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs[1], chained["hidden"][1][:, : theirs[1].shape[1]], atol=1e-3)
    # Read back here, the folder drafts as speculators chains it: its first draft is the run's.
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(0))
    run_first = drafts(proposer_from_arg(f"mtp_nextn:{run}", target), target, prompt, n=1)[0]
    assert torch.equal(drafts(proposer_from_arg(f"mtp:{out}", target), target, prompt, n=1)[0], run_first)


def test_a_speculators_mtp_folder_for_another_target_or_family_is_one_line(target, tmp_path):
    from draftsmith.models.target import build_tiny_target, freeze

    llama = freeze(build_tiny_target(seed=1, arch="llama", vocab_size=VOCAB, num_layers=2, hidden_size=64,
                                     num_heads=4, num_kv_heads=2))
    one_line_error(lambda: export_run(mtp_run(tmp_path, llama, "llama"), "speculators", tmp_path / "x"),
                   "speculators' MTP builds its module for qwen3 verifiers only")
    assert not (tmp_path / "x").exists()
    out = export_run(mtp_run(tmp_path, target, "qwen3"), "speculators", tmp_path / "spec")
    shallow = freeze(build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB, num_layers=2, hidden_size=64,
                                       num_heads=4, num_kv_heads=2))
    one_line_error(lambda: proposer_from_arg(f"mtp:{out}", shallow), "an MTP module of a target with 6 layers")
