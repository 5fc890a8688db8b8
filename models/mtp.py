"""DeepSeek-V3-style multi-token prediction (MTP) modules, trained jointly with the target.

Depth k (1-based) at sequence position i reads the previous depth's hidden state h^{k-1}_i
and the embedding of token t_{i+k}, and predicts t_{i+k+1}. h^0 is the target's hidden
state *after its final norm* (the input of its output head), because that is what the
serving engines hand a loaded module: vLLM's DeepSeekMTP and SGLang's NextN take the
target's `hidden_states` output, and `DeepseekV2Model.forward` ends in `self.norm`. The
norm is applied by `engine_hidden` in training and decoding alike, so MTP gradients reach
the final norm too, and one checkpoint means the same here and in an engine:

    h'  = eh_proj(concat(enorm(emb(t_{i+k})), hnorm(h^{k-1}_i)))    # embedding first
    h^k = block(h')                                                  # one causal decoder layer
    logits = head(shared_head.norm(h^k))                             # the target's head, shared

The block is the target's own decoder-layer class, so the MTP modules load into any
engine that builds them from the target's config. The embedding and output head are the
target's (shared, never copied).

`init: from_target` starts from the modules a checkpoint ships (DeepSeek-V3's extra layers,
Qwen3-Next's `mtp.*`; read by models/formats/mtp.py) instead of new ones, and
`freeze_target` trains them alone against the frozen target (train/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fields import MethodConfig, option, positive
from draftsmith.models.native import load_state_strict
from draftsmith.models.target import cache_kwarg, decoder_layers, final_norm, rotary_embedding

MTP_DIR = "mtp"  # the MTP modules sit in this subfolder of the saved target


CHAIN_INPUTS = ("hidden", "normed")  # MTPConfig.chain_input
INITS = ("new", "from_target")  # MTPConfig.init
# Families whose RMSNorm scales by (1 + weight), weight stored around 0 (Qwen3NextRMSNorm): the
# MTP norms follow, so a shipped checkpoint's norm weights load and export as they are stored.
ZERO_CENTERED_NORMS = ("qwen3_next",)


@dataclass
class MTPConfig(MethodConfig):
    num_depths: int = option(2, "K: MTP modules, depth k predicting the token k + 1 ahead")
    # Joint loss L_main + lambda/K * sum_k L_k; DeepSeek-V3 used 0.3 for the first ~2/3 of
    # training, then 0.1.
    lambda_early: float = option(0.3, "lambda, the MTP loss weight, before lambda_switch")
    lambda_late: float = option(0.1, "lambda from lambda_switch on")
    lambda_switch: float = option(0.67, "fraction of max_steps at which lambda drops")
    # What a module passes to the next depth: DeepSeek-V3 (and vLLM's DeepSeekMTP, SGLang's NextN)
    # its block's output; speculators' MTPDraftModel and vLLM's Qwen3-Next MTP the output after
    # the module's final norm (shared_head.norm). Drafts past the first depend on it.
    chain_input: str = option("hidden", "what depth k + 1 reads of depth k: hidden, the block's output "
                                        "(DeepSeek-V3, SGLang, vLLM DeepSeekMTP); normed, after shared_head.norm "
                                        "(speculators, vLLM Qwen3-Next MTP)")
    init: str = option("new", "new: fresh modules; from_target: the modules the target's checkpoint ships "
                              "(DeepSeek-V3 style model.layers.{N+k}, Qwen3-Next style mtp.*), K and chain_input "
                              "taken from it")
    freeze_target: bool = option(False, "train the MTP modules alone against the frozen target (no main loss; "
                                        "depth k weighted depth_decay**(k-1)); false: jointly with the target")
    # speculators' FastMTP weights its steps 0.6**(k-1), normalised (0.51, 0.31, 0.18 for three).
    depth_decay: float = option(0.6, "freeze_target: depth k's loss weight depth_decay**(k-1), normalised to sum 1")

    @classmethod
    def check_params(cls, params: dict, seq_len: int | None = None, target_config=None) -> None:
        """The recipe's method keys, in one line naming the key (the modules take the target's shape)."""
        positive(params, ("num_depths",))
        positive(params, ("lambda_early", "lambda_late", "lambda_switch"), low=0)
        if params.get("lambda_switch", 0) > 1:
            raise DraftsmithError(f"method.lambda_switch: a fraction of the run, at most 1; got {params['lambda_switch']}")
        if params.get("chain_input", "hidden") not in CHAIN_INPUTS:
            raise DraftsmithError(f"method.chain_input: one of {', '.join(CHAIN_INPUTS)}, got {params['chain_input']!r}")
        if params.get("init", "new") not in INITS:
            raise DraftsmithError(f"method.init: one of {', '.join(INITS)}, got {params['init']!r}")
        positive(params, ("depth_decay",), low=0)


class RMSNorm(nn.Module):
    """The Llama/Qwen/DeepSeek RMSNorm (computed in float32, as they do); `zero_centered`:
    Qwen3-Next's, scaling by (1 + weight) in float32 before the cast, weight starting at 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: its own norm; the head itself is the target's."""

    def __init__(self, hidden_size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, zero_centered)


def rms_norm_eps(target_config) -> float:
    """The target's RMSNorm epsilon: DeepSeek's MTP modules are RMSNorm (Llama-family) blocks,
    so a target normalised otherwise (GPT-2, Phi, GPT-NeoX, OPT, Falcon: LayerNorm) is refused."""
    eps = getattr(target_config, "rms_norm_eps", None)
    if not isinstance(eps, float):
        raise DraftsmithError(f"MTP heads need a target with RMSNorm layers (Llama, Qwen, Mistral, DeepSeek families); "
                              f"{getattr(target_config, 'model_type', type(target_config).__name__)} has no rms_norm_eps")
    return eps


class MTPLayer(nn.Module):
    def __init__(self, target_config, layer_class: type, layer_idx: int):
        super().__init__()
        hidden, eps = target_config.hidden_size, rms_norm_eps(target_config)
        centered = getattr(target_config, "model_type", None) in ZERO_CENTERED_NORMS
        self.enorm = RMSNorm(hidden, eps, centered)
        self.hnorm = RMSNorm(hidden, eps, centered)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = layer_class(target_config, layer_idx=layer_idx)
        self.shared_head = SharedHead(hidden, eps, centered)

    def fuse(self, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))

    def forward(self, embeds, prev_hidden, position_embeddings, attention_mask=None, cache=None,
                position_ids=None) -> torch.Tensor:
        x = self.fuse(embeds, prev_hidden)
        kwargs = {"position_embeddings": position_embeddings, "attention_mask": attention_mask,
                  "position_ids": position_ids}
        if cache is not None:
            kwargs[cache_kwarg(self.block)] = cache
            kwargs["use_cache"] = True
        out = self.block(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class MTPDrafter(nn.Module):
    """K MTP layers for a given target; layer k-1 serves depth k. Each block is built as
    the target's last layer (same attention type: full, not sliding); exports renumber
    them after the main layers, as DeepSeek-V3 stores them."""

    method = "mtp"

    def __init__(self, target_config, num_depths: int, layer_class: type):
        super().__init__()
        self.config = MTPConfig(num_depths=num_depths)
        n = target_config.num_hidden_layers
        self.layers = nn.ModuleList(
            MTPLayer(target_config, layer_class, layer_idx=n - 1) for _ in range(num_depths)
        )

    @classmethod
    def from_target(cls, target: nn.Module, **overrides) -> "MTPDrafter":
        """New modules for `target` (a model), in its dtype; `overrides` are MTPConfig keys (the recipe's)."""
        config = MTPConfig(**overrides)
        heads = cls(target.config, config.num_depths, type(decoder_layers(target)[0]))
        heads.config = config
        return heads.to(next(target.parameters()).dtype)

    @property
    def num_depths(self) -> int:
        return len(self.layers)

    def next_input(self, layer: "MTPLayer", out: torch.Tensor) -> torch.Tensor:
        """What the next depth reads of `layer`'s block output `out` (MTPConfig.chain_input)."""
        return layer.shared_head.norm(out) if getattr(self.config, "chain_input", "hidden") == "normed" else out

    def native_state(self) -> dict[str, torch.Tensor]:
        return deepseek_names(self.state_dict())

    @classmethod
    def from_native(cls, config: MTPConfig, state: dict, target: nn.Module, source: str) -> "MTPDrafter":
        heads = cls.from_target(target, num_depths=config.num_depths)
        heads.config = config
        load_state_strict(heads, from_deepseek_names(state), source=source)  # a target of other sizes fails here
        return heads.to(next(target.parameters()).device)


def mtp_dir(target_dir) -> "Path":
    """TARGET/mtp, where the MTP modules are saved beside the target they extend."""

    folder = Path(target_dir) / MTP_DIR
    if not folder.is_dir():
        raise DraftsmithError(f"{target_dir} has no MTP modules (expected a {MTP_DIR}/ folder from the mtp recipe)")
    return folder


def deepseek_names(state: dict) -> dict:
    """Our nested names -> DeepSeek-V3's flat ones: `layers.k.block.self_attn...` becomes
    `layers.k.self_attn...`, beside `layers.k.{enorm,hnorm,eh_proj,shared_head.norm}`.
    `shared_head.head` and `embed_tokens` are the target's and are not repeated."""
    return {name.replace(".block.", "."): t for name, t in state.items()}


def from_deepseek_names(state: dict) -> dict:
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    out = {}
    for name, t in state.items():
        prefix, k, rest = name.split(".", 2)
        out[name if rest.startswith(own) else f"{prefix}.{k}.block.{rest}"] = t
    return out


def engine_hidden(target: nn.Module, last_layer_output: torch.Tensor) -> torch.Tensor:
    """h^0: the last decoder layer's output through the target's final norm, the state the
    engines pass to MTP modules (the same op the target runs before its head, so the same numbers)."""
    return final_norm(target)(last_layer_output)


def causal_mask(attn_implementation: str | None, rows: int, past: int, like: torch.Tensor) -> torch.Tensor | None:
    """Additive [1, 1, rows, past + rows] mask: new row i sees the `past` cached rows and
    new rows 0..i. Given explicitly because transformers' eager attention reads a missing
    mask as full attention (only SDPA and the flash kernels assume causal); the flash
    kernels take causality from the layer's `is_causal` and no dense mask (None here), and
    so does SDPA without a cache, where no mask lets it pick its fused causal kernel."""
    impl = attn_implementation or ""
    if rows <= 1 or impl.startswith("flash") or (impl == "sdpa" and past == 0):
        return None
    mask = torch.full((rows, past + rows), torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device)
    return mask.triu(past + 1)[None, None]


def mtp_forward(heads: MTPDrafter, target: nn.Module, input_ids: torch.Tensor,
                last_hidden: torch.Tensor) -> list[torch.Tensor]:
    """Training forward over whole sequences: the logits of every depth.

    `last_hidden` is the target's last decoder layer output [B, T, H]; h^0 is it after the
    target's final norm (`engine_hidden`).
    Depth k returns logits [B, T - k, V] whose position i predicts input_ids[:, i + k + 1]
    (the last position has no label inside the sequence and is dropped by the loss).
    """
    rotary = rotary_embedding(target)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    seq = input_ids.shape[1]
    prev = engine_hidden(target, last_hidden)
    logits = []
    for k, layer in enumerate(heads.layers, start=1):
        length = seq - k
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        rope = rotary(prev, positions)
        mask = causal_mask(target.config._attn_implementation, length, 0, prev)
        hidden = layer(embed(input_ids[:, k:]), prev[:, :length], rope, attention_mask=mask, position_ids=positions)
        logits.append(head(layer.shared_head.norm(hidden)))
        prev = heads.next_input(layer, hidden)
    return logits


def mtp_losses(depth_logits: list[torch.Tensor], input_ids: torch.Tensor,
               loss_mask: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """Per-depth cross-entropy and top-1 accuracy against the true future tokens."""
    losses, accs = [], []
    for k, logits in enumerate(depth_logits, start=1):
        pred = logits[:, :-1]
        labels = input_ids[:, k + 1:]
        mask = torch.ones_like(labels, dtype=torch.bool) if loss_mask is None else loss_mask[:, k + 1:].bool()
        flat = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="none")
        denom = mask.sum().clamp(min=1)
        losses.append((flat * mask.flatten()).sum() / denom)
        accs.append(((pred.argmax(-1) == labels) & mask).sum().item() / denom.item())
    return losses, accs
