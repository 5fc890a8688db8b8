"""`transformers serve` for one model on 127.0.0.1: the server the tests and
scripts/bench_regenerate.py regenerate through (`pip install "draftsmith[serve]"`).

At scale a vLLM or SGLang server on the accelerators takes its place; only the URL changes.
"""

from __future__ import annotations

import os
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


def _serve_command() -> list[str]:
    beside = Path(sys.executable).with_name("transformers")  # the CLI of this interpreter's transformers
    found = str(beside) if beside.exists() else shutil.which("transformers")
    if not found:
        raise DraftsmithError("transformers serve: no `transformers` command beside this Python")
    return [found, "serve"]


class LocalServer:
    """Starts `transformers serve MODEL` on a free loopback port and waits (at most
    `wait_s`) until /health answers; `stop()` (or leaving the `with` block) ends it."""

    def __init__(self, model_dir: str | Path, log: str | Path, continuous_batching: bool = False,
                 device: str = "cpu", wait_s: float = 180.0, threads: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        command = [*_serve_command(), str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                   "--device", device, "--log-level", "warning"]
        if continuous_batching:
            command.append("--continuous-batching")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait(wait_s)
        except BaseException:
            self.stop()
            raise

    def _wait(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DraftsmithError(f"transformers serve exited with status {self.process.returncode} "
                                      f"(log: {self.log})")
            try:
                with _OPENER.open(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise DraftsmithError(f"transformers serve did not answer /health within {wait_s:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
