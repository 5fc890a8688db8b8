"""The feature cache from vLLM (`data cache-hidden --engine vllm`, data/engine_capture.py) on the
real target: the engine's layers and our head over its last one equal the in-process forward
within float32 tolerance, a drafter trained from either cache follows the same loss curve, and
an engine that dies mid-capture leaves the finished shards, which a rerun continues from; where
the rows' answers are not yet written, vLLM writes them, greedy the same as in-process.

Marked `engine` (`make test-engine`): 16 minutes on 2 cores of an AVX2 EPYC, eight engine starts.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.data.engine_capture import EngineCapture
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.target import load_target, target_forward

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "smollm2_135m" / "eagle3.yaml")
PROMPTS = ["Write a Python function that returns the factorial of n.",
           "Explain in two sentences what a Python list comprehension is.",
           "Write a Python function that checks whether a string is a palindrome.",
           "Name three uses of a Python dictionary."]
ROWS = ["data.num_conversations=8", "data.regen_max_new_tokens=48", "data.regen_temperature=0", "train.seq_len=160"]
LAYERS = [0, 14, 29]  # the first, a middle and the last layer's outputs (vLLM ids 1, 15, 30)
# float32 through two implementations of the same ops (vLLM's CPU kernels, transformers'):
# measured at most 1.1e-6 of a layer's largest value (its last), 1.2e-4 on logits of about 50; a
# wrong layer or norm is off by its whole size.
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def target():
    folder = find_model_dir("smollm2-135m-instruct")
    return folder, load_target(folder, dtype="float32", device="cpu")


def test_the_engines_layers_and_logits_equal_the_in_process_forward(target, tmp_path):
    folder, model = target
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with EngineCapture(model, folder, LAYERS, width, tmp_path / "engine") as capture:
        theirs = capture.forward({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        ours = target_forward(model, ids, attention_mask=mask, capture=LAYERS)
    real = mask.bool()
    for layer in LAYERS:
        gap = (theirs.hidden[layer][real] - ours.hidden[layer][real]).abs().max().item()
        scale = ours.hidden[layer][real].abs().max().item()
        print(f"layer {layer}: largest difference {gap:.3g} of {scale:.3g} ({gap / scale:.2g})")
        assert gap <= RELATIVE * scale, (layer, gap, scale)
    gap = (theirs.logits[real] - ours.logits[real]).abs().max().item()
    print(f"logits: largest difference {gap:.3g}")
    assert gap <= RELATIVE * ours.logits[real].abs().max().item()
    assert torch.equal(theirs.logits[real].argmax(-1), ours.logits[real].argmax(-1))
    assert not (tmp_path / "engine" / "captures").exists() or not any((tmp_path / "engine" / "captures").iterdir())


def stored(cache: Path) -> dict[str, torch.Tensor]:
    """Every tensor a cache stores, its shards in row order."""
    shards = [load_file(s) for s in sorted(cache.glob("shard-*.safetensors"))]
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["train/loss"] for row in rows if "train/loss" in row]


def test_a_cache_from_the_engine_trains_as_the_in_process_one_and_survives_its_death(tmp_path, monkeypatch, capsys):
    assert main(["-q", "data", "cache-hidden", "--recipe", RECIPE, *ROWS, "--out", str(tmp_path / "ours")]) == 0
    engine_cache = tmp_path / "engine"
    forward, calls = EngineCapture.forward, []

    def dies_in_the_second_shard(self, batch):  # call 1 is write_feature_cache's one-row probe
        calls.append(1)
        if len(calls) == 3:
            self.server.stop()
        return forward(self, batch)

    monkeypatch.setattr(EngineCapture, "forward", dies_in_the_second_shard)
    flags = ["--recipe", RECIPE, *ROWS, "--out", str(engine_cache), "--engine", "vllm", "--batch-size", "2",
             "--shard-rows", "2"]
    assert main(["-q", "data", "cache-hidden", *flags]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "vLLM exited mid-capture" in said[0] and "rerun to resume" in said[0], said
    assert (engine_cache / "shard-00000.safetensors").is_file()
    assert not json.loads((engine_cache / "manifest.json").read_text())["complete"]
    monkeypatch.setattr(EngineCapture, "forward", forward)
    assert main(["-q", "data", "cache-hidden", *flags]) == 0  # resumes: the first shard is kept
    manifest = json.loads((engine_cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["capture"].startswith("vllm ")

    real = load_file(tmp_path / "ours" / "rows.safetensors")["attention_mask"].bool()
    ours, theirs = stored(tmp_path / "ours"), stored(engine_cache)
    for key in ours:
        a, b = ours[key][real].float(), theirs[key][real].float()
        differs = (a != b).float().mean().item()
        print(f"{key}: {differs:.2%} of stored values differ, by at most {(a - b).abs().max().item():.3g}")
        assert differs < 0.01  # bfloat16 rounding either side of a boundary, nothing more
        assert torch.allclose(a, b, rtol=2 ** -7, atol=RELATIVE * a.abs().max().item())

    curves = []
    for name in ("ours", "engine"):
        assert main(["-q", "train", "--recipe", RECIPE, *ROWS, f"data.feature_cache={tmp_path / name}",
                     "train.max_steps=8", "train.log_every=1", "train.batch_size=2", "train.validation_every=1000",
                     "train.save_every=1000",
                     f"train.output_dir={tmp_path / f'run_{name}'}"]) == 0
        curves.append(_losses(tmp_path / f"run_{name}"))
    print("loss curves:", curves)
    assert len(curves[0]) == len(curves[1]) >= 8
    assert max(abs(a - b) / a for a, b in zip(*curves)) < 1e-3  # measured: 1e-6


def test_the_engine_answers_the_prompts_as_the_target_does(tmp_path, monkeypatch):
    """Where the rows' answers are not cached, `--engine vllm` has vLLM write them too: greedy,
    the same answers and rows as in-process regeneration."""
    flags = ["--recipe", RECIPE, *ROWS, "data.num_conversations=6"]
    caches = {}
    for name, engine in (("engine", ["--engine", "vllm"]), ("ours", [])):
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / f"cache_{name}"))  # no answers yet
        assert main(["-q", "data", "cache-hidden", *flags, "--out", str(tmp_path / name), *engine]) == 0
        caches[name] = tmp_path / name
    served = (caches["engine"] / ".engine" / "answers.log").read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')
    assert served >= 6  # vLLM answered every conversation (and the client's first probe)
    assert not (caches["ours"] / ".engine").exists()
    answers = [sorted((tmp_path / f"cache_{n}" / "regenerated").glob("*.jsonl")) for n in caches]
    assert [len(a) for a in answers] == [1, 1] and answers[0][0].name == answers[1][0].name
    assert answers[0][0].read_text() == answers[1][0].read_text()
    rows = [load_file(c / "rows.safetensors") for c in caches.values()]
    assert all(torch.equal(rows[0][k], rows[1][k]) for k in rows[0])


def test_sampled_answers_from_the_engine_whose_prompts_overflow_a_step(tmp_path, monkeypatch):
    """Seeded, sampled requests whose prompts exceed the CPU engine's 2048-token step: a split
    prefill crashes vLLM 0.32's CPU runner unless the answers server keeps each prefill whole
    (data/engine_answers.py)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    rows = ["data.num_conversations=4", "data.prompt_chars=12000", "data.regen_max_new_tokens=4", "train.seq_len=4096"]
    assert main(["-q", "data", "cache-hidden", "--recipe", RECIPE, *rows, "--out", str(tmp_path / "features"),
                 "--engine", "vllm"]) == 0
    answers = list((tmp_path / "cache" / "regenerated").glob("*.jsonl"))
    assert len(answers) == 1 and len(answers[0].read_text().splitlines()) == 4


def test_bench_capture_prints_both_paths_and_their_ratio():
    import re
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "scripts/bench_capture.py", "--conversations", "6", "--seq-len", "192",
                           "--recipes", "eagle3", "--batch-size", "2", *ROWS[1:3]],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    assert re.search(r"in-process +features +[0-9.]+ s", done.stdout)
    assert re.search(r"vLLM +features +[0-9.]+ s .* of which the engine's start [0-9.]+ s", done.stdout)
    assert re.search(r"vLLM over in-process: [0-9.]+x the feature stage", done.stdout)
    assert "eagle3.hidden:" in done.stdout
