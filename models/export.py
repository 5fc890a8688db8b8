"""`draftsmith export`: a trained drafter written in the layouts other tools load.

Which formats a method offers, and the function that writes each, is the method's entry
in the registry (`draftsmith/registry.py`); the layouts themselves live in
`export_eagle3.py`, `export_dflash.py` and `export_mtp.py`, and `layouts.py` tells them
apart when reading (and here, which method a run holds). The drafter modules know nothing about them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir
from draftsmith.models.layouts import NATIVE, identify
from draftsmith.models.target import resolve_model_dir
from draftsmith.registry import METHODS, resolve


def export_run(run: str | Path, fmt: str, out_dir: str | Path) -> Path:
    """Write the drafter of a training run (or a native drafter folder) in format `fmt`."""
    folder = Path(resolve_model_dir(run))
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

        check_engine_layout(folder)
    formats = METHODS[method].exports if method in METHODS else {}
    if fmt not in formats:
        raise DraftsmithError(f"{run} holds a {method} drafter: --format must be one of {', '.join(formats)}"
                              if formats else f"{run}: no export for method {method!r}")
    return resolve(formats[fmt], f"--format {fmt}")(folder, out_dir)


def export_native(folder: Path, out_dir: str | Path) -> Path:
    """The native folder itself, copied whole (config.json + model.safetensors)."""
    with atomic_dir(out_dir) as tmp:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(folder / name, tmp / name)
    return Path(out_dir)
