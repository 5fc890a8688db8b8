"""Faults a long run meets and bad input, each ending in one line (exit status 2) that names
the file, key or flag, and nothing of the user's lost or left half-written."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from draftsmith.cli import main
from draftsmith.train import loop
from draftsmith.train.loop import latest_checkpoint, train
from tiny_runs import ROOT, overrides, tiny_recipe

STRAIGHT = dict(train__max_steps=6, train__log_every=2, train__save_every=3, train__eval_every=100)


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

def test_validation_of_eval_batches_before_a_partial_last_batch():
    """eval_batches + 1 batches, the last one partial: fetching it would end the loader's pass,
    and gather_for_metrics would then cut the per-process means to the remainder (3)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    data = [{"x": torch.tensor([float(i)])} for i in range(11)]  # batches of 4, 4, 3
    loader = accelerator.prepare(DataLoader(data, batch_size=4))

    class Method:
        def loss(self, model, batch, step):
            return batch["x"].mean(), {f"m{k}": float(batch["x"].sum()) for k in range(6)}

    val = loop.evaluate(Method(), torch.nn.Linear(1, 1), loader, 2, 0, accelerator)
    assert val["val/loss"] == pytest.approx((1.5 + 5.5) / 2) and val["val/m0"] == pytest.approx((6 + 22) / 2)
    assert len(val) == 7


# ---------------------------------------------------------------- checkpoints and resume

def resume_args(run, *extra, **values):
    return ["train", recipe_path("mtp"), *overrides(run, **{**STRAIGHT, **values}), *extra]


def test_a_damaged_latest_checkpoint_is_named_and_an_earlier_one_resumes(run, tmp_path, capsys):
    work = copy_run(run, tmp_path)
    latest, earlier = work / "checkpoints" / "step-0000006", work / "checkpoints" / "step-0000003"
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
    (work / "checkpoints" / ".tmp-step-0000005").mkdir()
    stale = work / f".model.tmp-{dead_pid()}-abc"
    stale.mkdir()
    with (work / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "train/lo')
    assert main(resume_args(work, train__resume=str(earlier))) == 0
    assert not (work / "checkpoints" / ".tmp-step-0000005").exists() and not stale.exists()
    assert_same_records(work, run)


def test_a_resume_with_another_model_shape_fails_and_keeps_the_runs_recipe(run, tmp_path, capsys):
    work = copy_run(run, tmp_path)
    recipe = (work / "recipe.yaml").read_text()
    line = one_line_error(capsys, main(resume_args(work, "target.hidden_size=32", train__resume="true")))
    assert "cannot resume from" in line and "step-0000006" in line
    assert (work / "recipe.yaml").read_text() == recipe


def test_a_resumed_run_logs_the_same_windows(run, tmp_path, monkeypatch):
    """save_every (3) is no multiple of log_every (2): the window logged at step 4 spans
    steps 3 and 4, one on each side of the checkpoint."""
    from draftsmith.train.mtp import MTPTraining

    calls = {"n": 0}
    real_loss = MTPTraining.loss

    def dying_loss(self, model, batch, step):
        calls["n"] += 1
        if calls["n"] == 5:  # step 5: after the checkpoint at 3 and the log at 4
            raise KeyboardInterrupt
        return real_loss(self, model, batch, step)

    broken = tmp_path / "broken"
    monkeypatch.setattr(MTPTraining, "loss", dying_loss)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe("mtp", broken, **STRAIGHT))
    monkeypatch.setattr(MTPTraining, "loss", real_loss)
    assert latest_checkpoint(broken).name == "step-0000003"
    train(tiny_recipe("mtp", broken, **STRAIGHT, train__resume=True))
    assert_same_records(broken, run)


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    """torch.save reports a full disk as a RuntimeError, after writing part of the file."""
    real = loop.save_checkpoint

    def full_disk(accelerator, out_dir, step, keep, window=None):
        if step == 4:
            def save_state(path):
                os.makedirs(path, exist_ok=True)
                (Path(path) / "model.safetensors").write_bytes(b"\0" * 10)
                raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos; file write failed")
            accelerator.save_state = save_state
        return real(accelerator, out_dir, step, keep, window)

    monkeypatch.setattr(loop, "save_checkpoint", full_disk)
    out = tmp_path / "run"
    line = one_line_error(capsys, main(["train", recipe_path("mtp"), *overrides(
        out, train__max_steps=4, train__save_every=2, train__eval_every=100)]))
    assert "file write failed" in line and "step-0000002 is intact" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000002"]


# ---------------------------------------------------------------- recipes

@pytest.mark.parametrize("override, key", [
    ("train.lr=-0.001", "train.lr"), ("train.mixed_precision=fp64", "train.mixed_precision"),
    ("method.num_depths=0", "method.num_depths"), ("train.eval_every=0", "train.eval_every"),
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


@pytest.mark.parametrize("method, extra", [
    ("mtp", {"target__max_position_embeddings": 32, "train__seq_len": 64}),
    ("eagle3", {"train__seq_len": 4096}),  # refused before its data is regenerated
])
def test_rows_beyond_the_targets_positions_are_refused(run, tmp_path, capsys, method, extra):
    if method != "mtp":
        extra = {**extra, "target__path": str(run)}
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


@pytest.mark.parametrize("method", ["mtp", "draft_lm", "eagle3", "dflash", "dspark"])
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
