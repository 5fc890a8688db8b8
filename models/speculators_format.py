"""The folder format of vLLM's `speculators` library: written for EAGLE-3, DFlash and DSpark
(`draftsmith export --format speculators`), and read back from any speculators folder of
those algorithms (`eval --drafter METHOD:DIR`), ours or trained by speculators itself.

What the format is (speculators 0.9.0 on PyPI, read in its wheel: speculators/config.py
`SpeculatorModelConfig`, `SpeculatorsConfig`, `VerifierConfig`; models/{eagle3,dflash,dspark}/
config.py and core.py): one `config.json` with
- `speculators_model_type` ("eagle3", "dflash", "dspark"): the discriminator the library and
  vLLM dispatch on; no top-level `model_type` (vLLM 0.33.0 transformers_utils/config.py takes a
  config without one but with `speculators_config` as a speculators folder);
- `speculators_config`: `algorithm`, `proposal_methods` ([{"proposal_type": "greedy",
  "speculative_tokens": N}], N the drafts per verify), `default_proposal_method`, and the
  `verifier` (`name_or_path`, `architectures`: the target, which `vllm serve DIR` loads);
- `transformer_layer_config`: the draft decoder's own transformers config (Llama for EAGLE-3,
  Qwen3 for DFlash and DSpark), `draft_vocab_size`, and each algorithm's fields.
Weights (model.safetensors), the library's module names: EAGLE-3 `layers.0.*` (our
`midlayer.*`), `fc`, `norm`, `lm_head`, `d2t`/`t2d` only for a reduced vocabulary; DFlash and
DSpark `layers.{i}.*`, `fc`, `hidden_norm`, `norm` (+ `markov_head.*`, `confidence_head.*`),
no embedding or head (the verifier's are loaded, as `load_verifier_weights` does).

Conventions, each converted here (vLLM 0.33.0 vllm/transformers_utils/configs/speculators/
algos.py is what serving reads; tests/test_parity.py restates it):
- Layer ids are vLLM's capture ids, j = the output of target layer j - 1 (speculators'
  `resolve_target_layer_ids`: default [2, N // 2, N - 3], N itself allowed): ours + 1.
  vLLM hands DFlash and DSpark `target_layer_ids = aux - 1` (ours) and captures at `aux`.
- EAGLE-3 `norm_before_residual`: speculators' class defaults it to false, vLLM's mapping to
  true; ours is false (the residual is the unnormalised hidden), so it is always written, and a
  folder without it is refused rather than read two ways.
- DSpark's block convention is `sample_from_anchor`: true, the anchor is the first prediction
  slot (B drafts; our anchor_is_first_prediction, DeepSpec's); false, the anchor is context
  (B - 1 drafts; our anchor_is_context, the frozen-backbone "DFlash + refiner"). vLLM 0.33.0
  serves both (`dspark_bonus_anchor = not sample_from_anchor`) but defaults the key to false
  where speculators' DSpark config defaults it to true, so it is always written.
- MTP: speculators' `MTPDraftModel` (models/mtp/{config,core,model_definitions}.py) is one
  module (`num_nextn_predict_layers` must be 1), built for Qwen3-family verifiers only
  (`mtp_model_classes`: qwen3, qwen3_next, qwen3_5), chained for every draft and fed the
  verifier's hidden state at `num_hidden_layers` (transformers' last hidden state, after the
  final norm: what ours reads). Its `transformer_layer_config` is the verifier's own config;
  names `mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}` are
  DeepSeek's `enorm, hnorm, eh_proj, shared_head.norm` (the same [embedding; hidden] order),
  the block under the decoder layer's names. So module 1 of a Qwen3 target's run is written
  (a K-module run says so), as SGLang's NextN layout does. vLLM serves speculators MTP folders
  for Qwen3-Next and MiMo verifiers only (vllm/transformers_utils/configs/speculators/algos.py
  `update_mtp`, which takes the verifier's architectures): for a Qwen3 target the folder is
  for speculators and our decoder, and export prints no serve line.

Precision: weights and `torch_dtype` in the target's dtype unless `--dtype` (models/export.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir, read_json, write_json
from draftsmith.models.dtypes import DTYPES, cast_floats, config_dtype, dtype_name, export_dtype, target_dir_of
from draftsmith.models.export_eagle3 import window_keys, window_of
from draftsmith.models.native import config_from_dict, load_native_weights, read_native_meta

LAYOUT = "speculators"
SPECULATORS_VERSION = "0.9.0"  # the library version whose config this layout follows
# The verifier's weights a DFlash-family checkpoint never stores (the library reloads them).
_VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight", "verifier_lm_head.weight")


# ---------------------------------------------------------------- writing

def export_eagle3(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native EAGLE-3 folder as speculators' `Eagle3Speculator` (one Llama layer)."""
    from draftsmith.models.eagle3 import Eagle3Config

    folder = Path(folder)
    meta = read_native_meta(folder, expect_method="eagle3")
    c = config_from_dict(Eagle3Config, meta["config"], source=f"{folder}/config.json").derive()
    target = _target_dir(folder)
    state = load_native_weights(folder)
    out_dtype = _dtype(folder, dtype, state["fc.weight"].dtype)
    layer = {**c.llama_config().to_diff_dict(), "model_type": "llama", **window_keys(c.sliding_window)}
    config = {
        **_header("eagle3", ["Eagle3Speculator"], chain_drafts(target), target, out_dtype),
        "transformer_layer_config": _plain(layer),
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
    return _write(out_dir, config, weights, out_dtype)


def export_dflash(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DFlash folder as speculators' `DFlashSpeculator` (anchor as context)."""
    return _export_block(folder, out_dir, dtype, "dflash")


def export_dspark(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DSpark folder as speculators' `DSparkSpeculator`, either block convention,
    `sample_from_anchor` stating which."""
    return _export_block(folder, out_dir, dtype, "dspark")


def _export_block(folder, out_dir, dtype: str | None, method: str) -> Path:
    from draftsmith.models.dspark import ANCHOR_IS_FIRST_PREDICTION
    from draftsmith.models.native import load_drafter

    folder = Path(folder)
    drafter = load_drafter(folder, method)
    c = drafter.config
    if c.target_hidden_size != c.hidden_size:
        raise DraftsmithError(f"{folder}: the drafter is {c.hidden_size} wide and the target {c.target_hidden_size}; "
                              "speculators builds fc for equal widths (len(ids) * hidden_size)")
    target = _target_dir(folder)
    out_dtype = _dtype(folder, dtype, drafter.fc.weight.dtype)
    anchor_first = getattr(c, "block_convention", None) == ANCHOR_IS_FIRST_PREDICTION
    layer = {**c.qwen3_config().to_diff_dict(), "model_type": "qwen3", "layer_types": list(c.layer_types),
             **({"sliding_window": c.sliding_window, "use_sliding_window": True} if c.sliding_window else {})}
    config = {
        **_header(method, ["DSparkSpeculator" if method == "dspark" else "DFlashSpeculator"], c.drafts_per_block,
                  target, out_dtype),
        "transformer_layer_config": _plain(layer),
        "draft_vocab_size": c.vocab_size, "block_size": c.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        # Our sliding layers see their whole block (speculators' non-causal sliding windows).
        "mask_token_id": c.mask_token_id, "sliding_window_non_causal": bool(c.sliding_window),
        "sample_from_anchor": anchor_first,
        "draftsmith": {"target_layer_ids": list(c.target_layer_ids), "num_anchors": c.num_anchors},
    }
    if method == "dspark":
        config.update(markov_rank=c.markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=bool(c.markov_rank))
        config["draftsmith"].update(block_convention=c.block_convention, confidence_threshold=c.confidence_threshold)
    return _write(out_dir, config, drafter.state_dict(), out_dtype)


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


def export_mtp(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """An MTP run's module 1 as speculators' `MTPDraftModel`, its verifier the run's target."""
    from draftsmith.models.mtp import mtp_dir
    from draftsmith.models.native import load_drafter
    from draftsmith.models.target import load_target

    folder = Path(folder)
    target_config = read_json(folder / "config.json")
    check_mtp_type(target_config, f"{folder}/config.json")
    target = load_target(folder)
    heads = load_drafter(mtp_dir(folder), "mtp", target)
    out_dtype = DTYPES[dtype] if dtype else config_dtype(target_config) or next(heads.parameters()).dtype
    config = {
        **_header("mtp", ["MTPDraftModel"], chain_drafts(folder), folder, out_dtype),
        "transformer_layer_config": _plain(target_config),
        "num_nextn_predict_layers": 1,
        "draftsmith": {"modules_trained": heads.num_depths, "modules_written": 1,
                       "chain_input": getattr(heads.config, "chain_input", "hidden")},
    }
    module_one = {name.removeprefix("layers.0."): t for name, t in heads.native_state().items()
                  if name.startswith("layers.0.")}  # DeepSeek's names, the block's unnested
    weights = {_MTP_PREFIX + _renamed(name, ((ours, theirs) for theirs, ours in _MTP_NAMES)): t
               for name, t in module_one.items()}
    return _write(out_dir, config, weights, out_dtype)


def _renamed(name: str, prefixes) -> str:
    """`name` with the first of its (old, new) prefixes that it starts with replaced."""
    return next((new + name.removeprefix(old) for old, new in prefixes if name.startswith(old)), name)


def chain_drafts(target: Path) -> int:
    """Drafts per verify a chained drafter (EAGLE-3, MTP) is served with: the references' steps
    (models/serve.py: REFERENCE_CHAIN_STEPS) within the tile rule, as the serve lines give it."""
    from draftsmith.models.serve import REFERENCE_CHAIN_STEPS
    from draftsmith.models.tile import plan_tile, read_target_config

    return max(1, min(plan_tile(read_target_config(target)).D, REFERENCE_CHAIN_STEPS))


def check_mtp_type(target_config: dict, source: str) -> None:
    kind = target_config.get("model_type")
    if kind not in MTP_TYPES:
        raise DraftsmithError(f"{source}: the target is {kind}; speculators' MTP builds its module for "
                              f"{', '.join(MTP_TYPES)} verifiers only (draftsmith writes the speculators MTP layout for "
                              "those), so evaluate these MTP modules with eval --drafter mtp:RUN")


def _header(kind: str, architectures: list[str], drafts: int, target: Path, dtype: torch.dtype) -> dict:

    name = dtype_name(dtype)
    return {
        "architectures": architectures, "speculators_model_type": kind, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(drafts),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(target),
                         "architectures": list(read_json(target / "config.json").get("architectures") or [])},
        },
        "dtype": name, "torch_dtype": name,
    }


def verifier_name(target: Path) -> str:
    """The hub id of a target read from huggingface_hub's cache (its folder
    `models--ORG--NAME/snapshots/REV`: the name `vllm serve DIR` can load), else its path."""
    parts = Path(target).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return str(Path(target).resolve())


def is_hub_name(name: str) -> bool:
    return not Path(name).is_absolute() and not Path(name).exists()


def _target_dir(folder: Path) -> Path:

    target = target_dir_of(folder)
    if target is None:
        raise DraftsmithError(f"{folder}/config.json: target {read_native_meta(folder).get('target')!r} not found; "
                              "the speculators layout names its verifier (the target) and its architectures")
    return target


def _dtype(folder, dtype: str | None, trained: torch.dtype) -> torch.dtype:

    return export_dtype(folder, dtype, trained)


def _plain(layer: dict) -> dict:
    """A transformers config dict as the library nests it (no architectures of its own)."""
    return {k: v for k, v in layer.items() if k not in ("architectures", "transformers_version")}


def _write(out_dir, config: dict, state: dict, dtype: torch.dtype) -> Path:

    tensors = cast_floats(state, dtype)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
    return Path(out_dir)


def serve_note(out_dir: str | Path) -> str | None:
    """Why the printed vLLM line names the target: vLLM 0.33.0 (transformers_utils/config.py
    `maybe_override_with_speculators`) serves `vllm serve DIR` alone only for a verifier
    named by a hub id, and refuses a local folder."""
    name = read_json(Path(out_dir) / "config.json")["speculators_config"]["verifier"]["name_or_path"]
    if is_hub_name(name):
        return None
    return (f"the verifier is a local folder ({name}): vLLM serves `vllm serve DIR` alone only for a hub id, so the "
            "line names the target and the drafter in --speculative-config")


# ---------------------------------------------------------------- reading

def load(path: str | Path, method: str, target) -> torch.nn.Module:
    """A drafter of `method` from a speculators folder, for `target`: its verifier must be the
    target's architecture, and every setting we do not implement is refused in one line."""
    path = Path(path)
    meta = read_json(path / "config.json")
    source = f"{path}/config.json"
    if target is not None:
        check_verifier(meta, target, source)
    layer = meta.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftsmithError(f"{source}: transformer_layer_config must be the draft layer's config (a mapping)")
    weights = load_native_weights(path)
    try:
        if method == "mtp":
            return _read_mtp(meta, layer, weights, target, source)
        if method == "eagle3":
            return _read_eagle3(meta, layer, weights, target, source)
        return _read_block(meta, layer, weights, method, target, source)
    except KeyError as missing:
        raise DraftsmithError(f"{source}: missing key {missing}") from None


def check_verifier(meta: dict, target, source: str) -> None:
    """The drafter's recorded verifier against the target it is evaluated with (architectures,
    what speculators' VerifierConfig keeps to validate a verifier)."""
    verifier = ((meta.get("speculators_config") or {}).get("verifier") or {})
    theirs = list(verifier.get("architectures") or [])
    ours = list(getattr(target.config, "architectures", None) or [])
    if theirs and ours and theirs != ours:
        raise DraftsmithError(f"{source}: speculators_config.verifier is {verifier.get('name_or_path')!r} "
                              f"(architectures {theirs}), but the target given is {ours}: evaluate the drafter "
                              "against the verifier it was trained for")


def _capture_ids(meta: dict, key: str, target, source: str) -> list[int]:
    """Our layer ids from the library's capture ids (ours + 1); absent: its default
    [2, N // 2, N - 3] for the target's N layers."""
    ids = meta.get(key)
    if not ids:
        if target is None:
            raise DraftsmithError(f"{source}: no {key}, and no target to take the default from")
        n = target.config.num_hidden_layers
        ids = [2, n // 2, n - 3]
    if any(int(i) < 1 for i in ids):
        raise DraftsmithError(f"{source}: {key} {ids} include 0 (the embeddings), which no drafter here reads")
    return [int(i) - 1 for i in ids]


def _require(meta: dict, key: str, want, source: str, why: str) -> None:
    if key not in meta:
        raise DraftsmithError(f"{source}: no {key}; {why}")
    if meta[key] != want:
        raise DraftsmithError(f"{source}: {key} {meta[key]!r} is not supported here (only {want!r}): {why}")


def _read_eagle3(meta, layer, weights, target, source):
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

    _require(meta, "norm_before_residual", False, source,
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
        target_layer_ids=_capture_ids(meta, "eagle_aux_hidden_state_layer_ids", target, source),
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


def _read_block(meta, layer, weights, method, target, source):
    from draftsmith.models.dflash import DFlashConfig, DFlashDrafter
    from draftsmith.models.dspark import ANCHOR_IS_CONTEXT, ANCHOR_IS_FIRST_PREDICTION, DSparkConfig, DSparkDrafter

    vocab = layer["vocab_size"]
    if meta.get("draft_vocab_size", vocab) != vocab:
        raise DraftsmithError(f"{source}: draft_vocab_size {meta['draft_vocab_size']} below the vocabulary {vocab}; "
                              "draftsmith's DFlash and DSpark draft over the target's whole vocabulary")
    types = layer.get("layer_types") or ["full_attention"] * layer["num_hidden_layers"]
    if "sliding_attention" in types and not meta.get("sliding_window_non_causal"):
        raise DraftsmithError(f"{source}: sliding-window draft layers causal inside the block "
                              "(sliding_window_non_causal false); draftsmith's see their whole block")
    if meta.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise DraftsmithError(f"{source}: target_hidden_size {meta['target_hidden_size']} differs from the drafter's "
                              f"{layer['hidden_size']}, which speculators' own fc cannot have")
    if target is None:
        raise DraftsmithError(f"{source}: reading a speculators folder needs the target (it records no depth)")
    heads, hidden = layer["num_attention_heads"], layer["hidden_size"]
    rope = layer.get("rope_parameters") or {}
    ours = meta.get("draftsmith") or {}
    fields = dict(
        hidden_size=hidden, target_hidden_size=hidden, num_target_layers=target.config.num_hidden_layers,
        vocab_size=vocab, num_layers=layer["num_hidden_layers"], num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or hidden // heads,
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
        block_size=int(meta["block_size"]), allow_large_block=True,
        target_layer_ids=_capture_ids(meta, "aux_hidden_state_layer_ids", target, source),
        mask_token_id=meta["mask_token_id"], num_anchors=ours.get("num_anchors", DFlashConfig.num_anchors),
        layer_types=types, sliding_window=int(layer.get("sliding_window") or 0) if "sliding_attention" in types else 0,
    )
    if "sample_from_anchor" not in meta:
        raise DraftsmithError(f"{source}: no sample_from_anchor; the block convention must be stated (speculators' "
                              "DSpark reads an absent key as true, vLLM's mapping as false)")
    anchor_first = bool(meta["sample_from_anchor"])
    weights = {k: v for k, v in weights.items() if k not in _VERIFIER_OWNED}
    if method == "dflash":
        if anchor_first:
            raise DraftsmithError(f"{source}: a DFlash speculator with sample_from_anchor true (anchor as the first "
                                  "prediction) is DeepSpec's convention, which draftsmith's DFlash does not draft")
        return DFlashDrafter.from_native(DFlashConfig(**fields), weights, source=source.removesuffix("/config.json"))
    rank = int(meta.get("markov_rank") or 0)
    if (meta.get("markov_head_type", "vanilla") != "vanilla" or not meta.get("enable_confidence_head", True)
            or bool(meta.get("confidence_head_with_markov", bool(rank))) != bool(rank)):
        raise DraftsmithError(f"{source}: only DSpark with a vanilla Markov head and a confidence head on [h; W1[x]] "
                              "(or, with markov_rank 0, on h) is supported")
    convention = ANCHOR_IS_FIRST_PREDICTION if anchor_first else ANCHOR_IS_CONTEXT
    if ours.get("block_convention", convention) != convention:
        raise DraftsmithError(f"{source}: sample_from_anchor {anchor_first} contradicts draftsmith.block_convention "
                              f"{ours['block_convention']!r}")
    config = DSparkConfig(**fields, markov_rank=rank, block_convention=convention,
                          confidence_threshold=ours.get("confidence_threshold", DSparkConfig.confidence_threshold))
    return DSparkDrafter.from_native(config, weights, source=source.removesuffix("/config.json"))


def _read_mtp(meta, layer, weights, target, source):
    from draftsmith.models.mtp import MTPConfig, MTPDrafter

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
