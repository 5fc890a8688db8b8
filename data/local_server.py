"""OpenAI-compatible servers on 127.0.0.1, started and stopped by draftsmith: `transformers
serve` for one model (the server the tests and scripts/bench_regenerate.py regenerate through,
`pip install "draftsmith[serve]"`), and the vLLM engine (eval/engine.py) that serves a target
with one of our drafters. Both are a `LoopbackServer`: a command on a free loopback port, its
output in a log, ready when /health answers.

At scale a vLLM or SGLang server on the accelerators takes its place; only the URL changes.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from draftsmith.errors import DraftsmithError

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_get(url: str, timeout: float = 10.0) -> str:
    """The body of a GET on a loopback URL, never through a proxy."""
    with _OPENER.open(url, timeout=timeout) as reply:
        return reply.read().decode("utf-8", "replace")


# Why a server ended, by what its log says last, best first: a pydantic validation's own
# message (vLLM checks its config that way), a Python exception's line (module prefix dropped;
# a logged traceback's too), any logged error.
_WHY = (re.compile(r"Value error, (.*?)(?: \[type=.*)?$"),
        re.compile(r"^(?:.*?\bERROR\b.*?\] )?(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)\b:? .*)$"),
        re.compile(r"\bERROR\b.*?\] (.*)$"))


# Lines that only point back at the cause ("see the stack trace above"): vLLM's front end
# saying its engine core died.
_ECHOES = ("EngineDeadError", "EngineCore encountered an issue")


def why_it_failed(log: Path, fallback: str) -> str:
    """The reason a server's log gives for ending, else `fallback`; logged warnings and
    information are passed over (one may mention an error it survived)."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return fallback
    lines = [line.strip() for line in lines if " WARNING " not in line and " INFO " not in line
             and not any(echo in line for echo in _ECHOES)]
    for pattern in _WHY:
        for line in reversed(lines):
            found = pattern.search(line)
            if found:
                return re.sub(r"\s+", " ", found.group(1)).strip()[:400]
    return fallback


class LoopbackServer:
    """`command` (which must take `--host 127.0.0.1 --port PORT`, appended here) started on a
    free loopback port; waits at most `wait_s` until /health answers. A server that exits first
    is one line with the reason its log gives; `stop()` (or leaving the `with` block) ends it."""

    name = "server"

    def __init__(self, command: list[str], log: str | Path, env: dict[str, str] | None = None, wait_s: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            self._wait(wait_s)
        except BaseException:
            self.stop()
            raise

    def _wait(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                why = why_it_failed(self.log, "no reason in its log")
                raise DraftsmithError(f"{self.name} exited with status {self.process.returncode}: {why} "
                                      f"(log: {self.log})")
            try:
                with _OPENER.open(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise DraftsmithError(f"{self.name} did not answer /health within {wait_s:.0f} s (log: {self.log})")

    def exited(self, exc: Exception, doing: str, remedy: str) -> DraftsmithError | None:
        """The one line for a request that failed (`exc`) because the server had exited while
        `doing`: the reason its log gives, not the client's refused connection; None while it runs."""
        if self.process.poll() is None:
            return None
        return DraftsmithError(f"{self.name} exited {doing}: {why_it_failed(self.log, str(exc))} (log: {self.log}); "
                               f"{remedy}")

    def stop(self) -> None:
        """Ends the server and every process it started (vLLM's engine core runs apart)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 15)
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=15)
            except ProcessLookupError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve_command() -> list[str]:
    beside = Path(sys.executable).with_name("transformers")  # the CLI of this interpreter's transformers
    found = str(beside) if beside.exists() else shutil.which("transformers")
    if not found:
        raise DraftsmithError("transformers serve: no `transformers` command beside this Python")
    return [found, "serve"]


class LocalServer(LoopbackServer):
    """`transformers serve MODEL` on a free loopback port."""

    name = "transformers serve"

    def __init__(self, model_dir: str | Path, log: str | Path, continuous_batching: bool = False,
                 device: str = "cpu", wait_s: float = 180.0, threads: int | None = None):
        command = [*_serve_command(), str(model_dir), "--device", device, "--log-level", "warning"]
        if continuous_batching:
            command.append("--continuous-batching")
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        super().__init__(command, log, env, wait_s)
