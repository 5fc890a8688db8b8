"""DFlash and DSpark in the layouts other tools load, the native format, and back.

z-lab reference layout (github.com/z-lab/dflash, `DFlashDraftModel` in dflash/model.py
and tests/fixtures/dflash2-config.json, as read for this file). config.json is a Qwen3
config plus `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and
`dflash_config: {target_layer_ids, mask_token_id, block_size}` (the reference reads each
key from dflash_config first, then the top level). model.safetensors has no embedding and
no lm_head (the target's are used):

    layers.{i}.self_attn.{q,k,v,o}_proj.weight   layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight     layers.{i}.{input,post_attention}_layernorm.weight
    fc.weight [H, n*H_t]   hidden_norm.weight   norm.weight

Our module uses these names, so its state dict is the file. The reference reads layer id i
as HF `hidden_states[i + 1]`, the output of layer i, which is our convention: ids are
written unchanged. Its fc is n * hidden_size wide (it assumes the drafter is as wide as
the target); we also write `target_hidden_size`, which other DFlash readers accept.

DSpark (github.com/deepseek-ai/DeepSpec, deepspec/modeling/dspark: `Qwen3DSparkModel`,
VanillaMarkov, AcceptRatePredictor): the same backbone names plus
`markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r] and
`confidence_head.proj.{weight [1, H + r], bias [1]}`, with top-level keys `block_size`,
`mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`,
`markov_head_type: "vanilla"`, `enable_confidence_head`, `confidence_head_with_markov`,
`num_anchors`. Its slot k predicts the token at anchor + k + 1, our
"anchor_is_first_prediction". DeepSpec checkpoints also carry copies of the target's
`embed_tokens` and `lm_head`; ours do not, hence `architectures: ["DSparkDraftModel"]`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir, read_json, write_json
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter
from draftsmith.models.dspark import ANCHOR_IS_FIRST_PREDICTION, BLOCK_CONVENTIONS, DSparkConfig, DSparkDrafter
from draftsmith.models.native import load_drafter, load_native_weights

DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "DSparkDraftModel"
_KINDS = {DFLASH_ARCH: ("DFlash", "load_dflash_zlab"), DSPARK_ARCH: ("DSpark", "load_dspark")}


# ---------------------------------------------------------------- writing

def export_zlab(folder: str | Path, out_dir: str | Path) -> Path:
    """A native DFlash folder in the z-lab layout (`draftsmith export --format zlab`)."""
    return export_dflash_zlab(load_drafter(folder, "dflash"), out_dir)


def export_dspark_folder(folder: str | Path, out_dir: str | Path) -> Path:
    """A native DSpark folder in the DSpark layout (`draftsmith export --format dspark`)."""
    return export_dspark(load_drafter(folder, "dspark"), out_dir)


def export_dflash_zlab(drafter: DFlashDrafter, out_dir: str | Path) -> Path:
    if isinstance(drafter, DSparkDrafter):
        raise DraftsmithError("export_dflash_zlab: this is a DSpark drafter (its block convention and heads "
                              "would be lost); export it with export_dspark")
    return _write(out_dir, _backbone_config(drafter, DFLASH_ARCH), drafter)


def export_dspark(drafter: DSparkDrafter, out_dir: str | Path) -> Path:
    if not isinstance(drafter, DSparkDrafter):
        raise DraftsmithError("export_dspark: this is a DFlash drafter; export it with export_dflash_zlab")
    c = drafter.config
    config = _backbone_config(drafter, DSPARK_ARCH)
    config.update(
        target_layer_ids=list(c.target_layer_ids), mask_token_id=c.mask_token_id, num_anchors=c.num_anchors,
        markov_rank=c.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
        block_convention=c.block_convention,
        dspark_config={
            "block_convention": c.block_convention,
            "block_convention_meaning": (
                f"a block of {c.block_size} inputs [anchor, mask x {c.block_size - 1}] at positions anchor.. "
                f"gives {c.drafts_per_block} drafts; slot k predicts the token at anchor + k + "
                f"{1 - c.first_prediction_slot}"),
            "drafts_per_block": c.drafts_per_block,
            "confidence_threshold": c.confidence_threshold,
        },
    )
    return _write(out_dir, config, drafter)


def _backbone_config(drafter: DFlashDrafter, arch: str) -> dict:
    c = drafter.config
    qwen3 = c.qwen3_config().to_diff_dict()
    qwen3["rope_theta"] = float(c.rope_theta)  # transformers < 5 reads it at the top level
    return {
        "architectures": [arch], **qwen3,
        "dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id,
                          "block_size": c.block_size},
    }


def _write(out_dir, config: dict, drafter: DFlashDrafter) -> Path:
    out_dir = Path(out_dir)
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
    return out_dir


# ---------------------------------------------------------------- reading

def load_dflash_zlab(path: str | Path) -> DFlashDrafter:
    meta, weights = _read(path, DFLASH_ARCH)
    return DFlashDrafter.from_native(DFlashConfig(**_backbone_fields(meta, path)), weights, source=str(path))


def load_dspark(path: str | Path) -> DSparkDrafter:
    meta, weights = _read(path, DSPARK_ARCH)
    extra = meta.get("dspark_config") or {}
    if meta.get("markov_head_type", "vanilla") != "vanilla" or not meta.get("confidence_head_with_markov", True):
        raise DraftsmithError(f"{path}/config.json: only the vanilla Markov head with a confidence head on "
                              "[h; W1[x]] is supported")
    convention = extra.get("block_convention", meta.get("block_convention", ANCHOR_IS_FIRST_PREDICTION))
    if convention not in BLOCK_CONVENTIONS:
        raise DraftsmithError(
            f"{path}/config.json: block_convention {convention!r} is not one of {', '.join(BLOCK_CONVENTIONS)}"
        )
    config = DSparkConfig(
        **_backbone_fields(meta, path), markov_rank=_key(meta, "markov_rank", path),
        block_convention=convention, num_anchors=meta.get("num_anchors", DSparkConfig.num_anchors),
        confidence_threshold=extra.get("confidence_threshold", DSparkConfig.confidence_threshold),
    )
    return DSparkDrafter.from_native(config, weights, source=str(path))


def _read(path, arch: str) -> tuple[dict, dict]:
    path = Path(path)
    meta = read_json(path / "config.json")
    found = (meta.get("architectures") or [None])[0]
    if found != arch:
        if meta.get("format") == "draftsmith":
            raise DraftsmithError(
                f"{path} is a draftsmith native {meta.get('method')} drafter; load it with models.native.load_drafter"
            )
        if found in _KINDS:
            kind, loader = _KINDS[found]
            raise DraftsmithError(
                f"{path} holds a {kind} checkpoint ({found}), not {_KINDS[arch][0]}; load it with {loader}"
            )
        raise DraftsmithError(f"{path}/config.json: architectures {meta.get('architectures')!r}, expected [{arch!r}]")
    return meta, load_native_weights(path)  # any folder's model.safetensors, with one-line errors


def _key(meta: dict, key: str, path):
    nested = meta.get("dflash_config") or {}
    value = nested.get(key, meta.get(key))
    if value is None:
        raise DraftsmithError(f"{path}/config.json: no {key}")
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
        target_layer_ids=(meta.get("dflash_config") or {}).get("target_layer_ids", meta.get("target_layer_ids")),
        mask_token_id=_key(meta, "mask_token_id", path),
    )


def load_block_drafter(path: str | Path, method: str = "dflash") -> DFlashDrafter:
    """A DFlash or DSpark drafter from any of our formats, told apart by config.json; a
    checkpoint of the other method is refused in one line."""
    if read_json(Path(path) / "config.json").get("format") == "draftsmith":
        return load_drafter(path, method)
    return load_dspark(path) if method == "dspark" else load_dflash_zlab(path)
