"""A file is checked before it is trusted (issue 44, causes 1, 4 and 8): a GGUF conversion is
cached only when it is the file's model, a target folder whose load initialises weights anew
is refused, a resume compares what the run did (and is refused without a record of it), and
export reads the validation acceptance of the weights it exports."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file, save_file

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.models.gguf import PROVENANCE
from draftsmith.models.latency import run_acceptance
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.target import build_tiny_target, load_target
from draftsmith.recipe import dump_recipe
from draftsmith.train.run_folder import resume_changes
from test_faults import copy_run, one_line_error, resume_args, run  # noqa: F401  (run: the module's fixture)
from tiny_runs import tiny_recipe

# ---------------------------------------------------------------- GGUF files

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


def tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A GGUF file of a 2-layer Llama with a tied head and a byte-level vocabulary, written
    with the gguf package as llama.cpp lays one out (transformers converts it in a second)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * 3)
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_eos_token_id(len(tokens) - 3)
    rng = np.random.default_rng(0)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (kv, HIDDEN),
                   f"blk.{i}.attn_v.weight": (kv, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def retype_first_tensor(path: Path) -> None:
    """Change the first tensor's type in place (F32 read as F16): its bytes then dequantize
    to other values, some of them NaN or infinite (the damage of the issue's first case)."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    reader.tensors[0].field.parts[4][0] = gguf.GGMLQuantizationType.F16  # raw_dtype, in the mapped file
    del reader


def cached(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if not p.name.endswith(".lock")] if cache.exists() else []


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "gguf-cache"
    monkeypatch.setenv("DRAFTSMITH_GGUF_CACHE", str(cache))
    return cache


def test_a_sound_gguf_file_with_a_tied_head_converts_and_loads(tmp_path, gguf_cache):
    folder = find_model_dir(tiny_gguf(tmp_path / "tiny.gguf"), require="target")
    assert (Path(folder) / PROVENANCE).is_file() and cached(gguf_cache) == [Path(folder)]
    model = load_target(folder)  # the tied head is not "missing"
    assert model.config.tie_word_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("damage, said", [
    ("retyped", "model.embed_tokens.weight holds"),
    ("qwen2", "newly initialised (missing from the files): model.layers.0.self_attn.k_proj.bias"),
])
def test_a_damaged_gguf_file_is_one_line_and_nothing_is_cached(tmp_path, gguf_cache, capsys, damage, said):
    """A tensor's type changed converts to a non-finite embedding; the architecture renamed
    (qwen2) loads with the attention biases newly initialised. Both were cached as good
    conversions, and every later command reused them."""
    path = tiny_gguf(tmp_path / "damaged.gguf", arch="qwen2" if damage == "qwen2" else "llama")
    if damage == "retyped":
        retype_first_tensor(path)
    line = one_line_error(capsys, main(["plan", str(path)]))
    assert f"target {path}: the file does not convert to a sound" in line and said in line, line
    assert "nothing was cached" in line and cached(gguf_cache) == []
    with pytest.raises(DraftsmithError, match="does not convert to a sound"):  # not cached since: asked again, refused again
        find_model_dir(path)


# ---------------------------------------------------------------- target folders

@pytest.mark.parametrize("arch", ["qwen3", "gemma"])  # an untied head, a tied one
def test_a_target_folder_missing_a_weight_is_refused_not_initialised(tmp_path, arch):
    folder = tmp_path / arch
    build_tiny_target(arch=arch, vocab_size=128, num_layers=2, hidden_size=64, num_heads=4,
                      num_kv_heads=2).save_pretrained(folder)
    load_target(folder)  # as saved: every weight in place (a tied head included)
    weights = folder / "model.safetensors"
    state = load_file(weights)
    dropped = next(k for k in state if k.endswith("mlp.up_proj.weight"))
    save_file({k: v for k, v in state.items() if k != dropped}, weights, metadata={"format": "pt"})
    with pytest.raises(DraftsmithError) as caught:
        load_target(folder)
    message = str(caught.value)
    assert message.startswith(f"cannot load target {folder}: 1 weight(s) newly initialised (missing from the files)")
    assert dropped in message and "\n" not in message


# ---------------------------------------------------------------- resume: the run's record

@pytest.mark.parametrize("record", [None, "- train\n- seq_len\n", "", "train: 3\n"])
def test_a_resume_without_a_sound_recipe_record_is_refused(run, tmp_path, capsys, record):  # noqa: F811
    """With recipe.yaml missing, a list, empty or a section not a mapping, the guard was
    skipped: a changed train.seq_len was accepted and recipe.yaml rewritten with it."""
    work = copy_run(run, tmp_path)
    recipe = work / "recipe.yaml"
    recipe.unlink() if record is None else recipe.write_text(record)
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    line = one_line_error(capsys, main(resume_args(work, "train.seq_len=16", train__resume="true")))
    assert f"cannot resume from {work / 'checkpoints' / 'checkpoint_6'}: the run's recipe record {recipe}" in line
    assert "train.resume_changes=allow" in line
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before


def test_a_resume_allowed_without_a_recipe_record_rewrites_it(run, tmp_path):  # noqa: F811
    work = copy_run(run, tmp_path)
    (work / "recipe.yaml").unlink()
    assert main(resume_args(work, "train.resume_changes=allow", train__resume="true")) == 0
    assert yaml.safe_load((work / "recipe.yaml").read_text())["method"]["name"] == "mtp"


def test_a_key_restated_at_the_runs_default_is_no_change(run, tmp_path):  # noqa: F811
    work = copy_run(run, tmp_path)
    assert main(resume_args(work, "method.lambda_early=0.3", train__resume="true", train__max_steps=7)) == 0
    changes = json.loads((work / "run.json").read_text()).get("changes", [])
    assert [c["key"] for c in changes] == ["train.max_steps"]


def eagle3_checkpoint(tmp_path) -> Path:
    """A run folder's record and a checkpoint whose drafter config holds what the run
    derived (num_heads from the target), without training: resume_changes reads only these."""
    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "checkpoint_2"
    (checkpoint / "model").mkdir(parents=True)
    (out / "recipe.yaml").write_text(dump_recipe(tiny_recipe("eagle3", out)))
    (checkpoint / "model" / "config.json").write_text(json.dumps(
        {"format": "draftsmith", "method": "eagle3", "config": {"ttt_decay": 0.8, "num_heads": 4}}))
    return checkpoint


def test_a_method_key_restated_at_its_resolved_value_is_no_change(tmp_path):
    """The issue's case: `method.ttt_decay=0.8` was refused as a change from "(unset)"."""
    checkpoint = eagle3_checkpoint(tmp_path)
    out = checkpoint.parent.parent
    assert "ttt_decay" not in (out / "recipe.yaml").read_text()
    assert resume_changes(tiny_recipe("eagle3", out, method__ttt_decay=0.8, method__num_heads=4), checkpoint, 2) == []
    with pytest.raises(DraftsmithError, match=r"method.num_heads from 4 to 2 .*method.ttt_decay from 0.8 to 0.5"):
        resume_changes(tiny_recipe("eagle3", out, method__ttt_decay=0.5, method__num_heads=2), checkpoint, 2)


# ---------------------------------------------------------------- export: the best weights' acceptance

def test_the_acceptance_of_best_weights_and_checkpoints_is_found_in_their_run(tmp_path):
    """Export looked for metrics.jsonl in RUN/best, not RUN, and said the run logged no
    validation acceptance; each weights' own validation record is the one read."""
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "checkpoint_2"
    for folder in (run_dir / "model", run_dir / "best" / "model", checkpoint / "model"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r"}))
    (run_dir / "best" / "best.json").write_text(json.dumps({"step": 4, "metric": "val/tau_est", "value": 2.0}))
    (checkpoint / "step.json").write_text(json.dumps({"step": 2}))
    records = [{"step": 2, "val/acc_1": 0.5, "val/acc_2": 0.5}, {"step": 3, "train/loss": 1.0},
               {"step": 4, "val/acc_1": 0.8, "val/acc_2": 0.5}, {"step": 6, "val/acc_1": 0.6, "val/acc_2": 0.5}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert find_model_dir(run_dir) == run_dir / "best" / "model"
    assert run_acceptance(find_model_dir(run_dir)) == pytest.approx([0.8, 0.4])
    assert run_acceptance(checkpoint / "model") == pytest.approx([0.5, 0.25])
    assert run_acceptance(run_dir / "model") == pytest.approx([0.6, 0.3])
    shutil.rmtree(run_dir / "best")  # no best: the run folder stands for its last weights
    assert run_acceptance(find_model_dir(run_dir)) == pytest.approx([0.6, 0.3])
