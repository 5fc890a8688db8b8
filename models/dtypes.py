"""The dtypes exports are written in, shared by every writer and by the serve lines.

Drafters train in float32, but an engine serves a drafter in the dtype its config names, so
an export is written in the target's dtype unless `--dtype` says otherwise (models/export.py).
Its own module, so that the formats modules (models/formats/) and serve.py import
it without importing `export`, which imports them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.fsutil import read_json
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.native import read_native_meta

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dtype(config: dict) -> torch.dtype | None:
    """The dtype a Hugging Face config.json names (`dtype` from transformers 5, `torch_dtype` before)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(str(name).removeprefix("torch.")) if name else None


def target_dir_of(folder: str | Path) -> Path | None:
    """The target folder a native drafter records (`target`), if it is still there."""
    target = read_native_meta(folder).get("target")
    if not target:
        return None
    path = Path(find_model_dir(target))
    return path if (path / "config.json").is_file() else None


def export_dtype(folder: str | Path, dtype: str | None, trained: torch.dtype) -> torch.dtype:
    """`--dtype` if given, else the dtype of the target the drafter was trained for, else
    the drafter's own (`trained`: no target recorded, or its config names none)."""
    if dtype is not None:
        return DTYPES[dtype]
    target_dir = target_dir_of(folder)
    found = config_dtype(read_json(target_dir / "config.json")) if target_dir is not None else None
    return found or trained


def cast_floats(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in `dtype`, each its own contiguous CPU copy (a tied target's
    embedding and head stay two tensors in the file); integer and bool buffers as they are."""
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
