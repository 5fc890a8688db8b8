"""A Hugging Face hub cache laid out as huggingface_hub writes it, for offline tests:
`<repo_type>s--ORG--NAME/blobs/<sha256>`, `snapshots/<revision>/<path>` symlinked to the
blob, and `refs/main` holding the revision (its `hub_cache` fixture is in conftest.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes | Path], repo_type: str = "model",
             revision: str = "0" * 39 + "1") -> Path:
    """Put `files` (path in the repository -> bytes, or a local file to copy) in `cache` as
    revision `revision` of `repo_id`, which refs/main names; returns the snapshot folder."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def add_folder(cache: Path, repo_id: str, folder: Path, repo_type: str = "model") -> Path:
    """Every file under `folder` as one revision of `repo_id`."""
    files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return add_repo(cache, repo_id, files, repo_type)


def parquet(table: dict) -> bytes:
    """A parquet file's bytes holding `table` (column -> values), as the hub serves datasets."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(table), sink)
    return sink.getvalue().to_pybytes()
