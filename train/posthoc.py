"""Shared ground of the drafters trained post hoc against a frozen target (EAGLE-3,
DFlash, DSpark): the target itself, and the target's own answers as training data.

The target is loaded frozen, kept outside the trainable module, and run under no_grad to
capture the features a drafter reads; it never reaches the optimizer or a training wrapper.
With `data.feature_cache=DIR` those features come from a cache that `cache_hidden` wrote
(`draftsmith data cache-hidden`) instead, and only the target's embedding and head are loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from draftsmith.data.feature_cache import (
    ROW_KEYS,
    FeatureCache,
    check_sizes,
    load_target_ends,
    target_fingerprint,
    write_feature_cache,
)
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file, check_not_an_input
from draftsmith.models.target import TargetOutput, find_model_dir, load_target, target_forward
from draftsmith.recipe import Recipe
from draftsmith.registry import posthoc
from draftsmith.train.method import TrainMethod, build_method

EVAL_FRACTION = 0.05


def cache_dir() -> Path:
    """Where derived data is kept between runs: $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith")


def conversations_file(recipe: Recipe, target, tokenizer) -> tuple[Path | str, bool]:
    """The training conversations, answered by the target when asked (always for the
    embedded default, whose prompts have no answers). Returns (source, plain_text)."""
    from accelerate import PartialState

    from draftsmith.data.conversations import STDLIB_INSTRUCTIONS
    from draftsmith.data.regenerate import embedded_conversations, regenerate
    from draftsmith.processes import current_processes

    data = recipe.data
    embedded = data.dataset == "embedded"
    if data.dataset == STDLIB_INSTRUCTIONS and not data.regenerate:
        raise DraftsmithError(f"data.dataset {STDLIB_INSTRUCTIONS} holds prompts only: the target answers them "
                              "(data.regenerate must be true)")
    if not embedded and not data.regenerate:
        return _dataset_file(recipe), False
    # Answers depend only on the target and these settings, so every drafter trained
    # against the same target shares them: they are cached under a key of both.
    target_dir = find_model_dir(recipe.target.path)
    settings = json.dumps([answer_settings(recipe), target_fingerprint(target_dir)], sort_keys=True)
    key = hashlib.sha256(settings.encode()).hexdigest()[:16]
    out = cache_dir() / "regenerated" / f"{key}.jsonl"
    conversations = lambda: (embedded_conversations(data.num_conversations, data.prompt_chars)  # noqa: E731
                             if embedded else _load_dataset(data))
    template, template_kwargs = chat_settings(recipe, tokenizer)
    if data.regen_servers:
        from draftsmith.data.regen_server import Limits, regenerate_via_servers, sampling_for

        with PartialState().main_process_first():  # the main process asks the servers; the others read its file
            if not out.is_file():
                sampling = sampling_for(target_dir, tokenizer, embedded, data.regen_max_new_tokens,
                                        data.regen_temperature, data.regen_top_p, data.regen_top_k, recipe.train.seed,
                                        template, template_kwargs)
                regenerate_via_servers(data.regen_servers, (recipe.target.path, str(target_dir)), tokenizer,
                                       conversations(), out, sampling, plain=embedded,
                                       limits=Limits(in_flight=data.regen_in_flight), template_kwargs=template_kwargs)
        return out, embedded
    # Every process answers its share of the batches; the main one merges them (draftsmith/processes.py).
    # All test the file before any can write it: the merge waits for every process.
    if not out.is_file():
        regenerate(target, tokenizer, conversations(), out, max_new_tokens=data.regen_max_new_tokens,
                   temperature=data.regen_temperature, top_p=data.regen_top_p, top_k=data.regen_top_k,
                   seed=recipe.train.seed, plain=embedded, processes=current_processes(), chat_template=template,
                   enable_thinking=template_kwargs.get("enable_thinking"))
    return out, embedded


def chat_settings(recipe: Recipe, tokenizer) -> tuple[str | None, dict]:
    """The chat template (text; None: plain text, the embedded default) and its arguments
    (`enable_thinking`) that regeneration and training rows of this recipe render with."""
    from draftsmith.data.chat import chat_format

    data = recipe.data
    return chat_format(tokenizer, data.chat_template, data.enable_thinking, plain=data.dataset == "embedded")


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


class LossForward(nn.Module):
    """Routes `forward` to the drafter's `loss`, so that the DDP/FSDP/DeepSpeed wrapper
    accelerate puts around the trainable module runs its hooks on the loss computation."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args, **kwargs):
        return self.drafter.loss(*args, **kwargs)


def num_proc(processes: int) -> int | None:
    """`datasets.map`'s num_proc for data.num_proc: None (this process) for 1."""
    return processes if processes > 1 else None


def training_rows(recipe: Recipe, target, tokenizer):
    """The rendered rows of a post-hoc run, split (train, eval), and where they came from:
    the one definition an online run and a feature cache of it share."""
    from accelerate import PartialState

    from draftsmith.data.chat import tokenize_conversations

    source, plain = conversations_file(recipe, target, tokenizer)
    template, template_kwargs = chat_settings(recipe, tokenizer)
    # The main process tokenizes first, in data.num_proc processes; the others read what
    # `datasets` cached of it (a file-backed source) instead of all tokenizing at once.
    with PartialState().main_process_first():
        rows = tokenize_conversations(source, tokenizer, recipe.train.seq_len, plain=plain, chat_template=template,
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


class PostHocMethod(TrainMethod):
    """Loads the frozen target and its tokenizer, and the rendered training rows (or, from a
    feature cache, the rows and their features, and the target's embedding and head only).

    A subclass sets `layer_ids`, says in `extract` what its loss reads of a target forward,
    reads it back through `features`, and calls `check_cache` once its layer ids are known."""

    layer_ids: list[int]

    def __init__(self, recipe: Recipe, device: torch.device):
        super().__init__(recipe, device)
        from draftsmith.data.tokenizer import check_fits, load_pretrained_tokenizer
        from draftsmith.models.tile import read_target_config

        if not recipe.target.path:
            raise DraftsmithError(f"method {recipe.method.name} trains against a frozen target: set target.path=")
        self.target_dir = find_model_dir(recipe.target.path)
        self.tokenizer = load_pretrained_tokenizer(self.target_dir)
        check_fits(self.tokenizer, read_target_config(self.target_dir).get("vocab_size"), self.target_dir,
                   recipe.target.path)
        # A bad template or thinking switch is one line before any data is written; the
        # thinking mode decided (unset: off where the template has the switch) is what the
        # run's recipe.yaml records.
        _, template_kwargs = chat_settings(recipe, self.tokenizer)
        if "enable_thinking" in template_kwargs:
            recipe.data.enable_thinking = template_kwargs["enable_thinking"]
        self.cache = FeatureCache(recipe.data.feature_cache) if recipe.data.feature_cache else None
        if self.cache is not None:
            self.cache.expect_target(self.target_dir)
            self.cache.expect(rows_settings(recipe), section="rows")
            self.target = load_target_ends(self.target_dir, dtype=recipe.target.dtype, device=device)
            n_train = self.cache.manifest["splits"]["train"]
            self.train_data = self.cache.rows(0, n_train)
            self.eval_data = self.cache.rows(n_train, self.cache.manifest["num_rows"])
        else:
            self.target = load_target(self.target_dir, dtype=recipe.target.dtype, device=device,
                                      attn_implementation=recipe.target.attn_implementation)
            self.train_data, self.eval_data, self.rows_source = training_rows(recipe, self.target, self.tokenizer)

    def train_tokens(self) -> dict[str, torch.Tensor]:
        """The training rows' token columns [N, T] without features (for a draft vocabulary)."""
        return self.tokens_of(self.train_data)

    def tokens_of(self, data) -> dict[str, torch.Tensor]:
        """The token columns of the training or the held-out rows, cached or not."""
        return data.tokens if self.cache is not None else data[:]

    def extract(self, out: TargetOutput) -> dict[str, torch.Tensor]:
        """What the loss reads of one target forward ([B, T, ...] each); a cache stores exactly this."""
        raise NotImplementedError

    def feature_spec(self) -> dict:
        """What, besides the target and the rows, decides `extract`'s output."""
        return {"method": self.recipe.method.name, "layer_ids": list(self.layer_ids)}

    def check_cache(self) -> None:
        """Refuse a feature cache that holds other features than this run's loss reads."""
        if self.cache is not None:
            self.cache.expect(self.feature_spec())

    def features(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`extract` of the frozen target's forward over the batch, or its cached copy."""
        if self.cache is not None:
            return {k: batch[k] for k in self.cache.manifest["tensors"]}
        # A packed batch goes in by its positions alone: transformers then masks each conversation
        # off from the others (packed-sequence masks on every attention backend; data/packing.py).
        packed = batch.get("position_ids")
        with torch.no_grad():
            out = target_forward(self.target, batch["input_ids"], position_ids=packed, capture=self.layer_ids,
                                 attention_mask=batch["attention_mask"] if packed is None else None)
            return self.extract(out)

    def tokens_in(self, batch) -> int:
        return int(batch["attention_mask"].sum())


def cache_hidden(recipe: Recipe, out: str | Path, batch_size: int = 8, shard_rows: int = 0) -> Path:
    """Run the target once over the rows `recipe` trains on and store what its method's loss
    reads of them (`draftsmith data cache-hidden`); resumable. Builds the method itself, so
    the rows, split, layer ids and draft vocabulary are the training run's own."""
    if recipe.method.name not in posthoc():
        raise DraftsmithError(f"method.name {recipe.method.name!r}: only {', '.join(posthoc())} "
                              "read target features")
    from draftsmith.processes import current_processes

    check_sizes(batch_size, shard_rows)  # before the target is loaded or any data regenerated
    check_not_an_input(out, {"--target": find_model_dir(recipe.target.path) if recipe.target.path else None,
                             "--dataset": recipe.data.dataset}, folder=True)
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, feature_cache=""))
    # Under `accelerate launch` every process computes its share of the shards on its own device.
    processes = current_processes()
    device = torch.device(processes.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    method = build_method(recipe, device)
    train_rows, eval_rows = method.train_data[:], method.eval_data[:]
    tokens = {k: torch.cat([train_rows[k], eval_rows[k]]) for k in ROW_KEYS}
    identity = {
        "target": {"path": str(method.target_dir), "fingerprint": target_fingerprint(method.target_dir)},
        **method.feature_spec(),
        "rows": rows_settings(recipe),
        "source": str(method.rows_source),
        "splits": {"train": len(method.train_data), "eval": len(method.eval_data)},
    }
    return write_feature_cache(out, identity, tokens, lambda batch: method.features(
        {k: v.to(device) for k, v in batch.items()}), batch_size=batch_size, shard_rows=shard_rows,
        processes=processes)
