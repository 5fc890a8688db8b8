"""Shared ground of the drafters trained post hoc against a frozen target (EAGLE-3,
DFlash, DSpark): the target itself, and the rows data/posthoc_rows.py prepares from its answers.

The target is loaded frozen, kept outside the trainable module, and run under no_grad to
capture the features a drafter reads; it never reaches the optimizer or a training wrapper.
With `data.feature_cache=DIR` those features come from a cache that `cache_hidden` wrote
(`draftsmith data cache-hidden`) instead, and only the target's embedding and head are loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
from torch import nn

from draftsmith.data.engine_capture import IN_PROCESS, EngineCapture
from draftsmith.data.feature_cache import (
    ROW_KEYS,
    FeatureCache,
    check_sizes,
    load_target_ends,
    target_fingerprint,
    write_feature_cache,
)
from draftsmith.data.posthoc_rows import chat_settings, rows_settings, training_rows
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import check_not_an_input
from draftsmith.models.model_dir import target_folder
from draftsmith.models.native import save_drafter
from draftsmith.models.target import TargetOutput, load_target, target_forward
from draftsmith.recipe import Recipe
from draftsmith.registry import posthoc
from draftsmith.train.method import TrainMethod

log = logging.getLogger(__name__)


class LossForward(nn.Module):
    """Routes `forward` to the drafter's `loss`, so that the DDP/FSDP/DeepSpeed wrapper
    accelerate puts around the trainable module runs its hooks on the loss computation."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args, **kwargs):
        return self.drafter.loss(*args, **kwargs)


class PostHocMethod(TrainMethod):
    """Loads the frozen target and its tokenizer, and the rendered training rows (or, from a
    feature cache, the rows and their features, and the target's embedding and head only);
    then the drafter (`build_drafter`), trained in float32 through its `loss`.

    A subclass builds its drafter, whose config names the `target_layer_ids` it reads, says in
    `extract` what its loss reads of a target forward, and reads it back through `features`."""

    layer_ids: list[int]

    def __init__(self, recipe: Recipe, device: torch.device, target: nn.Module | None = None,
                 target_dir: Path | str | None = None):
        """`target`: the frozen target already loaded (by another method of one feature cache)."""
        super().__init__(recipe, device, target_dir)
        from draftsmith.data.tokenizer import check_fits, load_pretrained_tokenizer
        from draftsmith.models.tile import read_target_config

        if not recipe.target.path:
            raise DraftsmithError(f"method {recipe.method.name} trains against a frozen target: set target.path=")
        self.tokenizer = load_pretrained_tokenizer(self.target_dir)
        check_fits(self.tokenizer, read_target_config(self.target_dir).get("vocab_size"), self.target_dir,
                   recipe.target.path)
        # A bad template or thinking switch is one line before any data is written. The thinking
        # mode decided (unset: off where the template has the switch) keys the rows' caches as
        # if the recipe had set it, and the run's recipe.yaml records it (self.recipe, a copy:
        # the caller's recipe is left as it was).
        _, template_kwargs = chat_settings(recipe, self.tokenizer)
        if "enable_thinking" in template_kwargs:
            recipe = dataclasses.replace(recipe, data=dataclasses.replace(
                recipe.data, enable_thinking=template_kwargs["enable_thinking"]))
        self.recipe = recipe
        self.load_rows(device, target)
        drafter = self.build_drafter()
        self.layer_ids = list(drafter.config.target_layer_ids)
        drafter.gradient_checkpointing = recipe.train.gradient_checkpointing
        self.model = LossForward(drafter.to(device=device, dtype=torch.float32))
        self.check_cache()

    def load_rows(self, device: torch.device, target: nn.Module | None = None) -> None:
        """The target and the rows: from a feature cache, the rows it holds and the target's ends
        alone; else the whole target (`target` where given), and the rows rendered from its
        answers (data/posthoc_rows.py)."""
        recipe = self.recipe
        self.feature_cache = FeatureCache(recipe.data.feature_cache) if recipe.data.feature_cache else None
        if self.feature_cache is not None:
            self.train_data, self.validation_data = cached_rows(self.feature_cache, recipe, self.target_dir)
            self.target = load_target_ends(self.target_dir, dtype=recipe.target.dtype, device=device)
        else:
            if target is None:
                target = load_target(self.target_dir, dtype=recipe.target.dtype, device=device,
                                     attn_implementation=recipe.target.attn_implementation)
            self.target = target
            self.train_data, self.validation_data, self.rows_source = training_rows(recipe, self.target, self.tokenizer,
                                                                                      self.target_dir)

    def train_tokens(self) -> dict[str, torch.Tensor]:
        """The training rows' token columns [N, T] without features (for a draft vocabulary)."""
        return self.tokens_of(self.train_data)

    def tokens_of(self, data) -> dict[str, torch.Tensor]:
        """The token columns of the training or the held-out rows, cached or not."""
        return data.tokens if self.feature_cache is not None else data[:]

    def extract(self, out: TargetOutput) -> dict[str, torch.Tensor]:
        """What the loss reads of one target forward ([B, T, ...] each); a cache stores exactly this."""
        raise NotImplementedError

    def feature_identity(self) -> dict:
        """What, besides the target and the rows, decides `extract`'s output."""
        return {"method": self.recipe.method.name, "layer_ids": list(self.layer_ids)}

    def check_cache(self) -> None:
        """Refuse a feature cache that holds other features than this run's loss reads."""
        if self.feature_cache is not None:
            self.feature_cache.expect_method(self.feature_identity())

    def features(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`extract` of the frozen target's forward over the batch, or its cached copy."""
        if self.feature_cache is not None:
            return {k: batch[k] for k in self.train_data.stored}
        return self.extract(frozen_forward(self.target, batch, self.layer_ids))

    def save(self, model, out_dir: Path) -> Path:
        """The drafter in the native format, naming the target it was trained against."""
        return save_drafter(model.drafter, out_dir / "model", extra={"target": str(self.target_dir)})


def cached_rows(feature_cache: FeatureCache, recipe: Recipe, target_dir: Path):
    """The training and held-out rows of a feature cache of `recipe`'s rows over the target in
    `target_dir`, each with the features stored for the recipe's method (none for a method
    that reads only the rows, as the draft model does)."""
    feature_cache.expect_target(target_dir)
    feature_cache.expect(rows_settings(recipe), section="rows")
    n_train, name = feature_cache.manifest["splits"]["train"], recipe.method.name
    return feature_cache.rows(0, n_train, name), feature_cache.rows(n_train, feature_cache.manifest["num_rows"], name)


def frozen_forward(target: nn.Module, batch: dict[str, torch.Tensor], layer_ids) -> TargetOutput:
    """The frozen target's forward over a batch of rows, capturing `layer_ids`."""
    # A packed batch goes in by its positions alone: transformers then masks each conversation
    # off from the others (packed-sequence masks on every attention backend; data/packing.py).
    packed = batch.get("position_ids")
    with torch.no_grad():
        return target_forward(target, batch["input_ids"], position_ids=packed, capture=layer_ids,
                              attention_mask=batch["attention_mask"] if packed is None else None)


def _check_cacheable(recipes: list[Recipe]) -> None:
    """One post-hoc method per recipe, each named once (a cache keys its features by the name)."""
    names = [r.method.name for r in recipes]
    for recipe in recipes:
        if not recipe.method.spec.reads_target_features:
            raise DraftsmithError(f"method.name {recipe.method.name!r}: only {', '.join(posthoc())} "
                                  "read target features")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DraftsmithError(f"cache-hidden: method {twice[0]} named by two recipes (a cache holds one set of "
                              "features per method; its other runs read the same)")


def _rows_and_target(recipe: Recipe, target_dir: Path | str | None, decided: bool) -> dict:
    """What a cache's rows and features depend on: the rows' settings and the target as
    loaded. Before the methods are built (`decided` False), without the keys a method decides
    when they are unset (data.enable_thinking)."""
    rows = rows_settings(recipe)
    if not decided:
        rows.pop("data.enable_thinking", None)
    t = recipe.target
    return {**rows, "target.path": str(target_dir) if t.path else "", "target.dtype": t.dtype,
            "target.attn_implementation": t.attn_implementation}


def _check_same_rows(recipes: list[Recipe], target_dirs: list, decided: bool = False) -> None:
    """Every recipe trains on the same rows of the same target (`target_dirs`, the recipes'
    folders): one cache holds one set of rows, computed by one target."""
    first = _rows_and_target(recipes[0], target_dirs[0], decided)
    for recipe, target_dir in zip(recipes[1:], target_dirs[1:]):
        other = _rows_and_target(recipe, target_dir, decided)
        differs = [k for k in {**first, **other} if first.get(k) != other.get(k)]
        if differs:
            raise DraftsmithError(f"cache-hidden: the {recipes[0].method.name} and {recipe.method.name} recipes "
                                  f"train on other rows ({differs[0]}: {first.get(differs[0])!r} and "
                                  f"{other.get(differs[0])!r}); one cache holds one set of rows")


def _build_methods(recipes: list[Recipe], target_dirs: list, device: torch.device,
                   engine_dir: Path | None) -> list[PostHocMethod]:
    """Each recipe's method, online, over one target loaded once. `engine_dir`: the target's
    answers, where they are still to be written, come from a vLLM server of it."""
    first = recipes[0]
    target = load_target(target_dirs[0], dtype=first.target.dtype, device=device,
                         attn_implementation=first.target.attn_implementation)
    answering = contextlib.nullcontext(recipes)
    if engine_dir is not None:
        from draftsmith.data.engine_answers import engine_answers

        dtype = str(next(target.parameters()).dtype).removeprefix("torch.")  # the engine serves it as loaded
        answering = engine_answers(recipes, target_dirs[0], dtype, target.config.max_position_embeddings, engine_dir)
    methods = []
    with answering as answered:
        for recipe, target_dir in zip(answered, target_dirs):
            online = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, feature_cache=""))
            methods.append(recipe.method.spec.load("training")(online, device, target=target, target_dir=target_dir))
    return methods


def _all_rows(method: PostHocMethod) -> dict[str, torch.Tensor]:
    """A method's training rows, then its held-out ones: {ROW_KEYS: [N, T]} (each split read once)."""
    train_rows, validation_rows = method.train_data[:], method.validation_data[:]
    return {k: torch.cat([train_rows[k], validation_rows[k]]) for k in ROW_KEYS}


def cache_hidden(recipes: list[Recipe], out: str | Path, batch_size: int = 8, shard_rows: int = 0,
                 engine: str = "") -> Path:
    """Run the target once over the rows the recipes train on and store what each one's method
    reads of them (`draftsmith data cache-hidden`); resumable. Builds each method itself, so
    the rows, split, layer ids and draft vocabulary are the training runs' own; the target is
    loaded once, and each batch's forward captures the layers every method reads. `engine`
    "vllm": the forward runs in a vLLM server instead (data/engine_capture.py)."""
    from draftsmith.data.vllm_server import check_engine_name
    from draftsmith.processes import current_processes

    if engine:  # before the target is loaded or anything is written
        check_engine_name(engine, "data cache-hidden")
    _check_cacheable(recipes)
    target_dirs = [target_folder(recipe.target.path) for recipe in recipes]  # each resolved once
    _check_same_rows(recipes, target_dirs)
    check_sizes(batch_size, shard_rows)  # before the target is loaded or any data regenerated
    for recipe, target_dir in zip(recipes, target_dirs):
        check_not_an_input(out, {"--target": target_dir, "--dataset": recipe.data.dataset}, folder=True)
    # Under `accelerate launch` every process computes its share of the shards on its own device.
    processes = current_processes()
    if engine and processes.world > 1:
        raise DraftsmithError("cache-hidden --engine: one process drives the engine (it batches the requests "
                              "itself); run it without accelerate launch")
    device = torch.device(processes.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    methods = _build_methods(recipes, target_dirs, device, Path(out) / ".engine" if engine else None)
    first, target = methods[0], methods[0].target
    _check_same_rows([m.recipe for m in methods], [m.target_dir for m in methods], decided=True)
    tokens = _all_rows(first)
    for method in methods[1:]:  # the same settings render the same rows; said, not assumed
        rows = _all_rows(method)
        if len(method.train_data) != len(first.train_data) or any(not torch.equal(rows[k], tokens[k])
                                                                  for k in ROW_KEYS):
            raise DraftsmithError(f"cache-hidden: the {first.recipe.method.name} and {method.recipe.method.name} "
                                  "recipes rendered other rows from the same settings; one cache holds one set of rows")
    identity = {
        "target": {"path": str(first.target_dir), "fingerprint": target_fingerprint(first.target_dir)},
        "methods": {m.recipe.method.name: {k: v for k, v in m.feature_identity().items() if k != "method"}
                    for m in methods},
        "rows": rows_settings(first.recipe),  # with what the method decided (data.enable_thinking)
        "source": str(first.rows_source),
        "splits": {"train": len(first.train_data), "eval": len(first.validation_data)},
    }
    layer_ids = sorted({i for m in methods for i in m.layer_ids})

    def write(forward, label: str) -> Path:  # each method's `extract` of `forward(batch)`, and who ran it
        def compute(batch):
            features = forward(batch)
            return {f"{m.recipe.method.name}.{k}": v for m in methods for k, v in m.extract(features).items()}

        started = time.monotonic()
        written = write_feature_cache(out, {**identity, "capture": label}, tokens, compute, batch_size=batch_size,
                                      shard_rows=shard_rows, processes=processes)
        log.info("features of %d rows written in %.1f s (%s)", len(tokens["input_ids"]), time.monotonic() - started,
                 label)
        return written

    if not engine:
        return write(lambda batch: frozen_forward(target, {k: v.to(device) for k, v in batch.items()}, layer_ids),
                     IN_PROCESS)
    with EngineCapture(target, first.target_dir, layer_ids, tokens["input_ids"].shape[1], Path(out) / ".engine",
                       in_flight=batch_size) as capture:
        return write(capture.forward, capture.label)
