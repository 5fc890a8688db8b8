"""DFlash and DSpark drafters for transformers' remote-code path: draftsmith's own code.

`draftsmith export --format zlab` (DFlash) and `--format specforge` (DSpark) copy this file
as it is into the export folder, as `modeling_draftsmith.py`, and name its classes in
config.json's `auto_map`, so that

    AutoModel.from_pretrained(folder, trust_remote_code=True)

builds the drafter with transformers alone (no draftsmith, no z-lab or SpecForge code).
It therefore imports nothing but torch and transformers, and is tested as a module of
the package (tests/test_exports.py) against `models/dflash.py`, whose math it restates:

    ctx    = hidden_norm(fc(target_hidden))                 # [B, T, n*H_t] -> [B, T, H]
    layer: q from the block rows; keys/values = [proj(ctx); proj(block rows)], per-head
           q_norm/k_norm, RoPE, no mask (the block is bidirectional, the context visible);
           a `sliding_attention` layer (config.layer_types) sees only the context
           keys at most `sliding_window` positions before the block's anchor
    output = norm(last layer's block rows)

`forward(position_ids, noise_embedding, target_hidden)` follows the reference's calling
convention: `position_ids` [B, T + Q] cover the context positions and then the block's,
`noise_embedding` [B, Q, H] are the target's embeddings of [anchor, MASK, ...]. There is
no KV cache here: a caller recomputes the context (decode-time caching is draftsmith's).
The output head is the target's. DSpark adds `markov_bias` and `confidence_logits`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def _settings(config) -> dict:
    """dflash_config first, then the top level (how both reference loaders read keys)."""
    nested = dict(getattr(config, "dflash_config", None) or {})
    for key in ("target_layer_ids", "mask_token_id", "markov_rank"):
        if key not in nested and getattr(config, key, None) is not None:
            nested[key] = getattr(config, key)
    return nested


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class BlockAttention(nn.Module):
    def __init__(self, config, window: int = 0):
        super().__init__()
        self.window = window
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.groups = heads // kv
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def near(self, positions, rows: int):
        """A sliding layer's mask [B, 1, Q, T + Q]: context keys within the window before the
        block's anchor (its first row), the block's own keys all; None for a full-attention layer."""
        if not self.window:
            return None
        context, anchor = positions[:, :-rows], positions[:, -rows]
        seen = (context >= anchor[:, None] - self.window)[:, None, :].expand(-1, rows, -1)
        return torch.cat([seen, seen.new_ones(*seen.shape[:2], rows)], dim=-1)[:, None]

    def forward(self, x, ctx, cos, sin, positions):
        batch, rows = x.shape[:2]
        both = torch.cat([ctx, x], dim=1)
        split = lambda t: t.view(batch, t.shape[1], -1, self.head_dim)  # noqa: E731
        q = _rope(self.q_norm(split(self.q_proj(x))).transpose(1, 2), cos[:, -rows:], sin[:, -rows:])
        k = _rope(self.k_norm(split(self.k_proj(both))).transpose(1, 2), cos, sin)
        v = split(self.v_proj(both)).transpose(1, 2)
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.near(positions, rows), scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, -1))


class BlockLayer(nn.Module):
    def __init__(self, config, window: int = 0):
        super().__init__()
        self.self_attn = BlockAttention(config, window)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, positions):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "drafter"

    def __init__(self, config):
        super().__init__(config)
        settings = _settings(config)
        self.target_layer_ids = list(settings["target_layer_ids"])
        self.mask_token_id = settings.get("mask_token_id")
        self.block_size = config.block_size
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        window = getattr(config, "sliding_window", None) or 0
        self.layers = nn.ModuleList(BlockLayer(config, window if kind == "sliding_attention" else 0) for kind in types)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids, noise_embedding, target_hidden, **unused):
        """Final-normed hidden states [B, Q, H] of the block rows."""
        x = noise_embedding.to(self.fc.weight.dtype)
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, position_ids)
        return self.norm(x)


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkDraftModel(DFlashDraftModel):
    """The DFlash backbone with the anchor as the first prediction slot (slot k predicts
    the token at anchor + k + 1), a vanilla Markov head and a confidence head on [h; W1[x]]."""

    def __init__(self, config):
        super().__init__(config)
        rank = int(_settings(config)["markov_rank"])
        self.markov_head = MarkovHead(config.vocab_size, rank)
        self.confidence_head = ConfidenceHead(config.hidden_size + rank)
        self.post_init()

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Logit bias W2(W1[x_prev]) added to the draft after token `prev_ids`."""
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev_ids))

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        prev = self.markov_head.markov_w1(prev_ids).to(hidden.dtype)
        return self.confidence_head.proj(torch.cat([hidden, prev], dim=-1)).squeeze(-1)
