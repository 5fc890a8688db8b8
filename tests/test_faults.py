"""Faults a long run meets and bad input, each ending in one line (exit status 2) that names
the file, key or flag, and nothing of the user's lost or left half-written."""

import errno
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.models.model_dir import find_model_dir
from draftsmith.registry import posthoc, trainable
from draftsmith.train import loop
from draftsmith.train.checkpoints import check_checkpoint, latest_checkpoint
from draftsmith.train.loop import train
from tiny_runs import ROOT, overrides, tiny_recipe

STRAIGHT = dict(train__max_steps=6, train__log_every=2, train__save_every=3, train__validation_every=100)


def recipe_path(method: str) -> str:
    return str(ROOT / "recipes" / "tiny" / f"{method}.yaml")


def one_line_error(capsys, code) -> str:
    """The error line, after any progress bars of a run that had started."""
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("draftsmith: error: ") == 1, err[-3000:]
    return "draftsmith: error: " + err.split("draftsmith: error: ")[1].split("\n")[0]


def dead_pid() -> int:
    """The id of a process that has ended (what an interrupted writer leaves in its names)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def rows(run, drop=("train/tokens_per_s",)):
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_records(resumed, straight):
    """The same steps, keys and windows; values to round-off (a resume reloads exact states)."""
    a, b = rows(resumed), rows(straight)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == pytest.approx(rb, rel=1e-5, abs=1e-7), ra["step"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted tiny run: logs every 2 steps, checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("faults") / "run"
    train(tiny_recipe("mtp", out, **STRAIGHT))
    return out


def copy_run(run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


# ---------------------------------------------------------------- eval --out never deletes

def eval_args(run, out, *extra):
    return ["eval", "--target", str(run), "--out", str(out), "--drafter", "ngram", "--num-prompts", "1",
            "--max-new-tokens", "4", *extra]


def test_eval_out_refuses_what_is_not_a_previous_report(run, tmp_path, capsys):
    work = copy_run(run, tmp_path)
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    line = one_line_error(capsys, main(eval_args(work, work)))
    assert "no report.json" in line and str(work) in line
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    assert "not a folder" in one_line_error(capsys, main(eval_args(work, afile)))
    assert afile.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["notes.txt", "run"]


def test_eval_out_replaces_a_previous_report_whole_and_cleans_stale_temporaries(run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(eval_args(run, out)) == 0
    (out / "extra.txt").write_text("from the first report")
    stale = tmp_path / f".report.tmp-{dead_pid()}-x"  # an eval killed while writing
    stale.mkdir()
    (stale / "report.json").write_text("{}")
    assert main(eval_args(run, out, "--max-new-tokens", "3")) == 0
    assert json.loads((out / "report.json").read_text())["settings"]["max_new_tokens"] == 3
    assert not (out / "extra.txt").exists()  # replaced as a whole, not merged
    assert sorted(os.listdir(tmp_path)) == ["report"]


def test_export_out_refuses_the_run_and_folders_that_are_no_export(run, tmp_path, capsys):
    from draftsmith.registry import export_formats

    fmt = export_formats()[0]
    for out in (run, run / "model"):
        line = one_line_error(capsys, main(["export", str(run), "--format", fmt, "--out", str(out)]))
        assert "is the folder being exported" in line
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert "holds no config.json" in one_line_error(
        capsys, main(["export", str(run), "--format", fmt, "--out", str(mine)]))
    assert (mine / "notes.txt").read_text() == "mine" and (run / "model" / "config.json").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--num-draft", "-5"], "--num-draft"),
    (["--num-draft", "0"], "--num-draft"),
    (["--num-draft", "5000"], "exceeds the target's context"),
])
def test_eval_flags_out_of_range_are_refused(run, tmp_path, capsys, flags, message):
    assert message in one_line_error(capsys, main(eval_args(run, tmp_path / "r", *flags)))
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- validation

def test_validation_batches_stop_before_a_partial_last_batch():
    """validation_batches + 1 batches, the last one partial: fetching it would end the loader's pass,
    and gather_for_metrics would then cut the per-process means to the remainder (3)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    data = [{"x": torch.tensor([float(i)])} for i in range(11)]  # batches of 4, 4, 3
    loader = accelerator.prepare(DataLoader(data, batch_size=4))

    class Method:
        def loss(self, model, batch, step, micro=0, total_steps=0):
            return batch["x"].mean(), {f"m{k}": float(batch["x"].sum()) for k in range(6)}

    val = loop.validation_metrics(Method(), torch.nn.Linear(1, 1), loader, 2, 0, accelerator)
    assert val["val/loss"] == pytest.approx((1.5 + 5.5) / 2) and val["val/m0"] == pytest.approx((6 + 22) / 2)
    assert len(val) == 7


# ---------------------------------------------------------------- checkpoints and resume

def resume_args(run, *extra, **values):
    return ["train", recipe_path("mtp"), *overrides(run, **{**STRAIGHT, **values}), *extra]


def test_a_damaged_latest_checkpoint_is_named_and_an_earlier_one_resumes(run, tmp_path, capsys):
    work = copy_run(run, tmp_path)
    latest, earlier = work / "checkpoints" / "checkpoint_6", work / "checkpoints" / "checkpoint_3"
    assert latest_checkpoint(work) == latest
    (latest / "optimizer.bin").unlink()
    line = one_line_error(capsys, main(resume_args(work, train__resume="true")))
    assert "optimizer.bin is missing" in line and "train.resume=PATH" in line and str(earlier) in line
    weights = latest / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert "model.safetensors is truncated" in one_line_error(capsys, main(resume_args(work, train__resume="true")))
    line = one_line_error(capsys, main(resume_args(work, train__resume=str(work / "model"))))
    assert "is not a checkpoint" in line

    # What an interrupted save and an interrupted append leave; the next run cleans or drops it.
    (work / "checkpoints" / "checkpoint_5").mkdir()  # a save cut short: no step.json
    stale = work / f".model.tmp-{dead_pid()}-abc"
    stale.mkdir()
    with (work / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "train/lo')
    assert main(resume_args(work, train__resume=str(earlier))) == 0
    assert not (work / "checkpoints" / "checkpoint_5").exists() and not stale.exists()
    assert_same_records(work, run)
    # The damaged step 6 of the abandoned trajectory was set aside, not rotated against the
    # resumed run's own checkpoints; the latest is now the resumed run's whole step 6.
    assert "abandoned trajectory are kept in" in capsys.readouterr().err
    assert (work / "abandoned" / "checkpoint_6" / "model.safetensors").stat().st_size < weights.stat().st_size
    assert check_checkpoint(latest_checkpoint(work)) == 6


def test_a_resume_with_another_model_shape_fails_and_keeps_the_runs_recipe(run, tmp_path, capsys):
    work = copy_run(run, tmp_path)
    recipe = (work / "recipe.yaml").read_text()
    line = one_line_error(capsys, main(resume_args(work, "target.hidden_size=32", train__resume="true")))
    assert "cannot resume from" in line and "checkpoint_6" in line
    assert (work / "recipe.yaml").read_text() == recipe


def test_a_resumed_run_logs_the_same_windows(run, tmp_path, monkeypatch):
    """save_every (3) is no multiple of log_every (2): the window logged at step 4 spans
    steps 3 and 4, one on each side of the checkpoint."""
    from draftsmith.train.mtp import MTPTraining

    calls = {"n": 0}
    real_loss = MTPTraining.loss

    def dying_loss(self, model, batch, step, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # step 5: after the checkpoint at 3 and the log at 4
            raise KeyboardInterrupt
        return real_loss(self, model, batch, step, **kwargs)

    broken = tmp_path / "broken"
    monkeypatch.setattr(MTPTraining, "loss", dying_loss)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe("mtp", broken, **STRAIGHT))
    monkeypatch.setattr(MTPTraining, "loss", real_loss)
    assert latest_checkpoint(broken).name == "checkpoint_3"
    train(tiny_recipe("mtp", broken, **STRAIGHT, train__resume=True))
    assert_same_records(broken, run)


def train_failing_the_last_save(monkeypatch, capsys, out: Path, save_state) -> str:
    """A 4-step run saving at 2 and 4, whose step-4 save is `save_state`: its one error line."""
    real = loop.save_checkpoint

    def failing(accelerator, out_dir, step, *rest):
        if step == 4:
            accelerator.save_state = save_state
        return real(accelerator, out_dir, step, *rest)

    monkeypatch.setattr(loop, "save_checkpoint", failing)
    return one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(
        out, train__max_steps=4, train__save_every=2, train__validation_every=100)]))


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    """torch.save reports a full disk as a RuntimeError, after writing part of the file."""
    def save_state(path):
        os.makedirs(path, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"\0" * 10)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos; file write failed")

    out = tmp_path / "run"
    line = train_failing_the_last_save(monkeypatch, capsys, out, save_state)
    assert "file write failed" in line and "checkpoint_2 is intact" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint_2"]


# ---------------------------------------------------------------- recipes

@pytest.mark.parametrize("override, key", [
    ("train.lr=-0.001", "train.lr"), ("train.mixed_precision=fp64", "train.mixed_precision"),
    ("method.num_depths=0", "method.num_depths"), ("train.validation_every=0", "train.validation_every"),
    ("train.save_every=0", "train.save_every"), ("train.log_every=0", "train.log_every"),
])
def test_values_a_run_cannot_use_are_refused_before_it_starts(tmp_path, capsys, override, key):
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(out), override]))
    assert key in line and not out.exists()


def test_an_empty_recipe_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert "is empty" in one_line_error(capsys, main(["train", str(empty), f"train.output_dir={tmp_path / 'r'}"]))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("method", trainable())
def test_rows_beyond_the_targets_positions_are_refused(run, tmp_path, capsys, method):
    if method == "mtp":  # it builds the target it trains
        extra = {"target__max_position_embeddings": 32, "train__seq_len": 64}
    else:  # refused before any data is regenerated
        extra = {"train__seq_len": 4096, "target__path": str(run)}
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path(method), *overrides(out, **extra)]))
    assert "train.seq_len" in line and "is beyond the" in line and not out.exists()


# ---------------------------------------------------------------- broken targets and data

@pytest.fixture(scope="module")
def broken_targets(run, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    made = {}
    for name in ("bad_json", "bad_field", "cut_weights"):
        made[name] = root / name
        shutil.copytree(run / "model", made[name])
    config = made["bad_json"] / "config.json"
    config.write_text(config.read_text()[:100])
    config = json.loads((made["bad_field"] / "config.json").read_text())
    config["num_attention_heads"] = "four"
    (made["bad_field"] / "config.json").write_text(json.dumps(config))
    weights = made["cut_weights"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return made


@pytest.mark.parametrize("method", trainable())
def test_training_against_a_broken_target_is_one_line(broken_targets, tmp_path, capsys, method):
    for name, folder in broken_targets.items():
        out = tmp_path / name
        line = one_line_error(capsys, main(["train", recipe_path(method),
                                            *overrides(out, target__path=str(folder))]))
        assert str(folder) in line, (name, line)
        assert not out.exists(), name  # no empty run folder left behind


def test_eval_and_regenerate_against_a_broken_target_are_one_line(broken_targets, tmp_path, capsys):
    for name, folder in broken_targets.items():
        assert str(folder) in one_line_error(capsys, main(eval_args(folder, tmp_path / "r"))), name
        line = one_line_error(capsys, main(["data", "regenerate", "--target", str(folder),
                                            "--out", str(tmp_path / "o.jsonl"), "--limit", "1"]))
        assert str(folder) in line, name
    assert sorted(os.listdir(tmp_path)) == []


def test_a_posthoc_recipe_with_a_missing_target_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    line = one_line_error(capsys, main(["train", recipe_path("eagle3"),
                                        *overrides(tmp_path / "run", target__path=str(missing))]))
    assert str(missing) in line and not (tmp_path / "run").exists()


def test_bad_datasets_and_drafters_are_one_line(run, tmp_path, capsys):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert "not UTF-8" in one_line_error(capsys, main(eval_args(run, tmp_path / "r", "--dataset", str(latin1))))
    regen = ["data", "regenerate", "--target", str(run), "--out", str(tmp_path / "o.jsonl")]
    assert "not UTF-8" in one_line_error(capsys, main(regen + ["--dataset", str(latin1)]))
    assert "--limit" in one_line_error(capsys, main(regen + ["--limit", "0"]))

    other = tmp_path / "eagle3_run" / "model"  # a native drafter of another method
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"format": "draftsmith", "method": "eagle3", "config": {}}))
    line = one_line_error(capsys, main(eval_args(run, tmp_path / "r") + ["--drafter", f"draft_lm:{other.parent}"]))
    assert "is a eagle3 drafter" in line
    assert sorted(os.listdir(tmp_path)) == ["eagle3_run", "latin1.jsonl"]


def test_regenerate_refuses_prompts_beyond_the_context_and_leaves_no_partial(run, tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "def f(x):\n    return x\n" * 1500}) + "\n")
    regen = ["data", "regenerate", "--target", str(run), "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "4"]
    line = one_line_error(capsys, main(regen + ["--dataset", str(data)]))
    assert "conversation 0" in line and "exceeds the target's context of 2048" in line
    answers_only = tmp_path / "answers.jsonl"
    answers_only.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    assert "no user turn" in one_line_error(capsys, main(regen + ["--dataset", str(answers_only)]))
    assert sorted(os.listdir(tmp_path)) == ["answers.jsonl", "long.jsonl"]


# ---------------------------------------------------------------- caches whole or absent

def tiny_rows(n=6, t=4):
    return {k: torch.ones(n, t, dtype=torch.long) for k in ("input_ids", "loss_mask", "attention_mask")}


def doubled(batch):
    return {"hidden": batch["input_ids"].float() * 2}


@pytest.mark.parametrize("flags, flag", [(["--shard-rows", "-1"], "--shard-rows"), (["--batch-size", "0"], "--batch-size")])
def test_cache_sizes_are_refused_before_anything_is_written(run, tmp_path, capsys, flags, flag):
    out = tmp_path / "cache"
    line = one_line_error(capsys, main(["data", "cache-hidden", "--target", str(run), "--method", "eagle3",
                                        "--out", str(out), *flags]))
    assert flag in line and not out.exists()


def test_a_cache_without_shards_is_never_complete(tmp_path):
    from draftsmith.data.feature_cache import FeatureCache, write_feature_cache

    out = tmp_path / "cache"
    with pytest.raises(DraftsmithError, match="no rows"):
        write_feature_cache(out, {"target": {}}, tiny_rows(n=0), doubled)
    assert not out.exists()
    write_feature_cache(out, {"target": {}}, tiny_rows(), doubled, shard_rows=4)
    FeatureCache(out)
    # What the old writer left for --shard-rows -1: a manifest marked complete that plans no shards.
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in manifest["shards"]:
        (out / shard["file"]).unlink()
    (out / "manifest.json").write_text(json.dumps({**manifest, "shards": [], "complete": True}))
    with pytest.raises(DraftsmithError, match="incomplete"):
        FeatureCache(out)
    write_feature_cache(out, {"target": {}}, tiny_rows(), doubled, shard_rows=4)  # a rerun plans the shards anew
    cache = FeatureCache(out)
    assert len(cache.manifest["shards"]) == 2 and torch.equal(cache.rows(0, 6)[5]["hidden"], torch.full((4,), 2.0))


# ---------------------------------------------------------------- one rule for numbers

@pytest.mark.parametrize("recipe, override, key", [
    ("mtp", "train.lr=inf", "train.lr"), ("mtp", "train.lr=nan", "train.lr"), ("mtp", "train.clip=nan", "train.clip"),
    ("mtp", "data.regen_temperature=.nan", "data.regen_temperature"), ("mtp", "method.lambda_early=-inf", "method.lambda_early"),
    ("dflash", "method.gamma=nan", "method.gamma"),  # a float-or-None field: NaN is not "None"
    ("mtp", "train.seed=-1", "train.seed"), ("mtp", f"train.seed={2**70}", "train.seed"),
])
def test_non_finite_floats_and_seeds_out_of_range_are_refused(tmp_path, capsys, recipe, override, key):
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path(recipe), *overrides(out), override]))
    assert key in line and ("finite" in line or "2**32" in line) and not out.exists()


@pytest.mark.parametrize("flags, flag", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "0", "--temperature", "inf"], "--temperature"),
    (["--top-p", "nan"], "--top-p"), (["--confidence-threshold", "nan"], "--confidence-threshold"),
    (["--seed", "-1"], "--seed"),
])
def test_non_finite_flags_are_refused(run, tmp_path, capsys, flags, flag):
    line = one_line_error(capsys, main(eval_args(run, tmp_path / "r", *flags)))
    assert flag in line and not (tmp_path / "r").exists()
    regen = ["data", "regenerate", "--target", str(run), "--out", str(tmp_path / "o.jsonl")]
    if flag in ("--temperature", "--top-p", "--seed"):
        assert flag in one_line_error(capsys, main(regen + flags[-2:]))
    assert sorted(os.listdir(tmp_path)) == []


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    from draftsmith.train.mtp import MTPTraining

    real_loss = MTPTraining.loss

    def nan_from_step_3(self, model, batch, step, **kwargs):
        loss, metrics = real_loss(self, model, batch, step, **kwargs)
        return (loss * float("nan") if step >= 2 else loss), metrics

    monkeypatch.setattr(MTPTraining, "loss", nan_from_step_3)
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(out, **{**STRAIGHT, "train__save_every": 2})]))
    kept = latest_checkpoint(out)
    assert "step 3: the training loss is nan" in line and f"{kept} is kept" in line
    assert os.listdir(out / "checkpoints") == [kept.name] and check_checkpoint(kept) == 2
    assert not (out / "model").exists()
    assert max(r["step"] for r in rows(out)) == 2


def test_derived_figures_show_a_nan_loss():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)

    class Method:
        def loss(self, model, batch, step, micro=0, total_steps=0):
            return torch.tensor(float("nan")), {"loss_main": float("nan")}

    val = loop.validation_metrics(Method(), torch.nn.Linear(1, 1), [{"x": 1}], 1, 0, accelerator)
    assert math.isnan(val["val/ppl"]) and math.isnan(val["val/loss"])


# ---------------------------------------------------------------- run folders belong to one run

def test_a_fresh_run_into_another_runs_folder_is_refused_unless_resumed_or_overwritten(run, tmp_path, capsys):
    work = copy_run(run, tmp_path)
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    owner = json.loads((work / "run.json").read_text())["run_id"]
    line = one_line_error(capsys, main(resume_args(work)))
    assert f"holds another run (run {owner}" in line and "train.overwrite=true" in line
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before  # nothing touched
    assert "ask for one of them" in one_line_error(capsys, main(resume_args(work, "train.overwrite=true",
                                                                           train__resume=True)))
    assert main(resume_args(work, "train.overwrite=true", train__max_steps=3)) == 0
    assert "removing the run in" in capsys.readouterr().err
    assert [check_checkpoint(p) for p in (work / "checkpoints").iterdir()] == [3]  # the old run's are gone
    assert max(r["step"] for r in rows(work)) == 3
    assert json.loads((work / "run.json").read_text())["replaces"] == owner


def test_a_second_process_on_a_run_folder_is_refused(tmp_path, capsys):
    """A real second process holds the folder's lock; a run into the folder refuses, naming it."""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom draftsmith.fsutil import folder_lock\n"
         f"with folder_lock({str(out)!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(out, **STRAIGHT)]))
        assert f"is in use by process {holder.pid}" in line
        assert sorted(os.listdir(out)) == [".lock"]  # the holder's lock, and nothing of ours
    finally:
        holder.kill()
        holder.wait()
    # Killed with its lock file left behind: the next run takes the stale lock over and says so.
    assert (out / ".lock").read_text().strip() == str(holder.pid)
    assert main(["train", recipe_path("mtp"), *overrides(out, **{**STRAIGHT, "train__max_steps": 1})]) == 0
    assert f"taking over the lock of process {holder.pid}" in capsys.readouterr().err
    assert not (out / ".lock").exists() and (out / "model").is_dir()


def test_two_runs_at_once_into_one_folder(tmp_path):
    """Two real training processes: the second refuses in one line while the first runs on."""
    import signal

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "draftsmith.cli", "train", recipe_path("mtp"),
           *overrides(out, **{**STRAIGHT, "train__max_steps": 100_000, "train__save_every": 100_000})]
    # Its stderr to a file, not a pipe: nobody reads a pipe while it trains, and once its
    # progress bar fills one the run blocks in a write and can neither train nor stop.
    log = tmp_path / "first.err"
    # SIGINT back to its default in the child: a shell's background job (CI's, nohup's) runs
    # with SIGINT ignored, the child would inherit that, and Python would not turn it into
    # KeyboardInterrupt, so the run would neither stop nor release its lock.
    with log.open("w") as err:  # the child keeps its own copy of the descriptor
        first = subprocess.Popen(cmd, stderr=err, text=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while not (out / "metrics.jsonl").is_file():  # under way: its lock is held
            assert first.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        second = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        assert first.poll() is None  # still running: the refusal was the lock's, not a finished run's
        assert second.returncode == 2 and f"is in use by process {first.pid}" in second.stderr
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            first.kill()  # never left training on behind the suite
            raise
    assert not (out / ".lock").exists()  # released on the way out


# ---------------------------------------------------------------- outputs never replace inputs

def test_regenerate_out_equal_to_an_input_or_a_folder_is_refused_up_front(run, tmp_path, capsys, monkeypatch):
    import draftsmith.data.regenerate as regenerate_module

    def no_generation(*args, **kwargs):
        raise AssertionError("generation started before --out was checked")

    monkeypatch.setattr(regenerate_module, "load_pretrained_tokenizer", no_generation, raising=False)
    data = tmp_path / "human.jsonl"
    human = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "mine"}]})
    data.write_text(human + "\n")
    regen = ["data", "regenerate", "--target", str(run), "--dataset", str(data)]
    line = one_line_error(capsys, main(regen + ["--out", str(data)]))
    assert "--out" in line and "is the --dataset being read" in line
    (tmp_path / "link.jsonl").hardlink_to(data)  # the same file under another name
    assert "is the --dataset" in one_line_error(capsys, main(regen + ["--out", str(tmp_path / "link.jsonl")]))
    folder = tmp_path / "answers"
    folder.mkdir()
    assert "is a folder" in one_line_error(capsys, main(regen + ["--out", str(folder)]))
    assert data.read_text() == human + "\n" and sorted(os.listdir(tmp_path)) == ["answers", "human.jsonl", "link.jsonl"]
    read = find_model_dir(run)  # the run's best weights (RUN/best/model)
    model_files = sorted(os.listdir(read))
    line = one_line_error(capsys, main(["data", "cache-hidden", "--target", str(run), "--method", "eagle3",
                                        "--out", str(read)]))
    assert "is the --target being read" in line and sorted(os.listdir(read)) == model_files


# ---------------------------------------------------------------- files as open() would write them

@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_written_files_follow_the_umask(run, tmp_path, umask, file_mode, dir_mode):
    from safetensors.torch import save_file

    from draftsmith.fsutil import atomic_dir, write_json

    old = os.umask(umask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "folder") as tmp:
            (tmp / "inside.txt").write_text("x")
        write_json(tmp_path / "a.json", {"x": 2})  # a replacement keeps the rule too
        with atomic_dir(tmp_path / "export") as tmp:  # as the exports and save_drafter write
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            write_json(tmp / "config.json", {})
    finally:
        os.umask(old)
    exported = [tmp_path / "export", *(tmp_path / "export").rglob("*")]
    assert {p.stat().st_mode & 0o777 for p in exported} == {file_mode, dir_mode}  # safetensors' too
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "folder").stat().st_mode & 0o777 == dir_mode
    assert (tmp_path / "folder" / "inside.txt").stat().st_mode & 0o777 == file_mode


def test_a_models_files_follow_the_umask(run):
    """The run fixture wrote its model and checkpoints under pytest's umask."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [run / "model", *(run / "model").iterdir(), run / "metrics.jsonl", run / "recipe.yaml",
                 run / "run.json", latest_checkpoint(run) / "step.json"]:
        assert path.stat().st_mode & 0o777 == (0o777 if path.is_dir() else 0o666) & ~mask, path


# ---------------------------------------------------------------- a full disk, in every command

def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def torch_short_write(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 576 vs 484")


def test_a_full_disk_in_eval_keeps_the_previous_report(run, tmp_path, capsys, monkeypatch):
    import draftsmith.eval.report as report_module

    out = tmp_path / "r"
    assert main(eval_args(run, out)) == 0
    before = (out / "report.json").read_text()
    monkeypatch.setattr(report_module, "write_json", enospc)
    line = one_line_error(capsys, main(eval_args(run, out)))
    assert f"cannot write {out}: the disk is full (No space left on device); the previous {out} is intact" in line
    assert (out / "report.json").read_text() == before and sorted(os.listdir(tmp_path)) == ["r"]


def test_a_full_disk_when_saving_the_model_is_one_line(tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", torch_short_write)
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(out, **STRAIGHT)]))
    # The model is first written into the first checkpoint (checkpoint_N/model, what export and
    # eval read of it); the last weights are that step's files, linked.
    assert "cannot write the checkpoint of step 3" in line and "the disk is full" in line and "unexpected pos" in line
    assert "no earlier checkpoint exists" in line
    assert not (out / "model").exists() and latest_checkpoint(out) is None
    assert not list((out / "checkpoints").glob("*"))  # the failed one removed whole (with its folder)


def test_a_full_disk_in_regeneration_keeps_the_answers_written(run, tmp_path, capsys, monkeypatch):
    import draftsmith.data.regenerate as regenerate_module

    real_fsync, calls = os.fsync, []

    def fsync_then_full(fd):
        calls.append(fd)
        if len(calls) > 1:
            enospc()
        real_fsync(fd)

    monkeypatch.setattr(regenerate_module.os, "fsync", fsync_then_full)
    out = tmp_path / "o.jsonl"
    regen = ["data", "regenerate", "--target", str(run), "--out", str(out), "--limit", "2", "--batch-size", "1",
             "--max-new-tokens", "2"]
    line = one_line_error(capsys, main(regen))
    assert "the disk is full" in line and "rerun the same command to resume" in line
    partial = next(tmp_path.glob(".o.jsonl.*.partial"))
    assert len(partial.read_text().splitlines()) >= 1 and not out.exists()
    monkeypatch.setattr(regenerate_module.os, "fsync", real_fsync)
    assert main(regen) == 0 and len(out.read_text().splitlines()) == 2


def test_a_full_disk_in_export_and_in_the_feature_cache_is_one_line(tmp_path, monkeypatch):
    from draftsmith.data import feature_cache
    from draftsmith.data.feature_cache import FeatureCache, write_feature_cache
    from draftsmith.errors import DiskFull
    from draftsmith.fsutil import atomic_dir

    with pytest.raises(DiskFull, match=r"cannot write .*export: the disk is full .*export was not written"):
        with atomic_dir(tmp_path / "export") as tmp:  # as every export writes
            torch.save({"w": torch.zeros(2)}, tmp / "w.pt")
            torch_short_write()
    assert sorted(os.listdir(tmp_path)) == []
    out = tmp_path / "cache"
    real_save = feature_cache.save
    monkeypatch.setattr(feature_cache, "save", lambda tensors: real_save(tensors) if "input_ids" in tensors
                        else enospc())
    with pytest.raises(DiskFull, match=r"shard-00000.safetensors: the disk is full .* was not written"):
        write_feature_cache(out, {"target": {}}, tiny_rows(), doubled, shard_rows=4)
    monkeypatch.setattr(feature_cache, "save", real_save)
    with pytest.raises(DraftsmithError, match="incomplete"):
        FeatureCache(out)
    write_feature_cache(out, {"target": {}}, tiny_rows(), doubled, shard_rows=4)
    FeatureCache(out)


# ---------------------------------------------------------------- bad input, one line each

def test_a_recipe_with_a_key_twice_or_not_utf8_is_refused(tmp_path, capsys):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 0.01\neval:\n  num_prompts: 2\ntrain:\n  max_steps: 3\n")
    line = one_line_error(capsys, main(["train", str(twice), f"train.output_dir={tmp_path / 'r'}"]))
    assert str(twice) in line and "(line 5)" in line and "'train' is given twice" in line
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("train:\n  output_dir: caf\xe9\n".encode("latin-1"))
    assert "is not UTF-8" in one_line_error(capsys, main(["recipe", "show", str(latin1)]))
    assert sorted(os.listdir(tmp_path)) == ["latin1.yaml", "twice.yaml"]


@pytest.mark.parametrize("heads, message", [
    ('"8"', "'8'"), ("8.0", "8.0"), ("[8]", "[8]"), ("-8", "-8"), ("0", "no num_attention_heads"),
])
def test_plan_refuses_head_counts_that_are_no_positive_whole_number(tmp_path, capsys, heads, message):
    (tmp_path / "config.json").write_text(f'{{"num_attention_heads": {heads}, "num_key_value_heads": 1}}')
    line = one_line_error(capsys, main(["plan", str(tmp_path)]))
    assert message in line and "G =" not in line


@pytest.mark.parametrize("config, message", [
    ([1, 2], "expected a JSON object at the top level, got list"),
    ({"architectures": 5}, "'architectures' must be a list of class names, got 5"),
    ({"format": "draftsmith", "method": ["eagle3"], "config": {}}, "'method' must be a method's name"),
    ({"format": "draftsmith", "method": "eagle3", "config": [1]}, "'config' must be a mapping"),
])
def test_drafter_configs_of_the_wrong_shape_are_one_line(run, tmp_path, capsys, config, message):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(config))
    line = one_line_error(capsys, main(eval_args(run, tmp_path / "r") + ["--drafter", f"eagle3:{drafter}"]))
    assert message in line and str(drafter) in line


def test_a_tokenizer_larger_than_the_targets_vocabulary_is_one_line(run, tmp_path, capsys):
    from transformers import AutoTokenizer

    target = tmp_path / "target"
    shutil.copytree(run / "model", target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.add_tokens([f"<extra{i}>" for i in range(40)])
    tokenizer.save_pretrained(str(target))
    line = one_line_error(capsys, main(eval_args(target, tmp_path / "r")))
    assert f"has {len(tokenizer)} tokens, more than the 384 of target {target}" in line
    line = one_line_error(capsys, main(["data", "regenerate", "--target", str(target), "--out",
                                        str(tmp_path / "o.jsonl"), "--limit", "1"]))
    assert "more than the 384" in line and sorted(os.listdir(tmp_path)) == ["target"]


def test_mtp_heads_against_a_target_of_another_family_are_one_line(run, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=384, n_embd=32, n_layer=1, n_head=2, n_positions=256, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(run / "model" / name, gpt2)
    capsys.readouterr()
    line = one_line_error(capsys, main(["eval", "--target", str(gpt2), "--drafter", f"mtp:{run}", "--out",
                                        str(tmp_path / "r"), "--num-prompts", "1", "--max-new-tokens", "2",
                                        "--prompt-chars", "40", "--num-draft", "2"]))
    assert "MTP modules of a llama target, not of the gpt2 target given" in line


def test_a_full_disk_anywhere_else_is_one_line(tmp_path, capsys, monkeypatch):
    """Appending a metrics line is no atomic write: the command still ends in one line."""
    monkeypatch.setattr(loop, "log_metrics", enospc)
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(tmp_path / "run", **STRAIGHT)]))
    assert "the disk is full (No space left on device)" in line and "are intact" in line


# ---------------------------------------------------------------- round three: outputs that are not files

def out_commands(run, out: Path) -> dict[str, list[str]]:
    """Every command that writes an --out, writing `out`; each refuses a bad --out before any work."""
    from draftsmith.registry import export_formats

    return {
        "regenerate": ["data", "regenerate", "--target", str(run), "--out", str(out), "--limit", "1"],
        "eval": eval_args(run, out),
        "export": ["export", str(run), "--format", export_formats()[0], "--out", str(out)],
        "cache-hidden": ["data", "cache-hidden", "--target", str(run), "--method", "eagle3", "--out", str(out)],
        "prepare": ["data", "prepare", "sharegpt", "--out", str(out)],
    }


@pytest.mark.parametrize("kind", ["fifo", "link to a file", "link to a folder", "dangling link"])
def test_an_out_that_is_no_regular_file_or_folder_is_refused_before_any_work(run, tmp_path, capsys, kind):
    """A rename replaces a name, not what it names: --out /dev/full (as root) became a regular
    file of answers, and a link became our file. A FIFO stands in for a device here."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    out = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to({"link to a file": mine / "notes.txt", "link to a folder": mine,
                        "dangling link": tmp_path / "nowhere"}[kind])
    for name, args in out_commands(run, out).items():
        line = one_line_error(capsys, main(args))
        expected = "is a named pipe (FIFO), not a regular file" if kind == "fifo" else "is a symbolic link (to "
        assert expected in line and str(out) in line, (name, line)
    assert out.is_symlink() or out.is_fifo()
    assert (mine / "notes.txt").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["mine", "out"]


def test_a_second_writer_of_an_output_is_refused_in_one_line(run, tmp_path, capsys):
    """Two regenerations into one --out shared one partial file (every answer twice, or a
    FileNotFoundError at the rename), and two evals both "succeeded": one writer per output."""
    outs = {name: tmp_path / name for name in ("regenerate.jsonl", "eval", "export", "cache", "prepare.jsonl")}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import contextlib, sys, time\nfrom draftsmith.fsutil import output_lock\n"
         "with contextlib.ExitStack() as stack:\n    for out in sys.argv[1:]:\n"
         "        stack.enter_context(output_lock(out))\n    print('held', flush=True)\n    time.sleep(60)",
         *map(str, outs.values())], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        commands = out_commands(run, tmp_path / "x")
        for (name, args), out in zip(commands.items(), outs.values()):
            args = [str(out) if a == str(tmp_path / "x") else a for a in args]
            line = one_line_error(capsys, main(args))
            assert f"--out {out} is in use by process {holder.pid}" in line, (name, line)
        assert sorted(os.listdir(tmp_path)) == sorted(f".{out.name}.lock" for out in outs.values())
    finally:
        holder.kill()
        holder.wait()


def test_report_folders_are_named_by_the_exact_temperature(run, tmp_path, capsys):
    """`:g` named both t1e-07: the second report replaced the first and report.json listed one."""
    from draftsmith.eval.report import temperature_label

    assert [temperature_label(t) for t in (0.0, -0.0, 0.7, 1.0, 1e-7, 1.0000001e-7)] == \
        ["t0", "t0", "t0.7", "t1", "t1e-07", "t1.0000001e-07"]
    out = tmp_path / "r"
    assert main(eval_args(run, out, "--temperature", "1e-7", "--temperature", "1.0000001e-7")) == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert sorted(runs) == ["t1.0000001e-07", "t1e-07"]
    temps = [json.loads((out / label / "report.json").read_text())["settings"]["temperature"] for label in sorted(runs)]
    assert temps == [1.0000001e-7, 1e-7]
    line = one_line_error(capsys, main(eval_args(run, tmp_path / "r2", "--temperature", "0", "--temperature", "-0.0")))
    assert "are one setting (report folder t0)" in line and not (tmp_path / "r2").exists()


# ---------------------------------------------------------------- resumes that change the recipe

@pytest.mark.parametrize("override, change", [
    ("train.seq_len=16", "train.seq_len from 32 to 16"), ("train.batch_size=2", "train.batch_size from 4 to 2"),
    ("train.seed=1", "train.seed from 0 to 1"), ("method.num_depths=1", "method.num_depths from 2 to 1"),
    ("train.max_steps=5", "train.max_steps from 6 to 5"),
])
def test_a_resume_that_changes_the_runs_trajectory_is_refused(run, tmp_path, capsys, override, change):
    work = copy_run(run, tmp_path)
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    line = one_line_error(capsys, main(resume_args(work, override, train__resume="true")))
    assert "cannot resume from" in line and change in line and "train.resume_changes=allow" in line
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before


def test_a_resume_allowed_to_change_records_the_change_and_its_step(run, tmp_path):
    work = copy_run(run, tmp_path)
    assert main(resume_args(work, "train.seed=1", "train.resume_changes=allow", train__resume="true",
                            train__max_steps=7, train__validation_every=50)) == 0
    changes = {c["key"]: c for c in json.loads((work / "run.json").read_text())["changes"]}
    assert changes["train.seed"] == {"step": 6, "key": "train.seed", "was": 0, "now": 1}
    assert {k: (c["was"], c["now"]) for k, c in changes.items() if k != "train.seed"} == \
        {"train.max_steps": (6, 7), "train.validation_every": (100, 50)}  # these pass without allow
    assert "seed: 1" in (work / "recipe.yaml").read_text() and max(r["step"] for r in rows(work)) == 7


# ---------------------------------------------------------------- every write error is one line

def test_a_file_size_limit_a_read_only_disk_and_an_io_error_are_one_line(tmp_path, monkeypatch, capsys):
    """A real `ulimit -f` under safetensors' writer (exports, checkpoints) and torch.save; then
    EROFS and EIO as the OS reports them. Each is one line saying what was kept."""
    import resource

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from draftsmith.errors import DiskFull
    from draftsmith.fsutil import atomic_dir

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for write in (lambda tmp: save_file({"w": torch.zeros(4096)}, str(tmp / "model.safetensors")),
                  lambda tmp: torch.save({"w": torch.zeros(4096)}, tmp / "w.pt")):
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            with pytest.raises(DiskFull) as caught:
                with atomic_dir(tmp_path / "export") as tmp:
                    write(tmp)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert "cannot write" in str(caught.value) and "was not written" in str(caught.value)
        assert sorted(os.listdir(tmp_path)) == []
    assert "the file is past the file-size limit (Error while serializing: I/O error: File too large" in \
        _atomic_failure(tmp_path, SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    assert "the file system is read-only (Read-only file system)" in _atomic_failure(
        tmp_path, OSError(errno.EROFS, "Read-only file system"))

    def efbig_save_state(*args, **kwargs):  # as accelerate's save_state reports safetensors' error
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    line = train_failing_the_last_save(monkeypatch, capsys, tmp_path / "run", efbig_save_state)
    assert "the file is past the file-size limit: Error while serializing" in line and "checkpoint_2 is intact" in line
    monkeypatch.setattr(loop, "log_metrics", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(tmp_path / "run2", **STRAIGHT)]))
    assert "the device reported an I/O error (Input/output error)" in line and "are intact" in line


def _atomic_failure(tmp_path, exc) -> str:
    from draftsmith.errors import DiskFull
    from draftsmith.fsutil import atomic_dir

    with pytest.raises(DiskFull) as caught:
        with atomic_dir(tmp_path / "export"):
            raise exc
    return str(caught.value)


def test_a_truncated_cache_file_is_one_line_and_a_rerun_writes_it_anew(tmp_path):
    from draftsmith.data.feature_cache import FeatureCache, write_feature_cache

    out = tmp_path / "cache"
    write_feature_cache(out, {"target": {}}, tiny_rows(), doubled, shard_rows=4)
    for name in ("rows.safetensors", "shard-00001.safetensors"):
        file = out / name
        os.truncate(file, file.stat().st_size // 2)
        with pytest.raises(DraftsmithError, match=rf"{name} is truncated or damaged \(.*\); rerun draftsmith data "
                                                  "cache-hidden with the same arguments"):
            FeatureCache(out)
        write_feature_cache(out, {"target": {}}, tiny_rows(), doubled, shard_rows=4)  # writes the cut file anew
        assert torch.equal(FeatureCache(out).rows(0, 6)[5]["hidden"], torch.full((4,), 2.0))


# ---------------------------------------------------------------- shapes checked where they are declared

@pytest.mark.parametrize("recipe, override, message", [
    ("mtp", "target.intermediate_size=-1", "target.intermediate_size: must be at least 0, got -1"),
    ("mtp", "target.hidden_size=30", "target.num_heads=4 does not divide target.hidden_size=30"),
    ("mtp", "target.num_kv_heads=3", "target.num_kv_heads=3 does not divide target.num_heads=4"),
    ("mtp", "method.lambda_switch=2", "method.lambda_switch: a fraction of the run"),
    ("draft_lm", "method.hidden_size=30", "method.num_heads=4 does not divide method.hidden_size=30"),
    ("eagle3", "method.intermediate_size=-1", "method.intermediate_size: must be at least 1, got -1"),
    ("eagle3", "method.num_heads=3", "method.num_heads=3 does not divide method.hidden_size=64"),
    ("dflash", "method.num_kv_heads=3", "method.num_kv_heads=3 does not divide method.num_heads=4"),
    ("dflash", "method.gamma=0", "method.gamma: the loss decay over draft positions must be positive"),
    ("dspark", "method.markov_rank=-1", "method.markov_rank: must be at least 0"),
    # Decided: a block longer than the rows is refused, not warned about (its last drafts never train).
    ("dflash", "method.block_size=128", "method.block_size=128 is longer than the rows of train.seq_len=32"),
])
def test_shapes_are_refused_in_one_line_naming_the_key_before_any_model(run, tmp_path, capsys, recipe, override,
                                                                       message):
    """EAGLE-3's heads not dividing the width were a huggingface_hub validator's 47 lines, and
    target.intermediate_size=-1 torch's negative dimension; a post-hoc method is refused
    against its target's config before any answer is regenerated."""
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path(recipe), *overrides(out, target__path=str(run)
                                                                                 if recipe in posthoc() else ""),
                                        override]))
    assert message in line and not out.exists()


def test_a_deleted_working_directory_is_one_line(run, tmp_path):
    """transformers resolves a path against the working directory as it is imported (a
    FileNotFoundError traceback, every path given absolute)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    result = subprocess.run([sys.executable, "-m", "draftsmith.cli", "plan", str(run / "model")],
                            preexec_fn=lambda: (os.chdir(gone), os.rmdir(gone)), capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip() == ("draftsmith: error: the working directory no longer exists (deleted while this "
                                     "shell was in it): cd to an existing folder and run again")


# ---------------------------------------------------------------- text the tokenizer cannot take

def test_lone_surrogates_in_a_dataset_are_replaced_and_counted(run, tmp_path, capsys):
    """A JSON "\\ud800" (half a UTF-16 pair) reached the tokenizer: a TypeError in eval and regenerate."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "caf\\ud800 au lait"}\n{"turns": ["ok", "\\udfff?"]}\n', encoding="ascii")
    note = f"draftsmith: {data}: replaced {{}} lone UTF-16 surrogate(s) (invalid text, first in conversation 0) with U+FFFD"
    assert main(eval_args(run, tmp_path / "r", "--dataset", str(data), "--num-prompts", "2")) == 0
    assert note.format(2) in capsys.readouterr().err
    out = tmp_path / "o.jsonl"
    assert main(["data", "regenerate", "--target", str(run), "--dataset", str(data), "--out", str(out),
                 "--max-new-tokens", "2"]) == 0
    assert note.format(2) in capsys.readouterr().err
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])["messages"][0]["content"]
    assert first == "caf\ufffd au lait"


# ---------------------------------------------------------------- the debatable cases, decided

def test_a_nan_stop_names_only_a_checkpoint_whose_weights_are_finite(tmp_path, monkeypatch, capsys):
    """Decided: "the last good checkpoint" is read before it is named; one with NaN weights is not."""
    from safetensors.torch import load_file, save_file

    from draftsmith.train.mtp import MTPTraining

    real_loss, real_save = MTPTraining.loss, loop.save_checkpoint

    def nan_from_step_3(self, model, batch, step, **kwargs):
        loss, metrics = real_loss(self, model, batch, step, **kwargs)
        return (loss * float("nan") if step >= 2 else loss), metrics

    def poisoned(accelerator, out_dir, step, *rest):  # weights turned NaN on disk since
        real_save(accelerator, out_dir, step, *rest)
        file = out_dir / "checkpoints" / f"checkpoint_{step}" / "model.safetensors"
        save_file({k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in load_file(file).items()},
                  str(file), metadata={"format": "pt"})

    monkeypatch.setattr(MTPTraining, "loss", nan_from_step_3)
    monkeypatch.setattr(loop, "save_checkpoint", poisoned)
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(out, **{**STRAIGHT,
                                                                                       "train__save_every": 2})]))
    assert "step 3: the training loss is nan" in line
    assert "no checkpoint with finite weights had been saved; the later checkpoint_2 hold NaN" in line


def test_a_run_that_cannot_learn_or_validate_says_so_once(tmp_path, capsys):
    """Decided: train.lr=0 (a dry run) and train.validation_batches=0 (validation off) are taken, and said."""
    out = tmp_path / "run"
    assert main(["train", recipe_path("mtp"), *overrides(out, train__max_steps=1, train__lr=0,
                                                         train__validation_batches=0)]) == 0
    err = capsys.readouterr().err
    assert err.count("train.lr=0: the weights will not change") == 1
    assert err.count("train.validation_batches=0: validation is off") == 1
    assert not any(k.startswith("val/") for r in rows(out) for k in r)
