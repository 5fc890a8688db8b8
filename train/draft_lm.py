"""The external draft model: a small causal LM on the target's tokenizer, pretrained on the
corpus, optionally distilled towards the frozen target (forward KL on the same text)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir
from draftsmith.models.draft_lm import DraftLM, DraftLMConfig, distill_kl
from draftsmith.models.target import find_model_dir, load_target
from draftsmith.train.data_setup import load_tokenizer, packed_corpus
from draftsmith.train.method import TrainMethod


class DraftLMTraining(TrainMethod):
    def __init__(self, recipe, device):
        super().__init__(recipe, device)
        self.config = c = DraftLMConfig(**recipe.method.params)  # the loss's settings (distillation)
        if not recipe.target.path and c.distill_weight > 0:
            raise DraftsmithError("method.distill_weight > 0 needs target.path (the model to distill from)")
        self.tokenizer = load_tokenizer(recipe)
        self.target = None
        if recipe.target.path and c.distill_weight > 0:
            self.target = load_target(find_model_dir(recipe.target.path), device=device)
            if self.target.config.vocab_size != len(self.tokenizer):
                raise DraftsmithError(
                    f"target {recipe.target.path} has vocab {self.target.config.vocab_size}, "
                    f"its tokenizer {len(self.tokenizer)}")
        self.model = self.build_drafter()
        self.train_data = packed_corpus(recipe, self.tokenizer, "train")
        self.eval_data = packed_corpus(recipe, self.tokenizer, "validation")

    def build_drafter(self) -> nn.Module:
        r = self.recipe
        # seed + 1: not the initial weights of a tiny target built from train.seed
        return DraftLM.from_target(self.tokenizer, arch=r.target.arch, seed=r.train.seed + 1,
                                   max_position_embeddings=r.target.max_position_embeddings, **r.method.params)

    def loss(self, model, batch, step, micro=0, total_steps=0):
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits[:, :-1]
        lm = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        metrics = {"loss_main": lm.item(),
                   "acc_main": (logits.argmax(-1) == ids[:, 1:]).float().mean().item()}
        total = lm
        if self.target is not None:
            with torch.no_grad():
                target_logits = self.target(input_ids=ids).logits[:, :-1]
            kl = distill_kl(logits, target_logits, torch.ones_like(ids[:, 1:]), self.config.distill_temperature)
            total = lm + self.config.distill_weight * kl
            metrics["kl_target"] = kl.item()
            # Greedy agreement with the target is what a greedy verify accepts.
            metrics["acc_target"] = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
        return total, metrics

    def save(self, model, out_dir: Path) -> Path:
        with atomic_dir(out_dir / "model") as tmp:
            model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
        return out_dir / "model"
