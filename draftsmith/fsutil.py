"""Atomic writes: a reader never sees a half-written file, folder, checkpoint or report.

Everything is written under a temporary sibling name and renamed into place; on any
error the temporary is removed and whatever was at the destination before is untouched.
What is written gets the modes `open` and `mkdir` would give under the user's umask
(tempfile makes its files 0600 and folders 0700, which a server running as another user
cannot read). A full disk ends in one line saying what was kept.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from draftsmith.errors import DiskFull, DraftsmithError

# Writes the system refuses for the destination, not for our data: out of space or quota, past
# the file-size limit (`ulimit -f`: EFBIG, Python ignores SIGXFSZ), a read-only file system,
# a failing device. Each is one line saying what was kept, as a full disk is.
_WRITE_FAILURES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                   errno.EFBIG: "the file is past the file-size limit", errno.EROFS: "the file system is read-only",
                   errno.EIO: "the device reported an I/O error"}
# torch.save's zip writer reports a short write as a RuntimeError ("unexpected pos ...", "file write
# failed"); safetensors' writer as a SafetensorError ending in "(os error N)".
_FULL_WORDS = ("unexpected pos", "file write failed", "no space left", "disk quota")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _failure_errno(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    found = _OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is a write the system refused (`_WRITE_FAILURES`), from any library."""
    if isinstance(exc, DiskFull):
        return True
    if _failure_errno(exc) in _WRITE_FAILURES:
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _FULL_WORDS)


def write_failure(exc: BaseException) -> str:
    """What refused the write, in words: "the disk is full", "... read-only", ..."""
    if isinstance(exc, DiskFull):
        return exc.failure
    return _WRITE_FAILURES.get(_failure_errno(exc), "the disk is full")


def full_disk_reason(exc: BaseException) -> str:
    if isinstance(exc, DiskFull):
        return exc.reason
    return getattr(exc, "strerror", None) or next(
        (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _disk_full(dest: Path, existed: bool, exc: BaseException) -> DiskFull:
    kept = f"the previous {dest} is intact" if existed else f"{dest} was not written"
    return DiskFull(f"cannot write {dest}: {write_failure(exc)} ({full_disk_reason(exc)}); {kept}",
                    reason=full_disk_reason(exc), failure=write_failure(exc))


def _umask() -> int:
    """The process's umask, read without changing it (another thread may be creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc: the classic read, set and restore at once
    os.umask(mask)
    return mask


def user_mode(folder: bool = False) -> int:
    """The mode `open` (0666) or `mkdir` (0777) gives a new file or folder under the umask."""
    return (0o777 if folder else 0o666) & ~_umask()


def apply_user_modes(root: str | os.PathLike) -> None:
    """Give `root` and everything in it the modes `open`/`mkdir` would: libraries that write
    through a temporary file (safetensors' save_file) leave 0600 behind."""
    file_mode, dir_mode = user_mode(), user_mode(folder=True)
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, dir_mode if path.is_dir() else file_mode)


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
    existed = dest.exists()
    try:
        yield tmp
        apply_user_modes(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise _disk_full(dest, existed, exc) from None
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


def link_tree(source: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """`dest` (atomically) a copy of the folder `source` whose files are hard links where the
    file system allows (one write of a model serves a checkpoint, the best and the last)."""
    source = Path(source)
    with atomic_dir(dest) as tmp:
        for item in sorted(source.rglob("*")):
            target = tmp / item.relative_to(source)
            if item.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(item, target)
            except OSError:  # another device, or links refused: a copy
                shutil.copy2(item, target)
    return Path(dest)


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "w") -> Iterator:
    """Yield an open file whose contents replace `dest` only if the block succeeds."""
    dest = Path(dest)
    ensure_writable_dir(dest.parent)
    clean_stale(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent)
    existed = dest.exists()
    try:
        os.fchmod(fd, user_mode())
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if is_disk_full(exc):
            raise _disk_full(dest, existed, exc) from None
        raise


_NODE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def check_output(out: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse an output path that is not ours to replace, before any work is done. Every output
    is renamed into place, and a rename replaces the name, not what it names: a symbolic link
    would become our file (refused, naming where it points, so the user can give that path),
    and a device, FIFO or socket would be replaced by a regular file (as root, `--out /dev/full`
    replaced the system's device)."""
    out = Path(out)
    if out.is_symlink():
        raise DraftsmithError(f"{flag} {out} is a symbolic link (to {os.readlink(out)}); writing it would replace "
                              "the link, not what it points to: give the path it points to, or a new one")
    try:
        mode = out.stat().st_mode
    except OSError:  # absent (or under something that is no folder: the write names that)
        return
    kind = next((name for test, name in _NODE_KINDS if test(mode)), None)
    if kind is not None:
        raise DraftsmithError(f"{flag} {out} is {kind}, not a regular file or folder; writing it would replace it: "
                              "give the path of a new file")


def check_not_an_input(out: str | os.PathLike, inputs: dict[str, str | os.PathLike | None],
                       flag: str = "--out", folder: bool = False) -> None:
    """Refuse an output path that is one of the command's inputs (writing it would replace
    what it reads), no regular file or folder (`check_output`), or a folder where a file is
    meant, before any work is done."""
    out = Path(out)
    check_output(out, flag)
    for name, source in inputs.items():
        if not source or not (Path(source).exists() or Path(source).is_symlink()):
            continue  # a hub name or nothing: not a file here
        same = out.resolve() == Path(source).resolve()
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(out, source)  # another name (a hard link) of the same file
        if same:
            raise DraftsmithError(f"{flag} {out} is the {name} being read; writing it would replace it: "
                                  "give another path")
    if not folder and out.is_dir():
        raise DraftsmithError(f"{flag} {out} is a folder; give the path of a file to write")


class FolderInUse(DraftsmithError):
    """Another live process holds a folder's lock."""


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "folder") -> Iterator[int | None]:
    """Hold `folder`/.lock for the block, so that a second process writing the same folder
    refuses in one line instead of interleaving its files with ours.

    The lock is an flock on the file (released by the kernel when its holder dies, even by
    kill -9), and the file records the holder's pid for the message. Yields the pid of an
    ended holder whose lock was taken over (None when the lock was free)."""
    with _lock_file(Path(folder) / ".lock", f"{what} {folder}", "folder") as ended:
        yield ended


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, flag: str = "--out") -> Iterator[int | None]:
    """`folder_lock` for an output that is replaced whole (a file, a report or export folder):
    the lock file sits beside it, `.NAME.lock`, since a lock inside a folder would be renamed
    away with the folder it guards. Under `accelerate launch` only the main process (RANK 0)
    holds it: the others write their shares for it to merge."""
    out = Path(out)
    if int(os.environ.get("RANK", "0")) != 0:
        yield None
        return
    path = ensure_writable_dir(out.parent) / f".{out.name}.lock"
    with _lock_file(path, f"{flag} {out}", "path") as ended:
        yield ended


@contextlib.contextmanager
def _lock_file(path: Path, what: str, other: str) -> Iterator[int | None]:
    import fcntl

    while True:
        fd = _open_lock(path, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderInUse(f"{what} is in use by process {holder} (its lock file {path}); "
                              f"wait for it to end or choose another {other}") from None
        # The holder before us may have removed the file after we opened it: lock the file
        # that is at the path now, or two processes would each hold a lock of their own.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    try:
        previous = os.read(fd, 32).decode(errors="replace").strip()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield int(previous) if previous.isdigit() and int(previous) != os.getpid() else None
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


def _open_lock(path: Path, what: str) -> int:
    """The lock file opened (made where absent), or one line saying why it cannot be: a folder
    of that name, a name past the file system's limit (`.NAME.lock` is longer than NAME), no
    permission."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, user_mode())
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            why = "its name is longer than the file system allows; give a shorter name"
        elif path.is_dir():
            why = "a folder of that name is in the way; remove it if no other process uses it"
        else:
            why = exc.strerror or type(exc).__name__
        raise DraftsmithError(f"{what}: cannot make its lock file {path} ({why})") from None


def check_replaceable(dest: str | os.PathLike, marker: str, what: str) -> None:
    """Refuse an --out that writing `what` there would destroy: only an absent or empty
    folder, or a previous `what` (a folder holding `marker`), may be replaced, as a whole."""
    dest = Path(dest)
    check_output(dest)
    if not (dest.exists() or dest.is_symlink()):
        return
    if not dest.is_dir() or dest.is_symlink():
        raise DraftsmithError(f"--out {dest} exists and is not a folder; give a new folder or a previous {what}")
    if any(dest.iterdir()) and not (dest / marker).is_file():
        raise DraftsmithError(f"--out {dest} is a folder that holds no {marker} (not a previous {what}); "
                              "refusing to replace it: give a new folder")


def open_safetensors(path: str | os.PathLike, remedy: str = ""):
    """safetensors' `safe_open` of `path` (use it with `with`, or keep it open): the one reader
    of every safetensors file we read. A missing, truncated or damaged file is one line naming
    it (and `remedy`, what to do about it), not the library's error."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path} not found" + (f"; {remedy}" if remedy else ""))
    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DraftsmithError(f"{path} is truncated or damaged ({reason})" + (f"; {remedy}" if remedy else "")) from None


def read_safetensors(path: str | os.PathLike, remedy: str = "") -> dict:
    """Every tensor of a safetensors file, read through `open_safetensors`."""
    with open_safetensors(path, remedy) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def write_json(dest: str | os.PathLike, obj) -> None:
    with atomic_file(dest) as handle:
        json.dump(obj, handle, indent=2, sort_keys=False)
        handle.write("\n")


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path} not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftsmithError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):  # every JSON file we read (configs, manifests, records) is an object
        raise DraftsmithError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data
