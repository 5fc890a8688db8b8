"""DFlash trained post hoc against the frozen target.

Features are captured online from the target (never from a second copy); the block
embeddings and the output head are the target's own, frozen. DSpark trains on the same
backbone and data path (`train/dspark.py` subclasses this).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from accelerate import PartialState

from draftsmith.models.dflash import DFlashDrafter, concat_layers
from draftsmith.train.posthoc import PostHocMethod

log = logging.getLogger(__name__)


def anchor_seed(seed: int, micro: int, process: int, training: bool) -> int:
    """The seed of one micro-batch's anchors: every micro-batch and every process draws its
    own positions (as the references draw per batch), and a resumed run draws the same ones
    as the uninterrupted run, since `micro` resumes with the loop."""
    return int(np.random.SeedSequence([seed, micro, process, int(training)]).generate_state(1, np.uint64)[0] >> 1)


def flat_head(head):
    """The target's head over every position as one matrix product. A block's drafts are a
    slice of its positions, a non-contiguous 4-D tensor, which `F.linear` multiplies batch by
    batch against a broadcast copy of the head: 8x slower on a CPU (measured: 0.93 s against
    0.11 s for 448 positions of SmolLM2's 49,152-row head)."""
    return lambda h: head(h.reshape(-1, h.shape[-1]).to(head.weight.dtype)).view(*h.shape[:-1], -1)


class DFlashTraining(PostHocMethod):
    packs = True  # position_ids reach the loss (data/packing.py)
    drafter_class = DFlashDrafter  # DSpark's training trains its own on the same path

    def __init__(self, recipe, device, target=None):
        super().__init__(recipe, device, target)
        self.process_index = PartialState().process_index  # read once, not per training step
        self.embed = self.target.get_input_embeddings()
        self.head = flat_head(self.target.get_output_embeddings())

    def build_drafter(self):
        """A fresh drafter sized from the target (the tile rule's block); the recipe's method keys win."""
        return self.drafter_class.from_target(self.target, tile=self.recipe.target.tile, **self.drafter_params())

    def drafter_params(self) -> dict:
        """The recipe's method keys, and a mask token where neither they nor the target name one."""
        params = dict(self.recipe.method.params)
        if getattr(self.target.config, "mask_token_id", None) is None and params.get("mask_token_id") is None:
            params["mask_token_id"] = self.mask_token()
        return params

    def mask_token(self) -> int:
        """The tokenizer's mask token, or one chosen for a tokenizer without (data/tokenizer.py);
        the drafter's config, saved with the run and written into every export, records it."""
        from draftsmith.data.tokenizer import choose_mask_token

        rows = [self.tokens_of(data)["input_ids"] for data in (self.train_data, self.eval_data)]
        mask_id, why = choose_mask_token(self.tokenizer, self.target.get_input_embeddings().num_embeddings, rows)
        own = self.tokenizer.mask_token_id is not None  # nothing was chosen: said only with -v
        log.log(logging.DEBUG if own else logging.INFO, "mask token: id %d, %s", mask_id, why)
        return mask_id

    def extract(self, out):
        return {"hidden": concat_layers(out.hidden, self.layer_ids)}

    def loss_inputs(self, features: dict) -> tuple:
        """What the drafter's loss takes after the head (DSpark: the target's logits)."""
        return ()

    def loss(self, model, batch, step, micro=0, total_steps=0):
        f = self.features(batch)
        hidden = f["hidden"].float()
        mask = batch["loss_mask"] * batch["attention_mask"]
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(
            anchor_seed(self.recipe.train.seed, micro, self.process_index, model.training))
        return model(hidden, batch["input_ids"], mask, self.embed, self.head, *self.loss_inputs(f), generator=gen,
                     position_ids=batch.get("position_ids"))  # a packed batch's (data/packing.py)
