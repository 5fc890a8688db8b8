"""A run keeps its best weights by validation beside the last; a run folder stands for its
best, a checkpoint folder for its own weights, and the report names which were used."""

import json

from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.run_weights import weights_label
from draftsmith.train import loop
from draftsmith.train.best import BestWeights
from draftsmith.train.loop import train
from tiny_runs import tiny_recipe

REAL_VALIDATION = loop.validation_metrics


def scripted_validation(monkeypatch, losses: dict[int, float]) -> None:
    """Validation reports `losses[step]` as val/loss (the real metrics otherwise), so which
    step is best is known in advance."""
    def scripted(method, model, loader, max_batches, step, *rest):
        return {**REAL_VALIDATION(method, model, loader, max_batches, step, *rest), "val/loss": losses[step]}

    monkeypatch.setattr(loop, "validation_metrics", scripted)


def tensors(folder):
    return load_file(str(next(folder.rglob("model.safetensors"))))


def same_weights(a, b) -> bool:
    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def mtp_run(run, **extra):
    return tiny_recipe("mtp", run, train__validation_every=2, train__save_every=2, train__keep_checkpoints=0, **extra)


def test_a_run_stands_for_its_best_weights_and_a_checkpoint_for_its_own(tmp_path, monkeypatch):
    run = tmp_path / "run"
    scripted_validation(monkeypatch, {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5})  # MTP estimates no tau: lowest loss
    train(mtp_run(run))
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 4, "metric": "val/loss", "value": 1.0}
    best, checkpoint = run / "best" / "model", run / "checkpoints" / "checkpoint_4"
    assert find_model_dir(run) == best and find_model_dir(checkpoint) == checkpoint / "model"
    assert same_weights(best, checkpoint / "model") and not same_weights(best, run / "model")
    assert weights_label(best) == "best (step 4, val/loss 1)"
    assert weights_label(checkpoint / "model") == "checkpoint step 4" and weights_label(run / "model") == "last"
    # The report names the weights each drafter read.
    out = tmp_path / "report"
    assert main(["eval", "--target", str(run), "--drafter", f"mtp:{run}", "--drafter", f"last=mtp:{run / 'model'}",
                 "--out", str(out), "--num-prompts", "1", "--max-new-tokens", "8", "--prompt-chars", "60"]) == 0
    rows = {d["name"]: d["weights"] for d in json.loads((out / "report.json").read_text())["drafters"]}
    assert rows == {"mtp": "best (step 4, val/loss 1)", "last": "last"}
    assert "| drafter | weights | D |" in (out / "report.md").read_text()


def test_the_best_is_the_highest_estimated_tau_where_validation_estimates_one(tmp_path):
    keeper = BestWeights(tmp_path, None, writer=True)
    kept = []
    for step, tau in ((1, 1.2), (2, 1.5), (3, 1.4), (4, float("nan")), (5, 1.5)):
        val = {"val/loss": 9.0 - step, "val/tau_est": tau}  # the loss falls throughout: tau decides
        if keeper.offer(val, step, lambda folder, step=step: (folder / "model").mkdir()):
            kept.append(step)
    assert kept == [1, 2]  # a NaN is never best, a tie keeps the earlier
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 2
    assert not keeper.offer({"val/acc_1": 0.5}, 6, lambda folder: None)  # nothing to judge by


def test_a_resume_keeps_an_earlier_best_and_sets_aside_a_later_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    scripted_validation(monkeypatch, {2: 2.0, 4: 3.0, 6: 1.0, 8: 4.0})
    train(mtp_run(run))
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 6
    # Resumed from step 4: step 6's best belongs to the abandoned trajectory; the new one is
    # judged afresh from the resumed steps on.
    scripted_validation(monkeypatch, {6: 2.5, 8: 1.5})
    train(mtp_run(run, train__resume=str(run / "checkpoints" / "checkpoint_4")))
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 8, "metric": "val/loss", "value": 1.5}
    aside = [p.name for p in (run / "abandoned").iterdir()]
    assert any(name.startswith("best-step6-") for name in aside) and "checkpoint_6" in aside
    # Resumed from step 8 itself, the best on record (step 8, 1.5) is kept and beaten only by less.
    scripted_validation(monkeypatch, {10: 1.7, 12: 1.6})
    train(mtp_run(run, train__resume=True, train__max_steps=12))
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 8


def test_a_run_without_validation_stands_for_its_last_weights(tmp_path):
    run = tmp_path / "run"
    train(tiny_recipe("mtp", run, train__validation_batches=0))
    assert not (run / "best").exists() and find_model_dir(run) == run / "model"
