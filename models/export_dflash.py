"""DFlash and DSpark in the layouts other tools load, and back from any of them.

Every layout below was read off its loader's source; the commits read are the ones named.

z-lab DFlash (github.com/z-lab/dflash @ 44947fbf7111, dflash/model.py `DFlashDraftModel`;
SpecForge's `DFlashDraftModel` @ a6b6b0230009, specforge/modeling/draft/dflash.py, reads
the same). config.json is a Qwen3 config plus `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `layer_types` (SpecForge checks one per layer) and
`dflash_config: {target_layer_ids, mask_token_id, block_size}`; the readers take each key
from dflash_config first. The z-lab checkpoints load through
`AutoModel.from_pretrained(dir, trust_remote_code=True)`, so we add `auto_map` naming our
own modeling file, `models/zlab_modeling.py`, copied beside the weights. Weights, no
embedding or lm_head (the target's are used):

    layers.{i}.self_attn.{q,k,v,o}_proj.weight   layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight     layers.{i}.{input,post_attention}_layernorm.weight
    fc.weight [H, n*H_t]   hidden_norm.weight   norm.weight

Layer id i is HF `hidden_states[i + 1]` in both, our convention: ids are written unchanged.
Their fc is n * hidden_size wide; we also write `target_hidden_size` (our modeling file reads it).

SpecForge DSpark (@ a6b6b0230009, specforge/modeling/draft/dspark.py `DSparkDraftModel`,
configs/qwen3-8b-dspark.json): the DFlash config with `architectures: ["DSparkDraftModel"]`
and the heads' settings *inside* dflash_config: `projector_type: "dspark"`, `markov_rank`,
`markov_head_type: "vanilla"`, `enable_confidence_head`, `confidence_head_with_markov`,
`confidence_head_alpha`, `attention_mode` ("gqa" needs fewer KV heads than query heads,
"mha" equal ones). Its training labels slot k with the token at anchor + k + 1 (the anchor
is the first prediction slot, our ANCHOR_IS_FIRST_PREDICTION). Extra weights:
`markov_head.markov_w1.weight` [V, r] (an embedding), `markov_head.markov_w2.weight` [V, r],
`confidence_head.proj.{weight [1, H + r], bias [1]}`.

What SGLang and vLLM load (newest sources read): SGLang python/sglang/srt/models/dspark.py
@ 01f476234ab4 registers only `Qwen3DSparkModel` (EntryClass), and
speculative/dspark_components/dspark_config.py (`parse_dspark_draft_config`) reads
`markov_rank` and `markov_head_type` from `dspark_config` or the top level, never from
`dflash_config` (a SpecForge folder fails: "DSpark requires markov_rank > 0"); its gamma is
`block_size` (the drafts per block, anchor first) and `--speculative-num-draft-tokens` is
gamma + 1; it skips `embed_tokens.` and `lm_head.`. vLLM's registry sends
`DSparkDraftModel` to its DeepSeek-V4 class and `Qwen3DSparkModel` to
vllm/model_executor/models/qwen3_dspark.py @ 0302ff404394 (`Qwen3DSparkForCausalLM`), which
reads top-level `markov_rank`, `enable_confidence_head`, `confidence_head_with_markov`,
prefixes every weight but lm_head with `model.`, keeps an `embed_tokens`/`lm_head` the
file has (the target's otherwise), and takes the layer ids from `dflash_config` or the top
level, plus one (`get_eagle3_aux_layers_from_config`). SpecForge's own
scripts/gates/normalize_dflash_export.py (@ a6b6b0230009) rewrites its DSpark folders into
exactly that before SGLang loads them. So one layout serves DeepSpec, SGLang and vLLM:
DeepSpec's (below) with `dflash_config` kept too (`--format deepspec|sglang|vllm`), and
SpecForge's trainer keeps its own (`--format specforge`).

DeepSpec DSpark (github.com/deepseek-ai/DeepSpec @ afdfa7c93823,
deepspec/modeling/dspark/qwen3/{config,modeling}.py `Qwen3DSparkModel`, loaded by
deepspec/eval/dspark/evaluator.py with `Qwen3DSparkModel.from_pretrained`): a copy of the
target's Qwen3 config with `architectures: ["Qwen3DSparkModel"]` and at the top level
`num_target_layers`, `block_size`, `mask_token_id`, `target_layer_ids`, `num_anchors`,
`enable_confidence_head`, `confidence_head_with_markov`, `markov_rank`, `markov_head_type`,
`layer_types`; the same weight names plus the target's `embed_tokens.weight` and
`lm_head.weight`, stored in the drafter. Its evaluator drafts `block_size` tokens per block
(anchor first) and refuses the target's last layer as a context layer. A target with a
tied embedding and head (Qwen3-0.6B to 4B) gets two tensors in the file, as safetensors
requires.

Precision: weights and `torch_dtype` in the target's dtype unless `--dtype` says otherwise
(models/export.py).

Settings no loader reads (decode threshold, block convention) go under a `draftsmith` key.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir, read_json, write_json
from draftsmith.models import zlab_modeling
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter, reference_layer_ids
from draftsmith.models.dspark import ANCHOR_IS_FIRST_PREDICTION, BLOCK_CONVENTIONS, DSparkConfig, DSparkDrafter
from draftsmith.models.dtypes import DTYPES, cast_floats, export_dtype, target_dir_of
from draftsmith.models.layouts import NATIVE, SPECULATORS, expect
from draftsmith.models.native import load_drafter, load_native_weights, read_native_meta

DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "DSparkDraftModel"
DEEPSPEC_ARCH = "Qwen3DSparkModel"
MODELING_FILE = "modeling_draftsmith.py"  # models/zlab_modeling.py, as it is


# ---------------------------------------------------------------- writing

def export_zlab(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DFlash folder in the z-lab layout (`draftsmith export --format zlab`)."""
    drafter = load_drafter(folder, "dflash")
    return export_dflash_zlab(drafter, out_dir, _dtype(folder, dtype, drafter))


def export_specforge(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DSpark folder in SpecForge's layout (`draftsmith export --format specforge`)."""
    drafter = load_drafter(folder, "dspark")
    return export_dspark_specforge(drafter, out_dir, _dtype(folder, dtype, drafter))


def export_qwen3_dspark(folder: str | Path, out_dir: str | Path, dtype: str | None = None,
                        latency_table: str | Path | None = None) -> Path:
    """A native DSpark folder as `Qwen3DSparkModel` (`--format deepspec`, `sglang` or `vllm`:
    one folder all three load), with the embedding and head of the target it was trained
    on (the folder's `target`), and SGLang's serving calibration beside it: the confidence
    temperatures training fitted on its held-out rows, and with `latency_table` the
    steps-per-second table (models/dspark_calibration.py)."""
    from draftsmith.models.dspark_calibration import SPS_FILE, STS_FILE, sps_table
    from draftsmith.models.target import load_target

    drafter = load_drafter(folder, "dspark")
    target_dir = target_dir_of(folder)
    if target_dir is None:
        raise DraftsmithError(f"{folder}/config.json: target {read_native_meta(folder).get('target')!r} not found; "
                              "the Qwen3DSparkModel layout stores the target's embedding and head (DeepSpec reads "
                              "them), so the target folder is needed")
    extras = {}
    sts = Path(folder) / STS_FILE
    if sts.is_file():
        calibration = read_json(sts)
        if len(calibration.get("temperatures") or []) != drafter.drafts_per_block:
            raise DraftsmithError(f"{sts}: {len(calibration.get('temperatures') or [])} temperatures for a drafter of "
                                  f"{drafter.drafts_per_block} drafts per block (SGLang's gamma)")
        extras[STS_FILE] = calibration
    if latency_table is not None:
        extras[SPS_FILE] = sps_table(latency_table)
    return export_dspark_deepspec(drafter, out_dir, load_target(target_dir), _dtype(folder, dtype, drafter), extras)


def _dtype(folder, dtype: str | None, drafter) -> torch.dtype:

    return export_dtype(folder, dtype, drafter.fc.weight.dtype)


def export_dflash_zlab(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    if isinstance(drafter, DSparkDrafter):
        raise DraftsmithError("export_dflash_zlab: this is a DSpark drafter (its block convention and heads "
                              "would be lost); export it with export_dspark_specforge")
    config = _backbone_config(drafter, DFLASH_ARCH, dtype)
    return _write(out_dir, config, drafter.state_dict(), modeling=True)


def export_dspark_specforge(drafter: DSparkDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    c = _check_dspark(drafter, "SpecForge")
    config = _backbone_config(drafter, DSPARK_ARCH, dtype)
    config["dflash_config"].update(
        projector_type="dspark", markov_rank=c.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=bool(c.markov_rank), confidence_head_alpha=c.bce_weight,
        attention_mode="mha" if c.num_kv_heads == c.num_heads else "gqa",
    )
    config["draftsmith"] = _our_settings(c)
    return _write(out_dir, config, drafter.state_dict(), modeling=True)


def export_dspark_deepspec(drafter: DSparkDrafter, out_dir: str | Path, target,
                           dtype: torch.dtype | None = None, extras: dict | None = None) -> Path:
    """The `Qwen3DSparkModel` layout DeepSpec, SGLang and vLLM load (see the module doc)."""
    c = _check_dspark(drafter, "DeepSpec")
    if c.num_target_layers - 1 in c.target_layer_ids:
        raise DraftsmithError(f"target_layer_ids {c.target_layer_ids} include the target's last layer "
                              f"({c.num_target_layers - 1}), which DeepSpec's evaluator refuses")
    shared = _target_copies(target)
    for name, tensor in shared.items():
        if tuple(tensor.shape) != (c.vocab_size, c.hidden_size):
            raise DraftsmithError(f"the target's {name} has shape {tuple(tensor.shape)}; this drafter needs "
                                  f"({c.vocab_size}, {c.hidden_size}): it was trained for another target")
    config = _backbone_config(drafter, DEEPSPEC_ARCH, dtype)
    # DeepSpec, SGLang's DSpark and vLLM's Qwen3DSparkForCausalLM read these at the top level;
    # dflash_config (same values) stays for SGLang's DFlash base parser and vLLM's layer ids.
    config.update(
        target_layer_ids=list(c.target_layer_ids), mask_token_id=c.mask_token_id, num_anchors=c.num_anchors,
        markov_rank=c.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=bool(c.markov_rank), draftsmith=_our_settings(c),
    )
    return _write(out_dir, config, {**drafter.state_dict(), **shared}, extras=extras)


def _check_dspark(drafter, tool: str) -> DSparkConfig:
    if not isinstance(drafter, DSparkDrafter):
        raise DraftsmithError(f"{tool} DSpark export: this is a DFlash drafter; export it with export_dflash_zlab")
    c = drafter.config
    if c.block_convention != ANCHOR_IS_FIRST_PREDICTION:
        raise DraftsmithError(f"{tool} DSpark export: block_convention {c.block_convention!r}; {tool} reads slot k "
                              f"as the token at anchor + k + 1 ({ANCHOR_IS_FIRST_PREDICTION}): use --format native")
    if c.target_hidden_size != c.hidden_size:
        raise DraftsmithError(f"{tool} DSpark export: the drafter is {c.hidden_size} wide and the target "
                              f"{c.target_hidden_size}; {tool} builds fc for equal widths")
    return c


def _our_settings(c: DSparkConfig) -> dict:
    return {"block_convention": c.block_convention, "confidence_threshold": c.confidence_threshold,
            "num_anchors": c.num_anchors,
            "block_convention_meaning": f"a block of {c.block_size} inputs [anchor, mask x {c.block_size - 1}] gives "
                                        f"{c.drafts_per_block} drafts; slot k predicts the token at anchor + k + 1"}


def _backbone_config(drafter: DFlashDrafter, arch: str, dtype: torch.dtype | None = None) -> dict:
    c = drafter.config
    qwen3 = c.qwen3_config().to_diff_dict()
    qwen3["rope_theta"] = float(c.rope_theta)  # transformers < 5 reads it at the top level
    name = str(dtype or drafter.fc.weight.dtype).removeprefix("torch.")
    return {
        "architectures": [arch], **qwen3, "model_type": "qwen3",
        "dtype": name, "torch_dtype": name,  # transformers 5's name, and the one the engines' --dtype auto reads
        "layer_types": list(c.layer_types),
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id,
                          "block_size": c.block_size, **_window_keys(c)},
        **({"sliding_window": c.sliding_window, "use_sliding_window": True} if c.sliding_window else {}),
    }


def _window_keys(c: DFlashConfig) -> dict:
    """dflash_config's sliding-window keys as vLLM's DFlash reads them (qwen3_dflash.py
    `_resolve_layer_attention`, @ 036a00d1f5d0): the window (`swa_window_size`) and `causal:
    false`, since vLLM otherwise makes every sliding layer causal inside the block, where ours
    (and the layer_types' full layers) see the whole block."""
    return {"swa_window_size": c.sliding_window, "causal": False} if c.sliding_window else {}


def _write(out_dir, config: dict, state: dict, modeling: bool = False, extras: dict | None = None) -> Path:
    """`modeling`: our modeling file goes beside the weights, and `auto_map` points
    AutoModel at the config's architecture in it; `extras`: JSON files written beside them."""

    out_dir = Path(out_dir)
    if modeling:
        config = {**config, "auto_map": {"AutoModel": f"{MODELING_FILE[:-3]}.{config['architectures'][0]}"}}
    tensors = cast_floats(state, DTYPES[config["dtype"]])  # each its own copy: a tied embedding and head too
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        for name, data in (extras or {}).items():
            write_json(tmp / name, data)
        if modeling:
            shutil.copyfile(zlab_modeling.__file__, tmp / MODELING_FILE)
    return out_dir


# ---------------------------------------------------------------- reading

def load_any(path: str | Path, method: str = "dflash", target=None) -> DFlashDrafter:
    """A DFlash or DSpark drafter from any layout we write (native, z-lab, SpecForge,
    DeepSpec, speculators), told apart by config.json. A folder of another method, a layout we do not
    know, a missing weight, or (with `target`) stored target weights of the wrong shape
    are refused in one line."""
    layout, meta = expect(path, method)
    if layout == NATIVE:
        return load_drafter(path, method)
    if layout == SPECULATORS:
        from draftsmith.models.speculators_format import load

        return load(path, method, target)
    weights = load_native_weights(path)
    if method == "dflash":
        return DFlashDrafter.from_native(DFlashConfig(**_backbone_fields(meta, path)), weights, source=str(path))
    if layout == "deepspec":
        _drop_target_copies(weights, target, path)
    return DSparkDrafter.from_native(_dspark_config(meta, path), weights, source=str(path))


def _dspark_config(meta: dict, path) -> DSparkConfig:
    setting = lambda key, default=None: _key(meta, key, path, default)  # noqa: E731
    rank = int(setting("markov_rank", 0) or 0)
    # markov_rank 0 (DeepSpec's DFlash): no refiner, the confidence head on h alone.
    if (setting("markov_head_type", "vanilla") != "vanilla" or not setting("enable_confidence_head", True)
            or bool(setting("confidence_head_with_markov", bool(rank))) != bool(rank)):
        raise DraftsmithError(f"{path}/config.json: only DSpark with a vanilla Markov head and a confidence head on "
                              "[h; W1[x]] (or, with markov_rank 0, on h) is supported")
    ours = meta.get("draftsmith") or meta.get("dspark_config") or {}
    convention = ours.get("block_convention", meta.get("block_convention", ANCHOR_IS_FIRST_PREDICTION))
    if convention not in BLOCK_CONVENTIONS:
        raise DraftsmithError(
            f"{path}/config.json: block_convention {convention!r} is not one of {', '.join(BLOCK_CONVENTIONS)}"
        )
    return DSparkConfig(
        **_backbone_fields(meta, path), markov_rank=rank, block_convention=convention,
        num_anchors=ours.get("num_anchors", meta.get("num_anchors", DSparkConfig.num_anchors)),
        confidence_threshold=ours.get("confidence_threshold", DSparkConfig.confidence_threshold),
    )


def _target_copies(target) -> dict[str, torch.Tensor]:
    """The target's tensors DeepSpec's layout stores beside the drafter's, by its names."""
    return {"embed_tokens.weight": target.get_input_embeddings().weight,
            "lm_head.weight": target.get_output_embeddings().weight}


def _drop_target_copies(weights: dict, target, path) -> None:
    """DeepSpec's copies of the target's embedding and head: checked against the target
    when there is one, then dropped (we draft with the target's own)."""
    owns = _target_copies(target) if target is not None else dict.fromkeys(("embed_tokens.weight", "lm_head.weight"))
    for name, own in owns.items():
        stored = weights.pop(name, None)
        if stored is None:
            raise DraftsmithError(f"{path}/model.safetensors: no {name} (DeepSpec's layout stores the target's)")
        if own is None:
            continue
        if stored.shape != own.shape:
            raise DraftsmithError(f"{path}: {name} has shape {tuple(stored.shape)}, the target's "
                                  f"{tuple(own.shape)}: this drafter was trained for another target")
        if not torch.allclose(stored.float(), own.detach().float().cpu(), rtol=1e-2, atol=1e-3):
            warnings.warn(f"{path}: {name} differs from the target's; drafting uses the target's", stacklevel=3)


_REQUIRED = object()


def _key(meta: dict, key: str, path, default=_REQUIRED):
    """A setting from `dflash_config` (SpecForge, z-lab) or the top level (DeepSpec)."""
    value = (meta.get("dflash_config") or {}).get(key, meta.get(key))
    if value is None:
        if default is _REQUIRED:
            raise DraftsmithError(f"{path}/config.json: no {key}")
        return default
    return value


def _backbone_fields(meta: dict, path) -> dict:
    heads = _key(meta, "num_attention_heads", path)
    hidden = _key(meta, "hidden_size", path)
    rope = meta.get("rope_parameters") or {}
    return dict(
        hidden_size=hidden, target_hidden_size=meta.get("target_hidden_size", hidden),
        num_target_layers=_key(meta, "num_target_layers", path), vocab_size=_key(meta, "vocab_size", path),
        num_layers=_key(meta, "num_hidden_layers", path), num_heads=heads,
        num_kv_heads=meta.get("num_key_value_heads") or heads, head_dim=meta.get("head_dim") or hidden // heads,
        intermediate_size=_key(meta, "intermediate_size", path), rms_norm_eps=meta.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", meta.get("rope_theta", 10000.0)),
        max_position_embeddings=meta.get("max_position_embeddings", 32768),
        block_size=_key(meta, "block_size", path), allow_large_block=True,  # sized when it was trained
        # Absent: what z-lab and SpecForge read then, one layer per drafter layer spread their way.
        target_layer_ids=_key(meta, "target_layer_ids", path, None) or reference_layer_ids(
            _key(meta, "num_target_layers", path), _key(meta, "num_hidden_layers", path)),
        mask_token_id=_key(meta, "mask_token_id", path),
        **_window_fields(meta, path),
    )


def _window_fields(meta: dict, path) -> dict:
    """Sliding-window layers as the engines read them: layer_types, the window from
    dflash_config.swa_window_size or the top-level sliding_window; a layout whose sliding
    layers are causal inside the block (vLLM's default for them) is not what we draft."""
    types = meta.get("layer_types")
    window = _key(meta, "swa_window_size", path, None) or meta.get("sliding_window") or 0
    if not types or "sliding_attention" not in types:
        return {}
    if (meta.get("dflash_config") or {}).get("causal", True) or meta.get("is_causal"):
        raise DraftsmithError(f"{path}/config.json: sliding-window layers causal inside the block (set "
                              "dflash_config.causal false for block-bidirectional ones): not a drafter draftsmith runs")
    return {"layer_types": list(types), "sliding_window": int(window)}
