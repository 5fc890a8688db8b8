"""`draftsmith export`: a trained drafter written in the layouts other tools load.

Which formats a method offers, and the function that writes each, is the method's entry
in the registry (`draftsmith/registry.py`); the layouts themselves live in
`export_eagle3.py`, `export_dflash.py` and `export_mtp.py`, and `layouts.py` tells them
apart when reading (and here, which method a run holds). The drafter modules know nothing about them.

Precision: drafters train in float32, but an engine serves a drafter in the dtype its
config names (SGLang's `--dtype auto` reads `torch_dtype`, and turns float32 into float16
beside a bfloat16 target). So an export is written in the *target's* dtype (bf16 for real
targets) unless `--dtype` names another; `serve.py` prints the command that serves it.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir, read_json
from draftsmith.models.dtypes import DTYPES, target_dir_of
from draftsmith.models.layouts import NATIVE, identify
from draftsmith.models.serve import serve_commands
from draftsmith.models.target import find_model_dir
from draftsmith.registry import METHODS, import_ref


def export_run(run: str | Path, fmt: str, out_dir: str | Path, dtype: str | None = None,
               latency_table: str | Path | None = None) -> Path:
    """Write the drafter of a training run (or a native drafter folder) in format `fmt`,
    its weights in `dtype` (default: the target's); a writer that writes a cost table from
    `plan --measure`'s latency table (SGLang's DSpark) takes `latency_table`."""
    folder, method = _drafter_folder(run, fmt)
    formats = METHODS[method].exports if method in METHODS else {}
    if fmt not in formats:
        raise DraftsmithError(f"{run} holds a {method} drafter: --format must be one of {', '.join(formats)}"
                              if formats else f"{run}: no export for method {method!r}")
    if dtype is not None and dtype not in DTYPES:
        raise DraftsmithError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    writer = import_ref(formats[fmt], f"--format {fmt}")
    if latency_table is not None and "latency_table" in inspect.signature(writer).parameters:
        return writer(folder, out_dir, dtype, latency_table=latency_table)
    return writer(folder, out_dir, dtype)


def export_notes(run: str | Path, fmt: str, written: str | Path, latency_table: str | Path | None = None) -> list[str]:
    """What `draftsmith export` prints after writing: a note where the layout keeps less than
    the run trained, then the exact commands that serve the folder (an EAGLE-3 chain's length
    from `latency_table` and the run's acceptance when both exist, models/latency.py)."""
    folder, method = _drafter_folder(run, fmt)
    if fmt == "native":
        return []  # draftsmith's own: `eval --drafter METHOD:DIR` reads it
    notes = []
    if fmt == "speculators" and method != "mtp":  # MTP's says why it has no serve line (mtp_note)
        from draftsmith.models.speculators_format import serve_note

        notes += [note] if (note := serve_note(written)) else []
    if fmt == "specforge":
        notes.append("SpecForge's training layout (DSparkDraftModel, settings in dflash_config): SGLang and vLLM "
                     "load --format sglang|vllm (Qwen3DSparkModel) instead")
    if method == "mtp":
        from draftsmith.models.export_mtp import sglang_note
        from draftsmith.models.speculators_format import mtp_note

        trained = (read_json(Path(written) / "config.json").get("draftsmith_mtp") or {}).get("modules_trained", 1)
        note = sglang_note(trained) if fmt == "sglang" else mtp_note(written) if fmt == "speculators" else None
        notes += [note] if note else []
        target = None
    else:
        target = target_dir_of(folder)
    steps = None
    if latency_table and method == "eagle3" and target is not None:
        from draftsmith.models.latency import chain_steps
        from draftsmith.models.tile import plan_tile, read_target_config

        steps, why = chain_steps(folder, written, latency_table, plan_tile(read_target_config(target)).D)
        notes.append(f"EAGLE-3 chain: {why}" if steps else f"EAGLE-3 chain: the references' length ({why})")
    commands = serve_commands(method, written, target, steps)
    return notes + (["serve it with:", *(f"  {c}" for c in commands)] if commands else [])


def _drafter_folder(run: str | Path, fmt: str = "") -> tuple[Path, str]:
    folder = Path(find_model_dir(run))
    if not folder.is_dir():
        raise DraftsmithError(f"drafter {folder} not found")
    method, layout, meta = identify(folder)
    if method is None:
        if "architectures" in meta:
            raise DraftsmithError(f"{run} is a Hugging Face model folder (a draft model): serving engines load "
                                  f"{folder} as it is")
        raise DraftsmithError(f"{folder}/config.json is not a draftsmith drafter")
    if layout != NATIVE:
        raise DraftsmithError(f"{run} is already in the {layout} layout; export reads draftsmith's own runs")
    if method == "mtp":  # engines load MTP only for DeepSeek-style targets: say so before any format
        from draftsmith.models.export_mtp import check_engine_layout

        check_engine_layout(folder, fmt)
    return folder, method


def export_native(folder: Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """The native folder itself, copied whole (config.json + model.safetensors)."""
    if dtype is not None:
        raise DraftsmithError("--dtype: the native format is the drafter as trained (reloaded bit-identically); "
                              "give --dtype with an engine format")
    with atomic_dir(out_dir) as tmp:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(folder / name, tmp / name)
    return Path(out_dir)
