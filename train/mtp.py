"""MTP heads trained jointly with the target, from scratch (DeepSeek-V3 style)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.fsutil import atomic_dir
from draftsmith.models.mtp import MTP_DIR, MTPDrafter, mtp_forward, mtp_losses
from draftsmith.models.native import save_drafter
from draftsmith.models.target import build_tiny_target, find_model_dir, load_target, target_forward
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


def build_target(recipe, tokenizer) -> nn.Module:
    t = recipe.target
    if t.path:
        # Pretraining continues: not frozen, and in float32 whatever the checkpoint's dtype (bf16 for
        # Llama-3.2 and Qwen3), so AdamW updates float32 weights; the forward runs in train.mixed_precision.
        return load_target(find_model_dir(t.path), dtype="float32", attn_implementation=t.attn_implementation,
                           frozen=False)
    return build_tiny_target(
        seed=recipe.train.seed, arch=t.arch, vocab_size=len(tokenizer), num_layers=t.num_layers,
        hidden_size=t.hidden_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        intermediate_size=t.intermediate_size or None, max_position_embeddings=t.max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=t.tie_word_embeddings,
        **({"rope_theta": t.rope_theta} if t.rope_theta else {}),
    )


class MTPTraining(TrainMethod):
    def __init__(self, recipe, device):
        super().__init__(recipe, device)
        self.tokenizer = load_tokenizer(recipe)
        self.config = recipe.method.build_config()
        target = build_target(recipe, self.tokenizer)
        if recipe.train.gradient_checkpointing:
            target.gradient_checkpointing_enable()
        self.model = TargetWithMTP(target, MTPDrafter.for_target(target, self.config.num_depths))
        self.train_data = packed_corpus(recipe, self.tokenizer, "train")
        self.eval_data = packed_corpus(recipe, self.tokenizer, "validation")

    def mtp_weight(self, step: int) -> float:
        c = self.config
        early = step < c.lambda_switch * self.total_steps
        return (c.lambda_early if early else c.lambda_late) / max(1, c.num_depths)

    def loss(self, model, batch, step, micro=0):
        ids = batch["input_ids"]
        logits, depth_logits = model(ids)
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        losses, accs = mtp_losses(depth_logits, ids)
        total = main + self.mtp_weight(step) * torch.stack(losses).sum()
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
