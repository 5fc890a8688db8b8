"""Distributed training on CPU: 2 processes compute what 1 process computes, the frozen
target stays out of the optimizer and the wrappers, and a launch the machine cannot serve
ends in one line (train/launch_checks.py)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.train import launch_checks
from draftsmith.train.launch_checks import check_launch
from draftsmith.train.loop import train
from tiny_runs import ROOT, overrides, tiny_recipe

CHECK = ROOT / "scripts" / "check_distributed.sh"
LAUNCH_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP",
              "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(config: str, *args: str, cpu: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """`accelerate launch` of 2 processes with one of the shipped configs, sized to this machine."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"ACCELERATE_USE_CPU": "true"} if cpu else {})}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"recipes/accelerate/{config}.yaml",
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", free_port(), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_check(tmp_path, recipe: str, backends: str, steps: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "STEPS": str(steps), "BACKENDS": backends, "OUT": str(tmp_path / "check")}
    return subprocess.run(["bash", str(CHECK), recipe], env=env, capture_output=True, text=True, timeout=900)


# ---------------------------------------------------------------- same losses as 1 process

def test_two_process_ddp_logs_the_losses_of_one_process(tmp_path):
    done = run_check(tmp_path, "recipes/tiny/mtp.yaml", "ddp", steps=2)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    steps = [line.split()[0] for line in done.stdout.splitlines()[2:] if line.startswith(" ")]
    assert steps == ["1", "2", "val"] and "ddp: max relative deviation" in done.stdout, done.stdout


@pytest.mark.slow
def test_ddp_and_zero2_agree_with_one_process_and_fsdp2_says_why_not(tmp_path):
    done = run_check(tmp_path, "", "ddp zero2 fsdp2", steps=4)  # the default recipe
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "fsdp2: not run on CPU: FSDP needs GPUs" in done.stdout and done.stdout.rstrip().endswith("agree")


# ---------------------------------------------------------------- the frozen target

# Runs the real loop under 2-process DDP, keeping what it built and what prepare returned.
FROZEN = textwrap.dedent("""
    import sys
    from torch.nn.parallel import DistributedDataParallel
    from draftsmith.recipe import load_recipe
    from draftsmith.train import loop

    seen = {}
    build, make = loop.build_method, loop.make_accelerator

    def build_method(recipe, device):
        seen["method"] = build(recipe, device)
        return seen["method"]

    def make_accelerator(recipe, out_dir):
        accelerator = make(recipe, out_dir)
        prepare = accelerator.prepare

        def keep(*objects):
            seen["prepared"] = prepare(*objects)
            return seen["prepared"]

        accelerator.prepare = keep
        return accelerator

    loop.build_method, loop.make_accelerator = build_method, make_accelerator
    loop.train(load_recipe(sys.argv[1], sys.argv[2:]))
    model, optimizer = seen["prepared"][:2]
    target = seen["method"].target
    frozen = {id(p) for p in target.parameters()}
    assert isinstance(model, DistributedDataParallel), type(model)  # the drafter is wrapped ...
    assert not isinstance(target, DistributedDataParallel) and type(target).__name__ != "DeepSpeedEngine"
    assert all(m is not target for m in model.modules())             # ... and the target is not in it
    assert not frozen & {id(p) for p in model.parameters()}
    assert not frozen & {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert frozen and not any(p.requires_grad for p in target.parameters())
    print("frozen target outside", type(model).__name__)
""")


def test_the_frozen_target_is_never_trained_nor_wrapped(tmp_path):
    """EAGLE-3 keeps a frozen copy of the target's embedding inside its drafter: a copy, not
    the target's own parameters, which stay outside the DDP wrapper and the optimizer."""
    target = tmp_path / "target"
    train(tiny_recipe("mtp", target, train__max_steps=1, train__eval_every=100, target__num_layers=4))
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    args = overrides(tmp_path / "eagle3", target__path=str(target), train__max_steps=1, train__batch_size=2,
                     train__seq_len=256, train__eval_every=100, data__num_conversations=8,
                     data__regen_max_new_tokens=16, method__draft_vocab_size=128, method__ttt_length=2)
    done = launch("ddp", str(script), str(ROOT / "recipes/tiny/eagle3.yaml"), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("frozen target outside DistributedDataParallel") == 2, done.stdout


# ---------------------------------------------------------------- launches the machine cannot serve

@pytest.fixture
def launch_env(monkeypatch):
    """A clean launcher environment on a machine with `gpus` GPUs."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)

    def set_up(gpus: int = 0, **env):
        monkeypatch.setattr(launch_checks.torch.cuda, "device_count", lambda: gpus)
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))

    return set_up


@pytest.mark.parametrize("gpus, env, message", [
    (0, {"WORLD_SIZE": 8, "LOCAL_WORLD_SIZE": 8}, "launched 8 processes for GPUs, but this machine has none"),
    (2, {"WORLD_SIZE": 8, "LOCAL_WORLD_SIZE": 8}, "8 processes on this machine, which has 2 GPU"),
    (0, {"WORLD_SIZE": 2, "ACCELERATE_USE_FSDP": "true"}, "FSDP needs GPUs"),
    (0, {"WORLD_SIZE": 2, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "true"},
     "ACCELERATE_USE_CPU=true turns DeepSpeed off"),
])
def test_a_launch_the_machine_cannot_serve_is_one_line(launch_env, gpus, env, message):
    launch_env(gpus, **env)
    with pytest.raises(DraftsmithError, match=message):
        check_launch("mtp")


@pytest.mark.parametrize("gpus, env", [
    (0, {}),                                                         # one process
    (0, {"WORLD_SIZE": 2, "ACCELERATE_USE_CPU": "true"}),            # data parallel on CPU
    (0, {"WORLD_SIZE": 2, "ACCELERATE_USE_DEEPSPEED": "true"}),      # DeepSpeed on CPU
    (8, {"WORLD_SIZE": 16, "LOCAL_WORLD_SIZE": 8, "ACCELERATE_USE_FSDP": "true"}),  # 2 nodes of 8
])
def test_launches_the_machine_can_serve_pass(launch_env, gpus, env):
    launch_env(gpus, **env)
    check_launch("mtp")


def test_zero3_refuses_a_method_that_cannot_shard(launch_env, monkeypatch):
    from draftsmith.train.mtp import MTPTraining

    launch_env(0, ACCELERATE_USE_DEEPSPEED="true",
               ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ROOT / "recipes/accelerate/ds_zero3.json"))
    check_launch("mtp")  # declares nothing: it can
    monkeypatch.setattr(MTPTraining, "no_zero3", "it reads weights outside forward", raising=False)
    with pytest.raises(DraftsmithError, match=r"method mtp cannot train under DeepSpeed ZeRO-3 \(it reads"):
        check_launch("mtp")
    launch_env(0, ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ROOT / "recipes/accelerate/ds_zero2.json"))
    check_launch("mtp")  # ZeRO-2 keeps whole parameters in every process


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without GPUs")
def test_a_gpu_config_on_a_machine_without_gpus_stops_every_process(tmp_path):
    """Without the check, each process trains alone as rank 0 of 1 and writes the same folder."""
    done = launch("ddp", "-m", "draftsmith.train", "recipes/tiny/mtp.yaml", *overrides(tmp_path / "run"), cpu=False)
    assert done.returncode != 0
    assert done.stderr.count("draftsmith: error: accelerate launched 2 processes for GPUs") == 2, done.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
