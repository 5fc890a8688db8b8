"""The external draft model: a small causal LM that shares the target's tokenizer.

It is an ordinary transformers model (Llama-style, built from a config), so serving
engines load it as a draft model as it is. Pretrained on the corpus; with
`distill_weight > 0` a KL term pulls it towards the frozen target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DraftLMConfig:
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 1
    intermediate_size: int = 0  # 0: derived from hidden_size
    distill_weight: float = 0.0  # weight of KL(target || draft) beside the LM loss
    distill_temperature: float = 1.0


def distill_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(p_target || p_draft) per token, averaged over masked positions."""
    t = temperature
    log_q = F.log_softmax(draft_logits.float() / t, dim=-1)
    log_p = F.log_softmax(target_logits.float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1) * t * t
