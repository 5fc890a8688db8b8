"""The external draft model: a small causal LM on the target's tokenizer, pretrained on the
corpus, optionally distilled towards the frozen target (forward KL on the same text); or,
with `data.feature_cache`, trained on the target's own answers in that cache's rows (the
rows the post-hoc drafters train on: sequence-level distillation, the target never loaded)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_dir
from draftsmith.models.draft_lm import DraftLM, DraftLMConfig, distill_kl
from draftsmith.models.target import load_target
from draftsmith.train.data_setup import load_tokenizer, packed_corpus
from draftsmith.train.method import TrainMethod


class DraftLMTraining(TrainMethod):
    def __init__(self, recipe, device, target_dir=None):
        super().__init__(recipe, device, target_dir)
        self.config = c = DraftLMConfig(**recipe.method.params)  # the loss's settings (distillation)
        if not recipe.target.path and c.distill_weight > 0:
            raise DraftsmithError("method.distill_weight > 0 needs target.path (the model to distill from)")
        self.tokenizer = load_tokenizer(recipe, self.target_dir)
        self.target = None
        if recipe.data.feature_cache:
            self.load_answers(recipe, c)
            return
        if recipe.target.path and c.distill_weight > 0:
            self.target = load_target(self.target_dir, device=device)
            if self.target.config.vocab_size != len(self.tokenizer):
                raise DraftsmithError(
                    f"target {recipe.target.path} has vocab {self.target.config.vocab_size}, "
                    f"its tokenizer {len(self.tokenizer)}")
        self.model = self.build_drafter()
        self.train_data = packed_corpus(recipe, self.tokenizer, "train")
        self.validation_data = packed_corpus(recipe, self.tokenizer, "validation")

    def load_answers(self, recipe, c: DraftLMConfig) -> None:
        """The rows of a feature cache, their answer tokens the loss (no target loaded)."""
        from draftsmith.data.feature_cache import FeatureCache
        from draftsmith.train.posthoc import cached_rows

        if not recipe.target.path:
            raise DraftsmithError("data.feature_cache: set target.path= (the target the cache was written for)")
        if recipe.data.tokenizer:
            raise DraftsmithError("data.tokenizer: a feature cache's rows are in its target's tokens; "
                                  "leave data.tokenizer unset to use the target's tokenizer")
        if c.distill_weight > 0:
            raise DraftsmithError("method.distill_weight > 0 reads the target's logits, which a feature cache's "
                                  "rows do not hold for the draft model: set it to 0 (the rows are its answers)")
        self.model = self.build_drafter()
        self.train_data, self.validation_data = cached_rows(FeatureCache(recipe.data.feature_cache), recipe,
                                                            self.target_dir)

    def train_tokens(self) -> dict[str, torch.Tensor]:
        cached = self.recipe.data.feature_cache
        return self.train_data.tokens if cached else super().train_tokens()

    def build_drafter(self) -> nn.Module:
        r = self.recipe
        # seed + 1: not the initial weights of a tiny target built from train.seed
        return DraftLM.from_target(self.tokenizer, arch=r.target.arch, seed=r.train.seed + 1,
                                   max_position_embeddings=r.target.max_position_embeddings, **r.method.params)

    def loss(self, model, batch, step, micro=0, total_steps=0):
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits[:, :-1]
        # A feature cache's rows (conversations) train on the answers alone, as the post-hoc drafters do.
        lm = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        hit = (logits.argmax(-1) == ids[:, 1:]).float().flatten()
        weights = ((batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).flatten().float()
                   if self.recipe.data.feature_cache else torch.ones_like(lm))
        counted = weights.sum().clamp(min=1)
        lm, acc = (lm * weights).sum() / counted, (hit * weights).sum() / counted
        metrics = {"loss_main": lm.item(), "acc_main": acc.item()}
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
