"""The frozen target: building tiny ones, loading real ones, and one forward adapter.

Every call that hands a KV cache to a transformers model goes through `target_forward`.
transformers 5.24 renamed `past_key_values=` to `cache=` (the old name warns, and is
removed in 5.40), so the spelling is chosen once here from the model's signature.

Layer ids are "output of decoder layer i", 0-based, everywhere in draftsmith. They are
captured with forward hooks on the decoder layers: `output_hidden_states` would hand back
the *normed* output for the last layer, which is not what serving engines capture.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from draftsmith.errors import DraftsmithError


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


def target_shape(config) -> TargetShape:
    heads = config.num_attention_heads
    return TargetShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of any Llama/Qwen/Mistral-family causal LM."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise DraftsmithError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model).norm


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
    check_layer_ids(model, layer_ids)
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}
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


def new_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def crop_cache(cache, keep: int) -> None:
    """Keep the first `keep` tokens of a DynamicCache (transformers 5 crops by -n only)."""
    drop = cache.get_seq_length() - keep
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {keep}")
    if drop:
        cache.crop(-drop)


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
    """A transformers config for a small Llama- or Qwen3-style target."""
    from transformers import LlamaConfig, Qwen3Config

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise DraftsmithError(
            f"tiny target: hidden_size {hidden_size}, heads {num_heads} and kv heads {num_kv_heads} do not divide"
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or (hidden_size * 8 // 3 + 63) // 64 * 64,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **special_ids,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // num_heads, **common)
    raise DraftsmithError(f"tiny target: unknown architecture {arch!r} (expected 'llama' or 'qwen3')")


def build_tiny_target(seed: int = 0, **config_kwargs) -> nn.Module:
    """A freshly initialised tiny target, deterministic for a seed."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def resolve_model_dir(path: str | Path) -> Path | str:
    """A training run folder stands for the model it wrote (RUN/model); a hub name stays."""
    local = Path(path)
    if (local / "model" / "config.json").is_file():
        return local / "model"
    return local if local.exists() else str(path)


def load_target(path: str | Path, dtype: str = "auto", device: str | torch.device | None = None,
                attn_implementation: str | None = None) -> nn.Module:
    """Load a frozen Hugging Face causal LM from a folder (or a hub name when online)."""
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
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DraftsmithError(f"cannot load target {path}: {first}") from None
    if device is not None:
        model.to(device)
    return freeze(model)
