"""Distributed training on CPU: 2 processes compute what 1 process computes, the frozen
target stays out of the optimizer and the wrappers, and a launch the machine cannot serve
ends in one line (train/launch_checks.py)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import yaml

from draftsmith.errors import DraftsmithError
from draftsmith.registry import METHODS
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
    env = {**os.environ, "STEPS": str(steps), "BACKENDS": backends, "OUT": str(tmp_path / "check"),
           "PYTHON": sys.executable}  # this interpreter's draftsmith, not the machine's python3's
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
    import os, sys
    from torch.nn.parallel import DistributedDataParallel
    from draftsmith.recipe import load_recipe
    from draftsmith.train import loop

    seen = {}
    build, make = loop.build_method, loop.make_accelerator

    def build_method(recipe, device, target_dir=None):
        seen["method"] = build(recipe, device, target_dir)
        return seen["method"]

    def make_accelerator(recipe, out_dir):
        accelerator = make(recipe, out_dir)
        prepare = accelerator.prepare

        def keep(*objects):  # the first call's: model, optimizer, loaders (the schedule comes after)
            prepared = prepare(*objects)
            seen.setdefault("prepared", prepared)
            return prepared

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
    os.write(1, f"frozen target outside {type(model).__name__}\\n".encode())  # one write: two processes share the pipe
""")


def test_the_frozen_target_is_never_trained_nor_wrapped(tmp_path):
    """EAGLE-3 keeps a frozen copy of the target's embedding inside its drafter: a copy, not
    the target's own parameters, which stay outside the DDP wrapper and the optimizer."""
    target = tmp_path / "target"
    train(tiny_recipe("mtp", target, train__max_steps=1, train__validation_every=100, target__num_layers=4))
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    args = overrides(tmp_path / "eagle3", target__path=str(target), train__max_steps=1, train__batch_size=2,
                     train__seq_len=256, train__validation_every=100, data__num_conversations=8,
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
        check_launch(METHODS["mtp"])


@pytest.mark.parametrize("gpus, env", [
    (0, {}),                                                         # one process
    (0, {"WORLD_SIZE": 2, "ACCELERATE_USE_CPU": "true"}),            # data parallel on CPU
    (0, {"WORLD_SIZE": 2, "ACCELERATE_USE_DEEPSPEED": "true"}),      # DeepSpeed on CPU
    (8, {"WORLD_SIZE": 16, "LOCAL_WORLD_SIZE": 8, "ACCELERATE_USE_FSDP": "true"}),  # 2 nodes of 8
])
def test_launches_the_machine_can_serve_pass(launch_env, gpus, env):
    launch_env(gpus, **env)
    check_launch(METHODS["mtp"])


def test_zero3_refuses_a_method_that_cannot_shard(launch_env, monkeypatch):
    from draftsmith.train.mtp import MTPTraining

    launch_env(0, ACCELERATE_USE_DEEPSPEED="true",
               ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ROOT / "recipes/accelerate/ds_zero3.json"))
    check_launch(METHODS["mtp"])  # declares nothing: it can
    monkeypatch.setattr(MTPTraining, "no_zero3", "it reads weights outside forward", raising=False)
    with pytest.raises(DraftsmithError, match=r"method mtp cannot train under DeepSpeed ZeRO-3 \(it reads"):
        check_launch(METHODS["mtp"])
    launch_env(0, ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ROOT / "recipes/accelerate/ds_zero2.json"))
    check_launch(METHODS["mtp"])  # ZeRO-2 keeps whole parameters in every process


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without GPUs")
def test_a_gpu_config_on_a_machine_without_gpus_stops_every_process(tmp_path):
    """Without the check, each process trains alone as rank 0 of 1 and writes the same folder."""
    done = launch("ddp", "-m", "draftsmith.train", "recipes/tiny/mtp.yaml", *overrides(tmp_path / "run"), cpu=False)
    assert done.returncode != 0
    # Each process stops itself; torchrun's agent then ends the other, sometimes before that one
    # has printed its line (found by make test: 1 of 2 lines, about one run in three).
    assert done.stderr.count("draftsmith: error: accelerate launched 2 processes for GPUs") >= 1, done.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- the process group's timeout

WAIT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from draftsmith.recipe import load_recipe
    from draftsmith.train.loop import make_accelerator

    recipe = load_recipe(None, [f"train.dist_timeout={sys.argv[1]}", "tracking.report_to=none"])
    accelerator = make_accelerator(recipe, Path(sys.argv[2]))
    with accelerator.main_process_first():  # as the main process regenerates while the others wait
        if accelerator.is_main_process:
            time.sleep(float(sys.argv[3]))
    # One write per process: print's separate writes of its parts interleave between the two
    # processes on the shared pipe ("waitedwaited 0" was seen); a short write is atomic.
    os.write(1, f"waited {accelerator.process_index}\\n".encode())
""")


# Slow (28 s, most of it the 15 s timeout it proves): out of the CI suite, whose 10 minutes it
# would break; `make test-slow` runs it.
@pytest.mark.slow
def test_the_recipes_dist_timeout_bounds_the_wait_for_the_main_process(tmp_path):
    """train.dist_timeout reaches the process group: a wait longer than it fails (gloo's own
    default, 30 minutes, would let this 60 s wait pass), a shorter one passes. 15 s, not less:
    the same timeout bounds the process group's start, and two processes importing torch on a
    loaded 2-core machine can start seconds apart."""
    script = tmp_path / "wait.py"
    script.write_text(WAIT)
    done = launch("ddp", str(script), "0.25", str(tmp_path / "run"), "60")  # 15 s to wait, 60 s of work
    assert done.returncode != 0 and "waited 1" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert "Timed out waiting 15000ms" in done.stderr, done.stderr[-2000:]
    done = launch("ddp", str(script), "1", str(tmp_path / "run"), "2")  # 60 s to wait, 2 s of work
    assert done.returncode == 0 and "waited 1" in done.stdout, done.stdout + done.stderr[-2000:]


# ---------------------------------------------------------------- accelerate configs from anywhere

DEEPSPEED = textwrap.dedent("""
    import os
    import sys
    from pathlib import Path
    from draftsmith.recipe import load_recipe
    from draftsmith.train.loop import make_accelerator

    accelerator = make_accelerator(load_recipe(None, ["tracking.report_to=none"]), Path(sys.argv[1]))
    zero = accelerator.deepspeed_plugin.deepspeed_config["zero_optimization"]
    os.write(1, f"zero {zero['stage']} {zero['reduce_bucket_size']}\\n".encode())  # one write: print's parts interleave
""")


@pytest.mark.parametrize("name, stage", [("zero2", 2), ("zero3", 3)])
def test_the_deepspeed_configs_are_found_from_any_working_directory(tmp_path, monkeypatch, name, stage):
    from draftsmith.train.launch import launch_argv

    monkeypatch.chdir(tmp_path)  # not the repository: accelerate alone would miss recipes/accelerate/ds_*.json
    argv = launch_argv(name, "r.yaml")
    written = yaml.safe_load(open(argv[4]).read())["deepspeed_config"]["deepspeed_config_file"]
    assert written == str(ROOT / "recipes" / "accelerate" / f"ds_{name}.json")
    assert launch_argv(name, "r.yaml") == argv  # the same copy, not one more per launch


@pytest.mark.slow  # two DeepSpeed processes: about a minute on 2 cores
def test_zero2_launched_from_any_working_directory_runs_at_stage_2(tmp_path, monkeypatch):
    from draftsmith.train.launch import launch_argv

    monkeypatch.chdir(tmp_path)
    argv, stage = launch_argv("zero2", "r.yaml"), 2
    script = tmp_path / "zero_check.py"  # not deepspeed.py: the script's folder comes first on sys.path
    script.write_text(DEEPSPEED)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*argv[:5], "--num_processes", "2", "--mixed_precision", "no", "--main_process_port",
                           free_port(), str(script),
                           str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.count(f"zero {stage} 50000000") == 2, done.stdout + done.stderr[-3000:]


def test_a_users_config_finds_its_json_beside_it_or_says_where_it_looked(tmp_path, monkeypatch):
    from draftsmith.train.launch import launch_argv

    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    (folder / "mine.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    (folder / "lost.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: no.json\n")
    monkeypatch.chdir(tmp_path)
    copy = yaml.safe_load(open(launch_argv(str(folder / "mine.yaml"), "r.yaml")[4]).read())
    assert copy["deepspeed_config"]["deepspeed_config_file"] == str(folder / "ds.json")
    with pytest.raises(DraftsmithError, match=r"lost.yaml: deepspeed_config_file no.json is neither under the "
                                              r"working directory nor under .*configs or a folder above it"):
        launch_argv(str(folder / "lost.yaml"), "r.yaml")


# ---------------------------------------------------------------- FSDP2's shard units

def trained_model(method: str, arch: str, tmp_path):
    """The module `train` prepares for `method`: MTP's target with its heads, or a post-hoc
    drafter in its loss wrapper (built directly: no target run or regeneration needed)."""
    from draftsmith.train.method import build_method

    if method == "mtp":
        return build_method(tiny_recipe("mtp", tmp_path / "run", target__arch=arch, target__num_layers=4), "cpu").model
    from draftsmith.models.dflash import DFlashConfig, DFlashDrafter
    from draftsmith.models.target import build_tiny_target
    from draftsmith.train.posthoc import LossForward

    target = build_tiny_target(arch=arch, vocab_size=64, num_layers=4, hidden_size=32, num_heads=2, num_kv_heads=1)
    return LossForward(DFlashDrafter(DFlashConfig.from_target(target.config, mask_token_id=1, num_layers=2,
                                                              block_size=4, target_layer_ids=[1, 2])))


@pytest.mark.parametrize("method, arch, expected", [
    ("mtp", "qwen3", ["MTPLayer", "Qwen3DecoderLayer"]),  # the target trained with its heads
    ("mtp", "llama", ["LlamaDecoderLayer", "MTPLayer"]),
    ("dflash", "llama", ["DFlashLayer"]),
])
def test_fsdp2_shards_the_layers_of_the_model_being_trained(tmp_path, method, arch, expected):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from draftsmith.train.launch_checks import set_fsdp_wrap_classes

    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp2.yaml").read_text())["fsdp_config"]
    assert "fsdp_transformer_layer_cls_to_wrap" not in config  # one family's class would refuse the others
    assert config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    model = trained_model(method, arch, tmp_path)
    set_fsdp_wrap_classes(model)
    assert model._no_split_modules == expected
    # accelerate's own TRANSFORMER_BASED_WRAP, with no class named in the config, shards those layers.
    policy = fsdp2_prepare_auto_wrap_policy(
        FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap"), model)
    assert {type(m).__name__ for m in model.modules() if policy(m)} == set(expected)
