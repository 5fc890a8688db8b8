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
faster server takes more. A request that times out or meets a 5xx/429 is retried with
exponential backoff a bounded number of times; then the run stops with one line, keeping
what it wrote.

Sampling settings reach the engine in the first request form it accepts (probed once at
start): vLLM/SGLang's extra fields (`top_k`, `stop_token_ids`, `repetition_penalty`),
then `transformers serve`'s `generation_config` (which refuses unknown fields with 422, so
the probe tells the two apart), then plain OpenAI fields (no top-k, the server's own stop
tokens). An engine that silently ignores unknown fields (TGI, say) gets the first form and
whatever it honours of it; the probe cannot see that.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.data.chat import end_of_turn_ids
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import ensure_writable_dir

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
# Mixed scripts, digits, code and whitespace: two different tokenizers all but never
# count the same number of tokens for it (and its chat rendering).
PROBE = "Probe 1: déjà vu, 東京, ∑x², `def f(a, b):\n\treturn a ** b  # 42`"
# Whoever sits behind these URLs is on the cluster network: no HTTP proxy in between.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------- shared with data/regenerate.py
# (here, in a module that imports no torch, rather than in data/regenerate.py, which does)

@dataclass(frozen=True)
class Sampling:
    """How both paths decode a reply."""
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float  # 1: off
    top_k: int  # 0: off
    seed: int
    stop_ids: tuple[int, ...]  # the target's end-of-text and the template's end of turn
    pad_id: int

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise DraftsmithError(f"regenerate: max_new_tokens ({self.max_new_tokens}) must be positive and "
                                  f"temperature ({self.temperature}) not negative")
        if not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
            raise DraftsmithError(f"regenerate: top_p ({self.top_p}) must be in (0, 1] and top_k ({self.top_k}) "
                                  f"not negative")


def stop_token_ids(generation_config, tokenizer, chat_template: str | None = None, plain: bool = False) -> list[int]:
    """Where a reply ends: the target's and tokenizer's end-of-text ids and the template's end of turn."""
    ids = generation_config.eos_token_id
    ids = set([ids] if isinstance(ids, int) else ids or [])
    ids |= {tokenizer.eos_token_id} - {None}
    if not plain:
        ids |= set(end_of_turn_ids(tokenizer, chat_template))
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

@dataclass(frozen=True)
class Limits:
    in_flight: int = 16  # requests in flight per server
    timeout: float = 600.0  # seconds per request
    retries: int = 4  # extra tries of a request after a timeout, a dropped connection, a 5xx or a 429
    backoff: float = 1.0  # seconds before the first retry; doubles each time, at most 30


class _Transient(Exception):
    """A failure worth retrying: the server may be busy, restarting or briefly gone."""


class _Refused(Exception):
    """The server answered 4xx: the request itself is wrong for it; retrying cannot help."""


class Endpoint:
    """One server: JSON over HTTP with bounded retries."""

    def __init__(self, url: str, limits: Limits):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.limits = limits

    def call(self, path: str, body: dict | None = None, retries: int | None = None) -> dict:
        retries = self.limits.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return self._once(path, body)
            except _Transient as exc:
                last = exc
                if attempt < retries:
                    time.sleep(min(self.limits.backoff * 2 ** attempt, 30.0))
        raise DraftsmithError(f"server {self.url}: {last} (gave up after {retries + 1} tries)")

    def _once(self, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(request, timeout=self.limits.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = _detail(exc)
            if exc.code in RETRY_STATUS:
                raise _Transient(f"HTTP {exc.code} on {path}: {detail}") from None
            raise _Refused(f"HTTP {exc.code} on {path}: {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise _Transient(f"unreachable on {path} ({reason})") from None
        except ValueError:  # a body that is not JSON: a proxy's error page, a half-sent reply
            raise _Transient(f"answered {path} with something that is not JSON") from None


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except (ValueError, OSError):
        return exc.reason or ""
    detail = body.get("detail") or body.get("error") or body.get("message") or body
    if isinstance(detail, dict):
        detail = detail.get("message") or detail
    return " ".join(str(detail).split())[:300]


def _forms(sampling: Sampling, max_tokens: int) -> dict[str, dict]:
    """The request fields that carry `sampling`, per engine family, most complete first."""
    base = {"max_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    # vLLM and SGLang: -1 is "no top-k" in both; the repetition penalty is pinned because a
    # model's generation_config may suggest one, and it would change the distribution.
    engine = {**base, "top_k": sampling.top_k or -1, "stop_token_ids": list(sampling.stop_ids),
              "repetition_penalty": 1.0, "skip_special_tokens": True}
    config = {"max_new_tokens": max_tokens, "do_sample": sampling.temperature > 0, "top_k": sampling.top_k,
              "top_p": sampling.top_p, "repetition_penalty": 1.0, "eos_token_id": list(sampling.stop_ids),
              "pad_token_id": sampling.pad_id}
    if sampling.temperature > 0:
        config["temperature"] = sampling.temperature
    forms = {"vllm/sglang": engine, "transformers": {**base, "generation_config": json.dumps(config)}}
    if not sampling.top_k:  # plain OpenAI has no top-k: usable only when none is asked for
        forms["openai"] = base
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


class ServerClient:
    """One checked server: the model id it serves the target under, and the request form.

    What is checked, and what cannot be: the server's model list must hold the target's name
    or path (or one id with the same last path component), and its prompt-token count for a
    probe, chat template applied, must equal the local tokenizer's: that catches another
    tokenizer or template, not other weights under the same name (a fine-tune of the target
    passes; the OpenAI API exposes nothing of the weights). A server that reports no usage
    is checked by name only.
    """

    def __init__(self, url: str, target: tuple[str, ...], tokenizer, plain: bool, sampling: Sampling,
                 limits: Limits):
        self.endpoint, self.plain, self.sampling = Endpoint(url, limits), plain, sampling
        self.tokenizer, self.lock = tokenizer, threading.Lock()
        # Startup: a missing server should be one line soon, not after a long backoff.
        try:
            listed = self.endpoint.call("/v1/models", retries=min(limits.retries, 2))
        except _Refused as exc:
            raise DraftsmithError(f"server {self.endpoint.url}: no OpenAI model list ({exc})") from None
        ids = [str(m.get("id")) for m in listed.get("data", []) if isinstance(m, dict)]
        names, bases = target_names(*target)
        exact = [i for i in ids if i.rstrip("/") in names]
        same_base = [i for i in ids if Path(i.rstrip("/")).name in bases]
        if not exact and len(same_base) != 1:
            raise DraftsmithError(f"server {self.endpoint.url} serves {', '.join(ids) or 'no model'}, "
                                  f"not the target {target[0]}")
        self.model = (exact or same_base)[0]
        self.form = self._probe()

    def _body(self, prompt, form: dict, seed: int) -> dict:
        key = "prompt" if self.plain else "messages"
        return {"model": self.model, key: prompt, **form, "seed": seed}

    def _path(self) -> str:
        return "/v1/completions" if self.plain else "/v1/chat/completions"

    def _probe(self) -> dict:
        """The first request form the server takes; and the tokenizer check: the server must
        count as many prompt tokens for the probe as the target's tokenizer does here."""
        prompt = PROBE if self.plain else [{"role": "user", "content": PROBE}]
        refused = []
        for name, form in _forms(self.sampling, 1).items():
            try:
                reply = self.endpoint.call(self._path(), self._body(prompt, form, self.sampling.seed),
                                           retries=min(self.endpoint.limits.retries, 2))
            except _Refused as exc:
                refused.append(f"{name}: {exc}")
                continue
            self._check_tokenizer(prompt, reply)
            return _forms(self.sampling, self.sampling.max_new_tokens)[name]
        raise DraftsmithError(f"server {self.endpoint.url} refuses every request form: {'; '.join(refused)}")

    def _check_tokenizer(self, prompt, reply: dict) -> None:
        served = (reply.get("usage") or {}).get("prompt_tokens")
        if served is None:  # nothing to compare: the model id is all that was checked
            return
        if self.plain:
            local = len(self.tokenizer(prompt)["input_ids"])
        else:
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            local = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if served != local:
            raise DraftsmithError(f"server {self.endpoint.url} ({self.model}) counts {served} prompt tokens for a "
                                  f"probe the target's tokenizer makes {local} of: another tokenizer or chat template")

    def complete(self, history: list[dict], seed: int) -> tuple[str, int]:
        """The reply to `history` and its token count."""
        prompt = "".join(m["content"] for m in history) if self.plain else history
        try:
            reply = self.endpoint.call(self._path(), self._body(prompt, self.form, seed))
        except _Refused as exc:  # e.g. a prompt longer than the server's context
            raise DraftsmithError(f"server {self.endpoint.url}: {exc}") from None
        try:
            choice = reply["choices"][0]
            text = choice["text"] if self.plain else choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise DraftsmithError(f"server {self.endpoint.url}: a reply without choices: {str(reply)[:200]}") from None
        text = text or ""
        tokens = (reply.get("usage") or {}).get("completion_tokens")
        if tokens is None:
            with self.lock:  # a Rust tokenizer is not to be used by two threads at once
                tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return text, int(tokens)


def target_stop_ids(target_dir: str | Path, tokenizer, plain: bool) -> list[int]:
    """`stop_token_ids` of the target without loading its weights: its generation config."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(target_dir))
    except OSError:  # no generation_config.json: the model config's eos
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(target_dir)))
    return stop_token_ids(config, tokenizer, plain=plain)


def _request_seed(seed: int, index: int, turn: int) -> int:
    """One seed per reply, from the run's seed and the reply's place; fits every engine's int."""
    return (seed * 1_000_003 + index * 257 + turn) % (2 ** 31)


def answer_conversation(client: ServerClient, messages: list[dict], index: int) -> tuple[list[dict], int]:
    history, tokens = [], 0
    for turn, asked in enumerate(user_turns(messages, index)):
        history += asked
        text, n = client.complete(history, _request_seed(client.sampling.seed, index, turn))
        history.append({"role": "assistant", "content": text})
        tokens += n
    return history, tokens


def _target_identity(target: str | Path):
    """What says a rerun asks the same target: its weights' fingerprint when its folder is
    here (a target retrained in place starts afresh), else its name. Never a download: the
    servers hold the weights, which may be far larger than this machine's disk."""
    folder = Path(target)
    if folder.is_dir() and any(folder.glob("*.safetensors")):
        from draftsmith.models.feature_cache import target_fingerprint

        return target_fingerprint(folder)
    return str(target)


def regenerate_via_servers(urls: list[str], target: str | tuple[str, ...], tokenizer, conversations: list[list[dict]],
                           out_path: str | Path, sampling: Sampling, plain: bool = False,
                           limits: Limits = Limits()) -> Path:
    """Write `conversations` with the target's replies, as `regenerate` does, asking `urls`.

    `target`: the names a server may list it under, the last one its folder or hub name.
    """
    out_path = Path(out_path)
    if not urls:
        raise DraftsmithError("regenerate: no server given")
    if not conversations:
        raise DraftsmithError("regenerate: no conversations given")
    if limits.in_flight < 1:
        raise DraftsmithError(f"regenerate: in_flight ({limits.in_flight}) must be positive")
    for index, messages in enumerate(conversations):  # a bad record fails before any request
        user_turns(messages, index)
    target = (target,) if isinstance(target, (str, Path)) else tuple(target)
    clients = [ServerClient(url, target, tokenizer, plain, sampling, limits) for url in urls]
    # The key leaves the servers out: a rerun may resume through other ones.
    partial = partial_path(out_path, ["server", _target_identity(target[-1]), len(tokenizer), conversations,
                                      plain, sampling.max_new_tokens, sampling.temperature, sampling.top_p,
                                      sampling.top_k, sampling.seed, list(sampling.stop_ids)])
    with resuming(partial, 1, len(conversations)) as done:
        _collect(clients, conversations, partial, done, limits.in_flight)
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


def sampling_for(target_dir: str | Path, tokenizer, plain: bool, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> Sampling:
    """The in-process regeneration's settings for a server: the same stop tokens and pad."""
    stop = target_stop_ids(target_dir, tokenizer, plain)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    return Sampling(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop), pad)
