"""The target's answers from the vLLM engine, for `data cache-hidden --engine vllm`: where the
recipes' rows need answers not yet cached, a plain vLLM server of the target answers them
(through `data.regen_servers`, the path `data regenerate --server` takes), and is stopped
before the capture server starts. Measured on SmolLM2-135M, 2 cores: 2.07x in-process
`generate` greedy, the rows identical (scripts/bench_regenerate.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from draftsmith.data.posthoc_rows import answers_file
from draftsmith.errors import DraftsmithError
from draftsmith.recipe import Recipe

log = logging.getLogger(__name__)


def whole_prefills(build: dict, max_len: int) -> list[str]:
    """Flags that keep a CPU engine from splitting a prompt's prefill across steps. vLLM 0.32's
    CPU runner crashes on a seeded (sampled) request whose prefill was split: it rewinds the
    request's generator, which a CPU generator cannot ("CPU Generator does not use offset", in
    `_bookkeeping_sync`), and each reply is seeded here. Measured: 16 sampled prompts of the
    demo's rows in flight killed the engine within seconds. A prompt that does not fit a step
    waits for the next one instead."""
    if build["device"] != "cpu":
        return []
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_len)]


@contextlib.contextmanager
def engine_answers(recipes: list[Recipe], target_dir: Path, dtype: str, max_len: int,
                   work_dir: Path) -> Iterator[list[Recipe]]:
    """The recipes, answering through a vLLM server of the target (`dtype`, `max_len` tokens)
    while the context is open, where their answers are to be regenerated and are not cached;
    as given where they are, or where the recipe names its own servers."""
    from draftsmith.data.vllm_server import Served, VllmServer, engine_build, engine_python, server_flags

    answers = answers_file(recipes[0], target_dir)  # one file: the recipes' rows are checked the same
    if answers is None or answers.is_file() or recipes[0].data.regen_servers:
        yield recipes
        return
    python = engine_python()
    build = engine_build(python)
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    server = VllmServer(python, Served("plain", str(target_dir), dtype), work_dir / "answers.log", max_len,
                        flags=[*server_flags(build), *whole_prefills(build, max_len)])
    log.info("engine ready in %.1f s to answer the training prompts (log: %s)", time.monotonic() - started,
             server.log)
    try:
        yield [dataclasses.replace(r, data=dataclasses.replace(r.data, regen_servers=[server.url]))
               for r in recipes]
    except DraftsmithError as exc:
        if server.process.poll() is None:
            raise
        from draftsmith.data.local_server import why_it_failed

        # The client saw only a refused connection; the engine's log says why it ended.
        raise DraftsmithError(f"vLLM exited while answering the training prompts: {why_it_failed(server.log, str(exc))} "
                              f"(log: {server.log}); a rerun resumes after the answers written") from None
    finally:
        server.stop()
