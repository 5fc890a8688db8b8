"""The rows a drafter trained post hoc (EAGLE-3, DFlash, DSpark) learns from: the training
conversations, answered by the target when the recipe asks (cached under a key of the target
and the answer settings), rendered with the recipe's chat template, tokenized and split into
training and held-out rows; and the settings those rows depend on, which a feature cache records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from draftsmith.data.feature_cache import target_fingerprint
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file, output_lock
from draftsmith.recipe import Recipe

EVAL_FRACTION = 0.05
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where derived data is kept between runs: $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith")


def conversations_file(recipe: Recipe, target, tokenizer, target_dir: Path | str | None) -> tuple[Path | str, bool]:
    """The training conversations, answered by the target (at `target_dir`, its target.path
    resolved) when asked (always for the embedded default, whose prompts have no answers).
    Returns (source, untemplated)."""
    from accelerate import PartialState

    from draftsmith.data.conversations import STDLIB_INSTRUCTIONS
    from draftsmith.data.regenerate import embedded_conversations, regeneration, run_regeneration

    data = recipe.data
    embedded = data.dataset == "embedded"
    if data.dataset == STDLIB_INSTRUCTIONS and not data.regenerate:
        raise DraftsmithError(f"data.dataset {STDLIB_INSTRUCTIONS} holds prompts only: the target answers them "
                              "(data.regenerate must be true)")
    out = answers_file(recipe, target_dir)
    if out is None:
        return _dataset_file(recipe), False
    conversations = lambda: (embedded_conversations(data.num_conversations, data.prompt_chars)  # noqa: E731
                             if embedded else _load_dataset(data))
    settings = regeneration(data, recipe.train.seed)
    # Servers: the main process asks them, the others read its file. In process: every process
    # answers its share and the main one merges them (draftsmith/processes.py); all test the
    # file before any can write it, since the merge waits for every process.
    with PartialState().main_process_first() if settings.servers else contextlib.nullcontext():
        if not out.is_file():
            # One writer per cache file: two runs answering into it at once would double its answers.
            with output_lock(out, "the regenerated answers"):
                if not out.is_file():
                    started = time.monotonic()
                    run_regeneration(settings, target_dir, tokenizer, conversations, out, untemplated=embedded,
                                     names=(recipe.target.path,), model=target)
                    log.info("the target's answers written in %.1f s (%s)", time.monotonic() - started,
                             ", ".join(settings.servers) or "in-process")
    return out, embedded


def answers_file(recipe: Recipe, target_dir: Path | str | None) -> Path | None:
    """Where the target's answers to the recipe's conversations are cached (None: the recipe
    trains on its dataset's own answers). Answers depend only on the target and these
    settings, so every drafter trained against the same target shares them: the key is of
    both, not of who answered (this process or a server)."""
    data = recipe.data
    if data.dataset != "embedded" and not data.regenerate:
        return None
    identity = json.dumps([answer_settings(recipe), target_fingerprint(target_dir)], sort_keys=True)
    return cache_dir() / "regenerated" / f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}.jsonl"


def chat_settings(recipe: Recipe, tokenizer) -> tuple[str | None, dict]:
    """The chat template (text; None: plain text, the embedded default) and its arguments
    (`enable_thinking`) that regeneration and training rows of this recipe render with."""
    from draftsmith.data.chat import chat_format

    data = recipe.data
    return chat_format(tokenizer, data.chat_template, data.enable_thinking, untemplated=data.dataset == "embedded")


def _chat_keys(data) -> dict:
    """The chat settings where set (unset: keys of older caches hold)."""
    given = {"data.chat_template": data.chat_template, "data.enable_thinking": data.enable_thinking}
    return {k: v for k, v in given.items() if v not in ("", None)}


def _dataset_settings(data) -> dict:
    """How a dataset folder or hub dataset is read, where set (unset: keys of older caches hold)."""
    given = {"data.dataset_config": data.dataset_config, "data.dataset_split": data.dataset_split,
             "data.columns": data.columns}
    return {k: v for k, v in given.items() if v and not (k == "data.dataset_split" and v == "train")}


def _load_dataset(data):
    from draftsmith.data.conversations import STDLIB_INSTRUCTIONS, instruction_conversations, load_conversations

    if data.dataset == STDLIB_INSTRUCTIONS:
        return instruction_conversations(data.num_conversations, data.prompt_chars)
    return load_conversations(data.dataset, config=data.dataset_config, split=data.dataset_split,
                              columns=data.columns)


def _dataset_file(recipe: Recipe) -> Path | str:
    """The conversations as a file the row tokenizer reads: the dataset file itself, or, for a
    dataset folder, a hub dataset or a column mapping, its records written once as messages."""
    from accelerate import PartialState

    from draftsmith.data.conversations import is_dataset

    data = recipe.data
    settings = _dataset_settings(data)
    if not (settings or is_dataset(data.dataset)):
        return data.dataset
    key = hashlib.sha256(json.dumps([data.dataset, settings], sort_keys=True).encode()).hexdigest()
    out = cache_dir() / "conversations" / f"{key[:16]}.jsonl"
    with PartialState().main_process_first():
        if not out.is_file():
            records = _load_dataset(data)
            with atomic_file(out) as handle:
                handle.writelines(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in records)
    return out


def num_proc(processes: int) -> int | None:
    """`datasets.map`'s num_proc for data.num_proc: None (this process) for 1."""
    return processes if processes > 1 else None


def training_rows(recipe: Recipe, target, tokenizer, target_dir: Path | str | None):
    """The rendered rows of a post-hoc run, split (train, eval), and where they came from:
    the one definition an online run and a feature cache of it share."""
    from accelerate import PartialState

    from draftsmith.data.chat import tokenize_conversations

    source, untemplated = conversations_file(recipe, target, tokenizer, target_dir)
    template, template_kwargs = chat_settings(recipe, tokenizer)
    # The main process tokenizes first, in data.num_proc processes; the others read what
    # `datasets` cached of it (a file-backed source) instead of all tokenizing at once.
    with PartialState().main_process_first():
        rows = tokenize_conversations(source, tokenizer, recipe.train.seq_len, untemplated=untemplated, chat_template=template,
                                      template_kwargs=template_kwargs, num_proc=num_proc(recipe.data.num_proc))
    n_eval = max(1, round(EVAL_FRACTION * len(rows)))
    if len(rows) < 2:
        raise DraftsmithError(f"data.dataset {recipe.data.dataset!r}: {len(rows)} usable conversation(s); "
                              "need at least 2 (one held out for evaluation)")
    split = rows.train_test_split(test_size=n_eval, seed=recipe.train.seed, shuffle=True)
    return split["train"].with_format("torch"), split["test"].with_format("torch"), source


def answer_settings(recipe: Recipe) -> dict:
    """The recipe values the target's answers depend on, besides the target itself."""
    d = recipe.data
    return {"data.dataset": d.dataset, "data.num_conversations": d.num_conversations,
            "data.prompt_chars": d.prompt_chars, "data.regen_max_new_tokens": d.regen_max_new_tokens,
            "data.regen_temperature": d.regen_temperature, "data.regen_top_p": d.regen_top_p,
            "data.regen_top_k": d.regen_top_k, "train.seed": recipe.train.seed, **_dataset_settings(d),
            **_chat_keys(d)}


def rows_settings(recipe: Recipe) -> dict:
    """The recipe values `training_rows` depends on, besides the target: a feature cache
    records them, and a run reading the cache must have the same."""
    return {**answer_settings(recipe), "data.regenerate": recipe.data.regenerate,
            "train.seq_len": recipe.train.seq_len}
