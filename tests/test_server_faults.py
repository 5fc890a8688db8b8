"""Servers that misbehave: regeneration through OpenAI-compatible servers ends in one line
naming the server (and the request) for each fault, retries what is worth retrying, sends
the key from the environment, and loses nothing already written.

Each test runs a stdlib HTTP server on 127.0.0.1 scripted to fail one way; a request it is
told to leave unanswered waits at most a few seconds, and the server stops with the test."""

import http.server
import json
import threading
import time
from contextlib import contextmanager

import pytest

from draftsmith.cli import main
from draftsmith.data.regen_server import regenerate_via_servers
from draftsmith.data.reply_decoding import ReplyDecoding
from draftsmith.data.server_endpoint import Limits
from draftsmith.errors import DraftsmithError

HANG = "hang"  # an answer that never comes: the connection is taken and left waiting


class Drip:
    """An answer sent one byte every `every` seconds, in its status line and headers or in its
    body, for at most `limit` seconds: each socket read gets a byte in time, the whole never comes."""

    def __init__(self, part: str, every: float = 0.1, limit: float = 5.0):
        self.part, self.every, self.limit = part, every, limit

    def send(self, handler, release) -> None:
        head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        dripped = head + b" " * 100000 if self.part == "headers" else b" " * 100000
        if self.part == "body":
            handler.wfile.write(head)
        started = time.monotonic()
        try:
            for byte in dripped:
                if release.is_set() or time.monotonic() - started > self.limit:
                    return
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(self.every)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
            pass


def reply(content="Four.", usage=None) -> dict:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    return {**body, "usage": usage} if usage is not None else body


@contextmanager
def scripted_server(answer):
    """A loopback server: `answer(method, path, body, headers)` gives (status, JSON or bytes,
    extra headers), or HANG. Every request is recorded as (method, path, body, headers with
    lower-case names)."""
    seen, release = [], threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, method):
            size = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(size)) if size else None
            seen.append((method, self.path, body, {k.lower(): v for k, v in self.headers.items()}))
            got = answer(method, self.path, body, self.headers)
            if got == HANG:
                release.wait(10.0)  # bounded: the test's end releases it sooner
                return
            if isinstance(got, Drip):
                got.send(self, release)
                return
            status, payload, extra = (*got, {})[:3]
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in extra.items():
                self.send_header(key, value)
            try:
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
                pass

        def do_GET(self):
            self._answer("GET")

        def do_POST(self):
            self._answer("POST")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def chat_target_dir(tmp_path_factory):
    """A tiny target folder (its tokenizer and configs are all the server path reads)."""
    from chat_fixtures import save_tiny_chat_target

    folder = tmp_path_factory.mktemp("faults") / "target"
    save_tiny_chat_target("llama31", folder, num_layers=1)
    return folder


def serving(target, chat=lambda body, headers: (200, reply()), models=None):
    """An answer script: the model list names `target`, chats go to `chat`."""
    listed = models if models is not None else {"object": "list", "data": [{"id": str(target), "object": "model"}]}

    def answer(method, path, body, headers):
        if path == "/v1/models":
            return listed if listed == HANG or isinstance(listed, Drip) else (200, listed)
        return chat(body, headers)
    return answer


def regenerate_cli(target, url, tmp_path, capsys, *extra):
    """`draftsmith data regenerate` through `url`: its exit status and stderr lines."""
    data = tmp_path / "asked.jsonl"
    data.write_text('{"turns": ["Two plus two?", "Squared?"]}\n{"prompt": "Hi"}\n')
    code = main(["data", "regenerate", "--target", str(target), "--dataset", str(data), "--server", url,
                 "--out", str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--in-flight", "1", *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in lines if not line.startswith("regenerate: ")]  # the progress bar


def assert_one_line(code, err, *parts):
    assert code == 2 and len(err) == 1 and err[0].startswith("draftsmith: error: "), err
    for part in parts:
        assert part in err[0], err


def nothing_written(tmp_path):
    return not (tmp_path / "out.jsonl").exists() and not list(tmp_path.glob(".out.jsonl*"))


# ---------------------------------------------------------------- URLs

@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:21/v1", "http://:8000/v1", "http://127.0.0.1:port/v1",
                                 "127.0.0.1:8000"])
def test_a_url_that_is_not_http_is_refused_before_any_request(chat_target_dir, tmp_path, capsys, url):
    code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
    assert_one_line(code, err, f"server {url!r}: not an http(s) URL")
    assert nothing_written(tmp_path)


# ---------------------------------------------------------------- no answer

def test_a_server_that_never_answers_is_one_line_within_the_startup_timeout(chat_target_dir, tmp_path):
    sampling = ReplyDecoding(max_new_tokens=4, stop_ids=(0,))
    limits = Limits(in_flight=1, retries=3, startup_timeout=0.3, startup_retries=1)
    for models, path in ((HANG, "/v1/models"), (None, "/v1/chat/completions")):  # no list; no probe answer
        hang = serving(chat_target_dir, chat=lambda body, headers: HANG, models=models)
        with scripted_server(hang) as (url, seen):
            started = time.monotonic()
            with pytest.raises(DraftsmithError) as caught:
                regenerate_via_servers([url], str(chat_target_dir), None, [[{"role": "user", "content": "Hi"}]],
                                       tmp_path / "out.jsonl", sampling, limits=limits)
            elapsed = time.monotonic() - started
        message = str(caught.value)
        assert f"no answer on {path} within 0.3 s (gave up after 2 tries)" in message and "\n" not in message
        assert elapsed < 5.0 and [s[1] for s in seen].count(path) == 2
    assert nothing_written(tmp_path)
    # The defaults: a silent server is reported within about a minute (it was 30 minutes).
    assert Limits().startup_timeout * (Limits().startup_retries + 1) <= 60


# ---------------------------------------------------------------- malformed answers

@pytest.mark.parametrize("models, chat, message", [
    ([], reply(), "/v1/models answered [], not an OpenAI model list"),
    ({"data": "all of them"}, reply(), "not an OpenAI model list"),
    (b"<html>gateway</html>", reply(), "answered /v1/models with something that is not JSON: <html>gateway</html>"),
    (None, reply(content=123), "the probe: a malformed answer: its text is 123, not a string"),
    (None, {"id": "x"}, "the probe: an answer without choices"),
    (None, reply(usage={"prompt_tokens": "many"}), "usage.prompt_tokens is 'many', not a token count"),
    (None, reply(usage={"completion_tokens": "abc"}),
     "conversation 0, turn 1: a malformed answer: usage.completion_tokens is 'abc', not a token count"),
])
def test_a_malformed_answer_is_one_line_naming_the_server(chat_target_dir, tmp_path, capsys, models, chat, message):
    script = serving(chat_target_dir, chat=lambda body, headers: (200, chat), models=models)
    with scripted_server(script) as (url, _):
        code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
    assert_one_line(code, err, f"server {url.removesuffix('/v1')}", message)
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------- status codes and retries

def test_429_and_5xx_are_retried_then_the_run_completes(chat_target_dir, tmp_path, capsys):
    failures = iter([(429, {"error": {"message": "slow down"}}), (503, {"error": {"message": "overloaded"}})])

    def chat(body, headers):
        if body["max_tokens"] == 1:  # the start-up probe
            return 200, reply()
        # retry-after-ms keeps the client's backoff short here; it honours the header as servers send it
        return next(failures, (200, reply())) + ({"retry-after-ms": "10"},)

    with scripted_server(serving(chat_target_dir, chat=chat)) as (url, seen):
        code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
    assert code == 0, err
    rows = [json.loads(line)["messages"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [[m["content"] for m in row if m["role"] == "assistant"] for row in rows] == [["Four.", "Four."], ["Four."]]
    assert len([s for s in seen if s[1] == "/v1/chat/completions"]) == 2 + 1 + 3  # two failures, probe, 3 turns


def test_a_5xx_that_persists_gives_up_in_one_line_keeping_what_was_answered(chat_target_dir, tmp_path):
    calls = []

    def chat(body, headers):
        calls.append(body["messages"][-1]["content"])
        if body["messages"][-1]["content"] == "Hi":  # the second conversation: the server breaks down
            return 503, {"error": {"message": "overloaded"}}, {"retry-after-ms": "10"}
        return 200, reply()

    sampling = ReplyDecoding(max_new_tokens=4, stop_ids=(0,))
    conversations = [[{"role": "user", "content": "Two plus two?"}], [{"role": "user", "content": "Hi"}]]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_target_dir))
    with scripted_server(serving(chat_target_dir, chat=chat)) as (url, _):
        with pytest.raises(DraftsmithError) as caught:
            regenerate_via_servers([url], str(chat_target_dir), tokenizer, conversations, tmp_path / "out.jsonl", sampling,
                                   limits=Limits(in_flight=1, retries=2))
    message = str(caught.value)
    assert message.endswith("HTTP 503 on /v1/chat/completions: overloaded (gave up after 3 tries)"), message
    assert calls.count("Hi") == 3
    (partial,) = tmp_path.glob(".out.jsonl.*.partial")  # the first conversation is kept for a rerun
    assert [json.loads(line)["messages"][-1]["content"] for line in partial.read_text().splitlines()] == ["Four."]


def test_other_4xx_is_one_line_naming_the_request_and_never_retried(chat_target_dir, tmp_path, capsys):
    calls = []

    def chat(body, headers):
        calls.append(body["messages"][-1]["content"])
        if body["messages"][-1]["content"] == "Squared?":
            return 400, {"error": {"message": "This model's maximum context length is 8 tokens"}}
        return 200, reply()

    with scripted_server(serving(chat_target_dir, chat=chat)) as (url, _):
        code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
    assert_one_line(code, err, "conversation 0, turn 2: HTTP 400 on /v1/chat/completions: This model's maximum "
                               "context length is 8 tokens")
    assert calls.count("Squared?") == 1
    assert nothing_written(tmp_path)


def test_the_key_comes_from_the_environment(chat_target_dir, tmp_path, capsys, monkeypatch):
    def chat(body, headers):
        if headers.get("Authorization") != "Bearer sk-local":
            return 401, {"error": {"message": "invalid api key"}}
        return 200, reply()

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with scripted_server(serving(chat_target_dir, chat=chat)) as (url, seen):
        code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
        assert_one_line(code, err, "HTTP 401 on /v1/chat/completions: invalid api key",
                        "the key is read from OPENAI_API_KEY or VLLM_API_KEY")
        assert seen[0][3]["authorization"] == "Bearer EMPTY"  # a placeholder servers without a key ignore
        for name in ("VLLM_API_KEY", "OPENAI_API_KEY"):  # vLLM's own variable, then the client's, which wins
            monkeypatch.setenv(name, "sk-local" if name == "OPENAI_API_KEY" else "sk-vllm")
            code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
            assert seen[-1][3]["authorization"] == f"Bearer sk-{'local' if name == 'OPENAI_API_KEY' else 'vllm'}"
        assert code == 0, err


# ---------------------------------------------------------------- answers that drip, answers too long, bad text

@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_server_that_drips_its_answer_meets_a_whole_answer_deadline(chat_target_dir, tmp_path, part):
    """A byte every 0.1 s keeps every socket read within its timeout; the whole answer must come
    within the timeout, at start-up and per request (it was per read: a drip was waited on forever)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_target_dir))
    sampling = ReplyDecoding(max_new_tokens=4, stop_ids=(0,))
    conversations = [[{"role": "user", "content": "Hi"}]]
    for models, chat, limits, path in (
            (Drip(part), lambda body, headers: (200, reply()), Limits(startup_timeout=0.5, startup_retries=0),
             "/v1/models"),
            (None, lambda body, headers: (200, reply()) if body["max_tokens"] == 1 else Drip(part),
             Limits(timeout=0.5, retries=0), "/v1/chat/completions")):
        with scripted_server(serving(chat_target_dir, chat=chat, models=models)) as (url, _):
            started = time.monotonic()
            with pytest.raises(DraftsmithError) as caught:
                regenerate_via_servers([url], str(chat_target_dir), tokenizer, conversations, tmp_path / "out.jsonl",
                                       sampling, limits=limits)
            elapsed = time.monotonic() - started
        assert f"no answer on {path} within 0.5 s (gave up after 1 tries)" in str(caught.value)
        assert elapsed < 4.0, elapsed
    assert nothing_written(tmp_path)


@pytest.mark.parametrize("answer, message", [
    (reply(content="x" * 200_000), "an answer of 200000 characters, more than 4 tokens can hold"),
    (reply(usage={"completion_tokens": 4000}), "counts 4000 completion tokens, more than the max_tokens 4 asked for"),
])
def test_an_answer_longer_than_asked_is_refused_before_it_is_tokenized(chat_target_dir, tmp_path, capsys, monkeypatch,
                                                                        answer, message):
    """A server that ignores max_tokens (it was tokenized whole: 64 MB to an 8-token request
    ended in a tokenizer panic); the tokenizer is never called on it."""
    from transformers import PreTrainedTokenizerBase

    def chat(body, headers):
        return (200, reply()) if body["max_tokens"] == 1 else (200, answer)

    with scripted_server(serving(chat_target_dir, chat=chat)) as (url, _):
        real_call = PreTrainedTokenizerBase.__call__

        def guarded(self, text, *args, **kwargs):
            assert len(text) < 10_000, "a too long answer reached the tokenizer"
            return real_call(self, text, *args, **kwargs)

        monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", guarded)
        code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
    assert_one_line(code, err, "conversation 0, turn 1", message, "the server does not keep to")
    assert nothing_written(tmp_path)


def test_lone_surrogates_in_answers_are_replaced_and_counted(chat_target_dir, tmp_path, capsys):
    """JSON may escape half a UTF-16 pair ("\\ud800"), which no tokenizer takes and no UTF-8 file
    can hold (it was a TypeError); it becomes U+FFFD, counted in one line."""
    def chat(body, headers):
        return (200, reply()) if body["max_tokens"] == 1 else (200, reply(content="Four\ud800."))

    with scripted_server(serving(chat_target_dir, chat=chat)) as (url, _):
        code, err = regenerate_cli(chat_target_dir, url, tmp_path, capsys)
    assert code == 0, err
    assert err == ["draftsmith: regenerate: replaced 3 lone UTF-16 surrogate(s) in the servers' answers with U+FFFD"]
    rows = [json.loads(line)["messages"] for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [m["content"] for row in rows for m in row if m["role"] == "assistant"] == ["Four\ufffd."] * 3
