"""Atomic writes: a reader never sees a half-written file, folder, checkpoint or report.

Everything is written under a temporary sibling name and renamed into place; on any
error the temporary is removed and whatever was at the destination before is untouched.
"""

from __future__ import annotations

import contextlib
import glob
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def clean_stale(dest: str | os.PathLike) -> list[Path]:
    """Remove what an interrupted atomic write of `dest` left beside it: `.NAME.tmp-PID-*`
    and `.NAME.old-PID` whose process has ended. Names carry the writer's PID so that a
    write still under way (in another process) is never touched."""
    dest = Path(dest)
    removed = []
    for path in dest.parent.glob(f".{glob.escape(dest.name)}.*-*"):
        kind, _, rest = path.name[len(dest.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind in ("tmp", "old") and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            _remove(path)
            removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder that becomes `dest` only if the block succeeds."""
    dest = Path(dest)
    ensure_writable_dir(dest.parent)
    clean_stale(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists() or dest.is_symlink():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DraftsmithError(f"{dest} already exists")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        _remove(old)
    else:
        os.rename(tmp, dest)


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "w") -> Iterator:
    """Yield an open file whose contents replace `dest` only if the block succeeds."""
    dest = Path(dest)
    ensure_writable_dir(dest.parent)
    clean_stale(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_replaceable(dest: str | os.PathLike, marker: str, what: str) -> None:
    """Refuse an --out that writing `what` there would destroy: only an absent or empty
    folder, or a previous `what` (a folder holding `marker`), may be replaced, as a whole."""
    dest = Path(dest)
    if not (dest.exists() or dest.is_symlink()):
        return
    if not dest.is_dir() or dest.is_symlink():
        raise DraftsmithError(f"--out {dest} exists and is not a folder; give a new folder or a previous {what}")
    if any(dest.iterdir()) and not (dest / marker).is_file():
        raise DraftsmithError(f"--out {dest} is a folder that holds no {marker} (not a previous {what}); "
                              "refusing to replace it: give a new folder")


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
