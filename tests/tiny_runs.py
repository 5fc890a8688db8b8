"""Overrides that shrink any recipe to a run of a few seconds on one CPU core."""

from pathlib import Path

from draftsmith.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]

TINY_TARGET = {
    "target.num_layers": 2, "target.hidden_size": 64, "target.num_heads": 4, "target.num_kv_heads": 1,
    "data.vocab_size": 384, "data.max_chars": 120_000,
}
TINY_TRAIN = {
    "train.max_steps": 8, "train.batch_size": 4, "train.seq_len": 32, "train.lr": 3e-3,
    "train.log_every": 1, "train.validation_every": 4, "train.validation_batches": 2, "train.save_every": 4,
    "tracking.report_to": "none",
}


def overrides(out_dir, **extra) -> list[str]:
    values = {**TINY_TARGET, **TINY_TRAIN, "train.output_dir": str(out_dir)}
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in values.items()]


def tiny_recipe(name: str, out_dir, **extra):
    return load_recipe(ROOT / "recipes" / "tiny" / f"{name}.yaml", overrides(out_dir, **extra))


def for_method(table: dict, method: str, where: str):
    """`table[method]`, for a per-method table a test keeps beside the registry: a registered
    method the table lacks fails the test, naming the method and the table, never skipped."""
    if method not in table:
        raise AssertionError(f"method {method!r} is registered but {where} has no entry for it: add one")
    return table[method]


def interrupted(monkeypatch, training_class, call: int, start) -> None:
    """Run `start()` with `training_class.loss` raising KeyboardInterrupt at its `call`-th
    call (a run killed in the middle of a step); the real loss is back afterwards."""
    import pytest

    real, calls = training_class.loss, {"n": 0}

    def dying_loss(self, model, batch, step, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(self, model, batch, step, **kwargs)

    monkeypatch.setattr(training_class, "loss", dying_loss)
    with pytest.raises(KeyboardInterrupt):
        start()
    monkeypatch.setattr(training_class, "loss", real)
