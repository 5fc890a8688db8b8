"""The command that serves an export, printed by `draftsmith export` for the folder it wrote.

The flags are derived from what was written (its config.json) and from the target (the
tile rule's D, docs/design.md section 3), so the README's commands and the code cannot
disagree. What each engine takes (read in their sources; models/export_*.py name them):

- EAGLE-3 and MTP run as EAGLE-style chains: SGLang `--speculative-num-steps D
  --speculative-eagle-topk 1 --speculative-num-draft-tokens D + 1` (the verified rows, root
  included), vLLM `num_speculative_tokens: D`. MTP's engine is the target folder itself.
- DFlash: one block of B = 1 + D inputs gives B - 1 drafts; SGLang verifies B tokens, vLLM
  drafts B - 1.
- DSpark (anchor first): B inputs give B drafts; SGLang's gamma is B and its draft tokens
  B + 1, vLLM's `num_speculative_tokens` must equal B.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from draftsmith.fsutil import read_json
from draftsmith.models.export import config_dtype, dtype_name
from draftsmith.models.tile import plan_tile, read_target_config

SGLANG = "python -m sglang.launch_server"


def serve_commands(method: str, out_dir: str | Path, target: str | Path | None) -> list[str]:
    """The SGLang and vLLM command lines for an exported folder (those engines that load its
    layout); `target` is the target folder (MTP: the export is the target)."""
    out = str(out_dir)
    config = read_json(Path(out_dir) / "config.json")
    if method == "mtp":
        target = out
    if target is None:
        return []
    target_config = read_json(Path(target) / "config.json")
    # The engine's --dtype is the target's; the drafter's own config names its dtype (the export's).
    found = config_dtype(target_config)
    dtype = dtype_name(found) if found else "auto"
    model = shlex.quote(str(target))
    common = f"--model-path {model} --dtype {dtype}"
    if method in ("eagle3", "mtp"):
        d = plan_tile(read_target_config(target)).D
        if d < 1:
            return []
        chain = f"--speculative-num-steps {d} --speculative-eagle-topk 1 --speculative-num-draft-tokens {d + 1}"
        if method == "eagle3":
            return [f"{SGLANG} {common} --speculative-algorithm EAGLE3 --speculative-draft-model-path "
                    f"{shlex.quote(out)} {chain}",
                    _vllm(model, dtype, {"method": "eagle3", "model": out, "num_speculative_tokens": d})]
        lines = [_vllm(model, dtype, {"method": "mtp", "num_speculative_tokens": d})]
        if config.get("num_nextn_predict_layers") == 1:  # SGLang's NextN loads one module
            lines.insert(0, f"{SGLANG} {common} --speculative-algorithm EAGLE {chain}")
        return lines
    block = int((config.get("dflash_config") or {}).get("block_size") or config["block_size"])
    draft = f"--speculative-draft-model-path {shlex.quote(out)}"
    if method == "dflash":
        return [f"{SGLANG} {common} --speculative-algorithm DFLASH {draft} --speculative-num-draft-tokens {block}",
                _vllm(model, dtype, {"method": "dflash", "model": out, "num_speculative_tokens": block - 1})]
    if config.get("architectures") == ["Qwen3DSparkModel"]:  # the one DSpark layout the engines load
        return [f"{SGLANG} {common} --speculative-algorithm DSPARK {draft} --speculative-num-draft-tokens {block + 1}",
                _vllm(model, dtype, {"method": "dspark", "model": out, "num_speculative_tokens": block})]
    return []


def _vllm(model: str, dtype: str, spec: dict) -> str:
    return f"vllm serve {model} --dtype {dtype} --speculative-config {shlex.quote(json.dumps(spec))}"
