"""EAGLE-3: one decoder layer over a fusion of three target layers, trained with
training-time test (TTT).

The drafter reads, at each of its positions p, a pair (hidden_p, token x_{p+1}): hidden_p
is `fc` of the target's three captured layer outputs at p (ascending layer order, the
order in which SGLang and vLLM capture them) for committed positions, or the drafter's
own output at the previous step while it drafts. Its one layer (`midlayer`) is

    a   = self_attn(concat(input_layernorm(embed(x_{p+1})), hidden_norm(hidden_p)))  # q, k, v read 2H
    h   = hidden_p + a                                      # the residual is the unnormalised hidden
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))                             # over the draft vocabulary

`out` (pre-norm) is what the next drafting step takes as its hidden, as in SGLang's
`llama_eagle3.py`. Draft id i is target id i + d2t[i] (`data/draft_vocab.py`). The
embedding is the target's, frozen; H therefore equals the target's hidden size.

Module names are the SGLang/vLLM checkpoint names (`midlayer.self_attn.q_proj`, `fc`,
`norm`, `lm_head`, `d2t`, `t2d`), so export is a copy without renaming.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from draftsmith.errors import DraftsmithError
from draftsmith.fields import MethodConfig, divides, option, positive
from draftsmith.models.attention import (
    block_mask,
    check_backend,
    checkpointed,
    document_ids,
    flex_attend,
    is_block_mask,
    positions_of,
    use_flex,
)
from draftsmith.models.native import load_state_strict
from draftsmith.models.target import target_shape

METHOD = "eagle3"
NUM_FUSED_LAYERS = 3  # SGLang and vLLM build fc as Linear(3 * target_hidden_size, hidden_size)
# Eagle3Config.loss: the TTT step objective (`ttt_step_loss`). ce is soft cross-entropy;
# lk_lambda and lk_alpha are SpecForge 0.2.0's LK losses (its lk_loss_type lambda / alpha).
LOSSES = ("ce", "lk_lambda", "lk_alpha")


def default_layer_ids(num_layers: int) -> list[int]:
    """The reference choice [1, N//2 - 1, N - 4] (outputs of those layers, 0-based).

    Below 7 layers it collides, so tiny targets take the lowest, a middle and the
    second-to-last layer. Never the last layer: the engines capture a layer's output at
    the next layer's input, so the last layer's output is not available to them.
    """
    if num_layers >= 7:
        return [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers >= 4:
        return [0, (num_layers - 2) // 2, num_layers - 2]
    raise DraftsmithError(f"EAGLE-3 needs a target of at least 4 decoder layers, this one has {num_layers}")


@dataclass
class Eagle3Config(MethodConfig):
    """Fields left None are derived from the target by `from_target` (a recipe sets only
    the keys it names); `derive` then refuses anything missing or inconsistent."""

    hidden_size: int | None = option(None, "drafter width; must equal the target's (the embedding is shared)")
    target_hidden_size: int | None = option(None, "the target's hidden width (None: read from the target)")
    intermediate_size: int | None = option(None, "MLP width of the draft layer (None: the target's)")
    num_heads: int | None = option(None, "query heads (None: the target's)")
    num_kv_heads: int | None = option(None, "KV heads (None: the target's)")
    head_dim: int | None = option(None, "per-head width (None: the target's)")
    vocab_size: int | None = option(None, "the target's vocabulary (None: read from the target)")
    # min(vocab, 32000) is the usual size for 128k-152k vocabularies.
    draft_vocab_size: int | None = option(None, "tokens the draft head predicts (None: min(vocab, 32000))")
    target_layer_ids: list[int] | None = option(
        None, "the three fused target layers, output-of-layer ids, 0-based (None: default_layer_ids)")
    rms_norm_eps: float | None = option(None, "RMSNorm epsilon (None: the target's)")
    rope_theta: float | None = option(None, "RoPE base (None: the target's)")
    max_position_embeddings: int | None = option(None, "longest position (None: the target's)")
    ttt_length: int = option(7, "training-time-test steps: the drafter unrolls on its own outputs this many times")
    ttt_decay: float = option(0.8, "loss weight of TTT step j is ttt_decay ** j")
    attention_backend: str = option("sdpa", "TTT attention: sdpa (dense mask), flex, auto (models/attention.py)")
    loss: str = option("ce", "TTT step loss: ce, soft cross-entropy to the target; lk_lambda or lk_alpha, SpecForge's "
                             "LK losses on the expected acceptance sum_v min(p_target, p_draft) (docs/design.md)")
    kl_scale: float = option(1.0, "lk_lambda: the cross-entropy's weight is kl_scale * exp(-kl_decay * acceptance), "
                                  "the rest on 1 - acceptance; in [0, 1]")
    kl_decay: float = option(1.0, "lk_lambda: how fast the cross-entropy's weight falls as acceptance rises; >= 0")
    sliding_window: int = option(0, "the draft layer attends to context keys less than this many positions before "
                                    "the last committed one (speculators' sliding EAGLE-3); 0: full attention")

    SIZES = ("hidden_size", "target_hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
             "vocab_size", "draft_vocab_size", "max_position_embeddings", "ttt_length")

    @classmethod
    def check_params(cls, params: dict, seq_len: int | None = None, target_config=None) -> None:
        """The recipe's method keys, alone and (given the target's config) with what the target
        would fill in, before any data is prepared or a module built: one line naming the key."""
        values = {k: v for k, v in params.items() if v is not None}
        if target_config is not None:
            shape = target_shape(target_config)
            values = {"hidden_size": shape.hidden_size, "num_heads": shape.num_heads,
                      "num_kv_heads": shape.num_kv_heads, **values}
        positive(values, cls.SIZES)
        # The draft layer is a transformers Llama layer, whose config refuses such a width.
        divides(values, "hidden_size", "num_heads", "EAGLE-3's draft layer is a Llama layer; hidden_size is the "
                                                    "target's unless set")
        divides(values, "num_heads", "num_kv_heads", "each KV head serves a whole group of query heads")
        loss = values.get("loss")
        if loss is not None and loss not in LOSSES:
            raise DraftsmithError(f"method.loss: {loss!r} is not one of {', '.join(LOSSES)}")
        # Past these bounds lk_lambda's weight on 1 - acceptance turns negative: it would train acceptance down.
        scale = values.get("kl_scale")
        if scale is not None and not 0.0 <= scale <= 1.0:  # also refuses NaN
            raise DraftsmithError(f"method.kl_scale: lk_lambda's cross-entropy weight at zero acceptance must be in "
                                  f"[0, 1], got {scale}")
        decay = values.get("kl_decay")
        if decay is not None and not decay >= 0.0:
            raise DraftsmithError(f"method.kl_decay: must be >= 0 (the cross-entropy's weight falls as acceptance "
                                  f"rises), got {decay}")

    @classmethod
    def from_target(cls, target, **overrides) -> "Eagle3Config":
        """A drafter as wide as the target (model or config); non-None overrides win."""
        config = getattr(target, "config", target)
        shape = target_shape(config)
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise DraftsmithError(f"{cls.__name__}: unknown key(s) {', '.join(unknown)}")
        rope = getattr(config, "rope_parameters", None) or {}
        derived = dict(
            hidden_size=shape.hidden_size,
            target_hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            vocab_size=shape.vocab_size,
            draft_vocab_size=min(shape.vocab_size, 32000),
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=config.max_position_embeddings,
        )
        chosen = {k: v for k, v in overrides.items() if v is not None}
        if "target_layer_ids" not in chosen:
            chosen["target_layer_ids"] = default_layer_ids(shape.num_layers)
        made = cls(**{**derived, **chosen}).derive()
        check_target_fits(made, config)
        return made

    def derive(self) -> "Eagle3Config":
        """Check the config is complete and consistent (one-line errors); returns self."""
        missing = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]
        if missing:
            raise DraftsmithError(f"{type(self).__name__}: {', '.join(missing)} not set (build it with from_target)")
        self.check_params(dataclasses.asdict(self))
        ids = sorted(int(i) for i in self.target_layer_ids)
        if len(set(ids)) != NUM_FUSED_LAYERS or ids[0] < 0:
            raise DraftsmithError(
                f"EAGLE-3 target_layer_ids must be {NUM_FUSED_LAYERS} distinct layer ids >= 0, "
                f"got {self.target_layer_ids}"
            )
        self.target_layer_ids = ids  # engines concatenate in ascending layer order whatever the list says
        if self.hidden_size != self.target_hidden_size:
            raise DraftsmithError(
                f"EAGLE-3 hidden_size {self.hidden_size} must equal the target's {self.target_hidden_size}: "
                "the drafter shares the target's embedding"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftsmithError(
                f"draft vocabulary of {self.draft_vocab_size} tokens does not fit "
                f"the target vocabulary of {self.vocab_size}"
            )
        if self.ttt_length < 1 or not 0.0 < self.ttt_decay <= 1.0:
            raise DraftsmithError(
                f"EAGLE-3 ttt_length must be >= 1 and ttt_decay in (0, 1], got {self.ttt_length} and {self.ttt_decay}"
            )
        check_backend(self.attention_backend)
        if self.sliding_window < 0:
            raise DraftsmithError(f"EAGLE-3 sliding_window must be 0 (off) or a number of positions, got "
                                  f"{self.sliding_window}")
        return self

    def llama_config(self) -> LlamaConfig:
        """The transformers config of the building blocks we reuse (and of the export)."""
        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
            num_hidden_layers=1, hidden_act="silu", attention_bias=False, mlp_bias=False,
        )


def check_target_fits(config: Eagle3Config, target) -> None:
    """One-line errors when a drafter cannot run against this target (model or config)."""
    shape = target_shape(getattr(target, "config", target))
    last = shape.num_layers - 2
    bad = [i for i in config.target_layer_ids if i > last]
    if bad:
        raise DraftsmithError(
            f"EAGLE-3 target layer ids {config.target_layer_ids}: the target has {shape.num_layers} layers, so ids "
            f"must be in 0..{last} (engines read a layer's output at the next layer's input; {bad} cannot be captured)"
        )
    if (shape.vocab_size, shape.hidden_size) != (config.vocab_size, config.target_hidden_size):
        raise DraftsmithError(
            f"EAGLE-3 drafter expects a target with vocabulary {config.vocab_size} and hidden size "
            f"{config.target_hidden_size}, this target has {shape.vocab_size} and {shape.hidden_size}"
        )


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide concat and whose o_proj writes H."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q [B, heads, Q, d] and k, v [B, kv_heads, Q, d]."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v


class Eagle3Layer(nn.Module):
    """The `midlayer`; split around the attention core so training (TTT) and cached
    decoding share every projection and differ only in which keys a query sees."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        blocks = c.llama_config()
        self.self_attn = Eagle3Attention(c)
        self.mlp = LlamaMLP(blocks)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def attention_inputs(self, embeds, hidden, cos, sin):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.project(x, cos, sin)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = hidden + self.self_attn.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


def attend(q, k, v, visible, own_k=(), own_v=()) -> torch.Tensor:
    """Softmax attention of q [B, h, Q, d] over keys k/v [B, kv, L, d] where `visible`
    [B or 1, 1, Q, L] (bool) is True, plus, for TTT, the keys of unrolled steps 1..i at
    the query's own index (`own_k[j]` [B, kv, Q, d], always visible; the last is its own).
    Returns [B, Q, h * d]."""
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    keys, values = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = [torch.matmul(q, keys.transpose(2, 3)).mul_(scale).masked_fill_(~visible, float("-inf"))]
    scores += [(q * repeat_kv(kj, groups)).sum(-1, keepdim=True).mul_(scale) for kj in own_k]
    probs = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
    length = keys.shape[2]
    out = torch.matmul(probs[..., :length], values)
    for j, vj in enumerate(own_v):
        out = out + probs[..., length + j : length + j + 1] * repeat_kv(vj, groups)
    return out.transpose(1, 2).flatten(2)


def ttt_mask_mod(length: int, real: torch.Tensor | None, docs: torch.Tensor | None = None, window: int = 0):
    """The visibility of TTT step i as a flex-attention mask_mod over the concatenated keys
    [step 0 (`length`); step 1; ...; step i]: `attend`'s rule. Step-0 key k is visible to
    query q when k <= q and k is a real token (`real` [B, length] bool, None: all) of the
    query's conversation (`docs` [B, length] in a packed row, None: one), within `window`
    of q (q - window < k; 0: any), or k == q; a key of a later step only at the query's own index."""

    def mask_mod(b, h, q, k):
        pos = k % length
        context = pos <= q
        if real is not None:
            context = context & (real[b, pos] | (pos == q))
        if docs is not None:
            context = context & (docs[b, pos] == docs[b, q])
        if window:
            context = context & (pos > q - window)
        return torch.where(k < length, context, pos == q)

    return mask_mod


class DraftKV:
    """The drafter's own KV cache for one batch of sequences: [B, kv_heads, L, head_dim]."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, keep: int) -> None:
        if keep < len(self):
            self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]


class Eagle3Drafter(nn.Module):
    method = METHOD

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = c = config.derive()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's; set by copy_target_embedding
        self.fc = nn.Linear(NUM_FUSED_LAYERS * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(c.llama_config())
        self.gradient_checkpointing = False  # recompute each TTT step in backward (train.gradient_checkpointing)
        # Until a vocabulary is built: the first draft_vocab_size target ids.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)

    def native_state(self) -> dict[str, torch.Tensor]:
        """What the native format stores: everything but the embedding (the target's)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    @classmethod
    def from_native(cls, config: Eagle3Config, state: dict, target: nn.Module, source: str) -> "Eagle3Drafter":
        """Build a drafter from stored weights (no embedding) in their dtype, for `target`."""
        check_target_fits(config, target)
        drafter = cls(config)
        if "fc.weight" in state:
            drafter.to(state["fc.weight"].dtype)
        # The embedding is not stored: a stand-in passes the strict check, the target's replaces it.
        load_state_strict(drafter, {**state, "embed_tokens.weight": drafter.embed_tokens.weight}, source=source)
        drafter.set_draft_vocab(drafter.d2t.clone(), drafter.t2d.clone())  # refuse inconsistent maps
        return drafter.to(next(target.parameters()).device).copy_target_embedding(target).eval()

    @classmethod
    def from_target(cls, target: nn.Module, **overrides) -> "Eagle3Drafter":
        """A fresh drafter for `target`, its embedding copied in, on the target's device."""
        drafter = cls(Eagle3Config.from_target(target, **overrides))
        param = next(target.parameters())
        return drafter.to(param.device).copy_target_embedding(target)

    def copy_target_embedding(self, target: nn.Module) -> "Eagle3Drafter":
        check_target_fits(self.config, target)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        return self

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a vocabulary from `data.draft_vocab.build_draft_vocab`, checked for consistency."""
        d2t, t2d = torch.as_tensor(d2t).long().cpu(), torch.as_tensor(t2d).bool().cpu()
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise DraftsmithError(
                f"draft vocabulary maps of sizes {d2t.numel()}/{t2d.numel()} do not fit "
                f"draft vocabulary {self.d2t.numel()} / target vocabulary {self.t2d.numel()}"
            )
        ids = torch.arange(d2t.numel()) + d2t
        if not torch.equal(t2d.nonzero().flatten(), ids):
            raise DraftsmithError("draft vocabulary maps disagree: t2d must be True exactly at i + d2t[i], increasing")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of every draft id: [draft_vocab]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    # ---- pieces shared by training and decoding ---------------------------------------

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[.., 3 * H_t] (captured layers concatenated in ascending id order) -> [.., H]."""
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of drafter outputs."""
        return self.lm_head(self.norm(hidden))

    def step(self, input_ids, hidden, positions, cache: DraftKV, visible=None, committed: int | None = None):
        """A cached forward over Q new entries; returns their outputs [B, Q, H] (pre-norm).

        input_ids [B, Q]: each entry's token (x_{p+1} for position p); hidden [B, Q, H]:
        `fuse`d target features or the drafter's own earlier outputs; positions [B, Q];
        visible [Q, len(cache) + Q] bool, default causal. The new keys join `cache`.
        `committed`: the cache rows of committed positions (row = position) when the new
        entries are drafts; a sliding window then counts from the last of them, as training's
        TTT steps do (`ttt_logits`); None: the entries are committed positions themselves.
        """
        cos, sin = self.rotary_emb(hidden, positions)
        q, k, v = self.midlayer.attention_inputs(self.embed_tokens(input_ids), hidden, cos, sin)
        keys, values = cache.append(k, v)
        past, new = keys.shape[2] - q.shape[2], q.shape[2]
        if visible is None:
            visible = torch.ones(new, past + new, dtype=torch.bool, device=q.device).tril_(past)
        if self.config.sliding_window:
            rows = torch.arange(past + new, device=q.device)
            last = positions[0] if committed is None else torch.full((new,), committed - 1, device=q.device)
            visible = visible & ~(rows[None, :] <= last[:, None] - self.config.sliding_window)
        return self.midlayer.finish(hidden, attend(q, keys, values, visible[None, None]))

    # ---- training-time test ------------------------------------------------------------

    def ttt_logits(self, target_hidden, input_ids, attention_mask=None, position_ids=None) -> list[torch.Tensor]:
        """Draft logits [B, T, V_d] of every unrolled step; see `loss` for the alignment."""
        batch, length = input_ids.shape
        device = input_ids.device
        hidden = self.fuse(target_hidden)
        positions = positions_of(input_ids, position_ids)
        docs = None if position_ids is None else document_ids(positions)
        visible = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
        if attention_mask is not None:  # padded keys are hidden; a query always sees itself
            eye = torch.eye(length, dtype=torch.bool, device=device)
            visible = visible & (attention_mask.bool()[:, None, :] | eye)
        if docs is not None:  # a packed row: each conversation sees only itself
            visible = visible & (docs[:, :, None] == docs[:, None, :])
        window = self.config.sliding_window
        if window:  # every TTT step of position t reads the keys of t - window + 1 .. t, as speculators trains
            index = torch.arange(length, device=device)
            visible = visible & (index[None, :] > index[:, None] - window)
        visible = visible.expand(batch, length, length)[:, None]
        flex = use_flex(self.config.attention_backend, device)
        if flex:  # one BlockMask per step: step i reads (i + 1) * length keys
            real = None if attention_mask is None else attention_mask.bool()
            mask_mod = ttt_mask_mod(length, real, docs, window)
            visible = [block_mask(mask_mod, batch, length, (i + 1) * length, device)
                       for i in range(self.config.ttt_length)]
        recompute = self.gradient_checkpointing and self.training
        step_k, step_v, steps = (), (), []
        for i in range(self.config.ttt_length):
            tokens = F.pad(input_ids[:, 1 + i :], (0, 1 + i))  # x_{t+1+i}; 0 where past the end (masked)
            cos, sin = self.rotary_emb(hidden, positions + i)
            hidden, k, v = checkpointed(recompute, self.ttt_step, self.embed_tokens(tokens), hidden, cos, sin,
                                        visible[i] if flex else visible, step_k, step_v)
            step_k, step_v = (*step_k, k), (*step_v, v)
            steps.append(self.logits(hidden))
        return steps

    def ttt_step(self, embeds, hidden, cos, sin, visible, step_k, step_v):
        """One unrolled step over keys of the steps before it (`step_k`, step 0 first) and
        its own: (output [B, T, H], its k, its v)."""
        q, k, v = self.midlayer.attention_inputs(embeds, hidden, cos, sin)
        keys, values = (*step_k, k), (*step_v, v)
        if is_block_mask(visible):
            attn = flex_attend(q, torch.cat(keys, 2), torch.cat(values, 2), visible, q.shape[-1] ** -0.5)
            attn = attn.transpose(1, 2).flatten(2)
        else:
            attn = attend(q, keys[0], values[0], visible, keys[1:], values[1:])
        return self.midlayer.finish(hidden, attn), k, v

    def teacher(self, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All `loss` reads of the target's logits [.., V] (what a feature cache stores): the
        target's log-probabilities of the draft-vocabulary tokens [.., V_d], normalised over
        the full vocabulary (their softmax is the cross-entropy's teacher; their exp is the
        target's own probability, which LK's acceptance reads), in the logits' dtype, and
        the full-vocabulary argmax [..]."""
        draft = target_logits[..., self.draft_to_target]
        return (draft.float() - log_normaliser(target_logits)).to(draft.dtype), target_logits.argmax(-1)

    def forward(self, target_hidden, input_ids, target_logits, loss_mask, attention_mask=None, target_top=None,
                position_ids=None):
        """The training step is a forward, so that DDP/FSDP/ZeRO wrappers see it: call the
        wrapped module as `model(...)`; unwrapped, `loss(...)` is the same call."""
        return self.loss(target_hidden, input_ids, target_logits, loss_mask, attention_mask, target_top, position_ids)

    def loss(self, target_hidden, input_ids, target_logits, loss_mask, attention_mask=None, target_top=None,
             position_ids=None):
        """TTT loss over `ttt_length` unrolled steps -> (loss, metrics).

        Inputs all come from one target forward over `input_ids` [B, T]: target_hidden
        [B, T, 3 * H_t], target_logits [B, T, V] (or, with `target_top` given, `teacher`'s
        pair: draft-vocabulary log-probabilities [B, T, V_d] and target_top [B, T]);
        loss_mask [B, T] marks the tokens to learn to predict (assistant tokens); attention_mask [B, T] marks real
        tokens (pads are hidden from attention; positions are 0..T-1, as in a target forward
        given no position ids, or a packed batch's `position_ids` [B, T], data/packing.py: then
        a position attends to and learns labels of its own conversation only).

        Alignment. Drafter index t, step i (0-based) is the i-th draft of a chain whose
        committed context ends at position t: it reads (hidden, token x_{t+1+i}) at RoPE
        position t + i, where hidden is fc(target features at t) for i = 0 and the step
        i-1 output at t otherwise, and it is trained against target_logits[t + 1 + i],
        the target's distribution for token x_{t+2+i}, where loss_mask[t + 2 + i] is set.
        It attends to the step-0 keys of positions <= t (the committed context) and to
        the keys of steps 1..i at index t (its own chain): exactly the keys chain drafting
        sees at decode time, so training and decoding compute the same function, and the
        function SpecForge's TTT (sdpa path) computes (tests/test_loss_parity.py). SafeAILab's
        EAGLE-3 also hides step-0 keys t-i+1..t from step i (SafeAILab/EAGLE#247); we do
        not, since decoding never hides them. SpecForge gates the same label by
        loss_mask[t + i] (its model.py:493 with the unshifted mask); we keep the label's
        own mask, so that each span's first two tokens train and the two after it do not.

        Loss: soft cross-entropy to the target distribution restricted to the draft
        vocabulary and renormalised, averaged over positions whose target argmax has a
        draft id (others cannot be matched; the reference drops them too), summed as
        sum_i ttt_decay**i * loss_i. SpecForge divides step i's sum by all B * T indices
        instead (specforge/core/loss.py `_compute_loss`, a mean over B * T); we divide by
        the trained count, so that a row's gradient does not depend on the batch's padded
        width or on its neighbours' prompt lengths (batches are cut to their longest row:
        tests/test_padding.py). With `loss` lk_lambda or lk_alpha, loss_i is SpecForge's
        LK loss over the same positions instead (`ttt_step_loss`), and the same sum.
        Metrics: loss_k, acc_k (k = i + 1: draft argmax ==
        target argmax over all masked positions, so an argmax outside the draft
        vocabulary counts as a miss, as in SpecForge), tau_est = 1 + sum_k prod_{j<=k}
        acc_j, and vocab_coverage (masked positions whose target argmax has a draft id);
        with an LK loss also accept_k, the step's expected acceptance that LK trains.
        """
        length = input_ids.shape[1]
        steps = self.ttt_logits(target_hidden, input_ids, attention_mask, position_ids)
        draft_ids = self.draft_to_target
        lk = self.config.loss != "ce"
        with torch.no_grad():
            if target_top is None:
                target_logits, target_top = self.teacher(target_logits)
            teacher = target_logits.float().softmax(-1)  # [B, T, V_d]
            # The target's own probability of each draft token, for LK's acceptance.
            target_mass = target_logits.float().exp() if lk else None
            reachable = self.t2d[target_top]
        learn = loss_mask.bool() if attention_mask is None else loss_mask.bool() & attention_mask.bool()
        # A label of another conversation than its position's (a packed row) is never learned.
        docs = None if position_ids is None else document_ids(position_ids)
        same = (lambda shift: docs[:, shift:] == docs[:, : length - shift]) if docs is not None else None
        total = target_hidden.new_zeros((), dtype=torch.float32)
        step_losses, step_accs, step_accepts = [], [], []
        for i, logits in enumerate(steps):
            n = max(length - 2 - i, 0)  # indices t whose label x_{t+2+i} is inside the sequence
            mask = learn[:, 2 + i : 2 + i + n]
            if same is not None:
                mask = mask & same(2 + i)
            trained = mask & reachable[:, 1 + i : 1 + i + n]
            pred = logits[:, :n].float()
            mass = target_mass[:, 1 + i : 1 + i + n] if lk else None
            step_loss, accept = ttt_step_loss(self.config, pred, teacher[:, 1 + i : 1 + i + n], trained, mass)
            total = total + self.config.ttt_decay**i * step_loss
            step_losses.append(step_loss.detach())
            if lk:
                step_accepts.append(accept)
            hits = (draft_ids[pred.argmax(-1)] == target_top[:, 1 + i : 1 + i + n]) & mask
            step_accs.append(hits.sum() / mask.sum().clamp(min=1))
        first = learn[:, 2:] if same is None else learn[:, 2:] & same(2)
        coverage = (first & reachable[:, 1:-1]).sum() / first.sum().clamp(min=1)
        values = torch.stack(step_losses + step_accs + [coverage] + step_accepts).tolist()  # one device sync
        k = len(steps)
        metrics = {f"loss_{j + 1}": values[j] for j in range(k)}
        metrics.update({f"acc_{j + 1}": values[k + j] for j in range(k)})
        metrics["tau_est"] = tau_estimate(values[k : 2 * k])
        metrics["vocab_coverage"] = values[2 * k]
        if lk:
            metrics.update({f"accept_{j + 1}": values[2 * k + 1 + j] for j in range(k)})
        return total, metrics


def log_normaliser(logits: torch.Tensor, elements: int = 1 << 26) -> torch.Tensor:
    """logsumexp over the last dim in float32, keepdim, a slice of rows at a time (about
    `elements` floats), so a half-precision [B, T, V] is never copied whole to float32."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        return logits.new_zeros(*logits.shape[:-1], 1, dtype=torch.float32)
    rows = max(1, elements // max(1, flat.shape[-1]))
    out = torch.cat([part.float().logsumexp(-1) for part in flat.split(rows)])
    return out.view(*logits.shape[:-1], 1)


def ttt_step_loss(config: Eagle3Config, pred, teacher, trained, target_mass=None):
    """One TTT step's loss -> (loss, expected acceptance, detached; None for ce).

    pred [B, n, V_d]: the draft logits (float32); teacher [B, n, V_d]: the target's
    distribution renormalised over the draft vocabulary; trained [B, n] bool: the positions
    that train (loss-masked, target argmax reachable), over whose count every term is
    averaged; target_mass [B, n, V_d]: the target's own (full-vocabulary) probabilities of
    the draft tokens, for the LK losses only.

    ce: the mean soft cross-entropy CE = -sum_v teacher_v log q_v (q = softmax(pred)).
    LK (SpecForge 0.2.0 core/lk_loss.py, as its algorithms/eagle3/model.py calls it):
    per position the expected acceptance a = sum_v min(target_mass_v, q_v); A is its mean,
    L the mean of log a (0 where a = 0). lk_alpha: -L. lk_lambda: w * CE + (1 - w) * (1 - A),
    w = kl_scale * exp(-kl_decay * A) with A detached in w.
    """
    count = trained.sum().clamp(min=1)
    if config.loss == "ce":
        ce = -(teacher * pred.log_softmax(-1)).sum(-1)
        return (ce * trained).sum() / count, None
    accept = torch.minimum(pred.softmax(-1), target_mass).sum(-1)
    rate = (accept * trained).sum() / count
    if config.loss == "lk_alpha":
        # log a where a > 0, else 0 (as SpecForge), without a NaN gradient through log(0).
        log_accept = torch.where(accept > 0, accept, torch.ones_like(accept)).log()
        return -(log_accept * trained).sum() / count, rate.detach()
    ce = -(teacher * pred.log_softmax(-1)).sum(-1)
    ce = (ce * trained).sum() / count
    weight = config.kl_scale * torch.exp(-config.kl_decay * rate.detach())
    return weight * ce + (1 - weight) * (1 - rate), rate.detach()


def tau_estimate(accs: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the expected accepted length of a greedy chain."""
    tau, run = 1.0, 1.0
    for acc in accs:
        run *= acc
        tau += run
    return tau


# ---- native format: models/native.py (save_drafter / load_drafter) ------------------------
