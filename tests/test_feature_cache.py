"""The offline feature cache: `draftsmith data cache-hidden`, then training from it without
the target, which must be training online on the same rows, loss for loss."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

import draftsmith.train.posthoc as posthoc_module
from draftsmith.cli import main
from draftsmith.data.feature_cache import _human
from draftsmith.data.packing import pack_rows
from draftsmith.errors import DraftsmithError
from draftsmith.registry import method_spec, posthoc
from draftsmith.train import loaders
from draftsmith.train.loop import train
from tiny_runs import ROOT, for_method, overrides, tiny_recipe

# A bf16 target, as at scale: its features are bf16 already, so the cache holds them exactly
# and a cached run logs what the online run logs (up to the rounding the tolerance below allows
# for: CPU kernels round a row differently in another batch or at another width).
POSTHOC = dict(data__num_conversations=24, data__prompt_chars=120, data__regen_max_new_tokens=32,
               train__seq_len=80, train__max_steps=4, train__validation_every=2, train__save_every=100,
               target__dtype="bfloat16")
# What each method's cache holds (rows 80, target width 64 per layer, vocabulary 384; EAGLE-3's draft vocabulary 128).
TENSORS = {"eagle3": lambda hidden: {"hidden": [80, hidden], "logits": [80, 128], "target_top": [80]},
           "dflash": lambda hidden: {"hidden": [80, hidden]},
           "dspark": lambda hidden: {"hidden": [80, hidden], "logits": [80, 384]}}


def settings(name):
    """The method's registered `test_keys` (draftsmith/registry.py), as recipe overrides."""
    return {f"method__{k}": v for k, v in method_spec(name).test_keys.items()}


def tensors(name, manifest) -> dict:
    """The tensors a cache holds for `name`, by their stored names, and their per-row shapes."""
    hidden = 64 * len(manifest["methods"][name]["layer_ids"])
    shapes = for_method(TENSORS, name, "TENSORS in tests/test_feature_cache.py")(hidden)
    return {f"{name}.{k}": v for k, v in shapes.items()}


@pytest.fixture(scope="module")
def mtp_target_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("target") / "mtp"
    train(tiny_recipe("mtp", run, target__num_layers=4, train__max_steps=2, train__seq_len=64,
                      train__validation_every=100, train__save_every=100))
    return run / "model"


def recipe(name, run, target, **extra):
    return tiny_recipe(name, run, target__path=str(target), **{**POSTHOC, **settings(name), **extra})


def cache_hidden(name, run, target, out, *flags, **extra) -> int:
    """The CLI, given the recipe that `run` trains with."""
    return main(["data", "cache-hidden", "--recipe", str(ROOT / "recipes" / "tiny" / f"{name}.yaml"),
                 "--target", str(target), "--method", name, *overrides(run, **{**POSTHOC, **settings(name), **extra}),
                 "--out", str(out), *flags])


def metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "train/tokens_per_s"} for row in rows]


@pytest.mark.parametrize("name", posthoc())
def test_training_from_the_cache_is_training_online(name, mtp_target_dir, tmp_path, monkeypatch, capsys):
    online, cache = tmp_path / "online", tmp_path / "cache"
    assert cache_hidden(name, online, mtp_target_dir, cache, "--shard-rows", "8") == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and list(manifest["methods"]) == [name] and len(manifest["shards"]) > 1
    # Only what the loss reads: EAGLE-3 its 3 layers and draft-vocabulary logits, DFlash its
    # context layers, DSpark those and the full logits; each named after its method.
    assert {k: v["shape"] for k, v in manifest["tensors"].items()} == tensors(name, manifest)
    # The size printed up front is what lands on disk, give or take the shard headers.
    size = manifest["num_rows"] * sum(math.prod(v["shape"]) * getattr(torch, v["dtype"]).itemsize
                                      for v in manifest["tensors"].values())
    on_disk = sum((cache / s["file"]).stat().st_size for s in manifest["shards"])
    assert 0 <= on_disk - size < 1000 * len(manifest["shards"])
    assert f"= {_human(size)} in {len(manifest['shards'])} shard(s)" in capsys.readouterr().err

    train(recipe(name, online, mtp_target_dir))
    # From the cache the target is never loaded, only its embedding and head tensors are read.
    monkeypatch.setattr(posthoc_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    cached = tmp_path / "cached"
    train(recipe(name, cached, mtp_target_dir, data__feature_cache=str(cache)))
    logged = metrics(online)
    assert len(logged) == 6 and "val/loss" in logged[-1]
    # Not bit for bit: the online run's target forward covers each batch cut to its longest row
    # (data/batching.py), the cache's covered rows padded to train.seq_len, and in bf16 a few
    # features round differently at another width (measured: DSpark's val/tv 7e-5 relative
    # after two steps; EAGLE-3 and DFlash within 1e-6). 1e-3 is the golden curves' tolerance,
    # below what a 1% change of a loss weight moves (tests/test_golden.py).
    for got, want in zip(metrics(cached), logged, strict=True):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-6)


def test_an_interrupted_cache_resumes_where_it_stopped(mtp_target_dir, tmp_path, monkeypatch):
    run, cache = tmp_path / "run", tmp_path / "cache"
    calls, real = [], posthoc_module.frozen_forward

    def target_forwards(stop_at=None):
        def forward(target, batch, layer_ids):
            calls.append(len(batch["input_ids"]))
            if len(calls) == stop_at:
                raise KeyboardInterrupt
            return real(target, batch, layer_ids)
        monkeypatch.setattr(posthoc_module, "frozen_forward", forward)

    target_forwards(stop_at=4)  # the size probe, shard 0 in two batches, then the first of shard 1
    flags = ("--shard-rows", "8", "--batch-size", "4")
    assert cache_hidden("dflash", run, mtp_target_dir, cache, *flags) == 130
    assert not json.loads((cache / "manifest.json").read_text())["complete"]
    assert [p.name for p in cache.iterdir() if p.name.startswith(("shard", ".shard"))] == ["shard-00000.safetensors"]
    with pytest.raises(DraftsmithError, match="incomplete"):
        train(recipe("dflash", run, mtp_target_dir, data__feature_cache=str(cache)))

    kept = (cache / "shard-00000.safetensors").stat().st_mtime_ns
    calls.clear()
    target_forwards()
    assert cache_hidden("dflash", run, mtp_target_dir, cache, *flags) == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and (cache / "shard-00000.safetensors").stat().st_mtime_ns == kept
    assert sum(calls) == 1 + manifest["num_rows"] - 8  # the probe row, then only the missing rows
    assert cache_hidden("dflash", run, mtp_target_dir, tmp_path / "whole", *flags) == 0
    for shard in manifest["shards"]:
        assert (cache / shard["file"]).read_bytes() == (tmp_path / "whole" / shard["file"]).read_bytes()


def test_a_cache_made_for_something_else_is_refused_in_one_line(mtp_target_dir, tmp_path, capsys):
    eagle3, dflash = tmp_path / "eagle3", tmp_path / "dflash"
    assert cache_hidden("eagle3", tmp_path / "run", mtp_target_dir, eagle3) == 0
    assert cache_hidden("dflash", tmp_path / "run", mtp_target_dir, dflash) == 0
    other = tmp_path / "other_target"  # the same config, one tensor changed (as by more training)
    shutil.copytree(mtp_target_dir, other)
    weights = load_file(other / "model.safetensors")
    weights["lm_head.weight"] *= 1.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})

    def refused(name, cache, pattern, **extra):
        capsys.readouterr()
        args = overrides(tmp_path / "x", **{"target__path": str(mtp_target_dir), **POSTHOC, **settings(name),
                                            "data__feature_cache": str(cache), **extra})
        assert main(["train", str(ROOT / "recipes" / "tiny" / f"{name}.yaml"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(pattern, err[0]), err

    refused("eagle3", tmp_path / "nothing", r"nothing: no manifest.json")
    refused("eagle3", eagle3, r"written for another target .*: the weights of .*other_target differ",
            target__path=str(other))
    refused("dflash", eagle3, r"holds features for eagle3; this run needs dflash's")
    refused("dflash", dflash, r"holds layer_ids=\[0, 1, 2\]; this run needs layer_ids=\[0, 3\]",
            method__target_layer_ids=[0, 3])
    refused("eagle3", eagle3, r"holds draft_vocab_sha256=", method__draft_vocab_size=64)
    refused("eagle3", eagle3, r"holds train.seq_len=80; this run needs train.seq_len=64", train__seq_len=64)
    (eagle3 / "shard-00000.safetensors").unlink()
    refused("eagle3", eagle3, r"incomplete \(1 of 1 shards missing\): rerun draftsmith data cache-hidden")
    # Resuming into a folder that holds another cache.
    capsys.readouterr()
    assert cache_hidden("dflash", tmp_path / "run", mtp_target_dir, eagle3) == 2
    assert "holds a feature cache of other features or rows (methods differs)" in capsys.readouterr().err


# EAGLE-3 (its teacher pair) and DSpark (hidden states and full logits) cover every tensor a
# cache stores; DFlash's packed loss is DSpark's backbone's (tests/test_packing.py).
@pytest.mark.parametrize("name", [n for n in posthoc() if n != "dflash"])
def test_packed_training_from_the_cache_is_packed_training_online(name, mtp_target_dir, tmp_path, monkeypatch):
    """data.packing packs the cache's stored features as it packs the rows online, whose
    target forward then reads each conversation alone (tests/test_packing.py)."""
    online, cache = tmp_path / "online", tmp_path / "cache"
    wide = dict(train__seq_len=200)  # rows of up to ~90 tokens: two or more share a row
    assert cache_hidden(name, online, mtp_target_dir, cache, **wide) == 0
    saved = []  # rows per batch saved by packing

    def packing(rows):
        batch = pack_rows(rows)
        saved.append(len(rows) - batch["input_ids"].shape[0])
        return batch

    monkeypatch.setattr(loaders, "pack_rows", packing)
    train(recipe(name, online, mtp_target_dir, data__packing=True, **wide))
    assert sum(saved) > 0
    cached = tmp_path / "cached"
    train(recipe(name, cached, mtp_target_dir, data__feature_cache=str(cache), data__packing=True, **wide))
    logged = metrics(online)
    assert len(logged) == 6 and "val/loss" in logged[-1]
    for got, want in zip(metrics(cached), logged, strict=True):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-6)


def test_one_pass_of_the_target_caches_every_post_hoc_method(mtp_target_dir, tmp_path, monkeypatch, capsys):
    """Several recipes on the same rows: the target is loaded once and run once per batch, and
    each method's features are those a cache of that method alone holds, bit for bit."""
    names, run = posthoc(), tmp_path / "run"
    alone = {}
    for name in names:
        alone[name] = tmp_path / f"{name}_alone"
        assert cache_hidden(name, run, mtp_target_dir, alone[name]) == 0
    loads, forwards, real_load = [], [], posthoc_module.load_target
    monkeypatch.setattr(posthoc_module, "load_target", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    real_forward = posthoc_module.target_forward
    monkeypatch.setattr(posthoc_module, "target_forward", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    shared = tmp_path / "shared"
    args = [a for name in names for a in ("--recipe", str(recipe_file(tmp_path, name)))]
    assert main(["data", "cache-hidden", *args, "--target", str(mtp_target_dir), *overrides(run, **POSTHOC),
                 "--out", str(shared), "--batch-size", "8"]) == 0
    manifest = json.loads((shared / "manifest.json").read_text())
    assert list(manifest["methods"]) == names and len(loads) == 1
    assert len(forwards) == 1 + math.ceil(manifest["num_rows"] / 8)  # the size probe, then each batch once
    assert {k: v["shape"] for k, v in manifest["tensors"].items()} == {
        k: v for name in names for k, v in tensors(name, manifest).items()}
    stored = load_file(shared / "shard-00000.safetensors")
    for name in names:
        single = load_file(alone[name] / "shard-00000.safetensors")
        assert single.keys() == {k for k in stored if k.startswith(f"{name}.")}
        for key in single:
            assert torch.equal(stored[key], single[key]), key
    # A run reads its own method's features from it, as from a cache of its method alone.
    train(recipe("dflash", tmp_path / "from_shared", mtp_target_dir, data__feature_cache=str(shared)))
    train(recipe("dflash", tmp_path / "from_alone", mtp_target_dir, data__feature_cache=str(alone["dflash"])))
    assert metrics(tmp_path / "from_shared") == metrics(tmp_path / "from_alone")


def recipe_file(folder, name, **data) -> Path:
    """The tiny recipe of `name` with this file's method settings (and `data` keys) written in:
    with several recipes, an override reaches every one of them, so method keys go here."""
    spec = yaml.safe_load((ROOT / "recipes" / "tiny" / f"{name}.yaml").read_text())
    spec["method"].update({k.removeprefix("method__"): v for k, v in settings(name).items()})
    spec["data"] = {**spec.get("data", {}), **data}
    path = folder / f"{name}{'_other' if data else ''}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_recipes_that_train_on_other_rows_share_no_cache(mtp_target_dir, tmp_path, capsys):
    run, recipes = tmp_path / "run", [str(recipe_file(tmp_path, n)) for n in ("eagle3", "dflash")]
    common = overrides(run, **POSTHOC)

    def refused(args, pattern):
        capsys.readouterr()
        assert main(["data", "cache-hidden", *args, "--target", str(mtp_target_dir), *common,
                     "--out", str(tmp_path / "cache")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(pattern, err[0]), err
        assert not (tmp_path / "cache").exists()

    two = ["--recipe", recipes[0], "--recipe", recipes[1]]
    refused([*two, "--method", "dflash"], r"--method names the method of one recipe")
    refused(["--recipe", recipes[1], "--recipe", recipes[1]], r"method dflash named by two recipes")
    # A recipe whose answers are sampled otherwise trains on other rows.
    other = recipe_file(tmp_path, "dflash", regen_top_k=7)
    refused([*two[:2], "--recipe", str(other)], r"the eagle3 and dflash recipes train on other rows \(data.regen_top_k")


def test_the_draft_model_trains_on_a_caches_answer_tokens(mtp_target_dir, tmp_path, monkeypatch, capsys):
    """`data.feature_cache` for the draft model: the cache's rows (the target's answers), the
    loss on the answer tokens alone; a distillation weight (which would need the target) is refused."""
    import draftsmith.train.draft_lm as draft_lm_module

    cache = tmp_path / "cache"
    assert cache_hidden("dflash", tmp_path / "run", mtp_target_dir, cache) == 0
    rows = dict(data__regen_temperature=0.7, data__regen_top_p=0.8, data__regen_top_k=20)  # the dflash recipe's
    common = dict(target__path=str(mtp_target_dir), data__feature_cache=str(cache), method__distill_weight=0.0,
                  data__group_by_length=True, **POSTHOC, **rows)
    checked = []  # per batch: answer tokens, all tokens, the logged loss minus CE on the answers alone
    real_loss = draft_lm_module.DraftLMTraining.loss

    def loss(self, model, batch, *args, **kwargs):
        total, logged = real_loss(self, model, batch, *args, **kwargs)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
            answer = (batch["loss_mask"] * batch["attention_mask"])[:, 1:].bool()
            want = F.cross_entropy(logits[answer], batch["input_ids"][:, 1:][answer])
        checked.append((int(answer.sum()), int(batch["attention_mask"].sum()), logged["loss_main"] - want.item()))
        return total, logged

    monkeypatch.setattr(draft_lm_module.DraftLMTraining, "loss", loss)
    train(tiny_recipe("draft_lm", tmp_path / "draft_lm", **common))
    assert (tmp_path / "draft_lm" / "model" / "config.json").is_file() and len(checked) >= 4
    assert all(0 < answer < real and abs(gap) < 1e-4 for answer, real, gap in checked), checked
    losses = [row["train/loss"] for row in metrics(tmp_path / "draft_lm") if "train/loss" in row]
    assert losses[0] > losses[-1]  # it learns the answers
    with pytest.raises(DraftsmithError, match="distill_weight > 0 reads the target's logits"):
        train(tiny_recipe("draft_lm", tmp_path / "distilled", **{**common, "method__distill_weight": 0.5}))
    with pytest.raises(DraftsmithError, match="holds data.regen_top_k=20; this run needs data.regen_top_k=5"):
        train(tiny_recipe("draft_lm", tmp_path / "other", **{**common, "data__regen_top_k": 5}))


def test_a_cache_of_an_older_format_is_refused_in_one_line(mtp_target_dir, tmp_path):
    cache = tmp_path / "cache"
    assert cache_hidden("dflash", tmp_path / "run", mtp_target_dir, cache) == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    (cache / "manifest.json").write_text(json.dumps({**manifest, "format": "draftsmith-feature-cache/1"}))
    with pytest.raises(DraftsmithError, match=r"written by an older draftsmith \(draftsmith-feature-cache/1\): "
                                              "rerun draftsmith data cache-hidden into a new folder"):
        train(recipe("dflash", tmp_path / "x", mtp_target_dir, data__feature_cache=str(cache)))
