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
(DeepSeek-V3 and its relatives, Qwen3-Next below), so these layouts are offered for those
targets only. For Llama, Qwen3 and the other targets no engine builds MTP modules: the run's
`mtp/` folder is for draftsmith's own decoder (`eval --drafter mtp:RUN`), and the export
says so instead of writing a folder that would look loadable.

Qwen3-Next checkpoints hold one MTP module under `mtp.`, read by vLLM's Qwen3NextMTP
(vllm/model_executor/models/qwen3_next_mtp.py @ 055e47c28003: `mtp.` renamed to its
predictor, `num_nextn_predict_layers` layers, one `fc` and norm set for all, GemmaRMSNorm
norms, step k running layer k mod count): `fc` (our `eh_proj`, input
[embedding; hidden]), `pre_fc_norm_embedding` (`enorm`), `pre_fc_norm_hidden` (`hnorm`),
`layers.0.*` (the block: a full-attention decoder layer under the target's names), `norm`
(`shared_head.norm`), the norms zero-centred as the target's; embedding and head are the
target's. The module's output after `norm` is what the next draft reads (`chain_input`
normed). Its config.json names no MTP key; the written folder sets `num_nextn_predict_layers`
to 1 (vLLM's count of MTP layers, and how draftsmith tells the folder holds MTP modules).
`fc` and the norms are shared by every `mtp.layers.N`, so the layout holds one module of ours:
a K-module run of a Qwen3-Next target is refused in one line.

`read` reads all of these, and `init: from_target` (train/mtp.py) reads a target's
shipped modules through it; export writes tuned modules back under the same names.

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
from draftsmith.models.dtypes import DTYPES, config_dtype, dtype_name
from draftsmith.models.formats import speculators, write_folder
from draftsmith.models.layouts import NATIVE, SPECULATORS, expect, identify
from draftsmith.models.mtp import MTP_DIR, MTPConfig, MTPDrafter, mtp_dir
from draftsmith.models.native import load_drafter
from draftsmith.models.serve import recorded_tile

DEEPSEEK_TYPES = ("deepseek_v3",)  # model_type of targets whose engines run MTP (read in their sources)
DEEPSEEK_LAYOUT = "deepseek"  # a target whose config declares num_nextn_predict_layers
QWEN3_NEXT_TYPES = ("qwen3_next",)  # mtp.* beside the target, one module
ENGINE_TYPES = DEEPSEEK_TYPES + QWEN3_NEXT_TYPES
QWEN3_NEXT_PREFIX = "mtp."
# Our (DeepSeek's) names of a module's own parts -> Qwen3-Next's; its block sits under mtp.layers.0.
_QWEN3_NEXT_NAMES = (("enorm.", "pre_fc_norm_embedding."), ("hnorm.", "pre_fc_norm_hidden."), ("eh_proj.", "fc."),
                     ("shared_head.norm.", "norm."))
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's, repeated per module
MTP_SHARD = "model-mtp.safetensors"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


METHOD = MTPDrafter.method
SGLANG_MODULES = 1  # SGLang's NextN loader: "Only 1 nextn layer is supported"


def write_vllm(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """`draftsmith export --format vllm`: an MTP run's model/ (the target with mtp/), all K modules."""
    return _export(folder, out_dir, dtype, modules=None)


def write_sglang(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """`draftsmith export --format sglang`: module 1 alone, the one module SGLang's NextN loads."""
    return _export(folder, out_dir, dtype, modules=SGLANG_MODULES)


def sglang_note(num_depths: int) -> str | None:
    """The one line a K-module run's SGLang export prints."""
    if num_depths <= SGLANG_MODULES:
        return None
    return (f"SGLang's NextN loader reads one MTP module: wrote module 1 of {num_depths} (SGLang chains it for every "
            f"draft); --format vllm keeps all {num_depths}")


def _export(folder, out_dir, dtype: str | None, modules: int | None) -> Path:
    from draftsmith.models.target import load_target

    folder = Path(folder)
    check_export(folder)
    target = load_target(folder)
    own = next(target.parameters()).dtype
    if dtype is not None and DTYPES[dtype] != own:
        raise DraftsmithError(f"--dtype {dtype}: the MTP layout is the target's own folder, in the target's dtype "
                              f"({dtype_name(own)}); convert the target itself to change it")
    heads = load_drafter(mtp_dir(folder), METHOD, target)
    return write_engine_layout(heads, target, folder, out_dir, modules=modules)


def check_export(folder: Path, fmt: str = "") -> None:
    """One line, before any format is written, for a target no engine runs MTP modules for (for
    `--format speculators`, one that speculators' MTP class is not built for)."""
    config = read_json(folder / "config.json")
    if fmt == "speculators":
        check_mtp_type(config, f"{folder}/config.json")
        return
    if config.get("model_type") not in ENGINE_TYPES:
        arch = (config.get("architectures") or [config.get("model_type")])[0]
        raise DraftsmithError(
            f"{folder}: the target is {arch}; serving engines run MTP modules only for architectures that declare "
            f"them (DeepSeek-V3 style, num_nextn_predict_layers; Qwen3-Next's mtp.*), so the MTP modules in "
            f"{folder}/{MTP_DIR} are for draftsmith's own decoder: evaluate them with eval --drafter mtp:{folder}")


def write_engine_layout(heads: MTPDrafter, target, target_dir: str | Path, out_dir: str | Path,
                        modules: int | None = None) -> Path:
    """The target folder with the first `modules` MTP modules (all when None) added, named
    as the engines read the target's family (DeepSeek-V3's extra layers, Qwen3-Next's mtp.*)."""
    from transformers.core_model_loading import revert_weight_conversion

    if target.config.model_type in QWEN3_NEXT_TYPES:
        if heads.num_depths > 1:
            raise DraftsmithError(f"{target_dir}: Qwen3-Next's MTP layout holds one module (mtp.fc and its norms "
                                  f"are shared by every mtp.layers.N); this run trained {heads.num_depths}: train "
                                  "with method.num_depths=1 (method.init=from_target takes the checkpoint's one)")
        count, tensors = 1, _qwen3_next_tensors(heads)
    else:
        count = heads.num_depths if modules is None else min(modules, heads.num_depths)
        tensors = _deepseek_tensors(heads, target, count)
    # The checkpoint's names, not the module's (transformers fuses MoE experts in memory).
    # Each module's copy of the shared tensors is its own tensor in the file, as in DeepSeek's.
    tensors = {k: v.detach().cpu().clone() for k, v in revert_weight_conversion(target, tensors).items()}
    mtp = {"modules_trained": heads.num_depths, "modules_written": count}
    return _write_folder(tensors, {"num_nextn_predict_layers": count, "draftsmith_mtp": mtp}, target_dir, out_dir)


def _deepseek_tensors(heads: MTPDrafter, target, count: int) -> dict[str, torch.Tensor]:
    """Modules 0..count-1 as `model.layers.{N + k}.*`, each with its copy of the shared tensors."""
    n = target.config.num_hidden_layers
    shared = {"embed_tokens.weight": target.get_input_embeddings().weight,
              "shared_head.head.weight": target.get_output_embeddings().weight}
    tensors = {}
    for name, tensor in heads.native_state().items():
        _, k, rest = name.split(".", 2)
        if int(k) < count:
            tensors[f"model.layers.{n + int(k)}.{rest}"] = tensor
    for k in range(count):
        tensors.update({f"model.layers.{n + k}.{name}": t for name, t in shared.items()})
    return tensors


def _qwen3_next_tensors(heads: MTPDrafter) -> dict[str, torch.Tensor]:
    """Module 1 under `mtp.`: its own parts by Qwen3-Next's names, its block as mtp.layers.0
    (no embedding or head: the engines take the target's)."""
    out = {}
    for name, tensor in heads.native_state().items():
        _, k, rest = name.split(".", 2)
        if k == "0":
            own = _renamed(rest, _QWEN3_NEXT_NAMES)
            out[QWEN3_NEXT_PREFIX + (own if own != rest else f"layers.0.{rest}")] = tensor
    return out


def _renamed(name: str, pairs) -> str:
    """`name` with the first of its (old, new) prefixes that it starts with replaced."""
    return next((new + name.removeprefix(old) for old, new in pairs if name.startswith(old)), name)


def _write_folder(tensors: dict, config_update: dict, target_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of the target folder with `tensors` added and config.json updated."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    index_file = target_dir / "model.safetensors.index.json"
    with atomic_dir(out_dir) as tmp:
        for item in target_dir.iterdir():
            if item.name == MTP_DIR or item.name == "config.json":
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        write_json(tmp / "config.json", {**read_json(target_dir / "config.json"), **config_update})
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


def read(path: str | Path, target) -> MTPDrafter:
    """MTP modules of a draftsmith run or target folder (its mtp/), of a DeepSeek-style folder
    (`model.layers.{N + k}`, `num_nextn_predict_layers`) or of a Qwen3-Next one (`mtp.*`), for `target`."""
    path = Path(path)
    found, layout, config = identify(path)
    # Qwen3-Next ships mtp.* with no config key naming them: its family says where to look.
    shipped = found is None and config.get("model_type") in QWEN3_NEXT_TYPES
    if found != METHOD and not shipped:
        if found is None:
            mtp_dir(path)  # a model folder without MTP modules: says so in one line
        expect(path, METHOD)  # says what the folder holds instead, or what was expected
    if layout == SPECULATORS:
        return speculators.load(path, config, target, _read_speculators)
    # MTP modules are built from their target's own decoder layer and norms: against a target
    # of another family they cannot even be built (GPT-2 has no rms_norm_eps).
    family, theirs = config.get("model_type"), getattr(target.config, "model_type", None)
    if family and theirs and family != theirs:
        raise DraftsmithError(f"{path}: MTP modules of a {family} target, not of the {theirs} target given; "
                              "evaluate them against the target they extend")
    if layout == NATIVE:
        return load_drafter(mtp_dir(path), METHOD, target)
    return load_shipped(path, config, target)


def claim(path: Path, meta: dict) -> str | None:
    """The layout of a folder no architecture names, where it holds MTP modules: a draftsmith
    run or target with mtp/, or a DeepSeek-style target declaring num_nextn_predict_layers."""
    if (path / MTP_DIR / "config.json").is_file():
        return NATIVE
    return DEEPSEEK_LAYOUT if meta.get("num_nextn_predict_layers") else None


# What `eval --drafter mtp:DIR` reads, said when a folder holds none of it.
EXPECTED = ("a draftsmith MTP run or target folder (with mtp/) or a DeepSeek-style target whose config.json has "
            "num_nextn_predict_layers")


def serve(folder: Path, written: Path, fmt: str, latency_table: str | Path | None = None) -> list[str]:
    """What `draftsmith export` prints after writing `fmt`. The engine's model is the written
    target folder itself; vLLM's `mtp` chains all K modules, SGLang's NextN (EAGLE) one. A
    speculators folder of a Qwen3 target no engine serves (mtp_note says so)."""
    from draftsmith.models.serve import SGLANG, chain, engine_args, printed, vllm_line

    if fmt == "speculators":
        return [mtp_note(written)]
    config = read_json(written / "config.json")
    trained = (config.get("draftsmith_mtp") or {}).get("modules_trained", 1)
    notes = [note] if fmt == "sglang" and (note := sglang_note(trained)) else []
    model, dtype, common = engine_args(written)
    flags, d = chain(written, None, recorded_tile(folder))
    if not flags:
        return notes
    lines = [vllm_line(model, dtype, {"method": METHOD, "num_speculative_tokens": d})]
    if config.get("num_nextn_predict_layers") == 1:  # SGLang's NextN loads one module
        lines.insert(0, f"{SGLANG} {common} --speculative-algorithm EAGLE {flags}")
    return printed(notes, lines)


def load_from_target(folder: str | Path, target) -> MTPDrafter:
    """`method.init: from_target`: the MTP modules the target's own folder carries (a draftsmith
    run's mtp/, or its family's engine layout, which transformers skips on load), read by
    `read`; what is missing is one line naming the key."""
    folder = Path(folder)
    family = read_json(folder / "config.json").get("model_type")
    if not (folder / MTP_DIR).is_dir() and family not in ENGINE_TYPES:
        raise DraftsmithError(f"method.init=from_target: target {folder} ({family}) ships no MTP modules draftsmith "
                              "reads (DeepSeek-V3 style model.layers.{N+k} with num_nextn_predict_layers, Qwen3-Next "
                              "style mtp.*, or a draftsmith run's mtp/); use method.init=new")
    try:
        return read(folder, target)
    except DraftsmithError as exc:
        raise DraftsmithError(f"method.init=from_target: {exc}") from None


def load_shipped(path: Path, config: dict, target) -> MTPDrafter:
    """The modules a checkpoint carries in its family's engine layout; K, and what each depth
    passes on (chain_input), as the engines run that family."""
    n = config.get("num_hidden_layers")
    if n != target.config.num_hidden_layers or config.get("hidden_size") != target.config.hidden_size:
        raise DraftsmithError(f"{path}/config.json: MTP modules of a target with {n} layers of width "
                              f"{config.get('hidden_size')}; the target has {target.config.num_hidden_layers} "
                              f"of width {target.config.hidden_size}")
    if config.get("model_type") in QWEN3_NEXT_TYPES:
        state, chain = _qwen3_next_state(path), "normed"  # vLLM's Qwen3-Next MTP chains on its output after mtp.norm
    else:
        state, chain = _deepseek_state(path, n, int(config["num_nextn_predict_layers"])), "hidden"
    depth = 1 + max(int(name.split(".")[1]) for name in state)
    return MTPDrafter.from_native(MTPConfig(num_depths=depth, chain_input=chain), _fuse_experts(state), target,
                                  source=str(path))


def _deepseek_state(path: Path, n: int, depth: int) -> dict[str, torch.Tensor]:
    """`model.layers.{N + k}.*` -> our `layers.k.*`, the shared embedding and head left out."""
    stored = _read(path, tuple(f"model.layers.{n + k}." for k in range(depth)))
    state = {}
    for name, tensor in stored.items():
        _, _, layer, rest = name.split(".", 3)
        if rest not in SHARED:
            state[f"layers.{int(layer) - n}.{rest}"] = tensor
    held = {int(name.split(".")[1]) for name in state}
    if held != set(range(depth)):
        # transformers writes num_nextn_predict_layers 1 into every DeepSeek-V3 config, weights or not
        raise DraftsmithError(f"{path}: config.json declares num_nextn_predict_layers {depth} but no MTP tensors "
                              f"are stored under model.layers.{n + min(set(range(depth)) - held)}.")
    return state


def _qwen3_next_state(path: Path) -> dict[str, torch.Tensor]:
    """`mtp.*` -> our module 0: its block from mtp.layers.0, its own parts renamed."""
    stored = _read(path, (QWEN3_NEXT_PREFIX,))
    if not stored:
        raise DraftsmithError(f"{path}: no mtp.* tensors in its safetensors (a Qwen3-Next checkpoint's MTP module)")
    layers = sorted({name.split(".")[2] for name in stored if name.startswith("mtp.layers.")})
    if layers != ["0"]:
        raise DraftsmithError(f"{path}: Qwen3-Next-style MTP layers {layers or 'none'} under mtp.layers.N: one "
                              "module (mtp.layers.0 with mtp.fc and its norms) is what draftsmith reads")
    theirs = tuple((new, old) for old, new in _QWEN3_NEXT_NAMES)
    state = {}
    for name, tensor in stored.items():
        rest = name.removeprefix(QWEN3_NEXT_PREFIX)
        own = rest.removeprefix("layers.0.") if rest.startswith("layers.") else _renamed(rest, theirs)
        state[f"layers.0.{own}"] = tensor
    return state


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


# ---------------------------------------------------------------- the speculators layout

# transformer_layer_config model types whose MTP module speculators builds and we test against it
# (qwen3_next and qwen3_5 are hybrid or multimodal: their MTP layer index differs, not written yet).
MTP_TYPES = ("qwen3",)


# speculators' MTP layer names -> DeepSeek's (our native names; the block keeps its own names)
_MTP_NAMES = (("token_layernorm.", "enorm."), ("hidden_layernorm.", "hnorm."), ("input_proj.", "eh_proj."),
              ("final_layernorm.", "shared_head.norm."))


_MTP_PREFIX = "mtp_layers.0."


def mtp_note(folder: str | Path) -> str:
    """What a speculators MTP folder is for, and why a K-module run's holds module 1 alone."""
    meta = read_json(Path(folder) / "config.json").get("draftsmith") or {}
    trained = meta.get("modules_trained", 1)
    kept = (f"wrote module 1 of {trained} (speculators' MTP holds one, chained for every draft, as mtp_nextn "
            "drafts it here); " if trained > 1 else "")
    if meta.get("chain_input", "hidden") != "normed":
        kept += ("speculators chains the module on its normed output where this run trained DeepSeek's (the block's "
                 "output): drafts past the first differ there (method.chain_input=normed trains its way); ")
    return (kept + "speculators' MTPDraftModel reads this folder; vLLM serves speculators MTP folders only for "
            "Qwen3-Next and MiMo verifiers, so no serve line for this target")


def write_speculators(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """An MTP run's module 1 as speculators' `MTPDraftModel`, its verifier the run's target."""
    from draftsmith.models.target import load_target

    folder = Path(folder)
    target_config = read_json(folder / "config.json")
    check_mtp_type(target_config, f"{folder}/config.json")
    target = load_target(folder)
    heads = load_drafter(mtp_dir(folder), METHOD, target)
    out_dtype = DTYPES[dtype] if dtype else config_dtype(target_config) or next(heads.parameters()).dtype
    drafts = speculators.chain_drafts(folder, recorded_tile(folder))
    config = {
        **speculators.header(METHOD, ["MTPDraftModel"], drafts, folder, out_dtype),
        "transformer_layer_config": speculators.nested_config(target_config),
        "num_nextn_predict_layers": 1,
        "draftsmith": {"modules_trained": heads.num_depths, "modules_written": 1,
                       "chain_input": getattr(heads.config, "chain_input", "hidden")},
    }
    module_one = {name.removeprefix("layers.0."): t for name, t in heads.native_state().items()
                  if name.startswith("layers.0.")}  # DeepSeek's names, the block's unnested
    weights = {_MTP_PREFIX + _renamed(name, ((ours, theirs) for theirs, ours in _MTP_NAMES)): t
               for name, t in module_one.items()}
    return write_folder(out_dir, config, weights, out_dtype)


def check_mtp_type(target_config: dict, source: str) -> None:
    kind = target_config.get("model_type")
    if kind not in MTP_TYPES:
        raise DraftsmithError(f"{source}: the target is {kind}; speculators' MTP builds its module for "
                              f"{', '.join(MTP_TYPES)} verifiers only (draftsmith writes the speculators MTP layout for "
                              "those), so evaluate these MTP modules with eval --drafter mtp:RUN")


def _read_speculators(meta, layer, weights, target, source):
    if target is None:
        raise DraftsmithError(f"{source}: reading MTP modules needs the target they extend")
    check_mtp_type(layer, f"{source} transformer_layer_config")
    if int(meta.get("num_nextn_predict_layers", 1)) != 1:
        raise DraftsmithError(f"{source}: num_nextn_predict_layers {meta['num_nextn_predict_layers']}; speculators' "
                              "MTP holds one module")
    mine = target.config
    if (layer.get("hidden_size"), layer.get("num_hidden_layers")) != (mine.hidden_size, mine.num_hidden_layers):
        raise DraftsmithError(f"{source}: an MTP module of a target with {layer.get('num_hidden_layers')} layers of "
                              f"width {layer.get('hidden_size')}; the target has {mine.num_hidden_layers} of width "
                              f"{mine.hidden_size}")
    # (the verifier's embedding and head, where a folder carries them, are not the module's)
    state = {f"layers.0.{_renamed(name.removeprefix(_MTP_PREFIX), _MTP_NAMES)}": t
             for name, t in weights.items() if name.startswith(_MTP_PREFIX)}
    if not state:
        raise DraftsmithError(f"{source}: no {_MTP_PREFIX}* tensors in model.safetensors")
    # speculators chains the module on its normed output (core.py: mtp_output, after final_layernorm)
    return MTPDrafter.from_native(MTPConfig(num_depths=1, chain_input="normed"), state, target,
                                  source=source.removesuffix("/config.json"))
