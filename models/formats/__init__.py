"""Each method's formats: one module per method that has a trained drafter to read or write
(`models/formats/<method>.py`), named by its registry entry (`MethodSpec.formats`), plus the
layouts several methods share (`speculators.py`, vLLM's speculators library).

A method's formats module is the only code that knows its layouts. It offers:
- `read(path, target) -> drafter`: the drafter from every layout it is read from (draftsmith's
  native folder, the engines', other trainers'), told apart by `models/layouts.py`;
- its writers, `write_<format>(folder, out_dir, dtype=None)`, each named in the entry's
  `exports` (the `--format` choices, known without importing this module); those the entry's
  `latency_exports` names also take `latency_table=` (a cost table written beside the weights);
- `serve(folder, written, fmt, latency_table=None) -> list[str]`: what `draftsmith export`
  prints after writing `fmt`: notes, then the engine's serve lines (models/serve.py's pieces),
  sized from what the native `folder` holds and at the tile its run recorded (`recorded_tile`);
- optionally `check_export(folder, fmt)` (refuse before any format is written), `claim(path,
  meta) -> layout | None` (a folder no architecture names) and `EXPECTED` (what a folder it
  reads holds, said when a folder holds none of it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def read_layouts(path: str | Path, method: str, target, read_speculators: Callable, read_other: Callable):
    """A `method` drafter from the layout its folder holds: draftsmith's native folder, a
    speculators folder (`read_speculators(meta, layer, weights, target, source)`), else the
    method's own `read_other(path, layout, meta, target)`; a folder of another method, or of no
    layout the method reads, is one line (models/layouts.py)."""
    from draftsmith.models.formats import speculators
    from draftsmith.models.layouts import NATIVE, SPECULATORS, expect
    from draftsmith.models.native import load_drafter

    layout, meta = expect(path, method)
    if layout == NATIVE:
        return load_drafter(path, method, target)
    if layout == SPECULATORS:
        return speculators.load(path, meta, target, read_speculators)
    return read_other(path, layout, meta, target)


def write_folder(out_dir: str | Path, config: dict, state: dict, dtype, extras: dict | None = None,
                 copies: dict | None = None) -> Path:
    """A layout's folder, atomically: `state` cast to `dtype` as model.safetensors (each tensor
    its own copy, so a tied embedding and head are two), config.json, the JSON `extras` beside
    them and `copies` (file name -> source file)."""
    import shutil

    from safetensors.torch import save_file

    from draftsmith.fsutil import atomic_dir, write_json
    from draftsmith.models.dtypes import cast_floats

    tensors = cast_floats(state, dtype)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        for name, data in (extras or {}).items():
            write_json(tmp / name, data)
        for name, source in (copies or {}).items():
            shutil.copyfile(source, tmp / name)
    return Path(out_dir)
