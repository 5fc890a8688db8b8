"""The target's answers from the vLLM engine, for `data cache-hidden --engine vllm`: where the
recipes' rows need answers not yet cached, a plain vLLM server of the target answers them
(through `data.regen_servers`, the path `data regenerate --server` takes), and is stopped
before the capture server starts. On a CPU build it keeps prefills whole (vllm_server.py:
whole_prefills). Measured on SmolLM2-135M, 2 cores: 2.07x in-process `generate` greedy, the
rows identical (scripts/bench_regenerate.py), on one machine; 1.23x sampled on another
(README, "Offline features").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from draftsmith.data.posthoc_rows import answers_file
from draftsmith.errors import DraftsmithError
from draftsmith.recipe import Recipe


@contextlib.contextmanager
def engine_answers(recipes: list[Recipe], target_dir: Path, dtype: str, max_len: int,
                   work_dir: Path) -> Iterator[list[Recipe]]:
    """The recipes, answering through a vLLM server of the target (`dtype`, `max_len` tokens)
    while the context is open, where their answers are to be regenerated and are not cached;
    as given where they are, or where the recipe names its own servers."""
    from draftsmith.data.vllm_server import Served, start_vllm

    answers = answers_file(recipes[0], target_dir)  # one file: the recipes' rows are checked the same
    if answers is None or answers.is_file() or recipes[0].data.regen_servers:
        yield recipes
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    server, _ = start_vllm(Served("plain", str(target_dir), dtype), work_dir / "answers.log", max_len,
                           doing="to answer the training prompts")
    try:
        yield [dataclasses.replace(r, data=dataclasses.replace(r.data, regen_servers=[server.url]))
               for r in recipes]
    except DraftsmithError as exc:
        # The client saw only a refused connection; the engine's log says why it ended.
        raise server.exited(exc, "while answering the training prompts",
                            "a rerun resumes after the answers written") or exc from None
    finally:
        server.stop()
