"""Shared test setup: deterministic, single-threaded torch so the suite behaves the same
on a 2-core CI machine as on a laptop, and no network ever."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A GGUF file converts into the same folder whatever runs it (models/gguf.py: keyed by the
# file's hash), so the real target is converted once into the user's cache, not per session.
from draftsmith.models.gguf import cache_root  # noqa: E402  (light: no torch)

os.environ.setdefault("DRAFTSMITH_GGUF_CACHE", str(cache_root()))
# Regenerated answers are cached across runs; tests keep theirs out of the user's cache.
os.environ.setdefault("DRAFTSMITH_CACHE", tempfile.mkdtemp(prefix="draftsmith-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
