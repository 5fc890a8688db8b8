"""MTP heads: new ones trained jointly with the target (DeepSeek-V3 style), or, with
`method.init: from_target`, the modules the target's checkpoint ships (DeepSeek-V3's extra
layers, Qwen3-Next's mtp.*), tuned jointly as well or, with `method.freeze_target`, alone
against the frozen target (speculators' FastMTP tunes shipped heads so)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.mtp import MTP_DIR, MTPConfig, MTPDrafter, mtp_forward, mtp_losses
from draftsmith.models.native import save_drafter
from draftsmith.models.target import build_tiny_target, freeze, load_target, target_forward
from draftsmith.train.data_setup import load_tokenizer, packed_corpus
from draftsmith.train.method import TrainMethod


class TargetWithMTP(nn.Module):
    """The trainable unit: the target and its MTP heads, so one optimizer and one
    accelerate wrapper cover both and the MTP gradients reach the trunk."""

    def __init__(self, target: nn.Module, heads: MTPDrafter):
        super().__init__()
        self.target = target
        self.heads = heads

    def forward(self, input_ids: torch.Tensor):
        last = self.target.config.num_hidden_layers - 1
        out = target_forward(self.target, input_ids, capture=[last])
        return out.logits, mtp_forward(self.heads, self.target, input_ids, out.hidden[last])


class HeadsOnFrozenTarget(nn.Module):
    """The trainable unit with `freeze_target`: the heads alone. The target is held outside
    the module's registered children, so neither the optimizer, accelerate's wrapper nor a
    checkpoint sees it (train/method.py); it runs under no_grad, its logits cut to the last row."""

    def __init__(self, target: nn.Module, heads: MTPDrafter):
        super().__init__()
        self.heads = heads
        object.__setattr__(self, "target", target)  # not a submodule: see the class doc

    def forward(self, input_ids: torch.Tensor):
        last = self.target.config.num_hidden_layers - 1
        with torch.no_grad():
            out = target_forward(self.target, input_ids, capture=[last], logits_to_keep=1)
        return out.logits, mtp_forward(self.heads, self.target, input_ids, out.hidden[last])


def build_target(recipe, tokenizer, target_dir=None, frozen: bool = False, device=None) -> nn.Module:
    """The target at `target_dir` (the recipe's target.path resolved), else a tiny one built here."""
    t = recipe.target
    if t.path:
        # Pretraining continues: not frozen, and in float32 whatever the checkpoint's dtype (bf16 for
        # Llama-3.2 and Qwen3), so AdamW updates float32 weights; the forward runs in train.mixed_precision.
        # Frozen, still float32: the heads train in float32 and share its embedding and head.
        return load_target(target_dir, dtype="float32", attn_implementation=t.attn_implementation,
                           frozen=frozen, device=device if frozen else None)
    target = build_tiny_target(
        seed=recipe.train.seed, arch=t.arch, vocab_size=len(tokenizer), num_layers=t.num_layers,
        hidden_size=t.hidden_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        intermediate_size=t.intermediate_size or None, max_position_embeddings=t.max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=t.tie_word_embeddings,
        **({"rope_theta": t.rope_theta} if t.rope_theta else {}),
    )
    return freeze(target).to(device) if frozen else target


def build_heads(recipe, target: nn.Module) -> MTPDrafter:
    """New modules, or (init: from_target) the ones the target's checkpoint ships, with K and
    chain_input as that checkpoint has them unless the recipe sets chain_input. The recipe's
    config goes on the heads now, so training chains depths as decoding will."""
    params = recipe.method.params
    if params.get("init", "new") == "new":
        return MTPDrafter.from_target(target, **params)
    heads = shipped_heads(recipe, target)
    heads.config = MTPConfig(**{"num_depths": heads.num_depths, "chain_input": heads.config.chain_input, **params})
    return heads


def shipped_heads(recipe, target: nn.Module) -> MTPDrafter:
    """The MTP modules in the target's folder; a recipe num_depths other than theirs is refused."""
    from draftsmith.models.formats.mtp import load_from_target

    heads = load_from_target(find_model_dir(recipe.target.path), target)
    wanted = recipe.method.params.get("num_depths")
    if wanted is not None and wanted != heads.num_depths:
        raise DraftsmithError(f"method.num_depths={wanted}: target {recipe.target.path} ships {heads.num_depths} "
                              f"MTP module(s) and init=from_target tunes those; remove the key or set it to "
                              f"{heads.num_depths}")
    return heads


def check_from_target(recipe) -> None:
    """init=from_target needs a target folder to read the modules from: said before any work."""
    if recipe.method.params.get("init", "new") == "from_target" and not recipe.target.path:
        raise DraftsmithError("method.init=from_target reads the MTP modules a target's checkpoint ships: "
                              "set target.path=")


def depth_weights(num_depths: int, decay: float) -> list[float]:
    """freeze_target's loss weights: decay**(k-1) for depth k, normalised to sum 1 (speculators'
    FastMTP with 0.6), so the first draft, which every later one rests on, counts most."""
    raw = [decay ** k for k in range(num_depths)]
    return [w / sum(raw) for w in raw]


class MTPTraining(TrainMethod):
    def __init__(self, recipe, device, target_dir=None):
        super().__init__(recipe, device, target_dir)
        check_from_target(recipe)
        self.tokenizer = load_tokenizer(recipe, self.target_dir)
        frozen = bool(recipe.method.params.get("freeze_target", False))
        self.target = target = build_target(recipe, self.tokenizer, self.target_dir, frozen=frozen,
                                                  device=device)
        heads = self.build_drafter()
        self.config = heads.config
        if frozen:
            self.model = HeadsOnFrozenTarget(target, heads)
        else:
            if recipe.train.gradient_checkpointing:
                target.gradient_checkpointing_enable()
            self.model = TargetWithMTP(target, heads)
        self.train_data = packed_corpus(recipe, self.tokenizer, "train")
        self.validation_data = packed_corpus(recipe, self.tokenizer, "validation")

    def build_drafter(self) -> MTPDrafter:
        return build_heads(self.recipe, self.target)

    def mtp_weight(self, step: int, total_steps: int) -> float:
        c = self.config
        early = step < c.lambda_switch * total_steps
        return (c.lambda_early if early else c.lambda_late) / max(1, c.num_depths)

    def loss(self, model, batch, step, micro=0, total_steps=0):
        ids = batch["input_ids"]
        logits, depth_logits = model(ids)
        losses, accs = mtp_losses(depth_logits, ids)
        metrics = {}
        if self.config.freeze_target:  # the heads alone: no main loss
            weights = depth_weights(len(losses), self.config.depth_decay)
            total = sum(w * loss_k for w, loss_k in zip(weights, losses))
        else:
            main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            total = main + self.mtp_weight(step, total_steps) * torch.stack(losses).sum()
            metrics = {"loss_main": main.item(), "ppl": float(torch.exp(main.detach())),
                       "acc_main": (logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item()}
        for k, (loss_k, acc_k) in enumerate(zip(losses, accs), start=1):
            metrics[f"loss_mtp_{k}"] = loss_k.item()
            metrics[f"acc_mtp_{k}"] = acc_k
        return total, metrics

    def save(self, model, out_dir: Path) -> Path:
        with atomic_dir(out_dir / "model") as tmp:
            model.target.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            model.heads.config = self.config  # the recipe's, lambdas included
            save_drafter(model.heads, tmp / MTP_DIR, extra={"num_nextn_predict_layers": model.heads.num_depths,
                                                            "shared": ["embed_tokens", "shared_head.head"]})
        return out_dir / "model"
