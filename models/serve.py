"""The pieces of the commands that serve an export, which `draftsmith export` prints for the
folder it wrote. Each method's formats module (models/formats/<method>.py, `serve`) composes
its own lines from these, from what was written (its config.json) and from the target (the
tile rule's D, docs/design.md section 3, at the tile the run recorded: `recorded_tile`), so the
README's commands and the code cannot disagree.

An EAGLE-style chain (SGLang `--speculative-num-steps S --speculative-eagle-topk 1
--speculative-num-draft-tokens S + 1`, the verified rows with the root; vLLM
`num_speculative_tokens: S`) of S steps costs S drafter passes whatever the tile, so S is not
the tile rule's D: it is chosen by the rule of models/latency.py (`chain_steps`: expected
tokens/s from the run's validation acceptance and a `plan --measure` latency table) when
`export` is given a table, else the references' handful (`REFERENCE_CHAIN_STEPS`), and never
past D.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fields import DEFAULT_TILE
from draftsmith.fsutil import read_json
from draftsmith.models.dtypes import config_dtype, dtype_name
from draftsmith.models.tile import plan_tile, read_target_config

SGLANG = "python -m sglang.launch_server"
# How the references serve an EAGLE chain: SpecForge benchmarks EAGLE-3 at `--config-list
# 1,3,1,4` (benchmarks/README.md: batch 1, 3 steps, top-k 1, 4 draft tokens), and SGLang's
# automatic choice is 3 steps for most models, 5 for Llama and Grok, with num-draft-tokens
# = steps + 1 at top-k 1 (docs/advanced_features/speculative_decoding.md).
REFERENCE_CHAIN_STEPS = 3


def engine_args(target_dir: str | Path) -> tuple[str, str, str]:
    """(quoted target, engine dtype, SGLang's common flags): the engine's --dtype is the
    target's; the drafter's own config names its dtype (the export's)."""
    found = config_dtype(read_json(Path(target_dir) / "config.json"))
    dtype = dtype_name(found) if found else "auto"
    model = shlex.quote(str(target_dir))
    return model, dtype, f"--model-path {model} --dtype {dtype}"


def recorded_tile(folder: str | Path) -> int:
    """The verify tile the drafter in `folder` was sized for: target.tile of the recipe its
    run saved (RUN/recipe.yaml, what `eval --recipe RUN/recipe.yaml` honours), else
    DEFAULT_TILE for a folder no run recorded. The one value is read as data: models/ never
    imports the recipe (design.md section 5), and the run's other keys may predate a rename."""
    import yaml

    from draftsmith.models.run_weights import weights_run

    run = weights_run(folder)
    saved = run[0] / "recipe.yaml" if run else None
    if saved is None or not saved.is_file():
        return DEFAULT_TILE
    try:
        data = yaml.safe_load(saved.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        raise DraftsmithError(f"{saved}: the run's recorded recipe is not valid YAML") from None
    target = data.get("target") if isinstance(data, dict) else None
    tile = target.get("tile", DEFAULT_TILE) if isinstance(target, dict) else DEFAULT_TILE
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise DraftsmithError(f"{saved}: target.tile: must be a whole number of at least 1, got {tile!r}")
    return tile


def chain(target_dir: str | Path, steps: int | None, tile: int) -> tuple[str, int]:
    """SGLang's flags of an EAGLE-style chain of `steps` drafts (default: the references'),
    never past the tile rule's D on a `tile`-row verify kernel, and that length; ("", 0) where
    the tile leaves no draft."""
    d = plan_tile(read_target_config(target_dir), tile).D
    if d < 1:
        return "", 0
    d = min(d, steps or REFERENCE_CHAIN_STEPS)
    return f"--speculative-num-steps {d} --speculative-eagle-topk 1 --speculative-num-draft-tokens {d + 1}", d


def printed(notes: list[str], commands: list[str]) -> list[str]:
    """What `draftsmith export` prints: the notes, then the commands that serve the folder."""
    return notes + (["serve it with:", *(f"  {c}" for c in commands)] if commands else [])


def window_flag(config: dict) -> str:
    """SGLang's flag for a sliding-window drafter (its DFLASH and Llama EAGLE-3 read the window
    from the command line, not the config: --speculative-draft-window-size)."""
    if "sliding_attention" not in (config.get("layer_types") or []):
        return ""
    return f" --speculative-draft-window-size {int(config['sliding_window'])}"


def vllm_line(model: str, dtype: str, speculative_config: dict) -> str:
    return f"vllm serve {model} --dtype {dtype} --speculative-config {shlex.quote(json.dumps(speculative_config))}"
