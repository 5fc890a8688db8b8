"""The command that serves an export, printed by `draftsmith export` for the folder it wrote.

The flags are derived from what was written (its config.json) and from the target (the
tile rule's D, docs/design.md section 3), so the README's commands and the code cannot
disagree. What each engine takes (read in their sources; models/export_*.py name them):

- EAGLE-3 and MTP run as EAGLE-style chains: SGLang `--speculative-num-steps S
  --speculative-eagle-topk 1 --speculative-num-draft-tokens S + 1` (the verified rows, root
  included), vLLM `num_speculative_tokens: S`. MTP's engine is the target folder itself.
  A chain of S steps costs S drafter passes whatever the tile, so S is not the tile rule's D:
  it is chosen by the rule of models/latency.py (`chain_steps`: expected tokens/s from the
  run's validation acceptance and a `plan --measure` latency table) when `export` is given a
  table, else the references' handful (`REFERENCE_CHAIN_STEPS`), and never past D.
- DFlash: one block of B = 1 + D inputs gives B - 1 drafts; SGLang verifies B tokens, vLLM
  drafts B - 1.
- DSpark (anchor first): B inputs give B drafts; SGLang's gamma is B and its draft tokens
  B + 1, vLLM's `num_speculative_tokens` must equal B. SGLang also takes the confidence
  calibration and the cost table the export wrote beside the weights.
- The speculators layout: `vllm serve DIR` (the folder names its verifier and its drafts per
  verify) for a verifier named by a hub id, else the target with the folder in
  `--speculative-config`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from draftsmith.fsutil import read_json
from draftsmith.models.dtypes import config_dtype, dtype_name
from draftsmith.models.tile import plan_tile, read_target_config

SGLANG = "python -m sglang.launch_server"
# How the references serve an EAGLE chain: SpecForge benchmarks EAGLE-3 at `--config-list
# 1,3,1,4` (benchmarks/README.md: batch 1, 3 steps, top-k 1, 4 draft tokens), and SGLang's
# automatic choice is 3 steps for most models, 5 for Llama and Grok, with num-draft-tokens
# = steps + 1 at top-k 1 (docs/advanced_features/speculative_decoding.md).
REFERENCE_CHAIN_STEPS = 3


def serve_commands(method: str, out_dir: str | Path, target: str | Path | None,
                   steps: int | None = None) -> list[str]:
    """The SGLang and vLLM command lines for an exported folder (those engines that load its
    layout); `target` is the target folder (MTP: the export is the target). `steps`: the
    chain length of EAGLE-3 and MTP (default: the references', capped by the tile rule)."""
    out = str(out_dir)
    config = read_json(Path(out_dir) / "config.json")
    if method == "mtp":
        if "speculators_model_type" in config:  # a Qwen3 target's: vLLM serves none (speculators_format.py)
            return []
        target = out
    if target is None:
        return []
    # The engine's --dtype is the target's; the drafter's own config names its dtype (the export's).
    found = config_dtype(read_json(Path(target) / "config.json"))
    dtype = dtype_name(found) if found else "auto"
    if "speculators_model_type" in config:
        return [_speculators(out, config, target, dtype)]
    model = shlex.quote(str(target))
    common = f"--model-path {model} --dtype {dtype}"
    if method in ("eagle3", "mtp"):
        d = plan_tile(read_target_config(target)).D
        if d < 1:
            return []
        d = min(d, steps or REFERENCE_CHAIN_STEPS)
        chain = f"--speculative-num-steps {d} --speculative-eagle-topk 1 --speculative-num-draft-tokens {d + 1}"
        if method == "eagle3":
            return [f"{SGLANG} {common} --speculative-algorithm EAGLE3 --speculative-draft-model-path "
                    f"{shlex.quote(out)} {chain}{_window(config)}",
                    _vllm(model, dtype, {"method": "eagle3", "model": out, "num_speculative_tokens": d})]
        lines = [_vllm(model, dtype, {"method": "mtp", "num_speculative_tokens": d})]
        if config.get("num_nextn_predict_layers") == 1:  # SGLang's NextN loads one module
            lines.insert(0, f"{SGLANG} {common} --speculative-algorithm EAGLE {chain}")
        return lines
    block = (config.get("dflash_config") or {}).get("block_size") or config.get("block_size")
    if block is None:  # no layout of a block drafter: no engine line known for it (not a KeyError after the export)
        return []
    block = int(block)
    draft = f"--speculative-draft-model-path {shlex.quote(out)}"
    if method == "dflash":
        return [f"{SGLANG} {common} --speculative-algorithm DFLASH {draft} --speculative-num-draft-tokens {block}"
                + _window(config),
                _vllm(model, dtype, {"method": "dflash", "model": out, "num_speculative_tokens": block - 1})]
    if config.get("architectures") == ["Qwen3DSparkModel"]:  # the one DSpark layout the engines load
        return [f"{SGLANG} {common} --speculative-algorithm DSPARK {draft} --speculative-num-draft-tokens {block + 1}"
                + _dspark_calibration(Path(out_dir)),
                _vllm(model, dtype, {"method": "dspark", "model": out, "num_speculative_tokens": block})]
    return []


def _window(config: dict) -> str:
    """SGLang's flag for a sliding-window drafter (its DFLASH and Llama EAGLE-3 read the window
    from the command line, not the config: --speculative-draft-window-size)."""
    if "sliding_attention" not in (config.get("layer_types") or []):
        return ""
    return f" --speculative-draft-window-size {int(config['sliding_window'])}"


def _dspark_calibration(folder: Path) -> str:
    """SGLang's DSpark calibration flags for the files the export wrote (models/dspark_calibration.py)."""
    from draftsmith.models.dspark_calibration import SPS_FILE, STS_FILE

    flags = (("--speculative-dspark-confidence-sts-path", STS_FILE), ("--speculative-dspark-sps-table-path", SPS_FILE))
    return "".join(f" {flag} {shlex.quote(str(folder / name))}" for flag, name in flags if (folder / name).is_file())


def _speculators(out: str, config: dict, target, dtype: str) -> str:
    """vLLM reads the method and the drafts per verify from the folder (`vllm serve DIR`, the
    verifier named inside), where the verifier is a hub id; a local verifier it refuses in that
    form (models/speculators_format.py), so the line then names the target and the folder."""
    from draftsmith.models.speculators_format import is_hub_name

    spec = config["speculators_config"]
    if is_hub_name(spec["verifier"]["name_or_path"]):
        return f"vllm serve {shlex.quote(out)} --dtype {dtype}"
    return _vllm(shlex.quote(str(target)), dtype, {"method": config["speculators_model_type"], "model": out,
                                                   "num_speculative_tokens": spec["proposal_methods"][0][
                                                       "speculative_tokens"]})


def _vllm(model: str, dtype: str, spec: dict) -> str:
    return f"vllm serve {model} --dtype {dtype} --speculative-config {shlex.quote(json.dumps(spec))}"
