"""`draftsmith export`: a trained drafter written in the layouts other tools load.

Which formats a method offers, and the function that writes each, is the method's entry
in the registry (`draftsmith/registry.py`); the layouts themselves, and what export prints
after writing one (notes and the engine's serve lines), live in the method's formats module
(models/formats/<method>.py), and `layouts.py` tells them apart when reading (and here,
which method a run holds). Nothing here knows a method by name.

Precision: drafters train in float32, but an engine serves a drafter in the dtype its
config names (SGLang's `--dtype auto` reads `torch_dtype`, and turns float32 into float16
beside a bfloat16 target). So an export is written in the *target's* dtype (bf16 for real
targets) unless `--dtype` names another.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir
from draftsmith.models.dtypes import DTYPES
from draftsmith.models.layouts import NATIVE, identify
from draftsmith.models.model_dir import find_model_dir
from draftsmith.registry import METHODS, MethodSpec, import_ref


def export_run(run: str | Path, fmt: str, out_dir: str | Path, dtype: str | None = None,
               latency_table: str | Path | None = None) -> Path:
    """Write the drafter of a training run (or a native drafter folder) in format `fmt`,
    its weights in `dtype` (default: the target's); the formats the method's entry names in
    `latency_exports` write a cost table from `plan --measure`'s `latency_table` (SGLang's DSpark)."""
    folder, spec = _drafter_folder(run)
    check = spec.face("check_export", None)  # e.g. a target no engine runs this method for: before any format
    if check is not None:
        check(folder, fmt)
    if fmt not in spec.exports:
        raise DraftsmithError(f"{run} holds a {spec.name} drafter: --format must be one of {', '.join(spec.exports)}"
                              if spec.exports else f"{run}: no export for method {spec.name!r}")
    if dtype is not None and dtype not in DTYPES:
        raise DraftsmithError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if latency_table is not None:
        _check_latency_table(folder, latency_table)
    writer = import_ref(spec.exports[fmt], f"--format {fmt}")
    if latency_table is not None and fmt in spec.latency_exports:
        return writer(folder, out_dir, dtype, latency_table=latency_table)
    return writer(folder, out_dir, dtype)


def _check_latency_table(folder: Path, latency_table: str | Path) -> None:
    """`--latency-table` read and held against the drafter's target before anything is
    written, by the check `eval --latency-table` makes (`LatencyTable.check_fits`): a table of
    another target would size the serving of this one (DSpark's cost table, EAGLE-3's chain).
    The device is not compared: an export is made for the serving machine, not this one."""
    from draftsmith.models.dtypes import target_dir_of
    from draftsmith.models.latency import LatencyTable

    table = LatencyTable.read(latency_table)
    target_dir = target_dir_of(folder)
    if target_dir is not None:  # none recorded: no writer uses the table (DSpark's refuses first)
        table.check_fits(target_dir)


def export_notes(run: str | Path, fmt: str, written: str | Path, latency_table: str | Path | None = None) -> list[str]:
    """What `draftsmith export` prints after writing: a note where the layout keeps less than
    the run trained, then the exact commands that serve the folder (the method's `serve`)."""
    folder, spec = _drafter_folder(run)
    if fmt == "native":
        return []  # draftsmith's own: `eval --drafter METHOD:DIR` reads it
    return spec.face("serve")(folder, Path(written), fmt, latency_table)


def _drafter_folder(run: str | Path) -> tuple[Path, MethodSpec]:
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
    if method not in METHODS:
        raise DraftsmithError(f"{run}: no export for method {method!r}")
    return folder, METHODS[method]


def export_native(folder: Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """The native folder itself, copied whole (config.json + model.safetensors)."""
    if dtype is not None:
        raise DraftsmithError("--dtype: the native format is the drafter as trained (reloaded bit-identically); "
                              "give --dtype with an engine format")
    with atomic_dir(out_dir) as tmp:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(folder / name, tmp / name)
    return Path(out_dir)
