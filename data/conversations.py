"""Prompt and conversation files in the shapes people have, as OpenAI-style messages.

Accepted records (one per JSON Lines line, or a JSON array of them):

    {"turns": ["user text", "next user text"]}                     Spec-Bench, EAGLE, MT-Bench
    {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}      ShareGPT
    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}    OpenAI
    {"prompt": "user text"}

Every record becomes `[{"role": ..., "content": ...}, ...]`. `turns` hold only the user
side: the assistant replies are what the target generates when the conversation is run.

ShareGPT's speaker names are mapped as SpecForge maps them (human/user; gpt, chatgpt, bing,
bard, assistant; system). A record with a speaker that maps to none of these (a tool, a
narrator) is left out and counted in one line at the end: one odd row in a crawl of 100k
conversations is no reason to refuse the file. (SpecForge drops just the message; dropping
the record keeps the turns that remain answering each other.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

from draftsmith.errors import DraftsmithError

Conversation = list[dict[str, str]]

log = logging.getLogger(__name__)

SHAPES = ("turns", "conversations", "messages", "prompt")
# Role names as written in the file -> OpenAI roles.
_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "system": "system",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "assistant": "assistant",
}
_OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}


# Instructions about excerpts of the stdlib corpus, built at run time (nothing copied into the
# repository): what an instruct target answers in the embedded default's real-target recipes.
STDLIB_INSTRUCTIONS = "stdlib-instructions"
_INSTRUCTIONS = (
    "Explain what the following excerpt from Python's standard library does.\n\n```\n{}\n```",
    "Write a short summary of the following Python code, then list the names it defines.\n\n```\n{}\n```",
    "What would you change to make the following code easier to read? Show the changed code.\n\n```\n{}\n```",
    "Write a unit test for the following code.\n\n```\n{}\n```",
)


def instruction_conversations(count: int, max_chars: int = 384, split: str = "train") -> list[Conversation]:
    """`count` single-turn instructions, each asking one of `_INSTRUCTIONS` about an excerpt of
    the embedded corpus's `split` (train for training, test for eval: disjoint modules)."""
    from draftsmith.data.corpus import corpus_prompts

    excerpts = corpus_prompts(count, max_chars, split)
    return [[{"role": "user", "content": _INSTRUCTIONS[i % len(_INSTRUCTIONS)].format(text.strip("\n"))}]
            for i, text in enumerate(excerpts)]


def load_conversations(path: str | Path, limit: int | None = None, config: str = "", split: str = "",
                       columns: dict[str, str] | None = None) -> list[Conversation]:
    """The first `limit` records of `path` (all when None) as lists of messages.

    `path` is a local file, or a local dataset folder or hub dataset name read through
    `datasets` (its `config` and `split`, default "train"), or `stdlib-instructions` (built
    from the embedded corpus's `split`). `columns` maps shapes to the
    dataset's own column names ({"messages": "chosen"}): the column is read as that shape.
    """
    if limit is not None and limit < 1:
        raise DraftsmithError(f"{path}: limit must be at least 1, got {limit}")
    if str(path) == STDLIB_INSTRUCTIONS:
        return instruction_conversations(limit or 256, split=split or "train")
    if is_dataset(path):
        records = _read_dataset(str(path), config, split or "train", limit)
    else:
        path = Path(path)
        if not path.is_file():
            raise DraftsmithError(f"{path}: conversation file not found")
        records = _read_with_datasets(path)
        if records is None:
            records = _read_plain(path)
    if limit is not None:
        records = records[:limit]
    if not records:
        raise DraftsmithError(f"{path}: no records")
    if not columns:
        return _all_messages(records, path)
    records = _map_columns(records, columns, path)
    try:
        return _all_messages(records, path)
    except DraftsmithError as exc:  # say which mapping the rows do not fit
        mapping = ", ".join(f"{shape}: {column}" for shape, column in columns.items())
        raise DraftsmithError(f"{exc} (data.columns {{{mapping}}})") from None


class _UnknownRole(Exception):
    def __init__(self, role):
        super().__init__(role)
        self.role = role


# A lone UTF-16 surrogate: what a JSON "\ud800" escape decodes to (a pair decodes to one
# character). No tokenizer takes it and no UTF-8 file can hold it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> tuple[str, int]:
    """`text` with every lone surrogate replaced by U+FFFD, and how many there were: text from
    a file or a server is normalised so before any tokenizer sees it."""
    return _SURROGATE.subn("\ufffd", text)


def _clean(conversations: list[Conversation], path) -> None:
    """Replace lone surrogates in place; counted in one line on stderr."""
    count, first = 0, None
    for index, messages in enumerate(conversations):
        for message in messages:
            message["content"], n = replace_surrogates(message["content"])
            if n and first is None:
                first = index
            count += n
    if count:
        log.warning("draftsmith: %s: replaced %d lone UTF-16 surrogate(s) (invalid text, first in conversation %d) "
                    "with U+FFFD", path, count, first)


def _all_messages(records: list[dict], path) -> list[Conversation]:
    """Every record as messages, lone surrogates replaced (`_clean`); records with a role that
    maps to none are left out and counted in one line on stderr (all of them left out: an error)."""
    conversations, skipped = [], {}
    for index, record in enumerate(records):
        try:
            conversations.append(_to_messages(record, path, index))
        except _UnknownRole as exc:
            skipped.setdefault(repr(exc.role), index)
    _clean(conversations, path)
    if skipped:
        n = len(records) - len(conversations)
        roles = ", ".join(f"{role} (first in record {index})" for role, index in skipped.items())
        if not conversations:
            raise DraftsmithError(f"{path}: every record has a role that maps to none of user, assistant, system: "
                                  f"{roles}")
        log.warning("draftsmith: %s: skipped %d of %d records with a role that maps to none of user, assistant, "
                    "system: %s", path, n, len(records), roles)
    return conversations


def is_dataset(path: str | Path) -> bool:
    """A folder, or a name that is no local path (`HuggingFaceH4/ultrachat_200k`): a dataset."""
    local = Path(path).expanduser()
    if local.is_dir():
        return True
    text = str(path)
    # Hub names may hold dots (`org/chats-v1.5`); a data file's suffix says it is a file.
    file_like = local.suffix.lower() in (".json", ".jsonl", ".parquet", ".csv", ".txt", ".text", ".md")
    return not (local.exists() or file_like or text.startswith((".", "/", "~")))


def _read_dataset(spec: str, config: str, split: str, limit: int | None) -> list[dict]:
    import datasets

    from draftsmith.data.corpus import load_dataset_spec

    with _quiet(datasets):
        table = load_dataset_spec(spec, split, name=config or None)
        if limit is not None:
            table = table.select(range(min(limit, len(table))))
        return table.to_list()


def _map_columns(records: list[dict], columns: dict[str, str], path) -> list[dict]:
    """Each record as {shape: its mapped column}; a mapping that misses the rows is named."""
    unknown = sorted(set(columns) - set(SHAPES))
    if unknown:
        raise DraftsmithError(f"data.columns: unknown shape {unknown[0]!r} (shapes: {', '.join(SHAPES)})")
    present = set().union(*(record.keys() for record in records))
    for shape, column in columns.items():
        if column not in present:
            raise DraftsmithError(f"data.columns: {path} has no column {column!r} for {shape} "
                                  f"(columns: {', '.join(sorted(present))})")
    return [{shape: record.get(column) for shape, column in columns.items()} for record in records]


def first_user_prompts(conversations: list[Conversation]) -> list[str]:
    """The opening user message of each conversation: the prompt of a single-turn run."""
    prompts = []
    for index, messages in enumerate(conversations):
        text = next((m["content"] for m in messages if m["role"] == "user"), None)
        if text is None:
            raise DraftsmithError(f"conversation {index} has no user message")
        prompts.append(text)
    return prompts


def _read_with_datasets(path: Path) -> list[dict] | None:
    """Records through the `datasets` json loader and its cache; None when it cannot
    read the file, so that the plain reader can report what is wrong in one line."""
    import datasets

    with _quiet(datasets):
        try:
            table = datasets.load_dataset("json", data_files=str(path), split="train")
        # datasets surfaces arrow, pandas and generator errors (even StopIteration on an
        # empty file) for input it cannot put in one table; the plain reader decides
        # what they mean.
        except Exception:
            return None
    if _has_json_feature(table.features):
        return None
    try:
        return table.to_list()
    except UnicodeDecodeError:  # arrow keeps invalid UTF-8 until read: the plain reader names it
        return None


def _has_json_feature(feature) -> bool:
    """Whether datasets stored a mixed-type field as `Json`, whose decoding turns text
    that parses as JSON into other values (message content "4" comes back as the int 4)."""
    if isinstance(feature, dict):
        return any(_has_json_feature(inner) for inner in feature.values())
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    if inner is not None:
        return _has_json_feature(inner)
    return type(feature).__name__ == "Json"  # by name: older datasets have no Json type


@contextlib.contextmanager
def _quiet(datasets):
    """No progress bars or info logs for a file of prompts; the caller's settings after."""
    bars_were_off = datasets.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _read_plain(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DraftsmithError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"{path}: invalid JSON: {exc}") from None
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DraftsmithError(f"{path}:{number}: invalid JSON: {exc.msg}") from None
    if not all(isinstance(record, dict) for record in records):
        raise DraftsmithError(f"{path}: expected JSON objects, one per record")
    return records


def _to_messages(record: dict, path: Path, index: int) -> Conversation:
    where = f"{path}: record {index}"
    # A table loaded by `datasets` has every column in every row, None where absent.
    shape = next((key for key in SHAPES if record.get(key) is not None), None)
    if shape is None:
        seen = ", ".join(sorted(k for k, v in record.items() if v is not None)) or "none"
        raise DraftsmithError(f"{where}: unknown shape, keys {seen}; expected one of {', '.join(SHAPES)}")
    value = record[shape]
    if shape == "prompt":
        messages = [{"role": "user", "content": _text(value, where)}]
    elif shape == "turns":
        if not isinstance(value, list):
            raise DraftsmithError(f"{where}: turns must be a list of user messages")
        messages = [{"role": "user", "content": _text(turn, where)} for turn in value]
    elif shape == "conversations":
        messages = [_message(m, "from", "value", _SHAREGPT_ROLES, where) for m in _list(value, where)]
    else:
        messages = [_message(m, "role", "content", _OPENAI_ROLES, where) for m in _list(value, where)]
    if not messages:
        raise DraftsmithError(f"{where}: {shape} is empty")
    return messages


def _list(value, where: str) -> list:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DraftsmithError(f"{where}: expected a list of message objects")
    return value


def _message(message: dict, role_key: str, text_key: str, roles: dict, where: str) -> dict:
    role = message.get(role_key)
    if role not in roles:
        raise _UnknownRole(role)
    return {"role": roles[role], "content": _text(message.get(text_key), where)}


def _text(value, where: str) -> str:
    # OpenAI content may be a list of parts; the text parts are the message.
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(part.get("text") or "" for part in value)
    if not isinstance(value, str):
        raise DraftsmithError(f"{where}: message content must be text, got {type(value).__name__}")
    return value
