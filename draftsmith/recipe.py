"""Recipes: typed dataclass sections, YAML that sets only what differs, `key.sub=value`
overrides that win, and errors that name the key's full path in one line.

The `method` section is open-ended by design: `method.name` picks a drafter, and every
other key in the section must be a field of that drafter's config dataclass (its
hyperparameters live beside its module in `models/`, one source of truth).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from draftsmith.errors import DraftsmithError
from draftsmith.fields import DEFAULT_TILE, check_declared, check_section, divides, finite, option, seed
from draftsmith.registry import METHODS, MethodSpec, config_class, method_spec, trainable
from draftsmith.sampling_params import SamplingParams


@dataclass
class TargetSection:
    path: str = option("", 'A folder or hub name of a frozen target. Empty: the tiny target, built from the fields below (a method trained with its target pretrains it; a post-hoc one needs a path).')
    arch: str = option("llama", "tiny target architecture: llama or qwen3 (the toolkit's own), or another family "
                                "of models/tiny_archs.py (qwen2, mistral, gemma, mixtral, phi, deepseek_v3, ...)")
    num_layers: int = option(8, "tiny target: decoder layers", low=1)
    hidden_size: int = option(256, "tiny target: hidden width", low=1)
    num_heads: int = option(8, "tiny target: query heads", low=1)
    num_kv_heads: int = option(1, "tiny target: KV heads (G = num_heads / num_kv_heads sizes D)", low=1)
    intermediate_size: int = option(0, "tiny target: MLP width (0: derived from hidden_size)", low=0)
    max_position_embeddings: int = option(2048, "tiny target: longest sequence it takes (a target at a path "
                                                "has its own, which train.seq_len is checked against)", low=1)
    rope_theta: float = option(0.0, "a target built from these fields (no path): RoPE base frequency (0: the "
                                    "family's default, 10000; Llama-3 and Qwen3 use 500000 and 1000000)", low=0)
    tie_word_embeddings: bool = option(False, "a target built from these fields (no path): one matrix for the input "
                                              "embedding and the output head (Llama-3.2-1B and Qwen3 up to 4B tie them)")
    dtype: str = option("auto", 'dtype the frozen target is loaded in: auto, float32, bfloat16')
    attn_implementation: str = option("sdpa", "the target's attention: sdpa, eager, flash_attention_2")
    tile: int = option(DEFAULT_TILE, "verify kernel tile rows; sizes D and a block drafter's block (docs/design.md "
                                     "section 3)", low=1)


@dataclass
class DataSection:
    dataset: str = option("embedded", '"embedded" (the stdlib corpus), "stdlib-instructions" (instructions about '
                                      'its excerpts, for an instruct target to answer), a local '
                                      'json/jsonl/parquet/txt file, a dataset folder, or a hub name')
    text_field: str = option("", 'column of a plain-text corpus; empty: guessed')
    tokenizer: str = option("", "empty: the target's own, or one trained on the embedded corpus")
    vocab_size: int = option(2048, 'vocabulary of the tokenizer trained for the embedded default', low=1)
    max_chars: int = option(0, 'cap on the corpus characters read (0: all)', low=0)
    streaming: bool = option(False, "pretraining methods: stream the corpus through datasets (streaming=True), "
                                    "tokenized and packed as it is read, never held whole (FineWeb-Edu); "
                                    "the run is train.max_steps long")
    heldout_rows: int = option(256, "data.streaming: the corpus's first rows of train.seq_len tokens, held out "
                                    "for validation and never trained on", low=0)
    num_conversations: int = option(256, 'post-hoc methods on "embedded" or "stdlib-instructions": prompts to regenerate')
    prompt_chars: int = option(384, '... each an excerpt of this many characters (keep within train.seq_len)')
    regenerate: bool = option(True, 'post-hoc methods: answer the prompts with the target itself')
    regen_max_new_tokens: int = option(96, "regeneration: longest answer the target writes")
    # Sampled, as the references regenerate (SpecForge 0.7-0.8; DSpark's data 0.7 / 0.8 / 20):
    # a drafter trained on greedy answers never sees the target's other likely tokens.
    regen_temperature: float = option(0.7, "regeneration: sampling temperature (0: greedy)")
    regen_top_p: float = option(0.8, "regeneration: nucleus sampling mass (1: off)")
    regen_top_k: int = option(20, "regeneration: sample among this many likeliest tokens (0: off)")
    regen_servers: list[str] = option([], "regeneration: OpenAI-compatible server URLs (vLLM, SGLang, TGI, "
                                          "transformers serve) to answer through instead of in-process generate")
    regen_in_flight: int = option(16, "regeneration through servers: requests in flight per server")
    dataset_config: str = option("", "a hub or local dataset folder: its config name (empty: the default)")
    dataset_split: str = option("train", "a hub or local dataset folder: the split read")
    columns: dict[str, str] = option({}, "a dataset's columns by shape, e.g. {messages: chosen}; shapes: "
                                         "turns, conversations, messages, prompt")
    feature_cache: str = option("", "post-hoc methods: train from `draftsmith data cache-hidden` output, "
                                     "target not loaded (the draft model: its rows, the target's answers)")
    group_by_length: bool = option(False, "post-hoc methods: batch rows of similar length together, so that "
                                          "a batch (cut to its longest row) carries little padding")
    packing: bool = option(False, "post-hoc methods: a batch's conversations end to end in as few rows of "
                                  "train.seq_len as hold them, each attending only within itself (data/packing.py)")
    num_proc: int = option(1, "processes that tokenize the conversations (datasets' map num_proc)", low=1)
    chat_template: str = option("", "the target's chat template: empty (the tokenizer's own), a Jinja file, or a "
                                    "built-in (chatml); it renders regeneration prompts, training rows and eval prompts")
    # DeepSpec regenerates with --disable-thinking, and SpecForge and z-lab train and score Qwen3
    # drafters without thinking: unset means off wherever the template has the switch.
    enable_thinking: bool | None = option(None, "templates with a thinking switch (Qwen3): the target reasons before "
                                                "answering; unset: off, as the references train; set for a template "
                                                "without the switch: an error")


@dataclass
class TrainSection:
    output_dir: str = option("runs/default", "the run folder: recipe.yaml, metrics.jsonl, checkpoints/, model/")
    max_steps: int = option(1000, "optimizer steps", low=0)
    num_epochs: float = option(0.0, "passes over the training rows, instead of max_steps (0 there; a recipe "
                                     "that sets num_epochs and not max_steps trains by epochs)", low=0)
    lr_schedule: str = option("cosine_with_min_lr", "learning-rate schedule: cosine_with_min_lr (cosine to lr * "
                                                     "min_lr_ratio), or one of transformers' (linear, cosine, "
                                                     "constant_with_warmup, ...; train/schedule.py)")
    lr: float = option(1e-3, "peak learning rate (AdamW)", low=0)
    min_lr_ratio: float = option(0.1, "cosine_with_min_lr decays to lr * min_lr_ratio (a method's own reference "
                                      "value where its registry entry sets one: train_defaults)", low=0, high=1)
    warmup_ratio: float = option(0.04, "fraction of the run's steps spent warming up linearly", low=0, high=1)
    weight_decay: float = option(0.0, "AdamW weight decay", low=0)
    adam_beta2: float = option(0.95, "AdamW beta2 (a method's own reference value where its registry entry "
                                    "sets one: train_defaults)", low=0, high=1)
    batch_size: int = option(8, 'sequences per device per micro-step', low=1)
    grad_accum: int = option(1, "micro-steps accumulated per optimizer step", low=1)
    seq_len: int = option(256, "tokens per training row", low=2)
    clip: float = option(1.0, "gradient norm clip", low=0)
    seed: int = option(0, "seed of initialisation, data order and regeneration")
    resume: bool | str = option(False, "true: continue from the latest checkpoint in output_dir; a path: from that checkpoint")
    resume_changes: str = option("refuse", "a resume whose recipe changes the data, shapes or trajectory of the run "
                                           "it continues (seq_len, batch, accumulation, seed, lr, method, target, "
                                           "data): refuse it, or allow it (recorded in run.json with the step it "
                                           "took effect)", choices=("refuse", "allow"))
    overwrite: bool = option(False, "true: a fresh run replaces the run output_dir holds (its checkpoints, model "
                                    "and metrics); false: such a folder is refused")
    mixed_precision: str = option("auto", "training precision", choices={"auto": "bf16 where the device has it",
                                                                         "no": "", "bf16": "", "fp16": ""})
    validation_every: int = option(100, "validate every this many steps", low=1)
    validation_batches: int = option(4, "held-out batches per validation (0: no validation)", low=0)
    save_every: int = option(200, "checkpoint every this many steps", low=1)
    keep_checkpoints: int = option(2, "checkpoints kept (0: all; else at least 2: accelerate deletes the oldest "
                                      "before it writes the next, and 1 would leave none while a save is under way)", low=0)
    log_every: int = option(10, "log metrics every this many steps", low=1)
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    # torch's default (10 min for NCCL) is shorter than regeneration: the main process asks the
    # servers (or every process answers its share) for hours while the others wait at a barrier.
    dist_timeout: float = option(720.0, "minutes a process waits for the others at a collective before "
                                        "the launch fails (accelerate's InitProcessGroupKwargs); sized for "
                                        "regeneration, during which processes wait for hours", above=0)


@dataclass
class EvalSection:
    max_new_tokens: int = option(64, "eval: tokens generated per prompt", low=1)
    num_prompts: int = option(8, "eval: prompts decoded; of a conversation dataset, conversations (every user "
                                 "turn of each)", low=1)
    temperature: float = option(0.0, "eval: sampling temperature (0: greedy, checked token for token)")
    top_k: int = option(0, "eval: sample from the k likeliest tokens only (0: all)")
    top_p: float = option(1.0, "eval: sample from the smallest set of tokens of mass p (1: all)")
    seed: int = option(0, "eval: seed of the sampled decodes")
    num_draft: int | None = option(None, "eval: drafts per verify; null: the tile rule's D (--num-draft tile)")

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        """How eval draws a token at `temperature` (None: this section's); SamplingParams holds
        the one rule for these values, for a recipe's section and for eval's flags alike."""
        return SamplingParams(self.temperature if temperature is None else temperature, self.top_k, self.top_p)


@dataclass
class TrackingSection:
    report_to: str = option("wandb", 'wandb, tensorboard or none')
    mode: str = option("auto", "wandb: auto (online where wandb finds credentials: `wandb login`, WANDB_API_KEY; "
                               "else offline), online or offline")
    project: str = option("draftsmith", "tracker project name")
    run_name: str = option("", "tracker run name (empty: the output folder's name)")


@dataclass
class MethodSection:
    name: str = option("", "the drafter to train (a registered method); the section's other keys are its config's fields")
    params: dict[str, Any] = option({}, "only the keys the recipe set (the config derives the rest)")

    @property
    def spec(self) -> MethodSpec:
        """The registered method this section names: what the code below the recipe is handed
        (an unset or unknown name is one line)."""
        return method_spec(self.name)


@dataclass
class Recipe:
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    method: MethodSection = field(default_factory=MethodSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)


# ---------------------------------------------------------------- typed conversion

class NotFinite(DraftsmithError):
    """A float that is NaN or infinite: refused as such, whatever else the type allows."""


# Keys under their old names: refused naming the new one; read under the new one from the
# recipe.yaml a run saved before the rename (train/run_folder.py).
RENAMED = {"train.eval_every": "train.validation_every", "train.eval_batches": "train.validation_batches"}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where lossless."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for choice in typing.get_args(tp):
            try:
                return _coerce(value, choice, key)
            except NotFinite:
                raise
            except DraftsmithError:
                continue
        raise DraftsmithError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is Any:
        return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            try:
                return finite(number, key)
            except DraftsmithError as exc:  # not "expected float": a union must not try its other types
                raise NotFinite(str(exc)) from None
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp)[:1] or (Any,)
            return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    else:
        return value
    raise DraftsmithError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise DraftsmithError(f"{prefix}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names and path in RENAMED:
            raise DraftsmithError(f"{path}: renamed to {RENAMED[path]}")
        if key not in names:
            raise DraftsmithError(f"{path}: unknown key (known: {', '.join(sorted(names))})")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _build_method(data: dict) -> MethodSection:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise DraftsmithError(f"method: expected a mapping, got {data!r}")
    data = dict(data)
    name = data.pop("name", MethodSection.name)
    if not isinstance(name, str):
        raise DraftsmithError(f"method.name: expected str, got {name!r}")
    if not name:  # no drafter named: nothing to configure yet (training asks for one, registry.method_spec)
        if data:
            raise DraftsmithError(f"method.{next(iter(data))}: unknown key (method.name is not set: name the drafter "
                                  f"first, one of {', '.join(trainable())})")
        return MethodSection()
    cls = config_class(name)
    typed = _build(cls, data, "method")  # validates every key and type
    return MethodSection(name=name, params={k: getattr(typed, k) for k in data})


def recipe_from_dict(data: dict) -> Recipe:
    if not isinstance(data, dict):
        raise DraftsmithError(f"recipe: expected a mapping at the top level, got {type(data).__name__}")
    data = dict(data)
    method = _build_method(data.pop("method", None))
    recipe = _build(Recipe, {k: v for k, v in data.items()}, "")
    recipe.method = method
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    out = dataclasses.asdict(recipe)
    out["method"] = {"name": recipe.method.name, **recipe.method.params}
    return out


# ---------------------------------------------------------------- files and overrides

def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise DraftsmithError(f"{dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise DraftsmithError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or key.startswith(".") or key.endswith("."):
        raise DraftsmithError(f"override {text!r}: expected key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: plain YAML keeps the
    last, so a recipe with two `train:` sections would silently lose the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"recipe {path} not found")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as exc:
        raise DraftsmithError(f"recipe {path} is not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        problem = f": {exc.problem}" if getattr(exc, "problem", None) else ""
        raise DraftsmithError(f"recipe {path} is not valid YAML{where}{problem}") from None
    if data is None:  # an empty file would otherwise launch the full default run
        raise DraftsmithError(f"recipe {path} is empty (start from one in recipes/)")
    if not isinstance(data, dict):
        raise DraftsmithError(f"recipe {path}: expected a mapping at the top level")
    return data


def _length_by_epochs(data: dict) -> None:
    """A recipe that gives train.num_epochs and no train.max_steps trains by epochs (the
    default max_steps would otherwise make it give both, which `validate` refuses)."""
    train = data.get("train")
    if isinstance(train, dict) and train.get("num_epochs") and "max_steps" not in train:
        train["max_steps"] = 0


def _method_train_defaults(data: dict) -> None:
    """train.* keys the recipe leaves unset take the method's reference values (the registry's
    `train_defaults`: SpecForge's and DeepSpec's AdamW beta2 and cosine floor, say)."""
    method, train = data.get("method") or {}, data.get("train")
    spec = METHODS.get(method.get("name", MethodSection.name) if isinstance(method, dict) else None)
    if spec is None or not spec.train_defaults or not (train is None or isinstance(train, dict)):
        return
    data["train"] = {**spec.train_defaults, **(train or {})}


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Defaults, then the YAML file, then the command-line overrides."""
    data = read_yaml(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        _set_path(data, key, value)
    _length_by_epochs(data)
    _method_train_defaults(data)
    try:
        recipe = recipe_from_dict(data)
        validate(recipe)
        return recipe
    except DraftsmithError as exc:
        raise DraftsmithError(f"{path}: {exc}" if path else str(exc)) from None


def validate(recipe: Recipe) -> None:
    """Values a type check lets through but a run cannot use, refused before anything starts
    (a zero `*_every` would otherwise fail only after the first step, as a ZeroDivisionError):
    every key against what its field declares (its choices and bounds, draftsmith/fields.py
    `option`), then the rules across keys."""
    for section in dataclasses.fields(Recipe):
        if section.name != "method":
            check_section(getattr(recipe, section.name), section.name)
    _check_method(recipe.method, recipe.train.seq_len)
    _check_target(recipe.target)
    _check_length(recipe.train, recipe.data)
    seed(recipe.train.seed, "train.seed")
    seed(recipe.eval.seed, "eval.seed")
    try:
        recipe.eval.sampling()
    except DraftsmithError as exc:
        raise DraftsmithError(f"eval: {exc}") from None
    if recipe.train.keep_checkpoints == 1:  # a failed save must leave the previous checkpoint behind
        raise DraftsmithError("train.keep_checkpoints: 1 would leave no whole checkpoint while the next is written "
                              "(accelerate deletes the oldest first); give 2 or more, or 0 for all")
    if recipe.data.streaming and recipe.method.name and recipe.method.spec.reads_target_features:
        raise DraftsmithError(f"data.streaming: streams pretraining text, and method {recipe.method.name} trains on "
                              "conversations; remove the key")
    if isinstance(recipe.train.resume, str) and not recipe.train.resume:
        raise DraftsmithError("train.resume: expected true, false or a checkpoint folder, got ''")


def _check_method(method: MethodSection, seq_len: int) -> None:
    """The method's keys against its config's fields' declarations, its counts (num_*: None
    means derived) at least 1, then the config's own rules (`MethodConfig.check_params`)."""
    if not method.name:
        return
    config = method.spec.load("config")
    for f in dataclasses.fields(config):
        if f.name in method.params:
            check_declared(f, method.params[f.name], f"method.{f.name}")
    for key, value in method.params.items():
        if key.startswith("num_") and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise DraftsmithError(f"method.{key}: must be at least 1, got {value}")
    config.check_params(method.params, seq_len=seq_len)


def _check_target(target: TargetSection) -> None:
    """The tiny target's fields whole, and none of them set beside a target at a path (which
    has its own: a value here would be silently ignored)."""
    if not target.path:  # the tiny target is built from these fields: its transformers config needs them whole
        divides(vars(target), "hidden_size", "num_heads", "the tiny target's heads split its width", prefix="target")
        divides(vars(target), "num_heads", "num_kv_heads", "each KV head serves a whole group of query heads",
                prefix="target")
        return
    if target.max_position_embeddings != TargetSection.max_position_embeddings:
        raise DraftsmithError(f"target.max_position_embeddings={target.max_position_embeddings} sizes only the tiny "
                              f"target; target {target.path} has its own (remove the key)")
    if target.rope_theta or target.tie_word_embeddings:
        raise DraftsmithError(f"target.rope_theta and target.tie_word_embeddings shape only a target built from the "
                              f"recipe; target {target.path} has its own (remove the keys)")


def _check_length(t: TrainSection, data: DataSection) -> None:
    """The run's length: steps or epochs, exactly one (a streamed corpus has no epochs)."""
    if t.max_steps and t.num_epochs:
        raise DraftsmithError(f"train.max_steps={t.max_steps} and train.num_epochs={t.num_epochs} both set the "
                              "run's length: set one (train.max_steps=0 to train by epochs)")
    if not t.max_steps and not t.num_epochs:
        raise DraftsmithError("train.max_steps and train.num_epochs are both 0: set one of them to the run's length")
    if data.streaming and t.num_epochs:
        raise DraftsmithError(f"train.num_epochs={t.num_epochs}: a streamed corpus (data.streaming) has no length "
                              "to count passes in; set train.max_steps")


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
