"""A rehearsal of the MTP pretraining recipes (recipes/pretrain_1b) as a user runs them on a node:
FineWeb-Edu streamed from the hub through `datasets`, tokenized and packed as it is read, MTP
trained jointly with the model, the export the real path offers for such a target, and eval
with the trained MTP module as the drafter.

The hub is a cache laid out as huggingface_hub writes it (tests/hub_fixtures.py), read with
HF_HUB_OFFLINE: FineWeb-Edu's repository (its README's configs and parquet shards under
sample/10BT/, sample/100BT/ and data/<dump>/), the tokenizer the from-scratch recipe names
(meta-llama/Llama-3.2-1B: a tiny byte-level BPE in its place) and the checkpoint the
continued-pretraining recipe names (Qwen/Qwen3-1.7B-Base: a tiny Qwen3 model in its place).
The recipe's names are read as written; only these are overridden:
- width and depth: the from-scratch target's target.* shape (continued: the tiny checkpoint's own);
- steps and lengths: train.max_steps, seq_len, the held-out rows (data.heldout_rows) and the
  eval/save/log cadence, and the tracker (no wandb offline);
- paths: train.output_dir.
Everything else (streaming, config, split, text column, tokenizer and checkpoint names, batch
x accumulation, schedule, warmup, clip, weight decay, beta2, K and the lambda schedule) runs
as the recipe gives it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_fixtures import save_tiny_chat_target, tiny_chat_tokenizer
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.recipe import load_recipe
from hub_fixtures import add_folder, add_repo, parquet

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "pretrain_1b"
PRETRAIN_RECIPES = sorted(p.relative_to(ROOT / "recipes").as_posix() for p in (ROOT / "recipes" / FOLDER).glob("*.yaml"))
# recipe -> the tiny model class standing for the one it names (from scratch: its target.arch)
ARCH = {"pretrain_1b/llama_mtp.yaml": "llama", "pretrain_1b/qwen3_mtp_continued.yaml": "qwen3"}
FINEWEB = "HuggingFaceFW/fineweb-edu"
# FineWeb-Edu's README names its configs so (data_files per config), as the hub serves it.
README = b"""---
license: odc-by
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
- config_name: sample-100BT
  data_files:
  - split: train
    path: sample/100BT/*
- config_name: CC-MAIN-2024-10
  data_files:
  - split: train
    path: data/CC-MAIN-2024-10/*
---
# FineWeb-Edu
"""
SEQ_LEN = 32


def documents(shard: int, count: int) -> list[str]:
    return [f"Lesson {shard}.{i}: the quick brown fox jumps over the lazy dog {i} times. "
            f"What is {i} plus {i}? Two plus two is four, and {i} plus {i} is {2 * i}.\n" for i in range(count)]


def fineweb_files(docs_per_shard: int = 120) -> dict[str, bytes]:
    """FineWeb-Edu's layout: two parquet shards per sample config, one dump; its columns."""
    files = {"README.md": README}
    for folder in ("sample/10BT", "sample/100BT", "data/CC-MAIN-2024-10"):
        for shard in range(2):
            texts = documents(shard, docs_per_shard)
            files[f"{folder}/{shard:03d}_00000.parquet"] = parquet({
                "text": texts, "id": [f"<urn:{shard}:{i}>" for i in range(len(texts))],
                "dump": ["CC-MAIN-2024-10"] * len(texts), "score": [3.1] * len(texts),
                "int_score": [3] * len(texts), "token_count": [len(t) // 4 for t in texts]})
    return files


def put_hub(hub: Path, tmp_path: Path) -> None:
    """The corpus, the from-scratch recipe's tokenizer and the continued recipe's checkpoint."""
    add_repo(hub, FINEWEB, fineweb_files(), repo_type="dataset")
    tokenizer = tmp_path / "llama3-tokenizer"
    tiny_chat_tokenizer("llama31").save_pretrained(tokenizer)
    add_folder(hub, "meta-llama/Llama-3.2-1B", tokenizer)
    base = tmp_path / "qwen3-base"
    save_tiny_chat_target("qwen3", base, arch="qwen3", num_layers=2)
    add_folder(hub, "Qwen/Qwen3-1.7B-Base", base)


@pytest.fixture
def hub(hub_cache, datasets_cache, tmp_path):
    put_hub(hub_cache, tmp_path)
    return hub_cache


def overrides(recipe: str, out: Path, steps: int, **extra) -> list[str]:
    values = {"train.output_dir": out, "train.max_steps": steps, "train.seq_len": SEQ_LEN,
              "data.heldout_rows": 8, "train.validation_batches": 2, "train.validation_every": steps,
              "train.save_every": steps, "train.log_every": 1, "tracking.report_to": "none"}
    if not load_recipe(ROOT / "recipes" / recipe).target.path:  # from scratch: width and depth
        values |= {"target.num_layers": 2, "target.hidden_size": 64, "target.num_heads": 4,
                   "target.num_kv_heads": 1, "target.intermediate_size": 128}
    values |= extra
    return [f"{key}={value}" for key, value in values.items()]


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_pretraining_recipe_is_rehearsed():
    assert PRETRAIN_RECIPES and set(PRETRAIN_RECIPES) == set(ARCH)
    for recipe in PRETRAIN_RECIPES:
        written = load_recipe(ROOT / "recipes" / recipe)
        assert written.method.name == "mtp" and written.data.streaming
        assert written.target.path or written.target.arch == ARCH[recipe]


@pytest.mark.parametrize("recipe", PRETRAIN_RECIPES)
def test_pretraining_recipe_rehearsal(recipe, tmp_path, hub, capsys):
    run = tmp_path / "run"
    written = load_recipe(ROOT / "recipes" / recipe)
    assert main(["train", "--recipe", str(ROOT / "recipes" / recipe), *overrides(recipe, run, steps=2)]) == 0
    rows = history(run)
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["train/loss_mtp_1"] > 0 and "train/loss_mtp_2" not in r for r in train_rows)  # K = 1
    # Each step read batch x accumulation rows of the stream: tokens counted by the loop.
    assert any("val/loss_mtp_1" in r for r in rows)
    saved = json.loads((run / "model" / "config.json").read_text())
    assert saved["model_type"] == ARCH[recipe]
    if written.target.path:  # continued: the checkpoint's own layers, trained (not the tiny default shape)
        assert saved["num_hidden_layers"] == 2 and saved["tie_word_embeddings"] is False
    else:
        assert saved["tie_word_embeddings"] is True and saved["rope_parameters"]["rope_theta"] == 500000.0
    # The real path offers no engine layout for MTP on a Llama or Qwen3 target: one line, nothing written.
    capsys.readouterr()
    assert main(["export", str(run), "--format", "vllm", "--out", str(tmp_path / "export")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "export").exists()
    # eval: the trained model as the target, its MTP module as the drafter, greedy and lossless.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in documents(7, 2)))
    report = tmp_path / "report"
    assert main(["eval", "--target", str(run), "--drafter", f"mtp:{run}", "--drafter", f"mtp_nextn:{run}",
                 "--dataset", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(report)]) == 0
    result = json.loads((report / "report.json").read_text())
    assert {d["name"] for d in result["drafters"]} >= {"mtp", "mtp_nextn"}
    for prompt in result["prompts"]:
        assert prompt["outputs"]["mtp"] == prompt["outputs"]["plain"] == prompt["outputs"]["mtp_nextn"]


def test_streamed_rows_are_the_packed_corpus_in_order(tmp_path, hub, monkeypatch):
    """Documents of both shards in file order, end to end with end-of-text after each, cut into
    rows across the tokenizer's batches of documents (7 here); held-out rows first, training after."""
    from draftsmith.data import stream as stream_module
    from draftsmith.data.chat import pack_texts
    from draftsmith.models.model_dir import target_folder
    from draftsmith.train.data_setup import load_tokenizer, packed_corpus

    monkeypatch.setattr(stream_module, "DOCS_PER_BATCH", 7)
    recipe = load_recipe(ROOT / "recipes" / PRETRAIN_RECIPES[0], overrides(PRETRAIN_RECIPES[0], tmp_path / "r", 2))
    tokenizer = load_tokenizer(recipe, target_folder(recipe.target.path))
    held = packed_corpus(recipe, tokenizer, "validation")
    stream = packed_corpus(recipe, tokenizer, "train")
    docs = documents(0, 120) + documents(1, 120)
    flat = [t for d in docs for t in (*tokenizer(d, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)]
    expected = [flat[i:i + SEQ_LEN] for i in range(0, len(flat) - SEQ_LEN + 1, SEQ_LEN)]
    got = [row["input_ids"].tolist() for row in held] + [row["input_ids"].tolist() for row in stream]
    assert len(held) == 8 and got == expected
    assert pack_texts(docs, tokenizer, SEQ_LEN)["input_ids"] == expected  # the in-memory corpus packs alike


def test_resumed_stream_reproduces_the_uninterrupted_trajectory(tmp_path, hub, monkeypatch):
    """A resume restarts the stream at the checkpoint's last resume point (datasets' state
    inside a shard and the unfinished row), not at the corpus's first document, and then
    trains on the rows the uninterrupted run trained on."""
    from draftsmith.data import stream as stream_module
    from draftsmith.train.loop import train
    from draftsmith.train.mtp import MTPTraining
    from tiny_runs import interrupted

    # Batches of 2 documents (about 5 rows of 32 tokens), a resume point after every one.
    monkeypatch.setattr(stream_module, "DOCS_PER_BATCH", 2)
    monkeypatch.setattr(stream_module, "INDEX_EVERY", 1)
    encoded, real = [], stream_module.PackedStream._encoded

    def counting(self):  # documents the training stream tokenizes
        for batch in real(self):
            if self.start:
                encoded.append(len(batch))
            yield batch

    monkeypatch.setattr(stream_module.PackedStream, "_encoded", counting)
    recipe = PRETRAIN_RECIPES[0]

    def run(out, **extra):
        return train(load_recipe(ROOT / "recipes" / recipe, overrides(
            recipe, out, 4, **{"train.grad_accum": 2, "train.save_every": 2, "train.validation_every": 100, **extra})))

    straight = tmp_path / "straight"
    run(straight)
    straight_docs = sum(encoded)
    broken = tmp_path / "broken"
    # Killed in step 4 (the 7th micro-batch), after the checkpoint at step 2.
    interrupted(monkeypatch, MTPTraining, 7, lambda: run(broken))
    encoded.clear()
    run(broken, **{"train.resume": "true"})
    assert 0 < sum(encoded) < straight_docs  # it did not re-read the rows of steps 1 and 2
    expected = [(r["step"], r["train/loss"]) for r in history(straight) if "train/loss" in r]
    resumed = [(r["step"], r["train/loss"]) for r in history(broken) if "train/loss" in r]
    assert [s for s, _ in resumed] == [s for s, _ in expected] == [1, 2, 3, 4]
    for (s1, a), (s2, b) in zip(expected, resumed):
        assert s1 == s2 and a == pytest.approx(b, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("extra", "message"), [
    ({"data.dataset": "HuggingFaceFW/fineweb-edu-nope"}, "not in the Hugging Face cache"),
    ({"data.text_field": "content"}, "no text column 'content'"),
    ({"data.dataset_config": "sample-1T"}, "sample-1T"),
    ({"data.heldout_rows": 100000}, "fewer than the data.heldout_rows=100000"),
])
def test_bad_corpus_is_one_line_and_nothing_written(extra, message, tmp_path, hub, capsys):
    run = tmp_path / "run"
    recipe = PRETRAIN_RECIPES[0]
    assert main(["train", "--recipe", str(ROOT / "recipes" / recipe), *overrides(recipe, run, 2, **extra)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run.exists()


def test_a_corpus_shorter_than_the_run_stops_in_one_line(tmp_path, hub, capsys):
    run = tmp_path / "run"
    recipe = PRETRAIN_RECIPES[0]
    assert main(["train", "--recipe", str(ROOT / "recipes" / recipe),
                 *overrides(recipe, run, 50, **{"train.save_every": 1000})]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # after the progress bar
    assert len(errors) == 1 and "the corpus ended after" in errors[0] and "train.max_steps" in errors[0], errors
    assert not (run / "model").exists()


def test_a_stream_has_no_epochs_and_streams_pretraining_text_only():
    with pytest.raises(DraftsmithError, match="no length"):
        load_recipe(ROOT / "recipes" / PRETRAIN_RECIPES[0], ["train.num_epochs=1", "train.max_steps=0"])
    with pytest.raises(DraftsmithError, match="method eagle3 trains on conversations"):
        load_recipe(ROOT / "recipes" / "tiny" / "eagle3.yaml", ["data.streaming=true"])


def test_two_processes_read_the_stream_as_one_process_accumulating(tmp_path, hub, monkeypatch):
    """Under 2-process DDP the main process reads the stream and deals each its rows
    (accelerate's dispatch of an iterable dataset): the losses of one process accumulating
    the same rows, step for step."""
    from draftsmith.train.loop import train
    from test_distributed import launch

    recipe = PRETRAIN_RECIPES[0]
    single = tmp_path / "single"
    exact = {"train.mixed_precision": "'no'"}  # float32 in both: bf16 rounding would differ by layout
    train(load_recipe(ROOT / "recipes" / recipe, overrides(recipe, single, 2, **{"train.grad_accum": 2, **exact})))
    for name, value in (("HF_HUB_CACHE", hub), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_CACHE", tmp_path / "ds2")):
        monkeypatch.setenv(name, str(value))
    two = tmp_path / "two"
    done = launch("ddp", "-m", "draftsmith.train", "--recipe", str(ROOT / "recipes" / recipe),
                  *overrides(recipe, two, 2, **{"train.grad_accum": 1, **exact}))
    assert done.returncode == 0, done.stderr[-3000:]
    for a, b in zip(history(single), history(two), strict=True):
        assert a["step"] == b["step"]
        for key in ("train/loss", "train/loss_main", "train/loss_mtp_1"):  # validation reads validation_batches per process
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4), (key, a, b)


def test_shape_keys_of_a_built_target_are_refused_beside_a_path():
    with pytest.raises(DraftsmithError, match="target Qwen/Qwen3-1.7B-Base has its own"):
        load_recipe(ROOT / "recipes" / PRETRAIN_RECIPES[1], ["target.tie_word_embeddings=true"])
