"""The frozen target: building tiny ones, loading real ones, and one forward adapter.

Every call that hands a KV cache to a transformers model goes through `target_forward`.
transformers 5.24 renamed `past_key_values=` to `cache=` (the old name warns, and is
removed in 5.40), so the spelling is chosen once here from the model's signature.

Layer ids are "output of decoder layer i", 0-based, everywhere in draftsmith. They are
captured with forward hooks on the decoder layers: `output_hidden_states` would hand back
the *normed* output for the last layer, which is not what serving engines capture.

The target's KV caches are handled in target_cache.py, its verify forward under
torch.compile in compiled_verify.py, and a path becoming its folder in model_dir.py.
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
        from draftsmith.registry import METHODS

        others = ", ".join(n for n, s in METHODS.items() if not s.reads_target_features)
        raise DraftsmithError(f"target {type(config).__name__} has no attention heads (a recurrent model): the "
                              f"hidden-state drafters take the target's attention shape; use one that reads none "
                              f"({others})")
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


_FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm")  # Llama/Qwen/DeepSeek, then others


def final_norm(target: nn.Module) -> nn.Module:
    """The target's final norm, the last step before its output head (what MTP modules and
    logits over an engine's captured last-layer output read)."""
    decoder = decoder_module(target)
    children = dict(decoder.named_children())
    for name in _FINAL_NORMS:
        if isinstance(children.get(name), nn.Module):
            return children[name]
    raise DraftsmithError(f"target {type(target).__name__}: no final norm found in its decoder "
                          f"{type(decoder).__name__} (looked for {', '.join(_FINAL_NORMS)}); the state after it "
                          "is what its head reads")


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


def untrusted_weights(info: dict, unexpected: bool = False) -> str:
    """What `from_pretrained(..., output_loading_info=True)` says is wrong with a target's
    weights, in words ("" when nothing). Weights missing from the files or of another shape
    are initialised at random, which transformers only warns of: a target like that drafts
    and decodes without error and is silently another model, so it is refused. Weights the
    model has no place for (`unexpected`) are refused only where asked (a GGUF conversion):
    a folder may carry more than its architecture reads, as DeepSeek-style targets carry
    their MTP layers past the last decoder layer. Tied weights are never missing."""
    problems = [("newly initialised (missing from the files)", sorted(info.get("missing_keys") or ())),
                ("newly initialised (another shape in the files)",
                 sorted(str(k[0]) for k in info.get("mismatched_keys") or ())),
                ("in the files but not in the model", sorted(info.get("unexpected_keys") or ()) if unexpected else [])]
    said = [f"{len(keys)} weight(s) {what}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
            for what, keys in problems if keys]
    said += [str(message).strip().splitlines()[0] for message in info.get("error_msgs") or () if str(message).strip()][:1]
    return "; ".join(said)


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
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    # Whatever a corrupt folder makes transformers raise (a JSON error, a config field's
    # validation error, safetensors' error on a truncated file, a KeyError on an unknown
    # model_type) is about the user's files: name the folder and the first lines.
    except Exception as exc:
        raise DraftsmithError(f"cannot load target {path}: {first_lines(exc)}") from None
    problem = untrusted_weights(info)
    if problem:
        raise DraftsmithError(f"cannot load target {path}: {problem}")
    if device is not None:
        model.to(device)
    return freeze(model) if frozen else model
