"""What `accelerate launch` asked for, checked against the machine before training starts.

accelerate reads the launcher's environment (WORLD_SIZE, ACCELERATE_USE_*) when the
Accelerator is built, and several mismatches do not fail there: they quietly train the
wrong thing. A MULTI_GPU config on a machine without GPUs starts N independent
single-process runs that all write the same folder; an FSDP config on CPU falls back to
plain DDP; ACCELERATE_USE_CPU turns DeepSpeed off. More processes than GPUs fails later in
CUDA with a traceback. `check_launch` turns each into one line before anything is built.
"""

from __future__ import annotations

import json
import os

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.registry import MethodSpec


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def zero_stage() -> int:
    """The ZeRO stage of a DeepSpeed launch (0 when DeepSpeed is not used)."""
    if not _flag("ACCELERATE_USE_DEEPSPEED"):
        return 0
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        try:
            return int(json.loads(open(path).read()).get("zero_optimization", {}).get("stage", 0))
        except (OSError, ValueError) as exc:
            raise DraftsmithError(f"DeepSpeed config {path}: {exc}") from None
    return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))


def zero3_blocker(spec: MethodSpec) -> str:
    """Why a method cannot train under ZeRO-3, "" when it can. ZeRO-3 partitions every
    parameter of the prepared module and gathers it only inside that module's forward; a
    method declares `no_zero3 = "reason"` on its class when it reads parameters otherwise
    (`TrainMethod.no_zero3`)."""
    return spec.load("training").no_zero3


def check_launch(spec: MethodSpec) -> None:
    """Raise DraftsmithError when the launch cannot train the method `spec` as asked."""
    stage = zero_stage()
    blocker = zero3_blocker(spec) if stage == 3 else ""
    if blocker:
        raise DraftsmithError(f"method {spec.name} cannot train under DeepSpeed ZeRO-3 ({blocker}): "
                              "use recipes/accelerate/zero2.yaml or fsdp2.yaml")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world <= 1:
        return
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus = torch.cuda.device_count()
    cpu = _flag("ACCELERATE_USE_CPU")
    if stage and cpu:
        raise DraftsmithError("ACCELERATE_USE_CPU=true turns DeepSpeed off in accelerate: unset it "
                              "(DeepSpeed runs on CPU over gloo without it)")
    if _flag("ACCELERATE_USE_FSDP") and gpus == 0:
        raise DraftsmithError("FSDP needs GPUs: accelerate sets FSDP up only on accelerator devices, and a CPU "
                              "launch would quietly fall back to DDP; on CPU use recipes/accelerate/ddp.yaml "
                              "with ACCELERATE_USE_CPU=true")
    if cpu or (stage and gpus == 0):
        return  # data parallel on CPU over gloo, or DeepSpeed on CPU (process_group_kwargs)
    if gpus == 0:
        raise DraftsmithError(f"accelerate launched {world} processes for GPUs, but this machine has none: "
                              "use recipes/accelerate/cpu.yaml, or set ACCELERATE_USE_CPU=true for data "
                              "parallel on CPU")
    if per_node > gpus:
        raise DraftsmithError(f"accelerate launched {per_node} processes on this machine, which has {gpus} "
                              f"GPU(s): set num_processes to at most {gpus} per machine")


def process_group_kwargs(timeout_minutes: float) -> list:
    """How the processes' group is set up: a collective waits `timeout_minutes` (the recipe's
    train.dist_timeout) for the others, where torch's default is 10 minutes for NCCL. And
    accelerate names no backend for a DeepSpeed launch on a machine without GPUs, then runs
    every process as if alone; DeepSpeed's CPU accelerator names the one to use (gloo, or
    oneCCL where its bindings are installed)."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    timeout = timedelta(minutes=timeout_minutes)
    if not (_flag("ACCELERATE_USE_DEEPSPEED") and "LOCAL_RANK" in os.environ and not torch.cuda.is_available()):
        return [InitProcessGroupKwargs(timeout=timeout)]  # the backend as accelerate picks it
    from deepspeed.accelerator import get_accelerator

    return [InitProcessGroupKwargs(backend=get_accelerator().communication_backend_name(), timeout=timeout)]


def fsdp_wrap_classes(model: torch.nn.Module) -> list[str]:
    """The classes FSDP2 shards one by one in `model`: the ones its transformers parts name in
    `_no_split_modules` (the decoder layers of a target that MTP pretrains, of a draft LM) and
    the repeated blocks of our drafters (the entries of their ModuleLists). A config naming one
    class (LlamaDecoderLayer) fits one family only, and accelerate refuses it for any other."""
    names, present = set(), set()
    for module in model.modules():
        present.add(type(module).__name__)
        names |= set(getattr(module, "_no_split_modules", None) or ())
        if isinstance(module, torch.nn.ModuleList):
            names |= {type(entry).__name__ for entry in module if any(True for _ in entry.parameters())}
    return sorted(names & present)


def set_fsdp_wrap_classes(model: torch.nn.Module) -> None:
    """Where accelerate's TRANSFORMER_BASED_WRAP looks when the config names no class: the
    prepared module's `_no_split_modules` (recipes/accelerate/fsdp2.yaml names none)."""
    model._no_split_modules = fsdp_wrap_classes(model)
