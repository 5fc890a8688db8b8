"""Tiny configs of the causal-LM families draftsmith is tested on, built from transformers'
own config classes (no download): `tiny_config` in models/target.py picks one by name.

Every builder takes the same figures (`shape`: vocab_size, num_layers, hidden_size,
num_heads, num_kv_heads, intermediate_size, max_position_embeddings) plus special token ids,
and spells them as its family does (GPT-2 `n_embd`/`n_head`, OPT `ffn_dim`, Falcon
`multi_query`/`num_kv_heads`, DeepSeek-V3 `kv_lora_rank` for multi-latent attention).
Families whose attention has no KV-head count of its own (multi-head only: GPT-2,
GPT-NeoX, OPT; multi-latent: DeepSeek-V3) refuse a `num_kv_heads` other than `num_heads`.
Other config fields pass through with the special ids (e.g. Mistral's `sliding_window`).
Only the Llama and Qwen3 ones keep an untied head (the toolkit's own targets); the rest
keep their family's default, so tied heads (GPT-2, OPT, Gemma) are covered too.
"""

from __future__ import annotations

from typing import Callable

from draftsmith.errors import DraftsmithError


def _gqa(shape: dict) -> dict:
    """The Llama spelling, shared by most families."""
    return dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                max_position_embeddings=shape["max_position_embeddings"])


def _mha_only(arch: str, shape: dict) -> None:
    if shape["num_kv_heads"] != shape["num_heads"]:
        raise DraftsmithError(f"tiny target {arch}: num_kv_heads {shape['num_kv_heads']} must equal num_heads "
                              f"{shape['num_heads']} (this family has no KV-head count of its own)")


def _llama(shape, ids):
    from transformers import LlamaConfig

    return LlamaConfig(**_gqa(shape), **{"tie_word_embeddings": False, **ids})


def _qwen3(shape, ids):
    from transformers import Qwen3Config

    return Qwen3Config(**_gqa(shape), head_dim=shape["hidden_size"] // shape["num_heads"],
                       **{"tie_word_embeddings": False, **ids})


def _qwen2(shape, ids):
    from transformers import Qwen2Config

    return Qwen2Config(**_gqa(shape), **ids)


def _mistral(shape, ids):
    from transformers import MistralConfig

    # Mistral-7B v0.2 and later attend to everything; a window (v0.1) is asked for in `ids`.
    return MistralConfig(**_gqa(shape), **{"sliding_window": None, **ids})


def _gemma(shape, ids):
    from transformers import GemmaConfig

    return GemmaConfig(**_gqa(shape), head_dim=shape["hidden_size"] // shape["num_heads"], **ids)


def _mixtral(shape, ids):
    from transformers import MixtralConfig

    # a few small experts, two per token: the routed (MoE) path with little compute
    return MixtralConfig(**_gqa(shape), num_local_experts=4, num_experts_per_tok=2, **ids)


def _phi(shape, ids):
    from transformers import PhiConfig

    return PhiConfig(**_gqa(shape), **ids)


def _deepseek_v3(shape, ids):
    from transformers import DeepseekV3Config

    _mha_only("deepseek_v3", shape)
    head = shape["hidden_size"] // shape["num_heads"]
    # Multi-latent attention (kv_lora_rank set) and MoE from the second layer on, all small.
    return DeepseekV3Config(**_gqa(shape), kv_lora_rank=2 * head, q_lora_rank=3 * head,
                            qk_rope_head_dim=head // 2, qk_nope_head_dim=head // 2, v_head_dim=head,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                            topk_group=1, first_k_dense_replace=1,
                            moe_intermediate_size=max(8, shape["intermediate_size"] // 4), **ids)


def _gpt2(shape, ids):
    from transformers import GPT2Config

    _mha_only("gpt2", shape)
    return GPT2Config(vocab_size=shape["vocab_size"], n_positions=shape["max_position_embeddings"],
                      n_embd=shape["hidden_size"], n_layer=shape["num_layers"], n_head=shape["num_heads"],
                      n_inner=shape["intermediate_size"],
                      **{"bos_token_id": None, "eos_token_id": None, **ids})  # GPT-2's 50256 is past a tiny vocab


def _gpt_neox(shape, ids):
    from transformers import GPTNeoXConfig

    _mha_only("gpt_neox", shape)
    fields = _gqa(shape)
    fields.pop("num_key_value_heads")
    return GPTNeoXConfig(**fields, **ids)


def _opt(shape, ids):
    from transformers import OPTConfig

    _mha_only("opt", shape)
    return OPTConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                     word_embed_proj_dim=shape["hidden_size"], ffn_dim=shape["intermediate_size"],
                     num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                     max_position_embeddings=shape["max_position_embeddings"], **ids)


def _falcon(shape, ids):
    from transformers import FalconConfig

    heads, kv = shape["num_heads"], shape["num_kv_heads"]
    # Falcon-7B is multi-query; Falcon-40B/180B's "new decoder architecture" is grouped.
    attention = (dict(multi_query=True) if kv == 1 else dict(multi_query=False) if kv == heads
                 else dict(new_decoder_architecture=True, num_kv_heads=kv))
    return FalconConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                        num_hidden_layers=shape["num_layers"], num_attention_heads=heads,
                        ffn_hidden_size=shape["intermediate_size"],
                        max_position_embeddings=shape["max_position_embeddings"], **attention, **ids)


TINY_ARCHS: dict[str, Callable] = {
    "llama": _llama, "qwen3": _qwen3, "qwen2": _qwen2, "mistral": _mistral, "gemma": _gemma,
    "mixtral": _mixtral, "phi": _phi, "deepseek_v3": _deepseek_v3, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
    "opt": _opt, "falcon": _falcon,
}


def tiny_arch_config(arch: str, shape: dict, special_ids: dict):
    builder = TINY_ARCHS.get(arch)
    if builder is None:
        raise DraftsmithError(f"tiny target: unknown architecture {arch!r} (expected one of {', '.join(TINY_ARCHS)})")
    return builder(shape, special_ids)
