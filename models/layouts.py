"""Which drafter a folder holds, told from its config.json: every layout draftsmith writes
or reads (ours and the ones other tools load), so that `eval --drafter METHOD:DIR` accepts
any of them and names what it expected when it recognises none.

The readers themselves live in each method's formats module (models/formats/<method>.py,
`read`); this table only routes, from the registry: a method's foreign architectures, its
speculators type, and its formats module's `claim` for folders no architecture names.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import read_json
from draftsmith.registry import METHODS

NATIVE = "native"
SPECULATORS = "speculators"  # vLLM's speculators library: told apart by speculators_model_type, not architectures


def _architectures() -> dict[str, tuple[str, str]]:
    """architectures[0] -> (method, layout), from each method's registration. The engines'
    own names: a folder another tool trained carries the same architecture."""
    return {arch: (spec.name, layout) for spec in METHODS.values() for arch, layout in spec.foreign_layouts.items()}


def _expected(method: str) -> str:
    spec = METHODS.get(method)
    if spec is None:
        return "a drafter folder"
    expected = spec.face("EXPECTED", None)
    if expected:
        return expected
    return ("a draftsmith native folder" + "".join(f" or a {layout} folder (architectures [{arch!r}])"
                                                   for arch, layout in spec.foreign_layouts.items())
            + (f" or a speculators folder (speculators_model_type {spec.speculators_type!r})"
               if spec.speculators_type else ""))


def _speculators_method(file: Path, kind) -> str:
    """The method a speculators config holds, from its `speculators_model_type`; an
    algorithm no method here trains is one line naming the ones read."""
    known = {spec.speculators_type: spec.name for spec in METHODS.values() if spec.speculators_type}
    if kind not in known:
        raise DraftsmithError(f"{file}: speculators_model_type {kind!r} is not an algorithm draftsmith trains in "
                              f"that layout (it reads speculators folders of {', '.join(sorted(known))})")
    return known[kind]


def check_names(file: Path, meta: dict) -> None:
    """The fields that route a folder must have their shapes: a method's name, a list of
    architecture names (anything else would fail later as a TypeError deep in a loader)."""
    method, archs = meta.get("method"), meta.get("architectures")
    if "method" in meta and not isinstance(method, str):
        raise DraftsmithError(f"{file}: 'method' must be a method's name, got {method!r}")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise DraftsmithError(f"{file}: 'architectures' must be a list of class names, got {archs!r}")


def identify(path: str | Path) -> tuple[str | None, str | None, dict]:
    """(method, layout, config) of a drafter folder; (None, None, config) when unknown."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"drafter {path}: no config.json")
    meta = read_json(path / "config.json")
    check_names(path / "config.json", meta)
    if meta.get("format") == "draftsmith" and "method" in meta:
        return meta["method"], NATIVE, meta
    if "speculators_model_type" in meta:  # its architectures are the library's own names, or anything
        return _speculators_method(path / "config.json", meta["speculators_model_type"]), SPECULATORS, meta
    arch = (meta.get("architectures") or [None])[0]
    known = _architectures()
    if arch in known:
        return (*known[arch], meta)
    for spec in METHODS.values():  # a folder no architecture names: the method whose formats claim it
        claim = spec.face("claim", None)
        if claim is not None and (layout := claim(path, meta)) is not None:
            return spec.name, layout, meta
    return None, None, meta


def expect(path: str | Path, method: str) -> tuple[str, dict]:
    """The layout of a folder that must hold a `method` drafter, or one line saying what it
    holds instead, or what was expected."""
    found, layout, meta = identify(path)
    if found is None:
        arch = meta.get("architectures")
        raise DraftsmithError(f"{path}/config.json (architectures {arch!r}) is no layout draftsmith reads as "
                              f"{method}: expected {_expected(method)}")
    if found != method:
        raise DraftsmithError(f"{path} holds a {found} drafter, not {method} ({layout} layout); "
                              f"evaluate it as {found}:{path}")
    return layout, meta
