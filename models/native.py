"""The native drafter format: `config.json` + `model.safetensors`, reloaded bit-identically.

config.json holds `{"format": "draftsmith", "method": NAME, "config": {DrafterConfig fields}}`
plus whatever provenance the caller adds (target path, layer ids, draft vocabulary size).
`save_drafter` / `load_drafter` are the one way every method's trained module is written
and read back: a module class names its `method`, says what it stores (`native_state`)
and rebuilds itself from that (`from_native`); the registry maps a method to its classes.
Conversions to engine layouts live in `models/export*.py`, never here or in the models.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir, read_json, read_safetensors, write_json
from draftsmith.models.layouts import check_names

FORMAT = "draftsmith"


def config_to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(cls, data: dict[str, Any], source: str = "config"):
    """Build a config dataclass, refusing keys it does not know (a sign of another method)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftsmithError(f"{source}: unknown key(s) {', '.join(unknown)} for {cls.__name__}")
    return cls(**data)


def save_native(out_dir: str | Path, method: str, config, state_dict: dict[str, torch.Tensor],
                extra: dict[str, Any] | None = None) -> Path:
    """Write a drafter atomically: the folder appears whole or not at all."""
    out_dir = Path(out_dir)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        meta = {"format": FORMAT, "method": method, "config": config_to_dict(config)}
        meta.update(extra or {})
        write_json(tmp / "config.json", meta)
    return out_dir


def read_native_meta(path: str | Path, expect_method: str | None = None) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise DraftsmithError(f"drafter {path} not found")
    meta = read_json(path / "config.json")
    if meta.get("format") != FORMAT or "method" not in meta:
        raise DraftsmithError(f"{path}/config.json is not a draftsmith native drafter (no 'format: {FORMAT}')")
    check_names(path / "config.json", meta)
    if not isinstance(meta.get("config", {}), dict):
        raise DraftsmithError(f"{path}/config.json: 'config' must be a mapping of the drafter's settings, "
                              f"got {meta['config']!r}")
    if expect_method is not None and meta["method"] != expect_method:
        raise DraftsmithError(
            f"{path} holds a {meta['method']} drafter, not {expect_method}; load it as {meta['method']}:{path}"
        )
    return meta


def load_native_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return read_safetensors(Path(path) / "model.safetensors")


def load_state_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load weights, naming missing/unexpected tensors and shape mismatches in one line."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise DraftsmithError(
            f"{source}: weights do not fit {type(module).__name__}"
            f" (missing {missing[:3]}{'...' if len(missing) > 3 else ''},"
            f" unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})"
        )
    for name, tensor in state.items():
        if own[name].shape != tensor.shape:
            raise DraftsmithError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
            )
    module.load_state_dict(state, strict=True)


def save_drafter(drafter: torch.nn.Module, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """A trained drafter module in the native format (atomically)."""
    return save_native(out_dir, drafter.method, drafter.config, drafter.native_state(), extra)


def load_drafter(path: str | Path, method: str, target: torch.nn.Module | None = None):
    """A native drafter of `method` (a folder of another method is refused, naming it),
    rebuilt for `target` where the module shares the target's weights."""
    from draftsmith.registry import method_spec

    meta = read_native_meta(path, expect_method=method)
    spec = method_spec(method, "model")
    config = config_from_dict(spec.load("config"), meta["config"], source=f"{path}/config.json")
    return spec.load("model").from_native(config, load_native_weights(path), target, source=str(path))
