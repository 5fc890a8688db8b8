"""Atomic writes: a reader never sees a half-written file, folder, checkpoint or report.

Everything is written under a temporary sibling name and renamed into place; on any
error the temporary is removed and whatever was at the destination before is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from draftsmith.errors import DraftsmithError


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create `path` (and parents) or fail with one line naming it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise DraftsmithError(f"output folder {path} is not writable: {exc.strerror or exc}") from None
    return path


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder that becomes `dest` only if the block succeeds."""
    dest = Path(dest)
    ensure_writable_dir(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DraftsmithError(f"{dest} already exists")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "w") -> Iterator:
    """Yield an open file whose contents replace `dest` only if the block succeeds."""
    dest = Path(dest)
    ensure_writable_dir(dest.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(dest: str | os.PathLike, obj) -> None:
    with atomic_file(dest) as handle:
        json.dump(obj, handle, indent=2, sort_keys=False)
        handle.write("\n")


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftsmithError(f"{path} is not valid JSON: {exc}") from None
