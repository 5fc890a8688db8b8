"""One OpenAI-compatible server, reached for regeneration (data/regen_server.py).

Requests go through the `openai` client (the `serve` extra): the key from OPENAI_API_KEY
(else VLLM_API_KEY; none: a placeholder), its retries with backoff of timeouts, dropped
connections, 408/409/429 and 5xx a bounded number of times, after which the run stops with
one line, keeping what it wrote; any other 4xx stops it at once with one line naming the
request. Proxy variables are not read (the servers are on the cluster network), and neither
is OPENAI_BASE_URL: the URLs given are the servers. Start-up checks (the model list, a
one-token probe) use short timeouts, and every answer's shape is checked, so a server that
never answers or answers nonsense is one line, not a hang or a traceback.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass

from draftsmith.errors import DraftsmithError

# The key a server started with `--api-key` (vLLM, SGLang) asks for: OPENAI_API_KEY, as every
# OpenAI client reads it, else VLLM_API_KEY, the variable vLLM's server itself reads. With
# neither, a placeholder that servers without a key ignore.
API_KEY_VARS = ("OPENAI_API_KEY", "VLLM_API_KEY")


def api_key() -> str:
    return next((os.environ[name] for name in API_KEY_VARS if os.environ.get(name)), "EMPTY")


@dataclass(frozen=True)
class Limits:
    in_flight: int = 16  # requests in flight per server
    timeout: float = 600.0  # seconds per request
    # Extra tries of a request after a timeout, a dropped connection, a 408/409/429 or a 5xx, with
    # the openai client's backoff (0.5 s doubling to 8 s, or the server's Retry-After up to 2 min).
    retries: int = 4
    # The start-up requests (model list, probe) ask for one short token: a server that takes the
    # connection and never answers is one line within a minute, not after `timeout` per try.
    startup_timeout: float = 30.0
    startup_retries: int = 1


_DEADLINE = threading.local()  # the whole-answer deadline of the request this thread is sending


def _http_modules():
    """The HTTP client and core packages the installed openai client is built on (httpx and
    httpcore; httpx2 and httpcore2 from openai 3.x on), whose transport we extend."""
    import importlib

    import openai

    base = next(c for c in openai.DefaultHttpxClient.__mro__[1:] if c.__name__ == "Client")
    name = base.__module__.split(".")[0]
    return importlib.import_module(name), importlib.import_module(name.replace("httpx", "httpcore"))


def _deadline_transport():
    """A transport on which every answer arrives whole within its request's timeout, or times
    out. The client's own timeouts hold per socket operation, so a server sending a byte every
    few seconds (in its headers or its body) never trips them. A request is sent and its answer
    read on the caller's thread: the deadline is that thread's, set as the request goes out,
    and every connect, write and read of its connection waits at most for what is left of it.
    Running out reads as any timeout does: the client retries, then gives up in one line."""
    httpx, httpcore = _http_modules()

    def left(timeout: float | None) -> float | None:
        end = getattr(_DEADLINE, "end", None)
        if end is None:
            return timeout
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise httpcore.ReadTimeout("the whole answer did not arrive within the request's timeout")
        return remaining if timeout is None else min(timeout, remaining)

    class Stream(httpcore.NetworkStream):
        def __init__(self, inner):
            self.inner = inner

        def read(self, max_bytes, timeout=None):
            return self.inner.read(max_bytes, left(timeout))

        def write(self, buffer, timeout=None):
            self.inner.write(buffer, left(timeout))

        def close(self):
            self.inner.close()

        def start_tls(self, ssl_context, server_hostname=None, timeout=None):
            return Stream(self.inner.start_tls(ssl_context, server_hostname, left(timeout)))

        def get_extra_info(self, info):
            return self.inner.get_extra_info(info)

    class Backend(httpcore.NetworkBackend):
        def __init__(self):
            self.inner = httpcore.SyncBackend()

        def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            return Stream(self.inner.connect_tcp(host, port, left(timeout), local_address, socket_options))

        def connect_unix_socket(self, path, timeout=None, socket_options=None):
            return Stream(self.inner.connect_unix_socket(path, left(timeout), socket_options))

        def sleep(self, seconds):
            self.inner.sleep(seconds)

    class Transport(httpx.HTTPTransport):
        def handle_request(self, request):
            seconds = (request.extensions.get("timeout") or {}).get("read")
            _DEADLINE.end = None if seconds is None else time.monotonic() + seconds
            return super().handle_request(request)

    transport = Transport(trust_env=False, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
    # httpx builds its connection pool with httpcore's default backend and takes none of its own.
    assert hasattr(transport._pool, "_network_backend"), "httpcore's pool no longer names its backend"
    transport._pool._network_backend = Backend()
    return transport


class Refused(Exception):
    """The server answered 4xx: the request itself is wrong for it; retrying cannot help."""


def server_root(url: str) -> str:
    """`url` without a trailing /v1 (both spellings are in use); anything but http(s) is one line."""
    text = str(url).strip()
    parts = urllib.parse.urlsplit(text)
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        parts = parts._replace(scheme="")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DraftsmithError(f"server {text!r}: not an http(s) URL (expected http://HOST:PORT or "
                              f"http://HOST:PORT/v1)")
    return text.rstrip("/").removesuffix("/v1")


class Endpoint:
    """One server through the `openai` client: its key, timeouts, retries and backoff; the
    answers come back as the JSON the server sent, checked by the caller (`_reply_text`)."""

    def __init__(self, url: str, limits: Limits):
        self.url, self.limits = server_root(url), limits
        try:
            import openai
        except ImportError:
            raise DraftsmithError('regeneration through servers needs the openai client: '
                                  'pip install "draftsmith[serve]"') from None
        # trust_env=False: no proxy from the environment; these URLs are on the cluster network.
        # The timeouts are whole-answer deadlines (`_deadline_transport`), not per socket read.
        http = openai.DefaultHttpxClient(trust_env=False, transport=_deadline_transport())
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key(), max_retries=limits.retries,
                                    timeout=limits.timeout, http_client=http)
        self.startup = self.client.with_options(timeout=limits.startup_timeout,
                                                max_retries=min(limits.startup_retries, limits.retries))

    def call(self, path: str, body: dict | None = None, startup: bool = False):
        """The JSON answer to `/v1{path}` ("/models", "/chat/completions" or "/completions");
        `body` holds the request's fields, the non-standard ones under "extra_body". A 4xx
        raises `Refused`; anything else that fails is a DraftsmithError naming the server."""
        import openai

        client = self.startup if startup else self.client
        where, tries = f"/v1{path}", client.max_retries + 1
        try:
            raw = self._send(client, path, body)
        except openai.APITimeoutError:
            raise DraftsmithError(f"server {self.url}: no answer on {where} within {client.timeout:g} s "
                                  f"(gave up after {tries} tries)") from None
        except openai.APIConnectionError as exc:
            reason = " ".join(str(exc.__cause__ or exc).split())[:200]
            raise DraftsmithError(f"server {self.url}: unreachable on {where} ({reason}) "
                                  f"(gave up after {tries} tries)") from None
        except openai.APIStatusError as exc:
            status = f"HTTP {exc.status_code} on {where}: {_detail(exc.response)}"
            if exc.status_code in (401, 403):
                status += f" (the key is read from {' or '.join(API_KEY_VARS)})"
            if exc.status_code in (408, 409, 429) or exc.status_code >= 500:  # what the client retried
                raise DraftsmithError(f"server {self.url}: {status} (gave up after {tries} tries)") from None
            raise Refused(status) from None
        try:
            return json.loads(raw.http_response.content)
        except ValueError:  # a proxy's page or a half-written answer, sent with status 200
            raise DraftsmithError(f"server {self.url}: answered {where} with something that is not JSON: "
                                  f"{excerpt(raw.http_response.text)}") from None

    @staticmethod
    def _send(client, path: str, body: dict | None):
        if path == "/models":
            return client.models.with_raw_response.list()
        fields = dict(body)
        extra = fields.pop("extra_body", None) or None
        api = client.chat.completions if path == "/chat/completions" else client.completions
        return api.with_raw_response.create(**fields, extra_body=extra)


def excerpt(text) -> str:
    return " ".join(str(text).split())[:300]


def _detail(response) -> str:
    """What an error answer says: its message when it is JSON, else its text."""
    try:
        body = response.json()
    except ValueError:
        return excerpt(response.text or response.reason_phrase)
    detail = body
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body.get("message") or body
    if isinstance(detail, dict):
        detail = detail.get("message") or detail
    return excerpt(detail)
