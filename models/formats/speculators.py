"""The folder format of vLLM's `speculators` library, shared by the methods that write it
(`draftsmith export --format speculators`) and read it back (`eval --drafter METHOD:DIR`), ours
or trained by speculators itself. What is common lives here (the header, the verifier, the
capture ids, the weights file, the serve line); each method's own fields and tensor names live
in its formats module (models/formats/<method>.py: `write_speculators`, `_read_speculators`).

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

import shlex
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import read_json
from draftsmith.models.dtypes import dtype_name, target_dir_of
from draftsmith.models.native import load_native_weights, read_native_meta
from draftsmith.schema import Count, PositiveFloat, PositiveInt, Schema, validated

SPECULATORS_VERSION = "0.9.0"  # the library version whose config this layout follows


# ---------------------------------------------------------------- writing


def chain_drafts(target_dir: Path, tile: int) -> int:
    """Drafts per verify a chained drafter (EAGLE-3, MTP) is served with: the references' steps
    (models/serve.py: REFERENCE_CHAIN_STEPS) within the tile rule at `tile`, as the serve lines
    give it."""
    from draftsmith.models.serve import chain

    return max(1, chain(target_dir, None, tile)[1])


def header(kind: str, architectures: list[str], drafts: int, target_dir: Path, dtype: torch.dtype) -> dict:

    name = dtype_name(dtype)
    return {
        "architectures": architectures, "speculators_model_type": kind, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(drafts),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(target_dir),
                         "architectures": list(read_json(target_dir / "config.json").get("architectures") or [])},
        },
        "dtype": name, "torch_dtype": name,
    }


def verifier_name(target_dir: Path) -> str:
    """The hub id of a target read from huggingface_hub's cache (its folder
    `models--ORG--NAME/snapshots/REV`: the name `vllm serve DIR` can load), else its path."""
    parts = Path(target_dir).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return str(Path(target_dir).resolve())


def is_hub_name(name: str) -> bool:
    return not Path(name).is_absolute() and not Path(name).exists()


def target_dir(folder: Path) -> Path:

    target_dir = target_dir_of(folder)
    if target_dir is None:
        raise DraftsmithError(f"{folder}/config.json: target {read_native_meta(folder).get('target')!r} not found; "
                              "the speculators layout names its verifier (the target) and its architectures")
    return target_dir


def nested_config(layer: dict) -> dict:
    """A transformers config dict as the library nests it (no architectures of its own)."""
    return {k: v for k, v in layer.items() if k not in ("architectures", "transformers_version")}


def serve_notes(config: dict) -> list[str]:
    """Why the printed vLLM line names the target: vLLM 0.33.0 (transformers_utils/config.py
    `maybe_override_with_speculators`) serves `vllm serve DIR` alone only for a verifier
    named by a hub id, and refuses a local folder. `config`: the written folder's config.json."""
    name = config["speculators_config"]["verifier"]["name_or_path"]
    if is_hub_name(name):
        return []
    return [f"the verifier is a local folder ({name}): vLLM serves `vllm serve DIR` alone only for a hub id, so the "
            "line names the target and the drafter in --speculative-config"]


# ---------------------------------------------------------------- reading

class _Verifier(Schema):
    name_or_path: str = ""
    architectures: list[str] = []


class _Proposal(Schema):
    speculative_tokens: PositiveInt | None = None


class _SpeculatorsConfig(Schema):
    verifier: _Verifier | None = None
    proposal_methods: list[_Proposal] = []


class _LayerConfig(Schema):
    """The draft layer's transformers config, as far as the methods' readers take figures from it."""

    hidden_size: PositiveInt | None = None
    num_attention_heads: PositiveInt | None = None
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    intermediate_size: PositiveInt | None = None
    vocab_size: PositiveInt | None = None
    num_hidden_layers: PositiveInt | None = None
    max_position_embeddings: PositiveInt | None = None
    rms_norm_eps: PositiveFloat | None = None
    rope_theta: PositiveFloat | None = None
    rope_parameters: dict | None = None
    sliding_window: Count | None = None
    layer_types: list[str] | None = None
    model_type: str | None = None


class SpeculatorsSchema(Schema):
    """What draftsmith reads of a speculators config.json, ours or another trainer's (the module
    doc): the header's mappings, the capture ids (each method's key) and the figures of the
    draft layer. Keys absent keep the library's defaults; each method's reader refuses in one
    line the settings it does not implement."""

    speculators_config: _SpeculatorsConfig | None = None
    transformer_layer_config: _LayerConfig
    eagle_aux_hidden_state_layer_ids: list[Count] | None = None
    aux_hidden_state_layer_ids: list[Count] | None = None
    draft_vocab_size: PositiveInt | None = None
    target_hidden_size: PositiveInt | None = None
    block_size: PositiveInt | None = None
    mask_token_id: Count | None = None
    sample_from_anchor: bool | None = None
    norm_before_residual: bool | None = None
    draftsmith: dict | None = None


def load(path: str | Path, meta: dict, target, read) -> torch.nn.Module:
    """A drafter from a speculators folder (`meta`: its config.json), for `target`: its verifier
    must be the target's architecture; `read(meta, layer, weights, target, source)` is the
    method's own reader (models/formats/<method>.py), which refuses in one line every setting it
    does not implement."""
    path = Path(path)
    source = f"{path}/config.json"
    validated(SpeculatorsSchema, meta, source)  # the one check of the file, before any reader indexes it
    if target is not None:
        check_verifier(meta, target, source)
    layer = meta["transformer_layer_config"]
    weights = load_native_weights(path)
    try:
        return read(meta, layer, weights, target, source)
    except KeyError as missing:
        raise DraftsmithError(f"{source}: missing key {missing}") from None


def serve(written: Path, target_dir: Path | None, notes: tuple[str, ...] = ()) -> list[str]:
    """What `draftsmith export` prints after writing a speculators folder: why the line names
    the target (serve_notes) and the method's `notes`, then the line."""
    from draftsmith.models.serve import printed

    config = read_json(Path(written) / "config.json")
    notes = serve_notes(config) + list(notes)
    if target_dir is None:
        return notes
    return printed(notes, [serve_line(str(written), config, target_dir)])


def serve_line(out: str, config: dict, target_dir) -> str:
    """vLLM reads the method and the drafts per verify from the folder (`vllm serve DIR`, the
    verifier named inside), where the verifier is a hub id; a local verifier it refuses in that
    form (serve_notes), so the line then names the target and the folder."""
    from draftsmith.models.serve import engine_args, vllm_line

    model, dtype, _ = engine_args(target_dir)
    header = config["speculators_config"]
    if is_hub_name(header["verifier"]["name_or_path"]):
        return f"vllm serve {shlex.quote(out)} --dtype {dtype}"
    return vllm_line(model, dtype, {"method": config["speculators_model_type"], "model": out,
                                                       "num_speculative_tokens": header["proposal_methods"][0][
                                                           "speculative_tokens"]})


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


def capture_ids(meta: dict, key: str, target, source: str) -> list[int]:
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


def require(meta: dict, key: str, want, source: str, why: str) -> None:
    if key not in meta:
        raise DraftsmithError(f"{source}: no {key}; {why}")
    if meta[key] != want:
        raise DraftsmithError(f"{source}: {key} {meta[key]!r} is not supported here (only {want!r}): {why}")


