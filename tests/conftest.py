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


# ---------------------------------------------------------------- fixtures several modules share

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny Qwen3 target (tiny_models.tiny_target: VOCAB ids, MASK the last) saved as a
    folder, as the commands read one (DeepSpec's export copies its embedding and head)."""
    from tiny_models import tiny_target

    folder = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(target_dir):
    """That target loaded from its folder, frozen."""
    from draftsmith.models.target import freeze, load_target

    return freeze(load_target(target_dir))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub (offline) reads instead of the user's
    (hub_fixtures.py fills it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """A `datasets` cache of the test's own, so no Arrow file outlives it."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
