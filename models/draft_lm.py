"""The external draft model: a small causal LM that shares the target's tokenizer.

It is an ordinary transformers model (Llama-style, built from a config), so serving
engines load it as a draft model as it is. Pretrained on the corpus; with
`distill_weight > 0` a KL term pulls it towards the frozen target's distribution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fields import MethodConfig, divides, option, positive
from draftsmith.models.target import build_tiny_target


@dataclass
class DraftLMConfig(MethodConfig):
    num_layers: int = option(2, "decoder layers of the draft LM")
    hidden_size: int = option(128, "hidden width")
    num_heads: int = option(4, "query heads")
    num_kv_heads: int = option(1, "KV heads")
    intermediate_size: int = option(0, "MLP width (0: derived from hidden_size)")
    distill_weight: float = option(0.0, "weight of KL(target || draft) beside the LM loss (0: pretraining only)")
    distill_temperature: float = option(1.0, "softmax temperature of both distributions in the KL term")

    @classmethod
    def check_params(cls, params: dict, seq_len: int | None = None, target_config=None) -> None:
        """Every size of the draft model against the others, before it is built: one line naming the key."""
        values = {**{f.name: f.default for f in dataclasses.fields(cls)}, **params}
        positive(values, ("num_layers", "hidden_size", "num_heads", "num_kv_heads"))
        positive(values, ("intermediate_size", "distill_weight"), low=0)
        # It is a transformers Llama model, whose config refuses such a width.
        divides(values, "hidden_size", "num_heads", "the draft model is a Llama model")
        divides(values, "num_heads", "num_kv_heads", "each KV head serves a whole group of query heads")
        if not values["distill_temperature"] > 0:
            raise DraftsmithError(f"method.distill_temperature: must be positive, got {values['distill_temperature']}")


class DraftLM:
    """The draft model's constructor; the model itself is a transformers causal LM (saved as one)."""

    @classmethod
    def from_target(cls, tokenizer, arch: str, max_position_embeddings: int, seed: int, **overrides) -> nn.Module:
        """A fresh draft LM on the target's tokenizer (its vocabulary and special tokens), of the
        target section's architecture family and positions; `overrides` are DraftLMConfig keys
        (the recipe's method section). `seed` alone decides its initial weights."""
        c = DraftLMConfig(**overrides)
        return build_tiny_target(
            seed=seed, arch=arch, vocab_size=len(tokenizer), num_layers=c.num_layers, hidden_size=c.hidden_size,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, intermediate_size=c.intermediate_size or None,
            max_position_embeddings=max_position_embeddings, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        )


def distill_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(p_target || p_draft) per token, averaged over masked positions."""
    t = temperature
    log_q = F.log_softmax(draft_logits.float() / t, dim=-1)
    log_p = F.log_softmax(target_logits.float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1) * t * t
