"""EAGLE-3 drafters in the layouts engines load: SGLang's and vLLM's `LlamaForCausalLMEagle3`
(below), speculators' `Eagle3Speculator` (models/formats/speculators.py); read back from
either and from SpecForge's, and `serve`, what export prints for each.

    out_dir/config.json         a Llama config of one layer plus the EAGLE-3 keys below
    out_dir/model.safetensors   fc, midlayer.*, norm, lm_head, d2t, t2d; no embedding

Both engines share the target's embedding when the checkpoint has none, and skip t2d.

Target layer ids. draftsmith's ids are outputs of layers, 0-based. What each consumer reads
(checked in their sources):
- SGLang reads only the nested `eagle_config.eagle_aux_hidden_state_layer_ids` (ModelRunner,
  `get_draft_hidden_dim`) and captures `[i + 1 for i in ids]` at the *input* of those
  layers (`set_eagle3_layers_to_capture`: "for the ith layer, it takes the output of the
  (i-1)th layer"), so its ids are output-of-layer ids: ours unchanged. Without them it
  captures at the inputs of (2, N // 2, N - 3), i.e. the reference [1, N//2 - 1, N - 4].
- SpecForge (SGLang's trainer) reads the same nested key with the same meaning.
- vLLM reads only the top-level `eagle_aux_hidden_state_layer_ids`
  (`get_eagle3_aux_layers_from_config`) and captures `hidden_states + residual` before
  running layer j, i.e. id j = output of layer j - 1 (HF `hidden_states[j]`): ours + 1.
  Its built-in default is the same (2, N // 2, N - 3).
Since each engine reads only its own key, both keys go into both layouts; the `engine`
argument is recorded and is where an engine-specific difference would go.

Weight names and config fields each loader reads (sources read for this file):
- SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f60 (`LlamaForCausalLMEagle3`):
  `fc` (input `target_hidden_size` or `hidden_size`, times 3), `midlayer.*` with q/k/v and
  gate/up fused at load, `midlayer.hidden_norm`, `norm`, `lm_head` of `draft_vocab_size`
  rows (`tie_word_embeddings` false), `d2t` (draft id + d2t = target id), `t2d` skipped;
  `num_hidden_layers` > 1 would add plain layers, so it must be 1.
- vLLM vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e8 (`Eagle3LlamaForCausalLM`):
  `midlayer.` renamed `layers.0.`, every name but lm_head prefixed `model.`, `d2t` becomes
  `draft_id_to_target_id`, `t2d` skipped, `fc` built only with
  `eagle_config.use_aux_hidden_state` (default true), `norm_before_residual`,
  `attention_bias`, `mlp_bias`, `target_hidden_size`, `draft_vocab_size`; an
  `embed_tokens` in the file is loaded, otherwise the target's is shared. The layer ids are
  read by `get_eagle3_aux_layers_from_config` (top-level key only).
- SpecForge specforge/modeling/draft/llama3_eagle.py @ a6b6b0230009 (`LlamaForCausalLMEagle3`)
  trains with the same names and also saves `embed_tokens`; `read` reads its folders.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import read_json
from draftsmith.models.dtypes import DTYPES, export_dtype, target_dir_of
from draftsmith.models.eagle3 import (
    METHOD,
    Eagle3Config,
    Eagle3Drafter,
    default_layer_ids,
)
from draftsmith.models.formats import read_layouts, speculators, write_folder
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.native import config_from_dict, load_native_weights, read_native_meta
from draftsmith.models.serve import recorded_tile
from draftsmith.models.target import target_shape

ARCHITECTURE = "LlamaForCausalLMEagle3"
ENGINES = ("sglang", "vllm")


def export_config(config: Eagle3Config, engine: str, dtype: torch.dtype = torch.float32) -> dict:
    layer_ids = list(config.target_layer_ids)
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        # vLLM: the residual is the unnormalised hidden (SGLang has only this variant).
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
        "torch_dtype": str(dtype).removeprefix("torch."),  # what SGLang's and vLLM's --dtype auto read
        "dtype": str(dtype).removeprefix("torch."),  # the same, as transformers 5 names it
        "draftsmith": {"engine": engine, "ttt_length": config.ttt_length, "ttt_decay": config.ttt_decay},
    }
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    return {**out, **window_keys(config.sliding_window)}


def window_keys(window: int) -> dict:
    """A sliding-window draft layer as transformers' and vLLM's Llama layer read it (vLLM's
    LlamaAttention: `layer_types[i]` of the draft layers, then `sliding_window`)."""
    return {"layer_types": ["sliding_attention"], "sliding_window": window} if window else {}


def window_of(layer: dict, source: str) -> int:
    """The window `window_keys` writes (0: full attention)."""
    types = layer.get("layer_types") or ["full_attention"]
    if types != ["sliding_attention"]:
        return 0
    if not layer.get("sliding_window"):
        raise DraftsmithError(f"{source}: a sliding_attention draft layer without sliding_window")
    return int(layer["sliding_window"])


def _config_and_weights(run_or_drafter) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    if isinstance(run_or_drafter, Eagle3Drafter):
        return run_or_drafter.config, run_or_drafter.state_dict()
    path = Path(find_model_dir(run_or_drafter))  # a training run stands for its model/
    meta = read_native_meta(path, expect_method=METHOD)
    config = config_from_dict(Eagle3Config, meta["config"], source=f"{path}/config.json")
    return config, load_native_weights(path)


def export_eagle3(run_or_drafter: Eagle3Drafter | str | Path, out_dir: str | Path, engine: str,
                  dtype: str | None = None) -> Path:
    """Write a drafter, a native EAGLE-3 folder or a training run (its model/) for `engine`,
    atomically: the folder appears whole or not at all. Weights and `torch_dtype` are in
    `dtype`, by default the target's (a folder's recorded target; a module: its own dtype)."""

    if engine not in ENGINES:
        raise DraftsmithError(f"EAGLE-3 export: unknown engine {engine!r} (expected one of {', '.join(ENGINES)})")
    config, state = _config_and_weights(run_or_drafter)
    trained = state["fc.weight"].dtype
    if isinstance(run_or_drafter, Eagle3Drafter):
        out_dtype = DTYPES[dtype] if dtype else trained
    else:
        out_dtype = export_dtype(find_model_dir(run_or_drafter), dtype, trained)
    weights = {k: v for k, v in state.items() if not k.startswith("embed_tokens.")}
    return write_folder(out_dir, export_config(config, engine, out_dtype), weights, out_dtype)


def write_sglang(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    return export_eagle3(folder, out_dir, "sglang", dtype)


def write_vllm(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    return export_eagle3(folder, out_dir, "vllm", dtype)


def _layer_ids(cfg: dict, num_target_layers: int, source: str) -> list[int]:
    """Our ids from either engine's key; both present must agree."""
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if nested and top and [i + 1 for i in nested] != list(top):
        raise DraftsmithError(
            f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang) and "
            f"eagle_aux_hidden_state_layer_ids {top} (vLLM) name different layers; vLLM's must be SGLang's + 1"
        )
    if nested:
        return list(nested)
    if top:
        return [i - 1 for i in top]
    return default_layer_ids(num_target_layers)  # what both engines then pick themselves


def read(path: str | Path, target: nn.Module) -> Eagle3Drafter:
    """An EAGLE-3 drafter from a native folder, an SGLang/vLLM/SpecForge one or a speculators
    one (ours or trained elsewhere), told apart by config.json; anything else is one line."""
    return read_layouts(path, METHOD, target, _read_speculators,
                        lambda path, layout, meta, target: load_eagle3_export(path, target))


def serve(folder: Path, written: Path, fmt: str, latency_table: str | Path | None = None) -> list[str]:
    """What `draftsmith export` prints after writing `fmt`: SGLang's EAGLE3 chain and vLLM's
    `eagle3` (or the speculators line), the chain's length from `plan --measure`'s table and
    the run's acceptance when a table is given (models/latency.py), else the references'."""
    from draftsmith.models.serve import SGLANG, chain, engine_args, printed, vllm_line, window_flag

    target_dir, tile = target_dir_of(folder), recorded_tile(folder)
    notes, steps = [], None
    if latency_table and target_dir is not None:
        from draftsmith.models.latency import chain_steps
        from draftsmith.models.tile import plan_tile, read_target_config

        steps, why = chain_steps(folder, written, latency_table, plan_tile(read_target_config(target_dir), tile).D)
        notes.append(f"EAGLE-3 chain: {why}" if steps else f"EAGLE-3 chain: the references' length ({why})")
    if fmt == "speculators":
        return speculators.serve(written, target_dir, tuple(notes))
    if target_dir is None:
        return notes
    config = read_json(written / "config.json")
    model, dtype, common = engine_args(target_dir)
    flags, d = chain(target_dir, steps, tile)
    lines = [f"{SGLANG} {common} --speculative-algorithm EAGLE3 --speculative-draft-model-path "
             f"{shlex.quote(str(written))} {flags}{window_flag(config)}",
             vllm_line(model, dtype, {"method": METHOD, "model": str(written), "num_speculative_tokens": d})]
    return printed(notes, lines if flags else [])


def load_eagle3_export(path: str | Path, target: nn.Module) -> Eagle3Drafter:
    """Read an SGLang or vLLM EAGLE-3 folder back; the embedding is the target's."""
    path = Path(path)
    source = f"{path}/config.json"
    cfg = read_json(path / "config.json")
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise DraftsmithError(f"{source}: architectures {cfg.get('architectures')} do not include {ARCHITECTURE}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise DraftsmithError(
            f"{source}: num_hidden_layers {cfg['num_hidden_layers']}; only one-layer EAGLE-3 is supported"
        )
    try:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        ours = cfg.get("draftsmith") or {}
        config = Eagle3Config(
            hidden_size=cfg["hidden_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_layer_ids=_layer_ids(cfg, target_shape(target.config).num_layers, source),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            ttt_length=ours.get("ttt_length", 7),
            ttt_decay=ours.get("ttt_decay", 0.8),
            sliding_window=window_of(cfg, source),
        )
    except KeyError as missing:
        raise DraftsmithError(f"{source}: missing key {missing}") from None
    state = {k.removeprefix("model."): v for k, v in load_native_weights(path).items()}
    state.pop("embed_tokens.weight", None)  # a checkpoint may carry a copy; ours is the target's
    if "d2t" not in state:  # engines allow omitting the maps when the vocabularies are equal
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(config.draft_vocab_size) + state["d2t"]] = True
        state["t2d"] = t2d
    return Eagle3Drafter.from_native(config, state, target, source=str(path))


# ---------------------------------------------------------------- the speculators layout

def write_speculators(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native EAGLE-3 folder as speculators' `Eagle3Speculator` (one Llama layer)."""
    folder = Path(folder)
    meta = read_native_meta(folder, expect_method=METHOD)
    c = config_from_dict(Eagle3Config, meta["config"], source=f"{folder}/config.json").derive()
    target = speculators.target_dir(folder)
    state = load_native_weights(folder)
    out_dtype = export_dtype(folder, dtype, state["fc.weight"].dtype)
    layer = {**c.llama_config().to_diff_dict(), "model_type": "llama", **window_keys(c.sliding_window)}
    drafts = speculators.chain_drafts(target, recorded_tile(folder))
    config = {
        **speculators.header(METHOD, ["Eagle3Speculator"], drafts, target, out_dtype),
        "transformer_layer_config": speculators.nested_config(layer),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": None if c.target_hidden_size == c.hidden_size else c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "embed_requires_grad": False,
        "draftsmith": {"target_layer_ids": list(c.target_layer_ids), "ttt_length": c.ttt_length,
                       "ttt_decay": c.ttt_decay},
    }
    weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    if c.draft_vocab_size == c.vocab_size:  # the library registers no maps for a full vocabulary
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    return write_folder(out_dir, config, weights, out_dtype)


def _read_speculators(meta, layer, weights, target, source):
    speculators.require(meta, "norm_before_residual", False, source,
             "speculators reads an absent key as false and vLLM as true; our EAGLE-3 adds the unnormalised hidden")
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if meta.get(key):
            raise DraftsmithError(f"{source}: {key} true is a variant draftsmith's EAGLE-3 does not implement")
    if layer.get("model_type", "llama") != "llama":
        raise DraftsmithError(f"{source}: transformer_layer_config model_type {layer.get('model_type')!r}; "
                              "draftsmith's EAGLE-3 layer is Llama's (no per-head q/k norms)")
    if layer.get("num_hidden_layers", 1) != 1:
        raise DraftsmithError(f"{source}: num_hidden_layers {layer['num_hidden_layers']}; only one-layer EAGLE-3 is read")
    heads, hidden = layer["num_attention_heads"], layer["hidden_size"]
    rope = layer.get("rope_parameters") or {}
    ours = meta.get("draftsmith") or {}
    config = Eagle3Config(
        hidden_size=hidden, target_hidden_size=meta.get("target_hidden_size") or hidden,
        intermediate_size=layer["intermediate_size"], num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or hidden // heads,
        vocab_size=layer["vocab_size"], draft_vocab_size=meta.get("draft_vocab_size") or layer["vocab_size"],
        target_layer_ids=speculators.capture_ids(meta, "eagle_aux_hidden_state_layer_ids", target, source),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=layer.get("max_position_embeddings", 4096),
        ttt_length=ours.get("ttt_length", 7), ttt_decay=ours.get("ttt_decay", 0.8),
        sliding_window=window_of(layer, source),
    )
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()
             if k not in ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")}
    if "d2t" not in state:  # a full vocabulary: the identity maps
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return Eagle3Drafter.from_native(config, state, target, source=source.removesuffix("/config.json"))
