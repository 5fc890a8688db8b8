"""DFlash: a block-diffusion drafter that fills a whole block of mask tokens in one pass.

A few Qwen3-style decoder layers (per-head q_norm/k_norm, final norm) with no embedding or
head of their own: the block's input embeddings and the output head are the frozen
target's. The target's view of the committed text comes in as context features, the
outputs of n target layers concatenated, `fc` (n*H_t -> H, no bias), then `hidden_norm`.
In every layer the keys and values are [proj(context); proj(block)] with the layer's own
k_proj/v_proj, and the queries come from the block only; attention is bidirectional
inside the block. The context K/V of a position never change once computed, so decoding
keeps them per layer in a `ContextCache` and a step only runs the block.

Position ids (training and decoding alike): every token keeps its absolute position. The
context feature of position p (the target's hidden state after reading token p) sits at
p; the block of anchor a (the last committed token, whose hidden state the target has not
computed yet) occupies a .. a + B - 1 and sees the context at 0 .. a - 1, nothing later.

Block convention: draft j (1-based) is always the token at a + j. DFlash reads it from
slot j, so the anchor slot only conditions and B inputs give B - 1 drafts; DSpark
(dspark.py) reads it from slot j - 1, the anchor being the first prediction slot.
`first_prediction_slot` carries the difference; the config and modules here serve both,
as do the training blocks and their masks (dflash_blocks.py) and the loss weighting and
metrics (dflash_loss.py). The config's defaults follow the reference rules of
dflash_reference.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    repeat_kv,
    rotate_half,
)

from draftsmith.errors import DraftsmithError
from draftsmith.fields import DEFAULT_TILE, MethodConfig, divides, option, positive
from draftsmith.models.attention import check_backend, checkpointed, document_ids, flex_attend, is_block_mask, use_flex
from draftsmith.models.dflash_blocks import Blocks, make_blocks, sample_anchors, training_mask, window_visibility
from draftsmith.models.dflash_loss import draft_reduction, greedy_metrics, position_means
from draftsmith.models.dflash_reference import (
    auto_block_size,
    default_gamma,
    reference_context_layers,
    reference_depth,
    reference_kv_heads,
    spread_layer_ids,
    tile_draft_budget,
)
from draftsmith.models.native import load_state_strict
from draftsmith.models.target import target_shape

POSITION_WEIGHTS = ("decay", "dpace")  # DFlashConfig.position_weights (`draft_weights`)
LAYER_TYPES = ("full_attention", "sliding_attention")  # DFlashConfig.layer_types, transformers' names


@dataclass
class DFlashConfig(MethodConfig):
    """Fields left None are derived from the target by `from_target`."""

    hidden_size: int | None = option(None, "the drafter's width (None: the target's)")
    target_hidden_size: int | None = option(None, "the target's hidden width (None: read from the target)")
    num_target_layers: int | None = option(None, "the target's decoder layers (None: read from the target)")
    vocab_size: int | None = option(None, "the target's vocabulary: shared embedding and head (None: read)")
    num_layers: int | None = option(None, "drafter layers (None: 5 as the references, at most half a shallow target's)")
    num_heads: int | None = option(None, "query heads (None: the target's)")
    num_kv_heads: int | None = option(None, "KV heads (None: the target's where a reference drafter groups alike, "
                                            "else at most 4 query heads per KV head)")
    head_dim: int | None = option(None, "per-head width (None: the target's)")
    intermediate_size: int | None = option(None, "MLP width (None: the target's)")
    rms_norm_eps: float | None = option(None, "RMSNorm epsilon (None: the target's)")
    rope_theta: float | None = option(None, "RoPE base (None: the target's)")
    max_position_embeddings: int | None = option(None, "longest position (None: the target's)")
    block_size: int | str = option("auto", "B, the block drafted in one forward; auto: fill one verify tile")
    allow_large_block: bool = option(False, "silence the warning for B past the tile rule")
    num_context_layers: int | None = option(
        None, "target layers read as context (None: 5 as the references, fewer for shallow targets)")
    target_layer_ids: list[int] | None = option(
        None, 'target layers read, "output of layer i", 0-based (None: num_context_layers spread over its depth)')
    mask_token_id: int | None = option(None, "token id of the block's mask slots (None: the target's, else the tokenizer's)")
    gamma: float | None = option(None, "loss decay over draft positions, exp(-(j-1)/gamma) (None: DFlash's, by drafts per block)")
    position_weights: str = option("decay", "loss weight of draft j: decay, exp(-(j-1)/gamma); dpace, the acceptance "
                                            "it carries by the drafter's own confidence (speculators' D-PACE)")
    dpace_alpha: float = option(0.5, "D-PACE's confidence smoothing: (1 - alpha) * exp(-ce_j) + alpha, in (0, 1]")
    num_anchors: int = option(512, "blocks per sequence in one training pass")
    attention_backend: str = option("sdpa", "training attention: sdpa, flex, auto (models/attention.py)")
    sliding_window: int = option(0, "sliding_attention layers: a block sees the context keys at most this many "
                                    "positions before its anchor (speculators'; 0: every layer full attention)")
    layer_types: list[str] = option([], "per drafter layer, full_attention or sliding_attention (empty: all "
                                        "sliding when sliding_window is set, as speculators drafts)")

    # Draft j is read from slot j - 1 + first_prediction_slot (module docstring).
    @property
    def first_prediction_slot(self) -> int:
        return 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_prediction_slot

    @classmethod
    def from_target(cls, target_config, tile: int = DEFAULT_TILE, **overrides) -> "DFlashConfig":
        """The drafter for a target: its attention shape, layers spread over its depth, the
        block sized by the tile rule; `overrides` (recipe keys) win over all of it."""
        if isinstance(target_config, dict):
            target_config = SimpleNamespace(**target_config)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise DraftsmithError(f"{cls.__name__}: unknown key(s) {', '.join(unknown)}")
        t, shape = target_config, target_shape(target_config)  # shape: the fields every config spells alike
        rope = getattr(t, "rope_parameters", None) or {}
        derived = dict(
            hidden_size=shape.hidden_size, target_hidden_size=shape.hidden_size, num_target_layers=shape.num_layers,
            vocab_size=shape.vocab_size, num_layers=reference_depth(shape.num_layers),
            num_heads=shape.num_heads, num_kv_heads=reference_kv_heads(shape.num_heads, shape.num_kv_heads),
            head_dim=shape.head_dim,
            intermediate_size=shape.intermediate_size, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta") or getattr(t, "rope_theta", None) or 10000.0,
            max_position_embeddings=getattr(t, "max_position_embeddings", 32768),
            mask_token_id=getattr(t, "mask_token_id", None),
        )
        values = {**derived, **{k: v for k, v in overrides.items() if v is not None}}
        config = cls(**values)
        if config.block_size == "auto":
            config.block_size = auto_block_size(t, tile, config.first_prediction_slot)
        config.derive()
        config.check_tile(t, tile)
        return config

    SIZES = ("hidden_size", "target_hidden_size", "num_target_layers", "vocab_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "intermediate_size", "max_position_embeddings", "num_context_layers",
             "num_anchors")

    @classmethod
    def check_params(cls, params: dict, seq_len: int | None = None, target_config=None) -> None:
        """The recipe's method keys, alone, against the rows (`seq_len`) and (given the target's
        config) against what the target fills in, before any data is prepared or a module
        built: one line naming the key."""
        values = {k: v for k, v in params.items() if v is not None}
        if target_config is not None and "num_kv_heads" in values:
            values.setdefault("num_heads", target_shape(target_config).num_heads)
        positive(values, cls.SIZES)
        divides(values, "num_heads", "num_kv_heads", "each KV head serves a whole group of query heads")
        gamma = values.get("gamma")
        if gamma is not None and not gamma > 0:
            raise DraftsmithError(f"method.gamma: the loss decay over draft positions must be positive, got {gamma}")
        block = values.get("block_size")
        # A block longer than a row never fits in one: its last drafts would never train (and
        # their accuracy read 0), while decoding would draft them; refused, not warned about.
        if isinstance(block, int) and seq_len is not None and block > seq_len:
            raise DraftsmithError(f"method.block_size={block} is longer than the rows of train.seq_len={seq_len}: no "
                                  f"block fits in a row, so drafts past position {seq_len - 1} would never train; give "
                                  f"a block_size of at most {seq_len} (or longer rows)")

    def derive(self) -> "DFlashConfig":
        """Fill what follows from the rest, then refuse anything inconsistent (one line)."""
        missing = [f.name for f in dataclasses.fields(self)
                   if getattr(self, f.name) is None and f.name not in ("target_layer_ids", "gamma", "num_context_layers")]
        if missing:
            hint = " (the tokenizer's mask token)" if missing == ["mask_token_id"] else ""
            raise DraftsmithError(f"{type(self).__name__}: {', '.join(missing)} not set{hint}")
        self.check_params(dataclasses.asdict(self))
        if isinstance(self.block_size, str):
            raise DraftsmithError(f"block_size {self.block_size!r} needs the target: build the config with from_target")
        if self.drafts_per_block < 1:
            raise DraftsmithError(
                f"block_size {self.block_size!r} gives no drafts (need at least {self.first_prediction_slot + 1})"
            )
        if self.target_layer_ids is None:
            count = self.num_context_layers or reference_context_layers(self.num_target_layers)
            self.target_layer_ids = spread_layer_ids(self.num_target_layers, count)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.num_context_layers not in (None, len(self.target_layer_ids)):
            raise DraftsmithError(f"num_context_layers {self.num_context_layers} disagrees with target_layer_ids "
                                  f"{self.target_layer_ids}: set one of them")
        self.num_context_layers = len(self.target_layer_ids)
        depth = self.num_target_layers
        for i in self.target_layer_ids:
            if not 0 <= i < depth:
                raise DraftsmithError(
                    f"target_layer_ids: layer {i} is beyond the target's depth ({depth} layers, ids 0..{depth - 1})"
                )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise DraftsmithError(
                f"target_layer_ids {self.target_layer_ids} repeat a layer (a {depth}-layer target is too shallow "
                f"to spread {len(self.target_layer_ids)}); set target_layer_ids or fewer num_context_layers"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DraftsmithError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        check_backend(self.attention_backend)
        if self.position_weights not in POSITION_WEIGHTS:
            raise DraftsmithError(f"position_weights {self.position_weights!r} is not one of {', '.join(POSITION_WEIGHTS)}")
        if not 0.0 < self.dpace_alpha <= 1.0:  # also refuses NaN; at 0 the prefix products can vanish
            raise DraftsmithError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        if self.gamma is None:
            self.gamma = default_gamma(self.drafts_per_block)
        self.layer_types = resolve_layer_types(self.layer_types, self.sliding_window, self.num_layers)
        return self

    def check_tile(self, target_config, tile: int = DEFAULT_TILE) -> None:
        """Warn, with the numbers, when one verify of a full block needs a second tile."""
        group, budget = tile_draft_budget(target_config, tile)
        drafts = self.drafts_per_block
        if drafts > budget and not self.allow_large_block:
            warnings.warn(
                f"block_size {self.block_size} gives {drafts} drafts per verify, past the tile rule: "
                f"G = {group} query heads per KV head x (1 + {drafts}) rows = {group * (1 + drafts)} > tile {tile}, "
                f"so D = {budget} (block_size {budget + self.first_prediction_slot}); set allow_large_block to keep it",
                stacklevel=3,
            )

    def qwen3_config(self):
        """The transformers Qwen3Config of the backbone (for its MLP, rotary and exports)."""
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta)},
        )


def resolve_layer_types(layer_types: list[str], window: int, num_layers: int) -> list[str]:
    """Every layer's attention (`layer_types` given, or all sliding with a window, all full
    without); anything inconsistent is one line naming the key."""
    if window < 0:
        raise DraftsmithError(f"sliding_window must be 0 (off) or a number of positions, got {window}")
    kind = "sliding_attention" if window else "full_attention"
    types = list(layer_types) or [kind] * num_layers
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise DraftsmithError(f"layer_types {types}: one of {', '.join(LAYER_TYPES)} per drafter layer "
                              f"({num_layers})")
    if "sliding_attention" in types and not window:
        raise DraftsmithError("layer_types names sliding_attention layers: set sliding_window")
    return types



def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, heads, T, hd] with cos/sin [B, T, hd] (transformers' rotate_half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values also cover the context; names as in Qwen3Attention."""

    def __init__(self, qc, block_size: int = 0):
        super().__init__()
        hd, heads, kv = qc.head_dim, qc.num_attention_heads, qc.num_key_value_heads
        self.head_dim, self.groups, self.scaling = hd, heads // kv, hd**-0.5
        self.block_size = block_size  # a dense mask over several blocks goes to own_block_attend
        self.q_proj = nn.Linear(qc.hidden_size, heads * hd, bias=False)
        self.k_proj = nn.Linear(qc.hidden_size, kv * hd, bias=False)
        self.v_proj = nn.Linear(qc.hidden_size, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, qc.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, eps=qc.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=qc.rms_norm_eps)

    def project_kv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, KV, T, hd] of context or block rows."""
        shape = (*x.shape[:2], -1, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x, context_k, context_v, cos, sin, visible=None) -> torch.Tensor:
        """x: [B, Q, H] block rows; visible: bool [B, 1, Q, Tc + Q], a flex BlockMask of the
        same predicate (`block_mask_mod`), or None (all visible).

        The dense mask goes to SDPA. At training scale the mask is block-sparse (each block
        reads a context prefix and its own B keys), which flex attention exploits; at
        decode there is no mask at all.
        """
        shape = (*x.shape[:2], -1, self.head_dim)
        q = _rotate(self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        if is_block_mask(visible):
            out = flex_attend(q, k, v, visible, self.scaling)
        elif visible is not None and self.block_size and q.shape[2] > self.block_size:  # several blocks
            out = own_block_attend(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), visible, self.block_size,
                                   self.scaling)
        else:
            k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


def own_block_attend(q, k, v, visible, block_size: int, scale: float) -> torch.Tensor:
    """Attention of block rows q [B, h, Q, d] over keys [context (T); blocks (Q)] k, v
    [B, h, T + Q, d] under a dense `visible` [B|1, 1, Q, T + Q] whose block part is block-
    diagonal and whole (`block_visibility`, `layer_masks`): what SDPA computes under that mask,
    but with each row scored against its own block's keys only, so the cost is Q * (T + block)
    instead of Q * (T + Q). With N blocks per row the block part of SDPA's mask is N times
    wider than the context it hides; in a packed row, with anchors per conversation, N grows
    with the conversations in the row, and SDPA's cost with N squared."""
    batch, heads, rows, dim = q.shape
    context = k.shape[2] - rows
    n = rows // block_size
    scores = torch.matmul(q, k[:, :, :context].transpose(2, 3)) * scale
    scores = scores.masked_fill(~visible[..., :context], float("-inf"))
    blocks = lambda t: t[:, :, context:].reshape(batch, heads, n, block_size, dim)  # noqa: E731
    own = torch.matmul(q.reshape(batch, heads, n, block_size, dim), blocks(k).transpose(3, 4)) * scale
    probs = torch.cat([scores, own.reshape(batch, heads, rows, block_size)], dim=-1).softmax(-1)
    out = torch.matmul(probs[..., :context], v[:, :, :context])
    mixed = torch.matmul(probs[..., context:].reshape(batch, heads, n, block_size, block_size), blocks(v))
    return out + mixed.reshape(batch, heads, rows, dim)


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer (pre-norm residual) around DFlashAttention."""

    def __init__(self, qc, block_size: int = 0):
        super().__init__()
        self.self_attn = DFlashAttention(qc, block_size)
        self.mlp = Qwen3MLP(qc)
        self.input_layernorm = Qwen3RMSNorm(qc.hidden_size, eps=qc.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(qc.hidden_size, eps=qc.rms_norm_eps)

    def forward(self, x, context_k, context_v, cos, sin, visible=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context_k, context_v, cos, sin, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameter names follow the z-lab reference (layers.i.*, fc, hidden_norm, norm)."""

    method = "dflash"
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config.derive()
        qc = config.qwen3_config()
        n = len(config.target_layer_ids)
        # A dense mask's block part is block-diagonal: each layer's own_block_attend uses it.
        self.layers = nn.ModuleList(DFlashLayer(qc, config.block_size) for _ in range(config.num_layers))
        self.fc = nn.Linear(n * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qc)  # inv_freq is a non-persistent buffer
        self.gradient_checkpointing = False  # recompute each layer in backward (train.gradient_checkpointing)
        for module in self.modules():
            if isinstance(module, nn.Linear):  # the transformers initialisation (std 0.02)
                nn.init.normal_(module.weight, std=0.02)

    @classmethod
    def from_target(cls, target, tile: int = DEFAULT_TILE, **overrides) -> "DFlashDrafter":
        """A fresh drafter for `target` (a model or its config), sized by its config's
        `from_target` (the tile rule's `tile`); `overrides`, the recipe's keys, win."""
        return cls(cls.config_class.from_target(getattr(target, "config", target), tile=tile, **overrides))

    def native_state(self) -> dict[str, torch.Tensor]:
        return self.state_dict()  # no embedding or head of its own: the state is the file

    @classmethod
    def from_native(cls, config, state: dict, target=None, source: str = "") -> "DFlashDrafter":
        """The module from stored weights (any of our layouts); `target` is not needed."""
        # The saved dtype is the compute dtype: reloading bf16 weights into float32 would change the drafts.
        drafter = cls(config).to(state["fc.weight"].dtype if "fc.weight" in state else torch.float32)
        load_state_strict(drafter, state, source=source)
        return drafter

    @property
    def first_prediction_slot(self) -> int:
        return self.config.first_prediction_slot

    @property
    def drafts_per_block(self) -> int:
        return self.config.drafts_per_block

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per-layer context K/V of target features [B, T, n*H_t] at positions [B, T]."""
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(ctx, positions)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds, block_positions, context_kv, visible=None) -> torch.Tensor:
        """Final-normed hidden states [B, Q, H] of block rows at positions [B, Q]; `visible`
        one mask for every layer, or a dict of one per layer type (`layer_masks`)."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(x, block_positions)
        recompute = self.gradient_checkpointing and self.training
        masks = visible if isinstance(visible, dict) else dict.fromkeys(LAYER_TYPES, visible)
        for layer, kind, (k, v) in zip(self.layers, self.config.layer_types, context_kv):
            x = checkpointed(recompute, layer, x, k, v, cos, sin, masks[kind])
        return self.norm(x)

    def layer_masks(self, full, context_positions, block_positions) -> dict | object:
        """`full` (the mask of full-attention layers), and for sliding-attention layers the same
        with context keys further than sliding_window positions before their query hidden."""
        if "sliding_attention" not in self.config.layer_types:
            return full
        size = self.config.block_size
        anchors = block_positions[:, ::size].repeat_interleave(size, dim=1)  # each row's block anchor
        near = window_visibility(anchors, context_positions, self.config.sliding_window)
        own = torch.ones(*near.shape[:3], block_positions.shape[1], dtype=torch.bool, device=near.device)
        near = torch.cat([near, own], dim=-1)  # the block's own keys: all within the window
        return {"full_attention": full, "sliding_attention": near if full is None else full & near}

    def decode_hidden(self, anchor: torch.Tensor, cache: "ContextCache", embed: nn.Module) -> torch.Tensor:
        """One decode step: hidden [B, drafts, H] of the prediction slots for the block
        [anchor, MASK x (B - 1)] at positions len(cache) .. len(cache) + B - 1."""
        size = self.config.block_size
        ids = torch.full((anchor.shape[0], size), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        positions = torch.arange(len(cache), len(cache) + size, device=anchor.device).expand_as(ids)
        masks = None
        if self.config.sliding_window:  # only a sliding layer reads the cached context's positions
            past = torch.arange(len(cache), device=anchor.device).expand(ids.shape[0], -1)
            masks = self.layer_masks(None, past, positions)
        hidden = self(embed(ids), positions, cache.layers, masks)
        first = self.first_prediction_slot
        return hidden[:, first:first + self.drafts_per_block]

    def training_hidden(self, target_hidden, blocks: "Blocks", embed: nn.Module) -> torch.Tensor:
        """All blocks of a batch in one pass: prediction-slot hidden [B, N, drafts, H]."""
        seq = target_hidden.shape[1]
        kv = self.context_kv(target_hidden, blocks.context_positions)
        flex = use_flex(self.config.attention_backend, target_hidden.device)
        positions = blocks.positions.flatten(1)
        if flex:  # one BlockMask per layer type
            visible = {kind: training_mask(blocks.anchors, seq, self.config.block_size, True, blocks.docs,
                                           self.window_of(kind), blocks.context_positions, positions)
                       for kind in set(self.config.layer_types)}
        else:
            full = training_mask(blocks.anchors, seq, self.config.block_size, False, blocks.docs)
            visible = self.layer_masks(full, blocks.context_positions, positions)
        hidden = self(embed(blocks.input_ids.flatten(1)), positions, kv, visible)
        first = self.first_prediction_slot
        hidden = hidden.view(*blocks.anchors.shape, self.config.block_size, -1)
        return hidden[:, :, first:first + self.drafts_per_block]

    def window_of(self, kind: str) -> int:
        return self.config.sliding_window if kind == "sliding_attention" else 0

    def sample_blocks(self, input_ids, loss_mask, generator=None, anchors=None, position_ids=None) -> "Blocks":
        """Blocks at `anchors`, or drawn from `generator`; `position_ids` of a packed batch
        (data/packing.py) keep every block inside its own conversation."""
        docs = None if position_ids is None else document_ids(position_ids)
        if anchors is None:
            anchors = sample_anchors(loss_mask, self.config.num_anchors, generator, docs)
        return make_blocks(input_ids, loss_mask, anchors, self.config, position_ids)

    def loss(self, target_hidden, input_ids, loss_mask, embed: nn.Module,
             head: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator | None = None,
             anchors: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Position-weighted cross-entropy over many random blocks per sequence.

        target_hidden [B, T, n*H_t] (target_layer_ids order), input_ids and loss_mask [B, T];
        anchors [B, N] (-1 pads) instead of drawing them from `generator`; position_ids [B, T]
        of a packed batch.
        Metrics: conditional greedy accuracy acc_1..acc_{drafts}, tau_est, and the
        cross-entropy of each draft position ce_1..ce_{drafts}."""
        blocks = self.sample_blocks(input_ids, loss_mask, generator, anchors, position_ids)
        logits = head(self.training_hidden(target_hidden, blocks, embed)).float()
        # SpecForge's DFlash weights (specforge/algorithms/common/dflash_family_model.py:418-432,
        # @ a6b6b02): every loss-masked draft inside the sequence, drafts past a gap in the
        # mask included, not only the prefix (DSpark keeps DeepSpec's prefix). The loss parity
        # test (tests/test_loss_parity.py) holds us to it.
        ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view_as(blocks.in_data)
        loss = draft_reduction(self.config, ce, blocks.in_data)(ce)
        metrics = {"ce": float(loss.detach()), **greedy_metrics(logits.argmax(-1), blocks),
                   **position_means("ce", ce, blocks.label_mask)}
        return loss, metrics


class ContextCache:
    """Per-layer context K/V ([B, KV, T, hd]) of the committed positions that have target
    hidden states, i.e. every committed token but the last (which is the next anchor)."""

    def __init__(self):
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def crop(self, length: int) -> None:
        self.layers = [(k[:, :, :length], v[:, :, :length]) for k, v in self.layers]

    def extend(self, drafter: DFlashDrafter, target_hidden: torch.Tensor, start: int) -> None:
        """Append the context of target features [B, T, n*H_t] at positions start.. (the
        cache is cropped to `start` first, so a re-sent position replaces the old one)."""
        self.crop(start)
        if target_hidden.shape[1] == 0 and self.layers:
            return
        positions = torch.arange(start, start + target_hidden.shape[1], device=target_hidden.device)
        new = drafter.context_kv(target_hidden, positions.expand(target_hidden.shape[0], -1))
        if not self.layers:
            self.layers = new
        else:
            self.layers = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                           for (k, v), (nk, nv) in zip(self.layers, new)]


def concat_layers(hidden: dict[int, torch.Tensor], layer_ids: list[int]) -> torch.Tensor:
    """The context features of captured layers, in the drafter's layer order, on the last dim."""
    missing = [i for i in layer_ids if i not in hidden]
    if missing:
        raise DraftsmithError(f"target hidden states of layer(s) {missing} were not captured")
    return torch.cat([hidden[i] for i in layer_ids], dim=-1)


def check_target(drafter: DFlashDrafter, target) -> None:
    """A drafter trained for another target fails here in one line, not deep in a matmul."""
    c, t = drafter.config, target.config
    for what, want, got in (("layers", c.num_target_layers, t.num_hidden_layers),
                            ("hidden size", c.target_hidden_size, t.hidden_size),
                            ("vocabulary", c.vocab_size, t.vocab_size)):
        if want != got:
            raise DraftsmithError(f"this drafter was built for a target with {what} {want}, the target has {got}")
