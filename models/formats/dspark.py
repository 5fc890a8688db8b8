"""DSpark in the layouts other tools load, and back from any of them. DSpark is DFlash's
backbone plus its heads, so the backbone's layout pieces are DFlash's (models/formats/dflash.py).

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

import shlex
import warnings
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.dspark import (
    ANCHOR_IS_CONTEXT,
    ANCHOR_IS_FIRST_PREDICTION,
    BLOCK_CONVENTIONS,
    DSparkConfig,
    DSparkDrafter,
)
from draftsmith.models.dtypes import target_dir_of
from draftsmith.models.formats import read_layouts, speculators, write_folder
from draftsmith.models.formats.dflash import (
    backbone_config,
    backbone_fields,
    block_dtype,
    block_serve_lines,
    setting,
    speculator_config,
    speculator_fields,
    without_verifier,
    write_block_layout,
)
from draftsmith.models.native import load_drafter, load_native_weights, read_native_meta

METHOD = DSparkDrafter.method
DSPARK_ARCH = "DSparkDraftModel"
DEEPSPEC_ARCH = "Qwen3DSparkModel"


def write_specforge(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DSpark folder in SpecForge's layout (`draftsmith export --format specforge`)."""
    drafter = load_drafter(folder, METHOD)
    return export_dspark_specforge(drafter, out_dir, block_dtype(folder, dtype, drafter))


def write_qwen3_dspark(folder: str | Path, out_dir: str | Path, dtype: str | None = None,
                        latency_table: str | Path | None = None) -> Path:
    """A native DSpark folder as `Qwen3DSparkModel` (`--format deepspec`, `sglang` or `vllm`:
    one folder all three load), with the embedding and head of the target it was trained
    on (the folder's `target`), and SGLang's serving calibration beside it: the confidence
    temperatures training fitted on its held-out rows, and with `latency_table` the
    steps-per-second table (models/dspark_calibration.py)."""
    from draftsmith.models.dspark_calibration import SPS_FILE, STS_FILE, read_sts, sps_table
    from draftsmith.models.target import load_target

    drafter = load_drafter(folder, METHOD)
    target_dir = target_dir_of(folder)
    if target_dir is None:
        raise DraftsmithError(f"{folder}/config.json: target {read_native_meta(folder).get('target')!r} not found; "
                              "the Qwen3DSparkModel layout stores the target's embedding and head (DeepSpec reads "
                              "them), so the target folder is needed")
    extras = {}
    sts = Path(folder) / STS_FILE
    if sts.is_file():
        extras[STS_FILE] = read_sts(sts, drafter.drafts_per_block)
    if latency_table is not None:
        extras[SPS_FILE] = sps_table(latency_table)
    return export_dspark_deepspec(drafter, out_dir, load_target(target_dir), block_dtype(folder, dtype, drafter), extras)


def export_dspark_specforge(drafter: DSparkDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    c = _check_dspark(drafter, "SpecForge")
    config = backbone_config(drafter, DSPARK_ARCH, dtype)
    config["dflash_config"].update(
        projector_type="dspark", markov_rank=c.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=bool(c.markov_rank), confidence_head_alpha=c.bce_weight,
        attention_mode="mha" if c.num_kv_heads == c.num_heads else "gqa",
    )
    config["draftsmith"] = _our_settings(c)
    return write_block_layout(out_dir, config, drafter.state_dict(), modeling=True)


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
    config = backbone_config(drafter, DEEPSPEC_ARCH, dtype)
    # DeepSpec, SGLang's DSpark and vLLM's Qwen3DSparkForCausalLM read these at the top level;
    # dflash_config (same values) stays for SGLang's DFlash base parser and vLLM's layer ids.
    config.update(
        target_layer_ids=list(c.target_layer_ids), mask_token_id=c.mask_token_id, num_anchors=c.num_anchors,
        markov_rank=c.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=bool(c.markov_rank), draftsmith=_our_settings(c),
    )
    return write_block_layout(out_dir, config, {**drafter.state_dict(), **shared}, extras=extras)


def _check_dspark(drafter, tool: str) -> DSparkConfig:
    if drafter.method != METHOD:
        raise DraftsmithError(f"{tool} DSpark export: this is a {drafter.method} drafter; export it with its own "
                              "formats")
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


def _heads_rank(get, source: str) -> int:
    """The refiner's rank from a layout's head settings (`get(key, default)` reads them), where
    they are the heads draftsmith builds; markov_rank 0 (DeepSpec's DFlash): no refiner, the
    confidence head on h alone."""
    rank = int(get("markov_rank", 0) or 0)
    if (get("markov_head_type", "vanilla") != "vanilla" or not get("enable_confidence_head", True)
            or bool(get("confidence_head_with_markov", bool(rank))) != bool(rank)):
        raise DraftsmithError(f"{source}: only DSpark with a vanilla Markov head and a confidence head on [h; W1[x]] "
                              "(or, with markov_rank 0, on h) is supported")
    return rank


def _dspark_config(meta: dict, path) -> DSparkConfig:
    rank = _heads_rank(lambda name, default=None: setting(meta, name, path, default), f"{path}/config.json")
    ours = meta.get("draftsmith") or meta.get("dspark_config") or {}
    convention = ours.get("block_convention", meta.get("block_convention", ANCHOR_IS_FIRST_PREDICTION))
    if convention not in BLOCK_CONVENTIONS:
        raise DraftsmithError(
            f"{path}/config.json: block_convention {convention!r} is not one of {', '.join(BLOCK_CONVENTIONS)}"
        )
    return DSparkConfig(
        **backbone_fields(meta, path), markov_rank=rank, block_convention=convention,
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


def read(path: str | Path, target=None) -> DSparkDrafter:
    """A DSpark drafter from any layout we write (native, SpecForge, DeepSpec, speculators),
    told apart by config.json. A folder of another method, a layout we do not know, a missing
    weight, or (with `target`) stored target weights of the wrong shape are refused in one line."""
    return read_layouts(path, METHOD, target, _read_speculators, _read_trainers_layout)


def _read_trainers_layout(path, layout: str, meta: dict, target) -> DSparkDrafter:
    """SpecForge's or DeepSpec's folder (DeepSpec's stores the target's embedding and head)."""
    weights = load_native_weights(path)
    if layout == "deepspec":
        _drop_target_copies(weights, target, path)
    return DSparkDrafter.from_native(_dspark_config(meta, path), weights, source=str(path))


def serve(folder: Path, written: Path, fmt: str, latency_table: str | Path | None = None) -> list[str]:
    """What `draftsmith export` prints after writing `fmt`. The Qwen3DSparkModel folder (anchor
    first, B inputs give B drafts): SGLang's gamma is B and its draft tokens B + 1, with the
    confidence calibration and the cost table the export wrote beside the weights; vLLM's
    `num_speculative_tokens` must equal B. SpecForge's training layout no engine serves."""
    target_dir = target_dir_of(folder)
    if fmt == "speculators":
        return speculators.serve(written, target_dir)
    if fmt == "specforge":
        return ["SpecForge's training layout (DSparkDraftModel, settings in dflash_config): SGLang and vLLM "
                "load --format sglang|vllm (Qwen3DSparkModel) instead"]
    return block_serve_lines(folder, written, METHOD, "DSPARK", lambda block: (block + 1, block),
                             lambda config: _calibration_flags(written))


def _calibration_flags(folder: Path) -> str:
    """SGLang's DSpark calibration flags for the files the export wrote (models/dspark_calibration.py)."""
    from draftsmith.models.dspark_calibration import SPS_FILE, STS_FILE

    flags = (("--speculative-dspark-confidence-sts-path", STS_FILE), ("--speculative-dspark-sps-table-path", SPS_FILE))
    return "".join(f" {flag} {shlex.quote(str(folder / name))}" for flag, name in flags if (folder / name).is_file())


# ---------------------------------------------------------------- the speculators layout

def write_speculators(folder: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A native DSpark folder as speculators' `DSparkSpeculator`, either block convention,
    `sample_from_anchor` stating which."""
    drafter = load_drafter(folder, METHOD)
    c = drafter.config
    config, out_dtype = speculator_config(drafter, Path(folder), dtype, ["DSparkSpeculator"],
                                          anchor_first=c.block_convention == ANCHOR_IS_FIRST_PREDICTION)
    config.update(markov_rank=c.markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=bool(c.markov_rank))
    config["draftsmith"].update(block_convention=c.block_convention, confidence_threshold=c.confidence_threshold)
    return write_folder(out_dir, config, drafter.state_dict(), out_dtype)


def _read_speculators(meta, layer, weights, target, source):
    fields = speculator_fields(meta, layer, target, source)
    ours = meta.get("draftsmith") or {}
    anchor_first = bool(meta["sample_from_anchor"])
    rank = _heads_rank(meta.get, source)
    convention = ANCHOR_IS_FIRST_PREDICTION if anchor_first else ANCHOR_IS_CONTEXT
    if ours.get("block_convention", convention) != convention:
        raise DraftsmithError(f"{source}: sample_from_anchor {anchor_first} contradicts draftsmith.block_convention "
                              f"{ours['block_convention']!r}")
    config = DSparkConfig(**fields, markov_rank=rank, block_convention=convention,
                          confidence_threshold=ours.get("confidence_threshold", DSparkConfig.confidence_threshold))
    return DSparkDrafter.from_native(config, without_verifier(weights), source=source.removesuffix("/config.json"))
