"""The hidden partial file a regeneration appends its answers to, and resumes from after the
last whole record; both paths (data/regenerate.py, data/regen_server.py) write through it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftsmith.fsutil import ensure_writable_dir


def partial_path(out_path: Path, settings: list) -> Path:
    """The hidden file a run with `settings` appends to: a rerun with other ones starts afresh."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return ensure_writable_dir(out_path.parent) / f".{out_path.name}.{key}.partial"


@contextmanager
def resuming(partial: Path, unit: int, total: int) -> Iterator[int]:
    """The records `partial` already holds (see `resume_point`); an error that leaves it
    empty removes it: there is nothing to resume, so nothing is left behind."""
    done = resume_point(partial, unit, total)
    try:
        yield done
    except BaseException:
        if partial.exists() and partial.stat().st_size == 0:
            partial.unlink()
        raise


def resume_point(partial: Path, unit: int, total: int) -> int:
    """Records already in the partial file; the file is cut back to whole records of whole
    units of `unit` records (all `total` records may end in a short one)."""
    if not partial.exists():
        return 0
    lines = partial.read_bytes().splitlines(keepends=True)
    good = 0
    for line in lines:
        if not line.endswith(b"\n") or not _is_json(line):  # the line an interruption cut short
            break
        good += 1
    # In-process, a batch is generated (and, when sampling, seeded) as a unit.
    done = good if good >= total else good - good % unit
    with partial.open("r+b") as handle:
        handle.truncate(sum(len(line) for line in lines[:done]))
    return done


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True
