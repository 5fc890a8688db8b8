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

The servers are reached through `Endpoint` (data/server_endpoint.py) and checked by
`ServerClient` (data/server_client.py).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.data.reply_decoding import ReplyDecoding, stop_token_ids, user_turns
from draftsmith.data.resume import partial_path, resuming
from draftsmith.data.server_client import ServerClient
from draftsmith.data.server_endpoint import Limits, server_root
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)


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
                           limits: Limits = Limits(), template_kwargs: dict | None = None) -> Path:  # noqa: B008 (a frozen dataclass)
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
