"""Hub names wherever a path is taken: a repository id (`Qwen/Qwen3-8B`,
`HuggingFaceH4/ultrachat_200k`) becomes the folder huggingface_hub keeps it in.

The cache is read first (`snapshot_download(local_files_only=True)`: the snapshot that
`refs/main` points to under `HF_HUB_CACHE`), so a machine that downloaded a model once, or
a cluster node with a shared cache, needs no network; only then, unless `HF_HUB_OFFLINE` is
set, is the repository downloaded into that cache. Nothing is ever downloaded elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from draftsmith.errors import DraftsmithError, first_lines

# owner/name as the hub spells it: letters, digits, "-", "_", "."; the owner may be absent.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
# Files a model repository may carry that loading never reads: Llama's original/ holds a
# second, PyTorch-pickle copy of the weights (16 GB for an 8B model).
_NEVER_NEEDED = ["original/*", "*.pth"]


def looks_like_repo_id(text: str | Path) -> bool:
    """A string that could name a hub repository and names no local path."""
    text = str(text)
    return bool(_REPO_ID.match(text)) and not text.startswith(".") and not Path(text).expanduser().exists()


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot of `repo_id` (its `main`), or None when the cache has none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError, ValueError):
        return None


def hub_snapshot(repo_id: str, repo_type: str = "model", what: str = "model", download: bool = True) -> Path:
    """The local folder of hub repository `repo_id`: cached, else downloaded (with `download`,
    unless offline). Not found either way: one line naming the cache and why."""
    from huggingface_hub import constants, snapshot_download

    found = cached_snapshot(repo_id, repo_type)
    if found is not None:
        return found
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if not download or offline():
        reason = "offline (HF_HUB_OFFLINE)" if offline() else "not downloaded here"
        raise DraftsmithError(f"{what} {repo_id}: not a local path, and not in {where}; {reason}")
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, ignore_patterns=_NEVER_NEEDED))
    # huggingface_hub raises its own errors, requests' and OSError for a missing repository,
    # a gated one, a network failure: all mean the same to the user, named in one line.
    except Exception as exc:
        raise DraftsmithError(f"{what} {repo_id}: not a local path, not in {where}, and not downloadable: "
                              f"{first_lines(exc, 1)}") from None


def dataset_source(name: str) -> str:
    """Where `datasets` should read a dataset from: a local path as given; a hub name from
    its snapshot in the Hugging Face cache when there is one (`datasets` alone does not look
    there offline); else the name, for `datasets` to fetch online. Offline and not cached:
    one line."""
    from huggingface_hub import constants

    if not looks_like_repo_id(name):
        return name
    snapshot = cached_snapshot(name, repo_type="dataset")
    if snapshot is not None:
        return str(snapshot)
    if offline():
        raise DraftsmithError(f"dataset {name}: not a local path, and not in the Hugging Face cache "
                              f"({constants.HF_HUB_CACHE}); offline (HF_HUB_OFFLINE)")
    return name
