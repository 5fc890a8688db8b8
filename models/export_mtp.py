"""MTP modules in DeepSeek-V3's layout: the target's folder, the modules as its extra layers.

DeepSeek-V3 checkpoints hold MTP module k (0-based) as `model.layers.{N + k}` of the
target, N = `num_hidden_layers`, with `num_nextn_predict_layers` = K in config.json. What
the engines read and feed (sources read for this file; tests/test_exports.py restates them):
- vLLM vllm/model_executor/models/deepseek_mtp.py @ 4f7c14402630 (`DeepSeekMTP`): layers
  N .. N + K - 1 from `num_nextn_predict_layers`, any K; under `model.layers.{N + k}.` the
  names `enorm`, `hnorm`, `eh_proj` (input [embedding; hidden], embedding first),
  `shared_head.norm`, `shared_head.head` and `embed_tokens` (loaded per module); every
  other name is the module's decoder block, with the target's decoder-layer names
  (per-expert `mlp.experts.{e}.{gate,up,down}_proj`). It picks module `spec_step_idx mod K`,
  but vLLM's EAGLE-style proposer passes no `spec_step_idx` (vllm-project/vllm#36910, #52688),
  so module 1 runs at every draft step, fed `previous_hidden_states`: first the target's
  output hidden state, after its final norm, then the module's own output.
- SGLang python/sglang/srt/models/deepseek_nextn.py @ c28bdc9012d2
  (`DeepseekV3ForCausalLMNextN`, `load_weights(..., is_nextn=True)` of deepseek_v2.py): the
  same names, one module only: it asserts `num_nextn_predict_layers == 1` ("Only 1 nextn
  layer is supported") and reads `model.layers.{N}` (layer 0 when N == 1); it takes
  `embed_tokens` and `shared_head.head` from the target, and chains that one module for
  every draft step, fed `spec_info.hidden_states` (again the target's post-norm state).
So `--format vllm` writes all K modules and `--format sglang` module 1 alone (a K-module
run says so in one line). Both engines run MTP only for architectures that declare it
(DeepSeek-V3 and its relatives), so these layouts are offered for DeepSeek-style targets
only. For Llama, Qwen3 and the other targets no engine builds MTP modules: the run's
`mtp/` folder is for draftsmith's own decoder (`eval --drafter mtp:RUN`), and the export
says so instead of writing a folder that would look loadable.

The written folder is the target's, with the modules' tensors added (a shard of their own
plus an index when the target is sharded) and `num_nextn_predict_layers` set; transformers
itself loads it as the plain target (it ignores the extra layers). Its dtype is the
target's: the folder is the target, so `--dtype` may only restate it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir, open_safetensors, read_json, write_json
from draftsmith.models.layouts import NATIVE, SPECULATORS, expect, identify
from draftsmith.models.mtp import MTP_DIR, MTPConfig, MTPDrafter, mtp_dir
from draftsmith.models.native import load_drafter

DEEPSEEK_TYPES = ("deepseek_v3",)  # model_type of targets whose engines run MTP (read in their sources)
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's, repeated per module
MTP_SHARD = "model-mtp.safetensors"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


SGLANG_MODULES = 1  # SGLang's NextN loader: "Only 1 nextn layer is supported"


def export_vllm(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """`draftsmith export --format vllm`: an MTP run's model/ (the target with mtp/), all K modules."""
    return _export(folder, out_dir, dtype, modules=None)


def export_sglang(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """`draftsmith export --format sglang`: module 1 alone, the one module SGLang's NextN loads."""
    return _export(folder, out_dir, dtype, modules=SGLANG_MODULES)


def sglang_note(num_depths: int) -> str | None:
    """The one line a K-module run's SGLang export prints."""
    if num_depths <= SGLANG_MODULES:
        return None
    return (f"SGLang's NextN loader reads one MTP module: wrote module 1 of {num_depths} (SGLang chains it for every "
            f"draft); --format vllm keeps all {num_depths}")


def _export(folder, out_dir, dtype: str | None, modules: int | None) -> Path:
    from draftsmith.models.export import DTYPES, dtype_name
    from draftsmith.models.target import load_target

    folder = Path(folder)
    check_engine_layout(folder)
    target = load_target(folder)
    own = next(target.parameters()).dtype
    if dtype is not None and DTYPES[dtype] != own:
        raise DraftsmithError(f"--dtype {dtype}: the MTP layout is the target's own folder, in the target's dtype "
                              f"({dtype_name(own)}); convert the target itself to change it")
    heads = load_drafter(mtp_dir(folder), "mtp", target)
    return write_deepseek(heads, target, folder, out_dir, modules=modules)


def check_engine_layout(folder: Path, fmt: str = "") -> None:
    """One line, for a target no engine runs MTP modules for (for `--format speculators`, one
    that speculators' MTP class is not built for: models/speculators_format.py)."""
    config = read_json(folder / "config.json")
    if fmt == "speculators":
        from draftsmith.models.speculators_format import check_mtp_type

        check_mtp_type(config, f"{folder}/config.json")
        return
    if config.get("model_type") not in DEEPSEEK_TYPES:
        arch = (config.get("architectures") or [config.get("model_type")])[0]
        raise DraftsmithError(
            f"{folder}: the target is {arch}; serving engines run MTP modules only for architectures that declare "
            f"them (DeepSeek-V3 style, num_nextn_predict_layers), so the MTP modules in {folder}/{MTP_DIR} are for "
            f"draftsmith's own decoder: evaluate them with eval --drafter mtp:{folder}")


def write_deepseek(heads: MTPDrafter, target, target_dir: str | Path, out_dir: str | Path,
                   modules: int | None = None) -> Path:
    """The target folder with the first `modules` MTP modules (all when None) added."""
    from transformers.core_model_loading import revert_weight_conversion

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    n = target.config.num_hidden_layers
    count = heads.num_depths if modules is None else min(modules, heads.num_depths)
    shared = {"embed_tokens.weight": target.get_input_embeddings().weight,
              "shared_head.head.weight": target.get_output_embeddings().weight}
    tensors = {}
    for name, tensor in heads.native_state().items():
        _, k, rest = name.split(".", 2)
        if int(k) < count:
            tensors[f"model.layers.{n + int(k)}.{rest}"] = tensor
    for k in range(count):
        tensors.update({f"model.layers.{n + k}.{name}": t for name, t in shared.items()})
    # The checkpoint's names, not the module's (transformers fuses MoE experts in memory).
    # Each module's copy of the shared tensors is its own tensor in the file, as in DeepSeek's.
    tensors = {k: v.detach().cpu().clone() for k, v in revert_weight_conversion(target, tensors).items()}
    index_file = target_dir / "model.safetensors.index.json"
    with atomic_dir(out_dir) as tmp:
        for item in target_dir.iterdir():
            if item.name == MTP_DIR or item.name == "config.json":
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        config = read_json(target_dir / "config.json")
        config["num_nextn_predict_layers"] = count
        config["draftsmith_mtp"] = {"modules_trained": heads.num_depths, "modules_written": count}
        write_json(tmp / "config.json", config)
        if index_file.is_file():  # sharded: the modules get a shard of their own
            index = read_json(index_file)
            save_file(tensors, str(tmp / MTP_SHARD), metadata={"format": "pt"})
            index["weight_map"].update({name: MTP_SHARD for name in tensors})
            write_json(tmp / index_file.name, index)
        else:
            with open_safetensors(target_dir / "model.safetensors") as f:
                main = {name: f.get_tensor(name) for name in f.keys()}
            save_file({**main, **tensors}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def load_any(path: str | Path, target) -> MTPDrafter:
    """MTP modules of a draftsmith run or target folder (its mtp/) or of a DeepSeek-style
    folder (`model.layers.{N + k}`, `num_nextn_predict_layers`), for `target`."""
    if identify(path)[0] is None:
        mtp_dir(path)  # a model folder without MTP modules: says so in one line
    layout, config = expect(path, "mtp")
    if layout == SPECULATORS:
        from draftsmith.models.speculators_format import load

        return load(path, "mtp", target)
    # MTP modules are built from their target's own decoder layer and norms: against a target
    # of another family they cannot even be built (GPT-2 has no rms_norm_eps).
    family, theirs = config.get("model_type"), getattr(target.config, "model_type", None)
    if family and theirs and family != theirs:
        raise DraftsmithError(f"{path}: MTP modules of a {family} target, not of the {theirs} target given; "
                              "evaluate them against the target they extend")
    if layout == NATIVE:
        return load_drafter(mtp_dir(path), "mtp", target)
    n, depth = config.get("num_hidden_layers"), int(config["num_nextn_predict_layers"])
    if n != target.config.num_hidden_layers or config.get("hidden_size") != target.config.hidden_size:
        raise DraftsmithError(f"{path}/config.json: MTP modules of a target with {n} layers of width "
                              f"{config.get('hidden_size')}; the target has {target.config.num_hidden_layers} "
                              f"of width {target.config.hidden_size}")
    stored = _read(Path(path), tuple(f"model.layers.{n + k}." for k in range(depth)))
    state = {}
    for name, tensor in stored.items():
        _, _, layer, rest = name.split(".", 3)
        if rest not in SHARED:
            state[f"layers.{int(layer) - n}.{rest}"] = tensor
    if not state:
        raise DraftsmithError(f"{path}: no tensors under model.layers.{n}. (num_nextn_predict_layers {depth})")
    return MTPDrafter.from_native(MTPConfig(num_depths=depth), _fuse_experts(state), target, source=str(path))


def _read(folder: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors whose names start with `prefixes`, from the single file or the shards."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({file for name, file in read_json(index)["weight_map"].items() if name.startswith(prefixes)})
    else:
        files = ["model.safetensors"]
    out = {}
    for file in files:
        if not (folder / file).is_file():
            raise DraftsmithError(f"{folder / file} not found")
        with open_safetensors(folder / file) as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(prefixes)})
    return out


def _fuse_experts(state: dict) -> dict:
    """Per-expert checkpoint tensors -> transformers' fused ones (`experts.gate_up_proj`
    [E, 2I, H] = [gate; up] per expert, `experts.down_proj` [E, H, I])."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, kind = match.groups()
        groups.setdefault(prefix, {}).setdefault(kind, {})[int(expert)] = tensor
    for prefix, kinds in groups.items():
        experts = sorted(kinds.get("down", {}))
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([kinds["gate"][e], kinds["up"][e]]) for e in experts])
            out[f"{prefix}.down_proj"] = torch.stack([kinds["down"][e] for e in experts])
        except KeyError as missing:
            raise DraftsmithError(f"{prefix}: expert weights incomplete (missing {missing})") from None
    return out
