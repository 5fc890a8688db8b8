"""The frozen target: building tiny ones, loading real ones, and one forward adapter.

Every call that hands a KV cache to a transformers model goes through `target_forward`.
transformers 5.24 renamed `past_key_values=` to `cache=` (the old name warns, and is
removed in 5.40), so the spelling is chosen once here from the model's signature.

Layer ids are "output of decoder layer i", 0-based, everywhere in draftsmith. They are
captured with forward hooks on the decoder layers: `output_hidden_states` would hand back
the *normed* output for the last layer, which is not what serving engines capture.

Two kinds of target cache, both handled only here: transformers' DynamicCache (grows, is
cropped by -n), and its StaticCache (preallocated, fixed addresses: what CUDA graphs need),
rolled back by moving its write position. `CompiledVerify` is the verify forward under
torch.compile over a static cache.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.models.tile import as_dict, kv_heads


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, T, H]
    cache: object | None = None


@dataclass(frozen=True)
class TargetShape:
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


# Configs spell the same figure differently (GPT-2 `n_inner`, OPT `ffn_dim`, Falcon
# `ffn_hidden_size`); transformers' attribute_map covers only some. KV heads: tile.kv_heads.
_FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")


def target_shape(config) -> TargetShape:
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        raise DraftsmithError(f"target {type(config).__name__} has no attention heads (a recurrent model): the "
                              "hidden-state drafters take the target's attention shape; use ngram or a draft model")
    return TargetShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_heads=heads,
        num_kv_heads=kv_heads(as_dict(config), heads),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=next((v for v in (getattr(config, k, None) for k in _FFN_KEYS) if v is not None),
                               4 * config.hidden_size),
    )


# ---- the parts of any causal LM ----------------------------------------------------------
#
# transformers names the parts differently per architecture (GPT-2 `transformer.h` and
# `ln_f`, OPT `model.decoder.layers` and `final_layer_norm`, GPT-NeoX `gpt_neox.layers`).
# Embedding and head have accessors of their own (`get_input_embeddings`,
# `get_output_embeddings`); layers and final norm are found from what transformers itself
# declares, in this order:
#   1. the decoder: `model.get_decoder()` (the stack that holds the layers);
#   2. the config's `base_model_pp_plan` (pipeline stages, e.g. embed_tokens, layers, norm);
#   3. the class that `_can_record_outputs["hidden_states"]` records, or `_no_split_modules`
#      names: the ModuleList of those;
#   4. else the one ModuleList in the decoder with `num_hidden_layers` entries.
# The path found is remembered per model (the search walks every submodule once).

_LAYER_PATHS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def decoder_module(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (LlamaModel, GPT2Model, OPTDecoder, ...)."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        decoder = None
    return decoder if isinstance(decoder, nn.Module) else getattr(model, "base_model", model)


def _layer_classes(model: nn.Module) -> tuple[set[type], set[str]]:
    """The decoder-layer classes transformers records as hidden states, and the names of
    the blocks it never splits across devices (also the decoder layers, for causal LMs)."""
    classes: set[type] = set()
    for owner in (model, decoder_module(model)):
        recorded = (getattr(owner, "_can_record_outputs", None) or {}).get("hidden_states")
        for item in recorded if isinstance(recorded, (list, tuple)) else [recorded]:
            item = getattr(item, "target_class", item)  # an OutputRecorder names its class
            for cls in item if isinstance(item, tuple) else (item,):
                if isinstance(cls, type):
                    classes.add(cls)
    return classes, set(getattr(model, "_no_split_modules", None) or ())


def _text_config(model: nn.Module):
    """The language model's config (a multimodal config keeps it under text_config)."""
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _num_layers(model: nn.Module) -> int | None:
    return getattr(_text_config(model), "num_hidden_layers", None)


def _pp_plan(model: nn.Module) -> list[str]:
    return list(getattr(_text_config(model), "base_model_pp_plan", None) or ())


def _find_layer_path(model: nn.Module) -> str | None:
    n = _num_layers(model)

    def fits(m) -> bool:
        return isinstance(m, nn.ModuleList) and len(m) > 0 and (n is None or len(m) == n)

    classes, names = _layer_classes(model)
    where = {m: name for name, m in model.named_modules()}
    decoder = decoder_module(model)
    # The decoder first; then the whole model, since a `get_decoder` may name something
    # else (ModernBERT's decoder is its head).
    for root in dict.fromkeys([decoder, model]):
        prefix = where.get(root, "") + "." if where.get(root) else ""
        for key in _pp_plan(model):
            if fits(getattr(root, key, None)):
                return prefix + key
        lists = [(name, m) for name, m in root.named_modules() if fits(m)]
        for name, m in lists:
            if all(isinstance(x, tuple(classes)) or type(x).__name__ in names for x in m):
                return prefix + name
        outer = [name for name, _ in lists if not any(name.startswith(o + ".") for o, _ in lists)]
        if len(outer) == 1:
            return prefix + outer[0]
    return None


def _layer_path(model: nn.Module) -> str:
    path = _LAYER_PATHS.get(model)
    if path is None:
        path = _find_layer_path(model)
        if path is None:
            raise DraftsmithError(
                f"target {type(model).__name__}: no decoder layers found (its decoder "
                f"{type(decoder_module(model)).__name__} holds no list of {_num_layers(model)} layers)")
        _LAYER_PATHS[model] = path
    return path


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of any transformers causal LM (see the search above)."""
    return model.get_submodule(_layer_path(model))


def rotary_embedding(model: nn.Module) -> nn.Module:
    """The decoder's shared rotary embedding (Llama family: `rotary_emb`)."""
    rotary = getattr(decoder_module(model), "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise DraftsmithError(f"target {type(model).__name__}: no shared rotary embedding (rotary_emb) "
                              f"in its decoder {type(decoder_module(model)).__name__}")
    return rotary


def check_capturable(model: nn.Module, layer_ids: Iterable[int], who: str) -> None:
    """One line when `who` (a drafter) needs hidden states this target cannot give."""
    layer_ids = tuple(layer_ids)
    if not layer_ids:
        return
    try:
        decoder_layers(model)
        check_layer_ids(model, layer_ids)
    except DraftsmithError as exc:
        raise DraftsmithError(f"{who} reads the target's hidden states, which cannot be captured: {exc}") from None


def check_layer_ids(model_or_config, layer_ids: Iterable[int]) -> None:
    config = getattr(model_or_config, "config", model_or_config)
    n = config.num_hidden_layers
    for i in layer_ids:
        if not 0 <= int(i) < n:
            raise DraftsmithError(f"target layer id {i} is beyond the target's depth ({n} layers, ids 0..{n - 1})")


@contextlib.contextmanager
def capture_layers(model: nn.Module, layer_ids: Iterable[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Record the output of the given decoder layers during forwards inside the block."""
    layer_ids = sorted(set(int(i) for i in layer_ids))
    captured: dict[int, torch.Tensor] = {}
    if not layer_ids:  # nothing to find: a target whose layers cannot be found still decodes
        yield captured
        return
    check_layer_ids(model, layer_ids)
    layers = decoder_layers(model)
    handles = []
    for i in layer_ids:
        def hook(_module, _inputs, output, i=i):
            captured[i] = output[0] if isinstance(output, tuple) else output
        handles.append(layers[i].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def cache_kwarg(model: nn.Module) -> str:
    """The name under which this transformers version takes a cache (see module doc)."""
    return _cache_kwarg_of(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    # Once per class: inspecting a signature costs tens of microseconds, and the decoder
    # calls this for every forward of the target and of a draft model.
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def target_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    cache=None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    capture: Iterable[int] = (),
    logits_to_keep: int = 0,
) -> TargetOutput:
    """One target forward: logits, the captured layer outputs, and the updated cache."""
    kwargs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
        kwargs["use_cache"] = True
    else:
        kwargs["use_cache"] = False
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    with capture_layers(model, capture) as hidden:
        out = model(**kwargs)
    new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return TargetOutput(logits=out.logits, hidden=dict(hidden), cache=new_cache if cache is not None else None)


def new_cache(model: nn.Module, rollback: int = 1):
    """A DynamicCache that can be rolled back by up to `rollback` tokens.

    Sliding-window and linear-attention layers drop rows past their window (or kernel) as
    they go, which a rejected draft's crop could then not undo; told to record their past,
    they keep those rows until the next `crop_cache`. A recurrent state (Mamba, gated
    delta-net) cannot be recomputed backwards: transformers (>= 5.25, the floor) keeps the
    states after each of a forward's last `rollback` tokens, so a verify of 1 + D tokens
    needs `rollback >= 1 + D`.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.activate_past_recording(recurrent_states_to_keep=max(1, int(rollback)))
    return cache


def new_static_cache(model: nn.Module, max_len: int):
    """A transformers StaticCache of `max_len` tokens, its buffers allocated by the first forward.

    A StaticLayer writes each forward at its length counter, `cumulative_length` (a device
    tensor, so that a compiled graph reads it rather than baking it in), and reports the
    whole buffer as the keys; the causal mask transformers builds from that counter hides
    every slot past the query positions. So keeping the first n tokens is setting the
    counter to n (`crop_cache`): rows past it are never read and the next forward overwrites
    them. A tree verify passes its own 4D mask, which must then span all `max_len` slots.
    """
    from transformers import StaticCache

    impl = getattr(model.config, "_attn_implementation", "") or ""
    if "flash" in impl:
        # flash-attn takes no mask: it would read the stale slots past the write position
        raise DraftsmithError(f"a static target cache needs a masked attention (sdpa or eager), "
                              f"not attn_implementation={impl!r}")
    cache = StaticCache(config=model.config, max_cache_len=int(max_len))
    if any(cache.is_sliding):
        raise DraftsmithError("a static target cache needs full-attention layers; use the dynamic cache")
    return cache


def is_static_cache(cache) -> bool:
    from transformers import StaticCache

    return isinstance(cache, StaticCache)


def cache_length(cache) -> int:
    """Tokens in the cache as a Python int (a StaticCache reports a device tensor)."""
    return int(cache.get_seq_length())


def crop_cache(cache, keep: int) -> None:
    """Keep the first `keep` tokens of the cache.

    A DynamicCache is cropped by -n (transformers 5 refuses a positive argument). A
    StaticCache gets its write position set to `keep` (see `new_static_cache`), without
    reading its length: that read would wait for the device.
    """
    if is_static_cache(cache):
        if not 0 <= keep <= cache.get_max_length():
            raise ValueError(f"cannot set a static cache of {cache.get_max_length()} slots to {keep} tokens")
        for layer in cache.layers:
            layer.cumulative_length.fill_(keep)
        return
    drop = cache.get_seq_length() - keep
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {keep}")
    if drop:
        _check_rollback(cache, drop)
    cache.crop(-drop)  # crop(0) too: it trims the rows that recording layers kept past their window


def _check_rollback(cache, drop: int) -> None:
    """Refuse a crop of `drop` tokens that the cache cannot undo exactly."""
    if not getattr(cache, "is_croppable", True):
        raise DraftsmithError("this target's cache cannot be rolled back past rejected drafts; "
                              "decode it without drafts")
    for layer in cache.layers:
        history = getattr(layer, "recurrent_states_history", {}).get(0)
        if history is not None and layer.is_recurrent_states_initialized[0] and drop > len(history):
            # transformers would restore a state from before the tokens it should keep
            raise ValueError(f"cannot roll a recurrent state back {drop} tokens: the cache kept {len(history)} "
                             "(new_cache's `rollback` sizes it)")


def tree_cache_problem(cache) -> str | None:
    """Why a tree's accepted path cannot be gathered in this cache (None: it can). The
    gather moves rows by absolute slot, which only plain full-attention layers keep."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if any(getattr(cache, "is_sliding", ())):
        return "this target has sliding-window layers"
    other = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in (DynamicLayer, StaticLayer)})
    if other:
        return f"this target's cache has {', '.join(other)} layers"
    return None


def keep_cache_rows(cache, first: int, rows: list[int]) -> None:
    """Move KV rows `rows` (absolute, increasing, each >= its destination) onto
    `first, first + 1, ...` and drop everything after them. Either kind of cache: a row's
    slot is its token position in both."""
    moved = [(dst, src) for dst, src in enumerate(rows, start=first) if dst != src]
    if moved:
        dst = torch.tensor([d for d, _ in moved])
        src = torch.tensor([s for _, s in moved])
        for layer in cache.layers:
            dst, src = dst.to(layer.keys.device), src.to(layer.keys.device)
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]
    crop_cache(cache, first + len(rows))


# ---- the compiled verify forward --------------------------------------------------------


class _LayerRecorder:
    """Keeps the outputs of hooked decoder layers while `active`.

    One per model, its hooks installed once and never removed: a compiled graph inlines the
    hooks present when it was traced (dynamo does not guard on hooks), so the per-call hooks
    of `capture_layers` would leave a graph writing into a dead call's dict. Outside a
    compiled verify the hooks return at once.
    """

    def __init__(self):
        self.active = False
        self.outputs: dict[int, torch.Tensor] = {}
        self.hooked: set[int] = set()


_RECORDERS: "weakref.WeakKeyDictionary[nn.Module, _LayerRecorder]" = weakref.WeakKeyDictionary()


def _layer_recorder(model: nn.Module, layer_ids: tuple[int, ...]) -> _LayerRecorder:
    recorder = _RECORDERS.setdefault(model, _LayerRecorder())
    layers = decoder_layers(model)
    for i in layer_ids:
        if i not in recorder.hooked:
            def hook(_module, _inputs, output, i=i):
                if recorder.active:
                    recorder.outputs[i] = output[0] if isinstance(output, tuple) else output
            layers[i].register_forward_hook(hook)
            recorder.hooked.add(i)
    return recorder


def _verify_graph(model, recorder, capture, cache_name, input_ids, position_ids, attention_mask, cache):
    """What torch.compile captures: one target forward, and the recorded layers as outputs."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                use_cache=True, **{cache_name: cache})
    return out.logits, tuple(recorder.outputs.pop(i) for i in capture)


def compile_options(device: torch.device) -> dict:
    """torch.compile settings of the verify forward. On CUDA, 'reduce-overhead' (CUDA graphs:
    they replay fixed shapes at fixed addresses, hence the static cache and padded verify);
    elsewhere inductor's default. One graph (fullgraph) and no dynamic shapes either way."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return {"mode": mode, "fullgraph": True, "dynamic": False}


class CompiledVerify:
    """`target_forward` for verify passes, under torch.compile, over a static cache.

    Callers keep shapes fixed (the decoder pads every verify to 1 + D rows), so one graph
    serves every step: one for chains (causal mask built inside the graph from the cache's
    write position) and one for trees (the caller's 4D mask). Outputs of a CUDA graph are
    overwritten by its next replay, so they are copied out; elsewhere they are returned as is.
    """

    def __init__(self, model: nn.Module, capture: Iterable[int] = ()):
        self.model = model
        self.capture = tuple(sorted(set(int(i) for i in capture)))
        check_layer_ids(model, self.capture)
        self.recorder = _layer_recorder(model, self.capture)
        device = next(model.parameters()).device
        options = compile_options(device)
        self.cuda_graphs = options.get("mode") == "reduce-overhead"
        self._graph = torch.compile(_verify_graph, **options)

    def __call__(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> TargetOutput:
        if not is_static_cache(cache):
            raise DraftsmithError("a compiled verify needs a static target cache")
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are done with
        self.recorder.active = True
        try:
            logits, hidden = self._graph(self.model, self.recorder, self.capture, cache_kwarg(self.model),
                                         input_ids, position_ids, attention_mask, cache)
        except torch._dynamo.exc.Unsupported as exc:
            raise DraftsmithError(f"torch.compile cannot capture this target's verify in one graph "
                                  f"({first_lines(exc, 1)}); "
                                  "run without compile") from None
        finally:
            self.recorder.active = False
            self.recorder.outputs.clear()
        if self.cuda_graphs:
            logits, hidden = logits.clone(), tuple(h.clone() for h in hidden)
        return TargetOutput(logits=logits, hidden=dict(zip(self.capture, hidden)), cache=cache)


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def tiny_config(
    arch: str = "llama",
    vocab_size: int = 2048,
    num_layers: int = 8,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    **special_ids,
):
    """A transformers config for a small target of family `arch` (models/tiny_archs.py:
    llama and qwen3, the toolkit's own, and the other families draftsmith is tested on)."""
    from draftsmith.models.tiny_archs import tiny_arch_config

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise DraftsmithError(
            f"tiny target: hidden_size {hidden_size}, heads {num_heads} and kv heads {num_kv_heads} do not divide"
        )
    shape = dict(vocab_size=vocab_size, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                 intermediate_size=intermediate_size or (hidden_size * 8 // 3 + 63) // 64 * 64)
    return tiny_arch_config(arch, shape, special_ids)


def build_tiny_target(seed: int = 0, **config_kwargs) -> nn.Module:
    """A freshly initialised tiny target, deterministic for a seed."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def find_model_dir(path: str | Path, require: str = "") -> Path | str:
    """The one place a path on the command line becomes a model folder: a training run
    folder stands for its best weights (RUN/best/model) or else the model it wrote last
    (RUN/model; models/run_weights.py), a checkpoint folder for its own, a model folder for itself, and a hub
    name for its snapshot in the Hugging Face cache (downloaded there first when online,
    models/hub.py). A name found nowhere stays a string, for the loader to name what is
    wrong. With `require` (what the path is for, e.g. "target"), it must come to a folder
    with a config.json. A GGUF file (a `.gguf` path, a folder holding one, or an embedded
    name such as `smollm2-135m-instruct`) stands for the folder it is converted into once
    (models/gguf.py)."""
    from draftsmith.models.gguf import gguf_folder
    from draftsmith.models.hub import hub_snapshot, looks_like_repo_id
    from draftsmith.models.run_weights import run_weights

    converted = gguf_folder(path)
    if converted is not None:
        return converted
    local = Path(path)
    weights = run_weights(local)
    if weights is not None:
        return weights
    if not local.exists() and looks_like_repo_id(path):
        try:
            return hub_snapshot(str(path), what=require or "model")
        except DraftsmithError as exc:
            if require:
                raise DraftsmithError(f"{require} {path}: no such folder (a model folder or a training run "
                                      f"folder), nor a hub model: {str(exc).split(': ', 1)[-1]}") from None
            return str(path)
    if require and not (local / "config.json").is_file():
        raise DraftsmithError(f"{require} {path}: no config.json (a model folder or a training run folder)")
    return local if local.exists() or require else str(path)


def load_target(path: str | Path, dtype: str = "auto", device: str | torch.device | None = None,
                attn_implementation: str | None = None, frozen: bool = True) -> nn.Module:
    """Load a frozen (or, `frozen=False`, trainable) Hugging Face causal LM from a folder
    (or a hub name when online)."""
    from transformers import AutoModelForCausalLM

    local = Path(path)
    if local.exists() and not (local / "config.json").is_file():
        raise DraftsmithError(f"target {path}: no config.json in that folder")
    kwargs = {}
    if dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    if attn_implementation:
        if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise DraftsmithError("target.attn_implementation flash_attention_2: flash-attn asked for but not "
                                  "installed (pip install flash-attn, or use sdpa)")
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    # Whatever a corrupt folder makes transformers raise (a JSON error, a config field's
    # validation error, safetensors' error on a truncated file, a KeyError on an unknown
    # model_type) is about the user's files: name the folder and the first lines.
    except Exception as exc:
        raise DraftsmithError(f"cannot load target {path}: {first_lines(exc)}") from None
    if device is not None:
        model.to(device)
    return freeze(model) if frozen else model
