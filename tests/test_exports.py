"""Exports the engines and reference trainers load as they are, and drafters from those
layouts evaluated here: every format round-trips to identical drafts; each layout's config
fields and weight names are what its loader reads (transformers' own classes where they
run on CPU, a fixture of the loader's expected fields otherwise); bad input is one line."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.cli import main
from draftsmith.eval.proposers import proposer_from_arg
from draftsmith.models.dspark import ANCHOR_IS_CONTEXT
from draftsmith.models.export import export_notes, export_run
from draftsmith.models.formats.dspark import export_dspark_deepspec, export_dspark_specforge
from draftsmith.models.mtp import MTP_DIR
from draftsmith.models.native import save_drafter
from draftsmith.models.target import build_tiny_target, freeze
from draftsmith.registry import METHODS
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

# The tiny Qwen3 target (conftest.py's `target` and `target_dir`) and its drafters: tiny_models.py.


# ---------------------------------------------------------------- round trips

def test_every_post_hoc_format_round_trips_to_identical_drafts(target, target_dir, tmp_path):
    prompt = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2))
    for method, drafter in (("eagle3", eagle3(target)), ("dflash", dflash(target)), ("dspark", dspark(target))):
        native = save_drafter(drafter, tmp_path / method, extra={"target": str(target_dir)})
        formats = METHODS[method].exports
        assert formats and len(formats) >= 2
        for fmt in formats:
            out = export_run(native, fmt, tmp_path / f"{method}-{fmt}")
            assert_same_drafts(f"{method}:{native}", f"{method}:{out}", target, prompt)


def test_folders_written_by_the_other_tools_evaluate_like_ours(target, target_dir, tmp_path):
    """What SpecForge, z-lab, DeepSpec and the engines' trainers write lacks our extras
    (the `draftsmith` key, `target_hidden_size`, vLLM's copy of the layer ids, auto_map):
    such folders read the same."""
    prompt = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2))
    theirs = {"sglang": lambda c: c.pop("eagle_aux_hidden_state_layer_ids"),
              "zlab": lambda c: (c.pop("auto_map"), c["dflash_config"].pop("target_layer_ids")),  # the default spread
              "specforge": lambda c: (c.pop("auto_map"), c["dflash_config"].pop("block_size")),
              "deepspec": lambda c: None}
    for method, drafter, fmt in (("eagle3", eagle3(target), "sglang"), ("dflash", dflash(target), "zlab"),
                                 ("dspark", dspark(target), "specforge"), ("dspark", dspark(target), "deepspec")):
        native = save_drafter(drafter, tmp_path / fmt, extra={"target": str(target_dir)})
        out = export_run(native, fmt, tmp_path / f"{fmt}-theirs")
        config = json.loads((out / "config.json").read_text())
        config.pop("draftsmith", None)
        config.pop("target_hidden_size", None)
        theirs[fmt](config)
        (out / "config.json").write_text(json.dumps(config))
        assert_same_drafts(f"{method}:{native}", f"{method}:{out}", target, prompt)


def test_dspark_exports_refuse_what_their_loaders_would_misread(target, tmp_path):
    frozen_backbone = dspark(target, block_convention=ANCHOR_IS_CONTEXT, block_size=6)
    for export in (export_dspark_specforge, lambda d, out: export_dspark_deepspec(d, out, target)):
        one_line_error(lambda: export(frozen_backbone, tmp_path / "x"), "block_convention 'anchor_is_context'")
    last_layer = dspark(target, target_layer_ids=[1, 5])
    one_line_error(lambda: export_dspark_deepspec(last_layer, tmp_path / "x", target), "last layer")
    no_target = save_drafter(dspark(target), tmp_path / "no-target")  # DeepSpec needs the target's embedding
    one_line_error(lambda: export_run(no_target, "deepspec", tmp_path / "x"), "target None not found")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the loaders' own classes

def test_zlab_and_specforge_exports_load_with_transformers_alone(target, tmp_path):
    from transformers import AutoModel

    ids = torch.tensor([[5] + [MASK] * 5])
    embeds = target.get_input_embeddings()(ids)
    positions = torch.arange(7 + 6)[None]
    for drafter, export in ((dflash(target), "zlab"), (dflash(target, **WINDOWED), "zlab"),
                            (dspark(target, block_size=6), "specforge")):
        width = len(drafter.config.target_layer_ids) * 64  # every layer it reads
        feats = torch.randn(1, 7, width, generator=torch.Generator().manual_seed(0))
        name = f"{export}-{drafter.config.sliding_window}"
        native = save_drafter(drafter, tmp_path / name)
        out = export_run(native, export, tmp_path / f"{name}-out")
        config = json.loads((out / "config.json").read_text())
        module, cls = config["auto_map"]["AutoModel"].split(".")
        assert (out / f"{module}.py").is_file() and cls == config["architectures"][0]
        model, info = AutoModel.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
        assert type(model).__name__ == cls
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        with torch.no_grad():
            theirs = model.eval()(position_ids=positions, noise_embedding=embeds, target_hidden=feats)
            ours = drafter(embeds, positions[:, 7:], drafter.context_kv(feats, positions[:, :7]),
                           drafter.layer_masks(None, positions[:, :7], positions[:, 7:]))
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        logits = target.get_output_embeddings()
        assert torch.equal(logits(theirs).argmax(-1), logits(ours).argmax(-1))
        if export == "specforge":
            prev = torch.tensor([[5, 9, 11, 3, 2, 7]])
            torch.testing.assert_close(model.markov_bias(prev), drafter.markov_head(prev))
            torch.testing.assert_close(model.confidence_logits(theirs, prev), drafter.confidence_logits(ours, prev))


def tiny_deepseek(seed=1, layers=3):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=128)
    torch.manual_seed(seed)
    return freeze(DeepseekV3ForCausalLM(config))


def test_mtp_vllm_layout_round_trips_and_keeps_the_target_loadable(tmp_path):
    from transformers import AutoModelForCausalLM

    target = tiny_deepseek()
    run = mtp_run(tmp_path, target, "ds")
    out = export_run(run, "vllm", tmp_path / "ds-export")
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # vLLM's DeepSeekMTP (see models/formats/mtp.py): per module, these names and the block
    # under the target's own decoder-layer names (its last layer is the same MoE layer).
    block = {n.removeprefix("model.layers.2.") for n in names if n.startswith("model.layers.2.")}
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight"}
    assert "mlp.experts.3.gate_proj.weight" in block
    for k in (3, 4):
        module = {n.removeprefix(f"model.layers.{k}.") for n in names if n.startswith(f"model.layers.{k}.")}
        assert module == block | own
    # transformers loads the folder as the plain target, every weight in place.
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(reloaded.eval()(ids).logits, target(ids).logits)
    prompt = ids[0]
    assert_same_drafts(f"mtp:{run}", f"mtp:{out}", target, prompt)
    # A sharded target: the modules get a shard of their own, named in the index.
    sharded = tmp_path / "sharded" / "model"
    target.save_pretrained(sharded, max_shard_size="20KB")
    (sharded / MTP_DIR).symlink_to(run / "model" / MTP_DIR)
    out = export_run(sharded.parent, "vllm", tmp_path / "sharded-export")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.4.eh_proj.weight"] == "model-mtp.safetensors"
    assert len(set(index.values())) > 2
    assert_same_drafts(f"mtp:{run}", f"mtp:{out}", target, prompt)


def test_mtp_export_of_a_llama_target_says_it_is_for_our_own_decoder(tmp_path, capsys):
    target = freeze(build_tiny_target(seed=1, arch="llama", vocab_size=VOCAB, num_layers=2, hidden_size=32,
                                      num_heads=4, num_kv_heads=1))
    run = mtp_run(tmp_path, target, "llama")
    capsys.readouterr()
    assert main(["export", str(run), "--format", "vllm", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftsmith: error: ") and err.count("\n") == 1
    assert "for draftsmith's own decoder" in err and "LlamaForCausalLM" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- fixtures of the loaders' fields

# SpecForge @ a6b6b0230009: DSparkDraftModel reads these from dflash_config
# (specforge/modeling/draft/dspark.py, configs/qwen3-8b-dspark.json); DFlashDraftModel reads
# block_size, num_target_layers and one layer_types entry per layer from the top level.
SPECFORGE_DSPARK_NESTED = {"projector_type": "dspark", "markov_rank": 8, "markov_head_type": "vanilla",
                           "enable_confidence_head": True, "confidence_head_with_markov": True,
                           "attention_mode": "gqa", "target_layer_ids": [1, 3], "mask_token_id": MASK}
# DeepSpec @ afdfa7c93823 (deepspec/modeling/dspark/qwen3/config.py): top-level keys.
DEEPSPEC_TOP = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "num_target_layers": 6,
                "block_size": 5, "mask_token_id": MASK, "target_layer_ids": [1, 3], "num_anchors": 512,
                "enable_confidence_head": True, "confidence_head_with_markov": True, "markov_rank": 8,
                "markov_head_type": "vanilla", "tie_word_embeddings": False,
                "layer_types": ["full_attention"] * 2, "num_hidden_layers": 2, "hidden_size": 64}
HEADS = {"markov_head.markov_w1.weight": (VOCAB, 8), "markov_head.markov_w2.weight": (VOCAB, 8),
         "confidence_head.proj.weight": (1, 64 + 8), "confidence_head.proj.bias": (1,)}


def shapes(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_dspark_layouts_have_the_fields_and_names_specforge_and_deepspec_read(target, tmp_path):
    drafter = dspark(target)
    backbone = {k: tuple(v.shape) for k, v in dflash(target).state_dict().items()}
    specforge = export_dspark_specforge(drafter, tmp_path / "sf")
    config = json.loads((specforge / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["block_size"] == 5
    assert config["num_target_layers"] == 6 and config["layer_types"] == ["full_attention"] * 2
    assert SPECFORGE_DSPARK_NESTED.items() <= config["dflash_config"].items()
    assert "markov_rank" not in config  # nothing a reader might take from the wrong place
    assert shapes(specforge) == {**backbone, **HEADS}

    deepspec = export_dspark_deepspec(drafter, tmp_path / "ds", target)
    config = json.loads((deepspec / "config.json").read_text())
    assert DEEPSPEC_TOP.items() <= config.items()
    assert shapes(deepspec) == {**backbone, **HEADS, "embed_tokens.weight": (VOCAB, 64), "lm_head.weight": (VOCAB, 64)}
    # Both read config.json through transformers' Qwen3Config (their models subclass Qwen3PreTrainedModel).
    from transformers import Qwen3Config

    loaded = Qwen3Config.from_pretrained(deepspec)
    assert (loaded.target_layer_ids, loaded.markov_rank, loaded.block_size) == ([1, 3], 8, 5)
    assert loaded.layer_types == ["full_attention"] * 2 and loaded.num_hidden_layers == 2
    assert Qwen3Config.from_pretrained(specforge).dflash_config["projector_type"] == "dspark"
    stored = load_file(str(deepspec / "model.safetensors"))
    assert torch.equal(stored["lm_head.weight"], target.lm_head.weight)


def _engine_params(names, engine):
    """The parameters each engine's EAGLE-3 loader fills from these file names, by the
    renaming rules read in its source (models/formats/eagle3.py names the commits)."""
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
               ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}
    out = set()
    for name in names:
        if name == "t2d":
            continue
        if name == "d2t":
            out.add("hot_token_id" if engine == "sglang" else "draft_id_to_target_id")
            continue
        if engine == "vllm":
            name = name.replace("midlayer.", "layers.0.")
        for part, fused in stacked.items():
            name = name.replace(part, fused)
        out.add(name if name.startswith("lm_head") else f"model.{name}")
    return out


ENGINE_PARAMS = {  # each engine's module parameters for a one-layer drafter (embedding: the target's)
    "sglang": {"model.fc.weight", "model.norm.weight", "lm_head.weight", "hot_token_id",
               *(f"model.midlayer.{n}.weight" for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                        "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
                                                        "hidden_norm"))},
    "vllm": {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
             *(f"model.layers.0.{n}.weight" for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                      "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
                                                      "hidden_norm"))},
}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle3_layouts_fill_every_engine_parameter(target, tmp_path, engine):
    drafter = eagle3(target)
    out = export_run(save_drafter(drafter, tmp_path / "native"), engine, tmp_path / engine)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 96 and config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is False and config["eagle_config"]["use_aux_hidden_state"] is True
    ids = list(drafter.config.target_layer_ids)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids  # SGLang: output of layer i
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # vLLM: hidden_states[j]
    assert config["norm_before_residual"] is False
    file = shapes(out)
    assert _engine_params(file, engine) == ENGINE_PARAMS[engine]
    assert file["lm_head.weight"] == (96, 64) and file["fc.weight"] == (64, 3 * 64)


# ---------------------------------------------------------------- bad input

def test_bad_folders_are_one_line_errors_naming_what_was_expected(target, tmp_path):
    exports = {}
    for method, drafter, fmt in (("eagle3", eagle3(target), "vllm"), ("dflash", dflash(target), "zlab"),
                                 ("dspark", dspark(target), "specforge")):
        exports[method] = export_run(save_drafter(drafter, tmp_path / method), fmt, tmp_path / f"{method}-x")
    deepspec = export_dspark_deepspec(dspark(target), tmp_path / "deepspec", target)
    # A folder of one method passed as another.
    for spec, match in ((f"dflash:{exports['eagle3']}", "holds a eagle3 drafter, not dflash .*eagle3:"),
                        (f"eagle3:{exports['dspark']}", "holds a dspark drafter, not eagle3"),
                        (f"dflash:{deepspec}", "holds a dspark drafter, not dflash"),
                        (f"dspark:{exports['dflash']}", "holds a dflash drafter, not dspark")):
        one_line_error(lambda: proposer_from_arg(spec, target), match)
    # A layout nobody writes.
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    for method, expected in (("eagle3", "LlamaForCausalLMEagle3"), ("dflash", "DFlashDraftModel"),
                             ("dspark", "Qwen3DSparkModel")):
        one_line_error(lambda: proposer_from_arg(f"{method}:{unknown}", target), f"MedusaModel.*expected.*{expected}")
    # A layout missing a weight.
    for folder, name in ((exports["eagle3"], "fc.weight"), (exports["dspark"], "markov_head.markov_w2.weight"),
                         (deepspec, "lm_head.weight")):
        weights = load_file(str(folder / "model.safetensors"))
        del weights[name]
        save_file(weights, str(folder / "model.safetensors"))
        method = "eagle3" if folder == exports["eagle3"] else "dspark"
        one_line_error(lambda: proposer_from_arg(f"{method}:{folder}", target), re.escape(name))
    # A checkpoint whose vocabulary or hidden size does not fit the target.
    wide = freeze(build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB, num_layers=6, hidden_size=32,
                                    num_heads=4, num_kv_heads=2))
    other_vocab = freeze(build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB * 2, num_layers=6, hidden_size=64,
                                           num_heads=4, num_kv_heads=2))
    one_line_error(lambda: proposer_from_arg(f"dflash:{exports['dflash']}", wide), "hidden size 64, the target has 32")
    eagle = export_run(tmp_path / "eagle3", "sglang", tmp_path / "eagle3-sglang")
    one_line_error(lambda: proposer_from_arg(f"eagle3:{eagle}", other_vocab), "vocabulary 128 .* has 256")
    ok = export_dspark_deepspec(dspark(target), tmp_path / "deepspec-ok", target)
    one_line_error(lambda: proposer_from_arg(f"dspark:{ok}", other_vocab), "embed_tokens.weight has shape")


def test_mtp_deepseek_folder_for_another_target_is_refused(tmp_path):
    target = tiny_deepseek()
    out = export_run(mtp_run(tmp_path, target, "ds"), "vllm", tmp_path / "ds-export")
    other = freeze(build_tiny_target(seed=1, arch="llama", vocab_size=VOCAB, num_layers=2, hidden_size=32,
                                     num_heads=4, num_kv_heads=1))
    one_line_error(lambda: proposer_from_arg(f"mtp:{out}", other), "deepseek_v3 target, not of the llama target")
    one_line_error(lambda: proposer_from_arg(f"mtp:{out}", tiny_deepseek(layers=2)),
                   "target with 3 layers .* the target has 2")
    one_line_error(lambda: proposer_from_arg(f"dflash:{out}", target), "holds a mtp drafter, not dflash")


# ---------------------------------------------------------------- what each engine reads, restated

def sglang_nextn_reads(config: dict, names: set[str]) -> set[str]:
    """SGLang's NextN loader (python/sglang/srt/models/deepseek_nextn.py @ c28bdc9012d2 ->
    DeepseekV3ForCausalLM.load_weights(is_nextn=True) in deepseek_v2.py): asserts
    num_nextn_predict_layers == 1, reads the module under model.layers.{N} (0 when N == 1),
    `enorm`/`hnorm`/`eh_proj`/`shared_head.norm` as its own, everything else under the prefix
    as the decoder block, and skips `shared_head.head` and `embed_tokens` (the target's)."""
    assert config["num_nextn_predict_layers"] == 1, "Only 1 nextn layer is supported"
    n = config["num_hidden_layers"]
    prefix = f"model.layers.{0 if n == 1 else n}."
    return {name.removeprefix(prefix) for name in names if name.startswith(prefix)
            and "shared_head.head" not in name and "embed_tokens" not in name}


def test_mtp_sglang_layout_is_module_one_alone_and_says_so(tmp_path, capsys):
    target = tiny_deepseek()
    run = mtp_run(tmp_path, target, "ds")
    capsys.readouterr()
    assert main(["export", str(run), "--format", "sglang", "--out", str(tmp_path / "sglang")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sum("wrote module 1 of 2" in line for line in printed) == 1  # the one line a K-module run gets
    out = tmp_path / "sglang"
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    module = sglang_nextn_reads(config, names)
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"} <= module
    assert "mlp.experts.3.gate_proj.weight" in module and not any(n.startswith("model.layers.4.") for n in names)
    # SGLang's loader refuses the vLLM layout of the same run (two modules).
    vllm = export_run(run, "vllm", tmp_path / "vllm")
    with pytest.raises(AssertionError, match="Only 1 nextn layer"):
        sglang_nextn_reads(json.loads((vllm / "config.json").read_text()), names)
    # The folder reads back as a one-module drafter whose module is the run's module 1.
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(0))
    ours, one = proposer_from_arg(f"mtp:{run}", target), proposer_from_arg(f"mtp:{out}", target)
    assert one.heads.num_depths == 1
    for a, b in zip(ours.heads.layers[0].parameters(), one.heads.layers[0].parameters()):
        assert torch.equal(a, b)
    assert torch.equal(drafts(ours, target, prompt, n=1)[0], drafts(one, target, prompt, n=1)[0])
    # ... and drafts every position as `mtp_nextn` of the run: module 1 chained, as SGLang runs it.
    assert_same_drafts(f"mtp_nextn:{run}", f"mtp:{out}", target, prompt)
    # The printed command chains the one module the references' 3 steps (the tile rule's D, MLA:
    # G = H = 4, D = 31, is only the ceiling: each step is a drafter pass).
    sglang = next(line for line in printed if "sglang.launch_server" in line)
    assert f"--model-path {out}" in sglang and "--speculative-algorithm EAGLE" in sglang
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in sglang


def test_mtp_export_keeps_the_target_dtype(tmp_path):
    run = mtp_run(tmp_path, tiny_deepseek(), "ds")
    one_line_error(lambda: export_run(run, "vllm", tmp_path / "x", dtype="bfloat16"), "in the target's dtype .float32")
    assert not (tmp_path / "x").exists()


# SGLang python/sglang/srt/speculative/dspark_components/dspark_config.py @ 01f476234ab4
# (parse_dspark_draft_config): markov_rank from dspark_config, else the text config / top
# level, never from dflash_config; markov_head_type required with it. models/dspark.py
# there registers only Qwen3DSparkModel. vLLM's registry: Qwen3DSparkModel ->
# qwen3_dspark.Qwen3DSparkForCausalLM (@ 0302ff404394: top-level markov_rank,
# enable_confidence_head, confidence_head_with_markov), DSparkDraftModel -> DeepSeek-V4.
def sglang_dspark_reads(config: dict) -> dict:
    assert config["architectures"] == ["Qwen3DSparkModel"], "not SGLang's DSpark entry class"
    nested = config.get("dspark_config") or {}
    rank = int(nested.get("markov_rank", config.get("markov_rank", 0)) or 0)
    assert rank > 0, "DSpark requires markov_rank > 0"
    head = nested.get("markov_head_type", config.get("markov_head_type"))
    assert head in ("vanilla", "gated", "rnn")
    block = (config.get("dflash_config") or {}).get("block_size", config.get("block_size"))
    return {"markov_rank": rank, "markov_head_type": head, "gamma": block}


def vllm_dspark_reads(config: dict) -> dict:
    registry = {"Qwen3DSparkModel": "Qwen3DSparkForCausalLM", "DSparkDraftModel": "DSparkDeepseekV4ForCausalLM"}
    assert registry[config["architectures"][0]] == "Qwen3DSparkForCausalLM", "sent to the DeepSeek-V4 class"
    ids = config.get("eagle_aux_hidden_state_layer_ids") or [
        i + 1 for i in ((config.get("dflash_config") or {}).get("target_layer_ids") or config["target_layer_ids"])]
    return {"markov_rank": config["markov_rank"], "confidence": config.get("enable_confidence_head", False),
            "with_markov": config.get("confidence_head_with_markov", False), "aux_layer_ids": ids,
            "block_size": config["block_size"]}


def test_one_dspark_layout_serves_deepspec_sglang_and_vllm(target, target_dir, tmp_path):
    drafter = dspark(target)
    native = save_drafter(drafter, tmp_path / "native", extra={"target": str(target_dir)})
    prompt = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2))
    for fmt in ("sglang", "vllm", "deepspec"):
        out = export_run(native, fmt, tmp_path / fmt)
        config = json.loads((out / "config.json").read_text())
        assert sglang_dspark_reads(config) == {"markov_rank": 8, "markov_head_type": "vanilla", "gamma": 5}
        assert vllm_dspark_reads(config) == {"markov_rank": 8, "confidence": True, "with_markov": True,
                                             "aux_layer_ids": [i + 1 for i in drafter.config.target_layer_ids],
                                             "block_size": 5}
        assert DEEPSPEC_TOP.items() <= config.items()
        assert_same_drafts(f"dspark:{native}", f"dspark:{out}", target, prompt)
    # SpecForge's training layout is what SGLang and vLLM refuse, as the issue found.
    specforge = json.loads((export_run(native, "specforge", tmp_path / "sf") / "config.json").read_text())
    with pytest.raises(AssertionError, match="Qwen3DSparkModel"):
        sglang_dspark_reads(specforge)
    with pytest.raises(AssertionError, match="markov_rank > 0"):
        sglang_dspark_reads({**specforge, "architectures": ["Qwen3DSparkModel"]})
    with pytest.raises(AssertionError, match="DeepSeek-V4"):
        vllm_dspark_reads(specforge)


def test_tied_target_exports_two_tensors(tmp_path):
    """Qwen3-0.6B to 4B tie the embedding and head: the DeepSpec copies are two tensors."""
    from transformers import AutoModelForCausalLM

    config = build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB, num_layers=6, hidden_size=64, num_heads=4,
                               num_kv_heads=2).config
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    tied = freeze(AutoModelForCausalLM.from_config(config))
    assert tied.get_input_embeddings().weight.data_ptr() == tied.get_output_embeddings().weight.data_ptr()
    tied.save_pretrained(tmp_path / "tied")
    native = save_drafter(dspark(tied), tmp_path / "native", extra={"target": str(tmp_path / "tied")})
    out = export_run(native, "deepspec", tmp_path / "out")
    stored = load_file(str(out / "model.safetensors"))
    assert torch.equal(stored["lm_head.weight"], stored["embed_tokens.weight"])
    assert torch.equal(stored["lm_head.weight"], tied.lm_head.weight)


def test_exports_are_in_the_target_dtype_unless_told(target, tmp_path):
    bf16 = tmp_path / "bf16-target"
    build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB, num_layers=6, hidden_size=64, num_heads=4,
                      num_kv_heads=2).to(torch.bfloat16).save_pretrained(bf16)
    for method, drafter, fmt in (("eagle3", eagle3(target), "sglang"), ("dflash", dflash(target), "zlab"),
                                 ("dspark", dspark(target), "vllm"), ("dspark", dspark(target), "specforge")):
        native = save_drafter(drafter, tmp_path / f"{method}-{fmt}", extra={"target": str(bf16)})
        for dtype, expected in ((None, torch.bfloat16), ("float32", torch.float32)):
            out = export_run(native, fmt, tmp_path / f"{method}-{fmt}-{dtype}", dtype=dtype)
            config = json.loads((out / "config.json").read_text())
            assert config["torch_dtype"] == str(expected).removeprefix("torch.")
            stored = load_file(str(out / "model.safetensors"))
            assert {t.dtype for t in stored.values() if t.is_floating_point()} == {expected}
    one_line_error(lambda: export_run(native, "native", tmp_path / "n", dtype="bfloat16"), "native format")


def test_export_prints_the_commands_that_serve_it(target, target_dir, tmp_path, capsys):
    """The flags derive from the run: an EAGLE-3 chain of the references' 3 steps (under D = 128 // G - 1,
    63 at G = 2), DSpark's
    block B (5): SGLang verifies B + 1 tokens, vLLM drafts B; DFlash's block of 6 gives 5 drafts."""
    cases = {"eagle3": (eagle3(target), "vllm"), "dflash": (dflash(target), "zlab"), "dspark": (dspark(target), "sglang"),
             "eagle3_window": (eagle3(target, sliding_window=64), "sglang"),
             "dflash_window": (dflash(target, **WINDOWED), "zlab")}
    printed = {}
    for method, (drafter, fmt) in cases.items():
        native = save_drafter(drafter, tmp_path / method, extra={"target": str(target_dir)})
        capsys.readouterr()
        assert main(["export", str(native), "--format", fmt, "--out", str(tmp_path / f"{method}-out")]) == 0
        lines = capsys.readouterr().out.splitlines()
        printed[method] = [line.strip() for line in lines if "sglang.launch_server" in line or "vllm serve" in line]
        for line in printed[method]:
            assert str(target_dir) in line and str(tmp_path / f"{method}-out") in line and "--dtype float32" in line
    sglang, vllm = printed["eagle3"]
    assert "--speculative-algorithm EAGLE3" in sglang
    # A chain pays a drafter pass per step: the references' 3 steps, not the tile rule's 63.
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in sglang
    assert '"method": "eagle3"' in vllm and '"num_speculative_tokens": 3' in vllm
    sglang, vllm = printed["dflash"]
    assert "--speculative-algorithm DFLASH" in sglang and "--speculative-num-draft-tokens 6" in sglang
    assert '"method": "dflash"' in vllm and '"num_speculative_tokens": 5' in vllm
    sglang, vllm = printed["dspark"]
    assert "--speculative-algorithm DSPARK" in sglang and "--speculative-num-draft-tokens 6" in sglang
    assert '"method": "dspark"' in vllm and '"num_speculative_tokens": 5' in vllm
    # SGLang takes a drafter's window from its command line; vLLM from layer_types in the config.
    assert all("--speculative-draft-window-size" not in line for m in cases if "window" not in m for line in printed[m])
    assert printed["eagle3_window"][0].endswith("--speculative-draft-window-size 64")
    assert printed["dflash_window"][0].endswith("--speculative-draft-window-size 6")
    config = json.loads((tmp_path / "dflash_window-out" / "config.json").read_text())
    assert config["layer_types"] == WINDOWED["layer_types"] and config["sliding_window"] == 6
    assert config["dflash_config"]["swa_window_size"] == 6 and config["dflash_config"]["causal"] is False


def test_serve_lines_are_sized_at_the_tile_the_run_recorded(target, target_dir, tmp_path, capsys):
    """A run sized for a 4-row tile (D = 4 // G - 1 = 1 at G = 2) is served with a chain of 1, not
    the references' 3 at the default tile; its recipe.yaml read as saved, keys renamed since included."""
    run = tmp_path / "run"
    native = save_drafter(eagle3(target), run / "model", extra={"target": str(target_dir)})
    (run / "run.json").write_text(json.dumps({"id": "x"}))
    (run / "recipe.yaml").write_text("target:\n  tile: 4\ntrain:\n  eval_every: 5\n")
    assert main(["export", str(run), "--format", "vllm", "--out", str(tmp_path / "out")]) == 0
    sglang = next(line for line in capsys.readouterr().out.splitlines() if "sglang.launch_server" in line)
    assert "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2" in sglang
    (run / "recipe.yaml").write_text("target:\n  tile: 0\n")
    one_line_error(lambda: export_notes(native, "vllm", tmp_path / "out"), "target.tile: must be a whole number of at least 1, got 0")
