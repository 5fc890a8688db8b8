"""EAGLE-3 trained post hoc with training-time test against the frozen target.

The draft vocabulary is the most frequent target tokens under the loss mask of this run's
own training rows (the target's answers), built before the first step.
"""

from __future__ import annotations

import hashlib

import torch

from draftsmith.data.draft_vocab import build_draft_vocab
from draftsmith.models.eagle3 import Eagle3Drafter
from draftsmith.train.posthoc import PostHocMethod


class Eagle3Training(PostHocMethod):
    packs = True  # position_ids reach the loss (data/packing.py)

    def build_drafter(self) -> Eagle3Drafter:
        """A drafter as wide as the target, with the draft vocabulary of this run's training rows."""
        drafter = Eagle3Drafter.from_target(self.target, **self.recipe.method.params)
        rows = self.train_tokens()
        d2t, t2d = build_draft_vocab([rows["input_ids"]], [rows["loss_mask"] * rows["attention_mask"]],
                                     drafter.config.vocab_size, drafter.config.draft_vocab_size)
        drafter.set_draft_vocab(d2t, t2d)
        return drafter

    def extract(self, out):
        # All the loss reads of the logits (`teacher`): a feature cache keeps V_d + 1 numbers
        # per position instead of V, and training from it is exact.
        logits, top = self.model.drafter.teacher(out.logits)
        return {"hidden": torch.cat([out.hidden[i] for i in self.layer_ids], dim=-1), "logits": logits,
                "target_top": top}

    def feature_identity(self):
        d2t = self.model.drafter.d2t.cpu().numpy().tobytes()
        # "teacher": what `extract` stores of the logits. Caches from before it was named hold raw
        # draft-vocabulary logits, which the LK losses would read as probabilities: refused.
        return {**super().feature_identity(), "draft_vocab_sha256": hashlib.sha256(d2t).hexdigest()[:16],
                "teacher": "draft-vocabulary log-probabilities"}

    def loss(self, model, batch, step, micro=0, total_steps=0):
        f = self.features(batch)
        return model(f["hidden"].float(), batch["input_ids"], f["logits"].float(), batch["loss_mask"],
                     batch["attention_mask"], target_top=f["target_top"],
                     position_ids=batch.get("position_ids"))  # a packed batch's (data/packing.py)
