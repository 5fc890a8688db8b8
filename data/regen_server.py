"""Regeneration through serving engines: the target's answers from OpenAI-compatible
endpoints (vLLM, SGLang, TGI, `transformers serve`) instead of in-process `generate`.

Why: `generate` runs fixed batches that wait for their longest reply, while an engine with
continuous batching refills a slot as soon as a reply ends; at 100k conversations of up to
2048 tokens that is the difference between days and hours (SpecForge regenerates through
SGLang servers for the same reason).

The output is the in-process one (data/regenerate.py): one `{"messages": [...]}` line per
conversation, in input order, appended to a hidden partial file as the in-order prefix
grows, renamed to `out_path` when complete; a rerun resumes after the last whole line.
Requests run on threads, `in_flight` per server, each pulling the next conversation, so a
faster server takes more.

Requests go through the `openai` client (the `serve` extra): the key from OPENAI_API_KEY
(else VLLM_API_KEY; none: a placeholder), its retries with backoff of timeouts, dropped
connections, 408/409/429 and 5xx a bounded number of times, after which the run stops with
one line, keeping what it wrote; any other 4xx stops it at once with one line naming the
request. Proxy variables are not read (the servers are on the cluster network), and neither
is OPENAI_BASE_URL: the URLs given are the servers. Start-up checks (the model list, a
one-token probe) use short timeouts, and every answer's shape is checked, so a server that
never answers or answers nonsense is one line, not a hang or a traceback.

ReplyDecoding settings reach the engine in the first request form it accepts (probed once at
start): vLLM/SGLang's extra fields (`top_k`, `stop_token_ids`, `repetition_penalty`),
then `transformers serve`'s `generation_config` (which refuses unknown fields with 422, so
the probe tells the two apart), then plain OpenAI fields (no top-k, the server's own stop
tokens). An engine that silently ignores unknown fields (TGI, say) gets the first form and
whatever it honours of it; the probe cannot see that. Fields beyond the OpenAI API travel in
the client's `extra_body` (`_forms`, and `chat_template_kwargs` in `ServerClient._body`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.data.chat import end_of_turn_ids
from draftsmith.data.conversations import replace_surrogates
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import ensure_writable_dir
from draftsmith.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Mixed scripts, digits, code and whitespace: two different tokenizers all but never
# count the same number of tokens for it (and its chat rendering).
PROBE = "Probe 1: déjà vu, 東京, ∑x², `def f(a, b):\n\treturn a ** b  # 42`"


# ---------------------------------------------------------------- shared with data/regenerate.py
# (here, in a module that imports no torch, rather than in data/regenerate.py, which does)

@dataclass(frozen=True)
class ReplyDecoding(SamplingParams):
    """How both paths decode a reply: the sampling, plus its length, seed and stop tokens."""
    max_new_tokens: int = 1
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # the target's end-of-text and the template's end of turn
    pad_id: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise DraftsmithError(f"regenerate: max_new_tokens ({self.max_new_tokens}) must be positive")

    def ending(self, stop_ids: list[int], tokenizer) -> ReplyDecoding:
        """These settings ending a reply at `stop_ids`, padded with the tokenizer's pad (else the first stop)."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        return replace(self, stop_ids=tuple(stop_ids), pad_id=pad)


def stop_token_ids(generation_config, tokenizer, chat_template: str | None = None, untemplated: bool = False,
                   template_kwargs: dict | None = None) -> list[int]:
    """Where a reply ends: the target's and tokenizer's end-of-text ids and the template's end of turn."""
    ids = generation_config.eos_token_id
    ids = set([ids] if isinstance(ids, int) else ids or [])
    ids |= {tokenizer.eos_token_id} - {None}
    if not untemplated:
        ids |= set(end_of_turn_ids(tokenizer, chat_template, template_kwargs))
    return sorted(ids)


def user_turns(messages: list[dict], index: int) -> list[list[dict]]:
    """The conversation without its assistant turns, cut after each user turn."""
    turns, pending = [], []
    for message in messages:
        if message["role"] == "assistant":
            continue
        pending.append(message)
        if message["role"] == "user":
            turns.append(pending)
            pending = []
    if not turns:
        raise DraftsmithError(f"conversation {index} has no user turn to answer")
    return turns


def partial_path(out_path: Path, settings: list) -> Path:
    """The hidden file a run with `settings` appends to: a rerun with other ones starts afresh."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return ensure_writable_dir(out_path.parent) / f".{out_path.name}.{key}.partial"


@contextmanager
def resuming(partial: Path, unit: int, total: int) -> Iterator[int]:
    """The records `partial` already holds (see `resume_point`); an error that leaves it
    empty removes it: there is nothing to resume, so nothing is left behind."""
    done = resume_point(partial, unit, total)
    try:
        yield done
    except BaseException:
        if partial.exists() and partial.stat().st_size == 0:
            partial.unlink()
        raise


def resume_point(partial: Path, unit: int, total: int) -> int:
    """Records already in the partial file; the file is cut back to whole records of whole
    units of `unit` records (all `total` records may end in a short one)."""
    if not partial.exists():
        return 0
    lines = partial.read_bytes().splitlines(keepends=True)
    good = 0
    for line in lines:
        if not line.endswith(b"\n") or not _is_json(line):  # the line an interruption cut short
            break
        good += 1
    # In-process, a batch is generated (and, when sampling, seeded) as a unit.
    done = good if good >= total else good - good % unit
    with partial.open("r+b") as handle:
        handle.truncate(sum(len(line) for line in lines[:done]))
    return done


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- servers

# The key a server started with `--api-key` (vLLM, SGLang) asks for: OPENAI_API_KEY, as every
# OpenAI client reads it, else VLLM_API_KEY, the variable vLLM's server itself reads. With
# neither, a placeholder that servers without a key ignore.
API_KEY_VARS = ("OPENAI_API_KEY", "VLLM_API_KEY")
# The fields the OpenAI API defines for both endpoints; everything else goes in `extra_body`.
STANDARD_FIELDS = ("max_tokens", "temperature", "top_p")


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


class _Refused(Exception):
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
        raises `_Refused`; anything else that fails is a DraftsmithError naming the server."""
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
            raise _Refused(status) from None
        try:
            return json.loads(raw.http_response.content)
        except ValueError:  # a proxy's page or a half-written answer, sent with status 200
            raise DraftsmithError(f"server {self.url}: answered {where} with something that is not JSON: "
                                  f"{_short(raw.http_response.text)}") from None

    @staticmethod
    def _send(client, path: str, body: dict | None):
        if path == "/models":
            return client.models.with_raw_response.list()
        fields = dict(body)
        extra = fields.pop("extra_body", None) or None
        api = client.chat.completions if path == "/chat/completions" else client.completions
        return api.with_raw_response.create(**fields, extra_body=extra)


def _short(text) -> str:
    return " ".join(str(text).split())[:300]


def _detail(response) -> str:
    """What an error answer says: its message when it is JSON, else its text."""
    try:
        body = response.json()
    except ValueError:
        return _short(response.text or response.reason_phrase)
    detail = body
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body.get("message") or body
    if isinstance(detail, dict):
        detail = detail.get("message") or detail
    return _short(detail)


def _forms(sampling: ReplyDecoding, max_tokens: int) -> dict[str, dict]:
    """The request fields that carry `sampling`, per engine family, most complete first;
    the engines' own fields under "extra_body"."""
    base = {"max_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    # vLLM and SGLang: -1 is "no top-k" in both; the repetition penalty is pinned because a
    # model's generation_config may suggest one, and it would change the distribution.
    engine = {"top_k": sampling.top_k or -1, "stop_token_ids": list(sampling.stop_ids), "repetition_penalty": 1.0,
              "skip_special_tokens": True}
    config = {"max_new_tokens": max_tokens, "do_sample": sampling.temperature > 0, "top_k": sampling.top_k,
              "top_p": sampling.top_p, "repetition_penalty": 1.0, "eos_token_id": list(sampling.stop_ids),
              "pad_token_id": sampling.pad_id}
    if sampling.temperature > 0:
        config["temperature"] = sampling.temperature
    forms = {"vllm/sglang": {**base, "extra_body": engine},
             "transformers": {**base, "extra_body": {"generation_config": json.dumps(config)}}}
    if not sampling.top_k:  # plain OpenAI has no top-k: usable only when none is asked for
        forms["openai"] = {**base, "extra_body": {}}
    return forms


def target_names(*targets: str | Path) -> tuple[set[str], set[str]]:
    """The ids a server may list for the target named `targets` (as written, or as an absolute
    path), and their last path components: what a server serving a copy of the target from
    another folder lists. The tokenizer probe is what tells such a copy from another model."""
    names, bases = set(), set()
    for target in targets:
        text = str(target).rstrip("/")
        names.add(text)
        if Path(text).expanduser().exists():
            names.add(str(Path(text).expanduser().resolve()))
        bases.add(Path(text).name)
    return names, bases


def _count(usage, key: str, where: str) -> int | None:
    """A token count of an answer's `usage` (None: not reported); anything but a count is malformed."""
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise DraftsmithError(f"{where}: a malformed answer: usage is {_short(usage)[:100]}, not an object")
    value = usage.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise DraftsmithError(f"{where}: a malformed answer: usage.{key} is {value!r}, not a token count")
    return value


class ServerClient:
    """One checked server: the model id it serves the target under, and the request form.

    What is checked, and what cannot be: the server's model list must hold the target's name
    or path (or one id with the same last path component), and its prompt-token count for a
    probe, chat template applied, must equal the local tokenizer's: that catches another
    tokenizer or template, not other weights under the same name (a fine-tune of the target
    passes; the OpenAI API exposes nothing of the weights). A server that reports no usage
    is checked by name only.
    """

    def __init__(self, url: str, served_names: tuple[str, ...], tokenizer, untemplated: bool, sampling: ReplyDecoding,
                 limits: Limits, template_kwargs: dict | None = None):
        self.endpoint, self.untemplated, self.sampling = Endpoint(url, limits), untemplated, sampling
        self.template_kwargs = dict(template_kwargs or {})  # enable_thinking, as the recipe decided
        self.tokenizer, self.lock = tokenizer, threading.Lock()
        self.surrogates = 0  # lone surrogates replaced in this server's answers
        self._token_chars = None
        try:
            listed = self.endpoint.call("/models", startup=True)
        except _Refused as exc:
            raise DraftsmithError(f"server {self.endpoint.url}: no OpenAI model list ({exc})") from None
        models = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(models, list):
            raise DraftsmithError(f"server {self.endpoint.url}: /v1/models answered {_short(listed)[:100]}, "
                                  f"not an OpenAI model list")
        ids = [str(m.get("id")) for m in models if isinstance(m, dict)]
        names, bases = target_names(*served_names)
        exact = [i for i in ids if i.rstrip("/") in names]
        same_base = [i for i in ids if Path(i.rstrip("/")).name in bases]
        if not exact and len(same_base) != 1:
            raise DraftsmithError(f"server {self.endpoint.url} serves {', '.join(ids) or 'no model'}, "
                                  f"not the target {served_names[0]}")
        self.model = (exact or same_base)[0]
        self.form = self._probe()

    def _body(self, prompt, form: dict, seed: int) -> dict:
        key = "prompt" if self.untemplated else "messages"
        extra = dict(form["extra_body"])
        if self.template_kwargs and not self.untemplated:  # vLLM and SGLang hand them to the template (Qwen3's enable_thinking)
            extra["chat_template_kwargs"] = self.template_kwargs
        return {"model": self.model, key: prompt, **{k: form[k] for k in STANDARD_FIELDS}, "seed": seed,
                "extra_body": extra}

    def _path(self) -> str:
        return "/completions" if self.untemplated else "/chat/completions"

    def _probe(self) -> dict:
        """The first request form the server takes; and the tokenizer check: the server must
        count as many prompt tokens for the probe as the target's tokenizer does here."""
        prompt = PROBE if self.untemplated else [{"role": "user", "content": PROBE}]
        refused = []
        for name, form in _forms(self.sampling, 1).items():
            try:
                reply = self.endpoint.call(self._path(), self._body(prompt, form, self.sampling.seed), startup=True)
            except _Refused as exc:
                refused.append(f"{name}: {exc}")
                continue
            self._reply_text(reply, "the probe")
            self._check_tokenizer(prompt, reply)
            return _forms(self.sampling, self.sampling.max_new_tokens)[name]
        raise DraftsmithError(f"server {self.endpoint.url} refuses every request form: {'; '.join(refused)}")

    def _check_tokenizer(self, prompt, reply: dict) -> None:
        served = _count(reply.get("usage"), "prompt_tokens", f"server {self.endpoint.url}, the probe")
        if served is None:  # nothing to compare: the model id is all that was checked
            return
        if self.untemplated:
            local = len(self.tokenizer(prompt)["input_ids"])
        else:
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                      **self.template_kwargs)
            local = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if served != local:
            raise DraftsmithError(f"server {self.endpoint.url} ({self.model}) counts {served} prompt tokens for a "
                                  f"probe the target's tokenizer makes {local} of: another tokenizer or chat template")

    def _reply_text(self, reply, request: str) -> str:
        """The text of an answer, whose shape is checked: a malformed one is one line."""
        where = f"server {self.endpoint.url}, {request}"
        try:
            choice = reply["choices"][0]
            text = choice["text"] if self.untemplated else choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise DraftsmithError(f"{where}: an answer without choices: {_short(reply)[:200]}") from None
        if text is not None and not isinstance(text, str):
            raise DraftsmithError(f"{where}: a malformed answer: its text is {_short(text)[:100]}, not a string")
        text, replaced = replace_surrogates(text or "")  # before any tokenizer (or the UTF-8 file) sees it
        if replaced:
            with self.lock:
                self.surrogates += replaced
        return text

    def token_chars(self) -> int:
        """The most characters one token of the target's tokenizer can decode to (its longest
        vocabulary entry, byte-level or not, and one for a joining space)."""
        if self._token_chars is None:
            with self.lock:
                vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
                self._token_chars = max(map(len, vocab), default=64) + 1
        return self._token_chars

    def _check_length(self, text: str, tokens: int | None, where: str) -> None:
        """An answer no longer than the max_tokens asked for, checked before it is tokenized or
        written: a server that ignores the limit would otherwise hand the tokenizer (or a
        training row) megabytes."""
        asked = self.form["max_tokens"]
        if tokens is not None and tokens > asked:
            raise DraftsmithError(f"{where}: the answer counts {tokens} completion tokens, more than the max_tokens "
                                  f"{asked} asked for: the server does not keep to it")
        if len(text) > asked * self.token_chars():
            raise DraftsmithError(f"{where}: an answer of {len(text)} characters, more than {asked} tokens can hold "
                                  f"(at most {self.token_chars()} characters each): the server does not keep to "
                                  "max_tokens")

    def complete(self, history: list[dict], seed: int, request: str = "a request") -> tuple[str, int]:
        """The reply to `history` and its token count; `request` names it in errors."""
        prompt = "".join(m["content"] for m in history) if self.untemplated else history
        try:
            reply = self.endpoint.call(self._path(), self._body(prompt, self.form, seed))
        except _Refused as exc:  # e.g. a prompt longer than the server's context
            raise DraftsmithError(f"server {self.endpoint.url}, {request}: {exc}") from None
        text = self._reply_text(reply, request)
        tokens = _count(reply.get("usage"), "completion_tokens", f"server {self.endpoint.url}, {request}")
        self._check_length(text, tokens, f"server {self.endpoint.url}, {request}")
        if tokens is None:
            with self.lock:  # a Rust tokenizer is not to be used by two threads at once
                tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return text, tokens


def target_stop_ids(target_dir: str | Path, tokenizer, untemplated: bool, chat_template: str | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """`stop_token_ids` of the target without loading its weights: its generation config."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(target_dir))
    except OSError:  # no generation_config.json: the model config's eos
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(target_dir)))
    return stop_token_ids(config, tokenizer, chat_template, untemplated, template_kwargs)


def _request_seed(seed: int, index: int, turn: int) -> int:
    """One seed per reply, from the run's seed and the reply's place; fits every engine's int."""
    return (seed * 1_000_003 + index * 257 + turn) % (2 ** 31)


def answer_conversation(client: ServerClient, messages: list[dict], index: int) -> tuple[list[dict], int]:
    history, tokens = [], 0
    for turn, asked in enumerate(user_turns(messages, index)):
        history += asked
        text, n = client.complete(history, _request_seed(client.sampling.seed, index, turn),
                                  request=f"conversation {index}, turn {turn + 1}")
        history.append({"role": "assistant", "content": text})
        tokens += n
    return history, tokens


def _target_identity(target_path: str | Path):
    """What says a rerun asks the same target: its weights' fingerprint when its folder is
    here (a target retrained in place starts afresh), else its name. Never a download: the
    servers hold the weights, which may be far larger than this machine's disk."""
    folder = Path(target_path)
    if folder.is_dir() and any(folder.glob("*.safetensors")):
        from draftsmith.data.feature_cache import target_fingerprint

        return target_fingerprint(folder)
    return str(target_path)


def regenerate_via_servers(urls: list[str], served_names: str | tuple[str, ...], tokenizer, conversations: list[list[dict]],
                           out_path: str | Path, sampling: ReplyDecoding, untemplated: bool = False,
                           limits: Limits = Limits(), template_kwargs: dict | None = None) -> Path:
    """Write `conversations` with the target's replies, as `regenerate` does, asking `urls`.

    `served_names`: the names a server may list the target under, the last one its folder or hub name.
    """
    out_path = Path(out_path)
    if not urls:
        raise DraftsmithError("regenerate: no server given")
    for url in urls:  # every URL before any request
        server_root(url)
    if not conversations:
        raise DraftsmithError("regenerate: no conversations given")
    if limits.in_flight < 1:
        raise DraftsmithError(f"regenerate: in_flight ({limits.in_flight}) must be positive")
    for index, messages in enumerate(conversations):  # a bad record fails before any request
        user_turns(messages, index)
    served_names = (served_names,) if isinstance(served_names, (str, Path)) else tuple(served_names)
    chat = {"template_kwargs": template_kwargs} if template_kwargs else {}
    clients = [ServerClient(url, served_names, tokenizer, untemplated, sampling, limits, **chat) for url in urls]
    # The key leaves the servers out: a rerun may resume through other ones.
    partial = partial_path(out_path, ["server", _target_identity(served_names[-1]), len(tokenizer), conversations,
                                      untemplated, sampling.max_new_tokens, sampling.temperature, sampling.top_p,
                                      sampling.top_k, sampling.seed, list(sampling.stop_ids)]
                           + ([template_kwargs] if template_kwargs else []))  # older runs' keys stay
    with resuming(partial, 1, len(conversations)) as done:
        _collect(clients, conversations, partial, done, limits.in_flight)
    replaced = sum(client.surrogates for client in clients)
    if replaced:  # invalid text in answers: replaced before any tokenizer or the UTF-8 file saw it
        log.warning("draftsmith: regenerate: replaced %d lone UTF-16 surrogate(s) in the servers' answers with "
                    "U+FFFD", replaced)
    os.replace(partial, out_path)
    return out_path


def _collect(clients: list[ServerClient], conversations: list[list[dict]], partial: Path, done: int,
             in_flight: int) -> None:
    """Ask the servers for conversations `done`.. and append the answers to `partial` in order."""
    work: queue.Queue[int] = queue.Queue()
    for index in range(done, len(conversations)):
        work.put(index)
    results: queue.Queue = queue.Queue()
    stop = threading.Event()

    def worker(client: ServerClient) -> None:
        while not stop.is_set():
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((index, *answer_conversation(client, conversations[index], index), None))
            except BaseException as exc:  # handed to the main thread, which raises it
                results.put((index, None, 0, exc))
                return

    threads = [threading.Thread(target=worker, args=(client,), daemon=True, name=f"regen-{n}")
               for client in clients for n in range(in_flight)]
    for thread in threads:
        thread.start()
    finished, next_index, tokens, started = {}, done, 0, time.monotonic()
    synced = started
    try:
        with partial.open("a", encoding="utf-8") as handle, \
                tqdm(total=len(conversations), initial=done, desc="regenerate", unit="conv") as bar:
            while next_index < len(conversations):
                try:
                    index, messages, n, error = results.get(timeout=1.0)
                except queue.Empty:
                    if not any(thread.is_alive() for thread in threads) and results.empty():
                        raise DraftsmithError("regenerate: every request thread ended early") from None
                    continue
                if error is not None:
                    raise error
                finished[index], tokens = messages, tokens + n
                lines = []
                while next_index in finished:  # the in-order prefix is what a rerun resumes from
                    lines.append(json.dumps({"messages": finished.pop(next_index)}, ensure_ascii=False) + "\n")
                    next_index += 1
                if lines:
                    handle.write("".join(lines))
                    handle.flush()
                    # An fsync per short answer would stall this thread at thousands of answers
                    # a second; a crash loses at most a second, and resuming cuts a torn line.
                    if time.monotonic() - synced >= 1.0:
                        os.fsync(handle.fileno())
                        synced = time.monotonic()
                    bar.update(len(lines))
                bar.set_postfix_str(f"{tokens / max(time.monotonic() - started, 1e-9):.0f} tok/s", refresh=False)
            os.fsync(handle.fileno())
    finally:
        stop.set()  # the threads still asking finish their request and stop; nothing more is written


def decoding_for(target_dir: str | Path, tokenizer, how: ReplyDecoding, untemplated: bool, chat_template: str | None = None,
                 template_kwargs: dict | None = None) -> ReplyDecoding:
    """`how` for a server, ending where the in-process regeneration ends: the same stop tokens
    (from the same chat template and its switches) and pad, read without loading the weights."""
    return how.ending(target_stop_ids(target_dir, tokenizer, untemplated, chat_template, template_kwargs), tokenizer)
