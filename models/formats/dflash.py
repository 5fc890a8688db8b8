"""DFlash in the layouts other tools load, and back from any of them; the block-drafter
layout pieces DSpark's formats (models/formats/dspark.py) build on.

Every layout below was read off its loader's source; the commits read are the ones named.

z-lab DFlash (github.com/z-lab/dflash @ 44947fbf7111, dflash/model.py `DFlashDraftModel`;
SpecForge's `DFlashDraftModel` @ a6b6b0230009, specforge/modeling/draft/dflash.py, reads
the same). config.json is a Qwen3 config plus `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `layer_types` (SpecForge checks one per layer) and
`dflash_config: {target_layer_ids, mask_token_id, block_size}`; the readers take each key
from dflash_config first. The z-lab checkpoints load through
`AutoModel.from_pretrained(dir, trust_remote_code=True)`, so we add `auto_map` naming our
own modeling file, `models/dflash_remote_code.py`, copied beside the weights. Weights, no
embedding or lm_head (the target's are used):

    layers.{i}.self_attn.{q,k,v,o}_proj.weight   layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight     layers.{i}.{input,post_attention}_layernorm.weight
    fc.weight [H, n*H_t]   hidden_norm.weight   norm.weight

Layer id i is HF `hidden_states[i + 1]` in both, our convention: ids are written unchanged.
Their fc is n * hidden_size wide; we also write `target_hidden_size` (our modeling file reads it).

Precision: weights and `torch_dtype` in the target's dtype unless `--dtype` says otherwise
(models/export.py).

Settings no loader reads (decode threshold, block convention) go under a `draftsmith` key.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import read_json
from draftsmith.models import dflash_remote_code
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter
from draftsmith.models.dflash_reference import reference_layer_ids
from draftsmith.models.dtypes import DTYPES, export_dtype, target_dir_of
from draftsmith.models.formats import read_layouts, speculators, write_folder
from draftsmith.models.native import load_drafter, load_native_weights, read_native_meta

DFLASH_ARCH = "DFlashDraftModel"
MODELING_FILE = "modeling_draftsmith.py"  # models/dflash_remote_code.py, as it is


# ---------------------------------------------------------------- writing

METHOD = DFlashDrafter.method


def write_zlab(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DFlash folder in the z-lab layout (`draftsmith export --format zlab`)."""
    drafter = load_drafter(folder, METHOD)
    return export_dflash_zlab(drafter, out_dir, block_dtype(folder, dtype, drafter))


def block_dtype(folder, dtype: str | None, drafter) -> torch.dtype:
    return export_dtype(folder, dtype, drafter.fc.weight.dtype)


def export_dflash_zlab(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    if drafter.method != METHOD:
        raise DraftsmithError(f"export_dflash_zlab: this is a {drafter.method} drafter (its own settings and heads "
                              "would be lost); export it with its own formats")
    config = backbone_config(drafter, DFLASH_ARCH, dtype)
    return write_block_layout(out_dir, config, drafter.state_dict(), modeling=True)


def backbone_config(drafter: DFlashDrafter, arch: str, dtype: torch.dtype | None = None) -> dict:
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


def write_block_layout(out_dir, config: dict, state: dict, modeling: bool = False, extras: dict | None = None) -> Path:
    """A block drafter's folder in the dtype its config names. `modeling`: our modeling file
    goes beside the weights, and `auto_map` points AutoModel at the config's architecture in
    it; `extras`: JSON files written beside them."""
    copies = {}
    if modeling:
        config = {**config, "auto_map": {"AutoModel": f"{MODELING_FILE[:-3]}.{config['architectures'][0]}"}}
        copies[MODELING_FILE] = dflash_remote_code.__file__
    return write_folder(out_dir, config, state, DTYPES[config["dtype"]], extras, copies)


# ---------------------------------------------------------------- reading

def read(path: str | Path, target=None) -> DFlashDrafter:
    """A DFlash drafter from any layout we write (native, z-lab, SpecForge's, speculators), told
    apart by config.json. A folder of another method, a layout we do not know or a missing
    weight is refused in one line."""
    return read_layouts(path, METHOD, target, _read_speculators, lambda path, layout, meta, target: (
        DFlashDrafter.from_native(DFlashConfig(**backbone_fields(meta, path)), load_native_weights(path),
                                  source=str(path))))


def serve(folder: Path, written: Path, fmt: str, latency_table: str | Path | None = None) -> list[str]:
    """What `draftsmith export` prints after writing `fmt`: one block of B = 1 + D inputs gives
    B - 1 drafts; SGLang's DFLASH verifies B tokens, vLLM's `dflash` drafts B - 1."""
    from draftsmith.models.serve import window_flag

    target_dir = target_dir_of(folder)
    if fmt == "speculators":
        return speculators.serve(written, target_dir)
    return block_serve_lines(folder, written, METHOD, "DFLASH", lambda block: (block, block - 1), window_flag)


def block_serve_lines(folder: Path, written: Path, method: str, algorithm: str,
                      tokens: Callable[[int], tuple[int, int]], flags: Callable[[dict], str]) -> list[str]:
    """SGLang's and vLLM's lines for the block drafter of the native `folder`, written to
    `written`: `tokens(block)` gives SGLang's --speculative-num-draft-tokens and vLLM's
    num_speculative_tokens, `flags(config)` SGLang's extra flags from the written config; none
    where its target is not found."""
    from draftsmith.models.serve import SGLANG, engine_args, printed, vllm_line

    target_dir = target_dir_of(folder)
    if target_dir is None:
        return []
    block = int(read_native_meta(folder)["config"]["block_size"])  # as trained: every layout writes it unchanged
    config = read_json(written / "config.json")
    model, dtype, common = engine_args(target_dir)
    out, (sglang_tokens, vllm_tokens) = str(written), tokens(block)
    return printed([], [f"{SGLANG} {common} --speculative-algorithm {algorithm} --speculative-draft-model-path "
                        f"{shlex.quote(out)} --speculative-num-draft-tokens {sglang_tokens}" + flags(config),
                        vllm_line(model, dtype, {"method": method, "model": out, "num_speculative_tokens": vllm_tokens})])


_REQUIRED = object()


def setting(meta: dict, key: str, path, default=_REQUIRED):
    """A setting from `dflash_config` (SpecForge, z-lab) or the top level (DeepSpec)."""
    value = (meta.get("dflash_config") or {}).get(key, meta.get(key))
    if value is None:
        if default is _REQUIRED:
            raise DraftsmithError(f"{path}/config.json: no {key}")
        return default
    return value


def backbone_fields(meta: dict, path) -> dict:
    heads = setting(meta, "num_attention_heads", path)
    hidden = setting(meta, "hidden_size", path)
    rope = meta.get("rope_parameters") or {}
    return dict(
        hidden_size=hidden, target_hidden_size=meta.get("target_hidden_size", hidden),
        num_target_layers=setting(meta, "num_target_layers", path), vocab_size=setting(meta, "vocab_size", path),
        num_layers=setting(meta, "num_hidden_layers", path), num_heads=heads,
        num_kv_heads=meta.get("num_key_value_heads") or heads, head_dim=meta.get("head_dim") or hidden // heads,
        intermediate_size=setting(meta, "intermediate_size", path), rms_norm_eps=meta.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", meta.get("rope_theta", 10000.0)),
        max_position_embeddings=meta.get("max_position_embeddings", 32768),
        block_size=setting(meta, "block_size", path), allow_large_block=True,  # sized when it was trained
        # Absent: what z-lab and SpecForge read then, one layer per drafter layer spread their way.
        target_layer_ids=setting(meta, "target_layer_ids", path, None) or reference_layer_ids(
            setting(meta, "num_target_layers", path), setting(meta, "num_hidden_layers", path)),
        mask_token_id=setting(meta, "mask_token_id", path),
        **_window_fields(meta, path),
    )


def _window_fields(meta: dict, path) -> dict:
    """Sliding-window layers as the engines read them: layer_types, the window from
    dflash_config.swa_window_size or the top-level sliding_window; a layout whose sliding
    layers are causal inside the block (vLLM's default for them) is not what we draft."""
    types = meta.get("layer_types")
    window = setting(meta, "swa_window_size", path, None) or meta.get("sliding_window") or 0
    if not types or "sliding_attention" not in types:
        return {}
    if (meta.get("dflash_config") or {}).get("causal", True) or meta.get("is_causal"):
        raise DraftsmithError(f"{path}/config.json: sliding-window layers causal inside the block (set "
                              "dflash_config.causal false for block-bidirectional ones): not a drafter draftsmith runs")
    return {"layer_types": list(types), "sliding_window": int(window)}


# ---------------------------------------------------------------- the speculators layout

# The verifier's weights a block drafter's checkpoint never stores (the library reloads them).
VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def write_speculators(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DFlash folder as speculators' `DFlashSpeculator` (anchor as context)."""
    drafter = load_drafter(folder, METHOD)
    config, out_dtype = speculator_config(drafter, Path(folder), dtype, ["DFlashSpeculator"], anchor_first=False)
    return write_folder(out_dir, config, drafter.state_dict(), out_dtype)


def speculator_config(drafter: DFlashDrafter, folder: Path, dtype: str | None, architectures: list[str],
                      anchor_first: bool) -> tuple[dict, torch.dtype]:
    """The speculators config of a block drafter (its method's name is the library's type),
    and the dtype its weights are written in."""
    c = drafter.config
    if c.target_hidden_size != c.hidden_size:
        raise DraftsmithError(f"{folder}: the drafter is {c.hidden_size} wide and the target {c.target_hidden_size}; "
                              "speculators builds fc for equal widths (len(ids) * hidden_size)")
    target = speculators.target_dir(folder)
    out_dtype = block_dtype(folder, dtype, drafter)
    layer = {**c.qwen3_config().to_diff_dict(), "model_type": "qwen3", "layer_types": list(c.layer_types),
             **({"sliding_window": c.sliding_window, "use_sliding_window": True} if c.sliding_window else {})}
    config = {
        **speculators.header(drafter.method, architectures, c.drafts_per_block, target, out_dtype),
        "transformer_layer_config": speculators.nested_config(layer),
        "draft_vocab_size": c.vocab_size, "block_size": c.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        # Every layer of ours sees its whole block. speculators reads the key for sliding layers
        # only (full attention is always non-causal there), but vLLM 0.32 turns it into
        # `dflash_config.causal = not key` for every layer (transformers_utils/configs/speculators/
        # algos.py, models/qwen3_dflash.py), so false would serve a full-attention drafter causal:
        # measured, tau 2.39 against our 2.71 on an overfit DFlash (tests/test_engine.py).
        "mask_token_id": c.mask_token_id, "sliding_window_non_causal": True,
        "sample_from_anchor": anchor_first,
        "draftsmith": {"target_layer_ids": list(c.target_layer_ids), "num_anchors": c.num_anchors},
    }
    return config, out_dtype


def speculator_fields(meta: dict, layer: dict, target, source: str) -> dict:
    """A block drafter's backbone fields from a speculators config; what draftsmith's block
    drafters do not implement is refused in one line."""
    vocab = layer["vocab_size"]
    if meta.get("draft_vocab_size", vocab) != vocab:
        raise DraftsmithError(f"{source}: draft_vocab_size {meta['draft_vocab_size']} below the vocabulary {vocab}; "
                              "draftsmith's block drafters draft over the target's whole vocabulary")
    types = layer.get("layer_types") or ["full_attention"] * layer["num_hidden_layers"]
    if "sliding_attention" in types and not meta.get("sliding_window_non_causal"):
        raise DraftsmithError(f"{source}: sliding-window draft layers causal inside the block "
                              "(sliding_window_non_causal false); draftsmith's see their whole block")
    if meta.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise DraftsmithError(f"{source}: target_hidden_size {meta['target_hidden_size']} differs from the drafter's "
                              f"{layer['hidden_size']}, which speculators' own fc cannot have")
    if target is None:
        raise DraftsmithError(f"{source}: reading a speculators folder needs the target (it records no depth)")
    if "sample_from_anchor" not in meta:
        raise DraftsmithError(f"{source}: no sample_from_anchor; the block convention must be stated (speculators' "
                              "DSpark reads an absent key as true, vLLM's mapping as false)")
    heads, hidden = layer["num_attention_heads"], layer["hidden_size"]
    rope = layer.get("rope_parameters") or {}
    ours = meta.get("draftsmith") or {}
    return dict(
        hidden_size=hidden, target_hidden_size=hidden, num_target_layers=target.config.num_hidden_layers,
        vocab_size=vocab, num_layers=layer["num_hidden_layers"], num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or hidden // heads,
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
        block_size=int(meta["block_size"]), allow_large_block=True,
        target_layer_ids=speculators.capture_ids(meta, "aux_hidden_state_layer_ids", target, source),
        mask_token_id=meta["mask_token_id"], num_anchors=ours.get("num_anchors", DFlashConfig.num_anchors),
        layer_types=types, sliding_window=int(layer.get("sliding_window") or 0) if "sliding_attention" in types else 0,
    )


def without_verifier(weights: dict) -> dict:
    """A speculators checkpoint's tensors less the verifier's."""
    return {k: v for k, v in weights.items() if k not in VERIFIER_OWNED}


def _read_speculators(meta, layer, weights, target, source):
    fields = speculator_fields(meta, layer, target, source)
    if meta["sample_from_anchor"]:
        raise DraftsmithError(f"{source}: a DFlash speculator with sample_from_anchor true (anchor as the first "
                              "prediction) is DeepSpec's convention, which draftsmith's DFlash does not draft")
    return DFlashDrafter.from_native(DFlashConfig(**fields), without_verifier(weights),
                                     source=source.removesuffix("/config.json"))
