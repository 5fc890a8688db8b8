"""The one training loop, exercised through the MTP and draft-LM methods on tiny runs."""

import errno
import json
import math
import subprocess
import sys
from collections import Counter

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.mtp import mtp_dir
from draftsmith.models.native import load_drafter
from draftsmith.recipe import load_recipe
from draftsmith.train import loop
from draftsmith.train.checkpoints import checkpoint_folders, latest_checkpoint
from draftsmith.train.loop import train
from tiny_runs import ROOT, interrupted, overrides, tiny_recipe


def history(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir):
    return [(r["step"], r["train/loss"]) for r in history(run_dir) if "train/loss" in r]


def test_mtp_loss_falls_and_depth_accuracy_beats_unigram(tmp_path):
    run = tmp_path / "run"
    recipe = tiny_recipe("mtp", run, train__max_steps=60, train__batch_size=8, train__seq_len=64,
                         train__validation_every=30, train__validation_batches=4)
    train(recipe)
    rows = history(run)
    val = [r for r in rows if "val/loss" in r]
    assert val[-1]["val/loss"] < val[0]["val/loss"] - 0.5
    first = next(r for r in rows if "train/loss" in r)["train/loss"]
    assert rows[-1]["step"] == 60 and val[-1]["val/loss"] < first
    # Unigram baseline: always predicting the most frequent validation token.
    from transformers import AutoTokenizer

    from draftsmith.train.data_setup import packed_corpus

    tok = AutoTokenizer.from_pretrained(run / "model")
    ids = packed_corpus(recipe, tok, "validation")[:]["input_ids"].flatten().tolist()
    unigram = Counter(ids).most_common(1)[0][1] / len(ids)
    for k in (1, 2):
        assert val[-1][f"val/acc_mtp_{k}"] > unigram, (k, val[-1], unigram)
    # The saved target is a plain HF causal LM; the MTP heads load beside it.
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(run / "model")
    assert target.config.num_hidden_layers == 2 and target.config.num_key_value_heads == 1
    heads = load_drafter(mtp_dir(run / "model"), "mtp", target)
    config = heads.config
    assert config.num_depths == 2 and heads.num_depths == 2
    assert (run / "recipe.yaml").read_text().count("output_dir") == 1


def test_resume_reproduces_the_uninterrupted_trajectory(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train(tiny_recipe("mtp", straight, train__save_every=3))
    expected = train_losses(straight)

    broken = tmp_path / "broken"
    from draftsmith.train.mtp import MTPTraining

    # Killed in step 6, after the checkpoint at step 3 and logged steps 4 and 5.
    interrupted(monkeypatch, MTPTraining, 6,
                lambda: train(tiny_recipe("mtp", broken, train__save_every=3, train__validation_every=100)))
    assert latest_checkpoint(broken).name == "checkpoint_3"
    assert all((p / "step.json").is_file() for p in checkpoint_folders(broken))  # no half-written one
    train(tiny_recipe("mtp", broken, train__save_every=3, train__validation_every=100, train__resume=True))
    resumed = train_losses(broken)
    assert [s for s, _ in resumed] == list(range(1, 9))
    for (s1, a), (s2, b) in zip(expected, resumed):
        assert s1 == s2 and a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path, monkeypatch):
    """Four micro-batches of 1 accumulate the gradient of one batch of 4, compared where that
    is an identity: the gradient handed to the first optimizer step (after clipping, which
    scales both by their own, equal, norms), and the first step's loss.

    Not bit-equal: the two sum the same per-token terms in another order, and the
    accumulated one adds four quarter-scaled sums. In float32 each sum is off by at most about
    n * eps * sum|terms| (n = 4 * 32 tokens, eps = 1.2e-7: ~2e-5 of the largest gradient
    entry, where the terms cancel). Weights after AdamW are no fit for this comparison: its
    first step moves every weight by lr * g / |g|, so round-off in a gradient entry near zero
    can flip a whole step of lr (the failure on torch 2.14.1). Later steps start from such
    weights; one step is compared, and every step must be one optimizer step in both runs."""
    grads: dict[str, list[list[torch.Tensor]]] = {}
    real_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        grads[current].append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    common = dict(train__max_steps=2, train__validation_every=100, train__save_every=100)
    for current, (batch, accum) in {"b4": (4, 1), "b1x4": (1, 4)}.items():
        grads[current] = []
        train(tiny_recipe("mtp", tmp_path / current, train__batch_size=batch, train__grad_accum=accum, **common))
    assert len(grads["b4"]) == len(grads["b1x4"]) == 2  # one optimizer step per accumulated step
    for a, b in zip(grads["b4"][0], grads["b1x4"][0]):
        scale = float(a.abs().max())
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5 * scale + 1e-12)
    (_, first_a), (_, first_b) = train_losses(tmp_path / "b4")[0], train_losses(tmp_path / "b1x4")[0]
    assert first_a == pytest.approx(first_b, rel=1e-5)


def test_draft_lm_trains_on_the_targets_tokenizer_with_distillation(tmp_path):
    target_run = tmp_path / "target"
    train(tiny_recipe("mtp", target_run, train__max_steps=2, train__validation_every=100))
    draft = tmp_path / "draft"
    train(tiny_recipe("draft_lm", draft, target__path=str(target_run), train__max_steps=10,
                      method__hidden_size=32, method__num_heads=2, method__num_layers=1))
    rows = history(draft)
    val = [r for r in rows if "val/loss" in r]
    assert "train/kl_target" in rows[0] and val[-1]["val/loss"] < val[0]["val/loss"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(draft / "model")
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(target_run / "model"))
    assert model.config.hidden_size == 32


def test_bad_input_gets_one_line_and_leaves_nothing_half_written(tmp_path):
    with pytest.raises(DraftsmithError, match="holds no checkpoint"):
        train(tiny_recipe("mtp", tmp_path / "fresh", train__resume=True))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DraftsmithError, match="is not writable"):
        train(tiny_recipe("mtp", blocker / "run"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DraftsmithError, match="empty"):
        train(tiny_recipe("mtp", tmp_path / "e", data__dataset=str(empty), data__tokenizer=""))
    with pytest.raises(DraftsmithError, match="distill_weight > 0 needs target.path"):
        train(tiny_recipe("draft_lm", tmp_path / "d", target__path=""))


def test_a_failed_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = loop.save_checkpoint

    def failing(accelerator, out_dir, step, *rest):
        if step == 8:
            accelerator.save_state = lambda path: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        return real(accelerator, out_dir, step, *rest)

    monkeypatch.setattr(loop, "save_checkpoint", failing)
    with pytest.raises(DraftsmithError, match="No space left on device.*checkpoint_4 is intact"):
        train(tiny_recipe("mtp", run))
    assert latest_checkpoint(run).name == "checkpoint_4"
    assert [p.name for p in checkpoint_folders(run)] == ["checkpoint_4"]  # the failed one removed
    assert not (run / "model").exists()


# Slow (16 s): `draftsmith train --accelerate-config` (tests/test_cli.py) launches the same entry
# under accelerate in the CI suite; this one launches `python -m draftsmith.train` by hand.
@pytest.mark.slow
def test_accelerate_launch_runs_the_module_entry(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes/accelerate/cpu.yaml"), "-m", "draftsmith.train",
           str(ROOT / "recipes/tiny/mtp.yaml"), *overrides(run, train__max_steps=2)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "model" / "config.json").is_file() and (run / "model" / "mtp" / "model.safetensors").is_file()
    bad = subprocess.run([sys.executable, "-m", "draftsmith.train", str(ROOT / "recipes/tiny/mtp.yaml"),
                          "train.bogus=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("train.bogus: unknown key (known: " +
                                                               bad.stderr.split("(known: ")[1].strip())


def test_accelerate_rotates_the_checkpoints_keeping_the_newest(tmp_path):
    for keep, kept in ((2, [6, 8]), (0, [2, 4, 6, 8])):  # 0: all of them
        run = tmp_path / f"keep{keep}"
        train(tiny_recipe("mtp", run, train__save_every=2, train__keep_checkpoints=keep, train__validation_every=100))
        assert [p.name for p in checkpoint_folders(run)] == [f"checkpoint_{s}" for s in kept]
        assert all((p / "step.json").is_file() for p in checkpoint_folders(run))


def test_num_epochs_sets_the_length_from_the_data(tmp_path):
    from transformers import AutoTokenizer

    from draftsmith.train.data_setup import packed_corpus

    run = tmp_path / "run"
    # Given without max_steps (which the tiny recipe sets): the override names both, so max_steps=0 too.
    recipe = tiny_recipe("mtp", run, train__max_steps=0, train__num_epochs=1.5, data__max_chars=6000,
                         train__validation_every=100, train__save_every=100)
    train(recipe)
    per_epoch = len(packed_corpus(recipe, AutoTokenizer.from_pretrained(run / "model"), "train")) // 4
    assert per_epoch >= 4
    assert [s for s, _ in train_losses(run)] == list(range(1, math.ceil(1.5 * per_epoch) + 1))


def test_the_run_length_is_max_steps_or_num_epochs(tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("method:\n  name: mtp\ntrain:\n  num_epochs: 2\n")
    recipe = load_recipe(recipe_file)  # num_epochs without max_steps: by epochs
    assert (recipe.train.max_steps, recipe.train.num_epochs) == (0, 2.0)
    with pytest.raises(DraftsmithError, match="train.max_steps=8 and train.num_epochs=2.0 both set"):
        tiny_recipe("mtp", tmp_path / "a", train__num_epochs=2)
    with pytest.raises(DraftsmithError, match="train.max_steps and train.num_epochs are both 0"):
        tiny_recipe("mtp", tmp_path / "a", train__max_steps=0)


@pytest.mark.parametrize("schedule, warmup, factor", [
    ("linear", 0.0, lambda s: 1 - s / 8),
    ("cosine", 0.0, lambda s: 0.5 * (1 + math.cos(math.pi * s / 8))),
    ("constant_with_warmup", 0.25, lambda s: min(1.0, s / 2)),
])
def test_schedules_by_name_are_transformers_own(tmp_path, schedule, warmup, factor):
    """train/lr after step s is the rate of step s + 1: transformers' closed forms over 8 steps."""
    run = tmp_path / schedule
    train(tiny_recipe("mtp", run, train__lr_schedule=schedule, train__warmup_ratio=warmup, train__validation_every=100))
    logged = [(r["step"], r["train/lr"]) for r in history(run) if "train/lr" in r]
    assert logged == [(s, pytest.approx(3e-3 * factor(s), abs=1e-12)) for s in range(1, 9)]


def test_an_unknown_schedule_is_one_line_before_any_data(tmp_path):
    with pytest.raises(DraftsmithError, match="train.lr_schedule: expected one of cosine_with_min_lr, linear"):
        train(tiny_recipe("mtp", tmp_path / "run", train__lr_schedule="cosine_annealing"))
    assert not (tmp_path / "run").exists()



@pytest.mark.parametrize("old, new", [("eval_every", "validation_every"), ("eval_batches", "validation_batches")])
def test_a_renamed_validation_key_names_its_new_name(tmp_path, old, new):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"train:\n  {old}: 5\n")
    for args in ((recipe,), (None, [f"train.{old}=5"])):
        with pytest.raises(DraftsmithError, match=rf"train.{old}: renamed to train.{new}$"):
            load_recipe(*args)


def test_a_run_recorded_under_the_old_validation_keys_resumes_unchanged(tmp_path):
    """A run folder saved before the rename (recipe.yaml with train.eval_every) is read under the
    new names: restating its values is no change, and another value one under the new key."""
    from draftsmith.recipe import dump_recipe
    from draftsmith.train.run_folder import resume_changes

    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "checkpoint_2"
    checkpoint.mkdir(parents=True)
    text = dump_recipe(tiny_recipe("mtp", out))
    (out / "recipe.yaml").write_text(text.replace("validation_every:", "eval_every:")
                                     .replace("validation_batches:", "eval_batches:"))
    assert resume_changes(tiny_recipe("mtp", out), checkpoint, 2) == []
    changed = resume_changes(tiny_recipe("mtp", out, train__validation_every=3), checkpoint, 2)
    assert changed == [{"step": 2, "key": "train.validation_every", "was": 4, "now": 3}]


def test_verbosity_flags_set_what_a_run_says(tmp_path, capsys):
    from draftsmith.cli import main

    def run(name, *flags):
        args = ["train", "--recipe", str(ROOT / "recipes/tiny/mtp.yaml"),
                *overrides(tmp_path / name, train__max_steps=2, train__validation_every=1)]
        assert main([*flags[:1], *args, *flags[1:]]) == 0
        return capsys.readouterr().err

    said = run("default")
    assert "train mtp: 2 optimizer steps" in said and "step 1: loss" in said and "wrote" in said
    quiet = run("quiet", "-q")
    assert "step 1: loss" not in quiet and "wrote" not in quiet and "train mtp" not in quiet  # no bar either
    run("verbose", "-v", "-v")  # after the subcommand too
    import logging

    assert logging.getLogger("draftsmith").level == logging.DEBUG
    run("again")  # no flag: back to the default
    assert logging.getLogger("draftsmith").level == logging.INFO


def test_every_training_method_builds_its_drafter_by_one_protocol():
    """`build_drafter` on each method's training, which calls its own model class and never looks
    the method up again by its name (the registry's tables stay with train/method.py)."""
    from draftsmith.registry import import_ref, method_spec, trainable
    from draftsmith.train.method import TrainMethod

    for name in trainable():
        training = import_ref(method_spec(name).training, name)
        assert training.build_drafter is not TrainMethod.build_drafter, name
        source = (ROOT / "train" / f"{name}.py").read_text()
        assert not any(lookup in source for lookup in ("config_class(", "method_spec(", "import_ref(")), name
