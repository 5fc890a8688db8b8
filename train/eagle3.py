"""EAGLE-3 trained post hoc with training-time test against the frozen target.

The draft vocabulary is the most frequent target tokens under the loss mask of this run's
own training rows (the target's answers), built before the first step.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from draftsmith.data.draft_vocab import build_draft_vocab
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.train.posthoc import PostHocMethod


class Eagle3Training(PostHocMethod):
    packs = True  # position_ids reach the loss (data/packing.py)

    @classmethod
    def step_keys(cls, shape):
        return {"draft_vocab_size": shape.draft_vocab_size}

    @classmethod
    def drafter_config(cls, target_config, keys, tile):
        """As wide as the target, whatever the tile (the draft vocabulary is the rows', here the
        config's placeholder); the config's fields are read as attributes."""
        as_fields = SimpleNamespace(**target_config) if isinstance(target_config, dict) else target_config
        return Eagle3Config.from_target(as_fields, **keys)

    @classmethod
    def new_drafter(cls, target, keys, tile):
        """The target's embedding copied in, on the target's device."""
        return Eagle3Drafter.from_target(target, **keys)

    def build_drafter(self) -> Eagle3Drafter:
        """A drafter as wide as the target, with the draft vocabulary of this run's training rows."""
        drafter = self.new_drafter(self.target, self.recipe.method.params, self.recipe.target.tile)
        rows = self.train_tokens()
        d2t, t2d = build_draft_vocab([rows["input_ids"]], [rows["loss_mask"] * rows["attention_mask"]],
                                     drafter.config.vocab_size, drafter.config.draft_vocab_size)
        drafter.set_draft_vocab(d2t, t2d)
        return drafter

    @classmethod
    def features_of(cls, drafter, out):
        # All the loss reads of the logits (`teacher`): a feature cache keeps V_d + 1 numbers
        # per position instead of V, and training from it is exact.
        logits, top = drafter.teacher(out.logits)
        return {"hidden": torch.cat([out.hidden[i] for i in drafter.config.target_layer_ids], dim=-1),
                "logits": logits, "target_top": top}

    def extract(self, out):
        return self.features_of(self.model.drafter, out)

    def feature_identity(self):
        d2t = self.model.drafter.d2t.cpu().numpy().tobytes()
        # "teacher": what `extract` stores of the logits. Caches from before it was named hold raw
        # draft-vocabulary logits, which the LK losses would read as probabilities: refused.
        return {**super().feature_identity(), "draft_vocab_sha256": hashlib.sha256(d2t).hexdigest()[:16],
                "teacher": "draft-vocabulary log-probabilities"}

    @classmethod
    def loss_on(cls, model, target, batch, features, generator=None):
        f = features
        return model(f["hidden"].float(), batch["input_ids"], f["logits"].float(), batch["loss_mask"],
                     batch["attention_mask"], target_top=f["target_top"],
                     position_ids=batch.get("position_ids"))  # a packed batch's (data/packing.py)

    def loss(self, model, batch, step, micro=0, total_steps=0):
        return self.loss_on(model, self.target, batch, self.features(batch))

    @classmethod
    def step_note(cls, config):
        return f"TTT {config.ttt_length} steps, draft vocab {config.draft_vocab_size}"

    @classmethod
    def describe(cls, config):
        return (f"TTT {config.ttt_length} steps, decay {config.ttt_decay:g}, draft vocabulary "
                f"{config.draft_vocab_size}, loss {config.loss}, context layers {config.target_layer_ids}")
