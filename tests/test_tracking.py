"""Trackers as their users expect: wandb online where wandb finds credentials, offline where
it finds none or when asked; a resumed run continues the same wandb run (its id kept in the
run folder, resume="allow") and the same tensorboard log; run name and recipe logged.
No test reaches the network: wandb.init is replaced by a recorder."""

import os
from types import SimpleNamespace

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.train import tracking
from draftsmith.train.loop import train
from tiny_runs import interrupted, tiny_recipe


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc either


@pytest.fixture
def wandb_inits(monkeypatch):
    """Every wandb.init's keyword arguments, with a run that records what is logged."""
    import wandb

    inits = []

    def init(**kwargs):
        run = SimpleNamespace(id=kwargs.get("id"), logged=[], finish=lambda: None)
        run.log = lambda values, step=None, **_: run.logged.append((step, dict(values)))
        inits.append({**kwargs, "run": run})
        return run

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "config", SimpleNamespace(update=lambda values, **_: inits[-1].update(config=values)))
    return inits


def test_wandb_is_online_only_where_it_finds_credentials(tmp_path, monkeypatch, no_credentials):
    assert tracking.wandb_mode("auto") == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")  # what `wandb login` writes
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert tracking.wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a key for another server does not count
    assert tracking.wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert tracking.wandb_mode("auto") == "online"
    assert tracking.wandb_mode("offline") == "offline"  # asked for: whatever the credentials
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's own choice is left to wandb
    assert tracking.wandb_mode("auto") is None


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch, no_credentials, wandb_inits):
    from draftsmith.train.mtp import MTPTraining

    run = tmp_path / "run"
    settings = dict(tracking__report_to="wandb", tracking__run_name="my-run", train__save_every=4, train__validation_every=100)
    interrupted(monkeypatch, MTPTraining, 6, lambda: train(tiny_recipe("mtp", run, **settings)))  # after step 4's save
    train(tiny_recipe("mtp", run, **settings, train__resume=True))
    first, resumed = wandb_inits
    assert first["id"] and resumed["id"] == first["id"] and first["resume"] == resumed["resume"] == "allow"
    assert first["mode"] == "offline" and first["name"] == "my-run" and first["dir"] == str(run)
    assert first["project"] == "draftsmith" and first["config"]["train.seq_len"] == 32  # the resolved recipe
    assert [s for s, _ in resumed["run"].logged if s is not None][0] == 5  # continues after the checkpoint

    fresh = tmp_path / "fresh"  # a new run gets a new id
    train(tiny_recipe("mtp", fresh, **settings, train__max_steps=1))
    assert wandb_inits[-1]["id"] != first["id"]


def test_tensorboard_continues_in_the_same_log_without_the_interrupted_steps(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from draftsmith.train.mtp import MTPTraining

    run = tmp_path / "run"
    settings = dict(tracking__report_to="tensorboard", train__save_every=4, train__validation_every=100)
    # Killed in step 7: steps 5 and 6 were logged past the checkpoint at 4.
    interrupted(monkeypatch, MTPTraining, 7, lambda: train(tiny_recipe("mtp", run, **settings)))
    train(tiny_recipe("mtp", run, **settings, train__resume=True))
    logs = run / "logs" / "draftsmith"
    events = EventAccumulator(str(logs))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))  # once each, in one log
    assert "run/text_summary" in events.Tags()["tensors"]  # the run's name and recipe
    assert not [p for p in os.listdir(run / "logs") if p != "draftsmith"]


def test_tracking_settings_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(DraftsmithError, match="tracking.mode: expected auto, online, offline, got 'sometimes'"):
        train(tiny_recipe("mtp", tmp_path / "a", tracking__report_to="wandb", tracking__mode="sometimes"))
    with pytest.raises(DraftsmithError, match="tracking.report_to: expected wandb, tensorboard, none"):
        train(tiny_recipe("mtp", tmp_path / "b", tracking__report_to="mlflow"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
