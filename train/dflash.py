"""DFlash trained post hoc against the frozen target.

Features are captured online from the target (never from a second copy); the block
embeddings and the output head are the target's own, frozen. DSpark trains on the same
backbone and data path (`train/dspark.py` subclasses this).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

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

    def __init__(self, recipe, device, target=None, target_dir=None):
        super().__init__(recipe, device, target, target_dir)
        self.process_index = PartialState().process_index  # read once, not per training step

    @classmethod
    def step_keys(cls, shape):
        keys = {"mask_token_id": shape.vocab_size - 1, "num_anchors": shape.anchors}
        if shape.drafter_layers:
            # Distinct target layers: the reference rule repeats layers on a shallow target.
            count = min(shape.drafter_layers, shape.target_layers)
            spread = {round(i * (shape.target_layers - 1) / max(count - 1, 1)) for i in range(count)}
            keys.update(num_layers=shape.drafter_layers, target_layer_ids=sorted(spread))
        return keys

    @classmethod
    def drafter_config(cls, target_config, keys, tile):
        """The mask token, where neither the keys nor the target name one, is a placeholder (0):
        it sizes nothing, and a run chooses it from its tokenizer."""
        fields = SimpleNamespace(**target_config) if isinstance(target_config, dict) else target_config
        if getattr(fields, "mask_token_id", None) is None:
            keys = {"mask_token_id": 0, **keys}
        return cls.drafter_class.config_class.from_target(target_config, tile=tile, **keys)

    @classmethod
    def new_drafter(cls, target, keys, tile):
        """Sized from the target (the tile rule's block); the keys win."""
        return cls.drafter_class.from_target(target, tile=tile, **keys)

    def build_drafter(self):
        """`new_drafter` with the recipe's method keys and, where needed, a mask token."""
        return self.new_drafter(self.target, self.drafter_params(), self.recipe.target.tile)

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

        rows = [self.tokens_of(data)["input_ids"] for data in (self.train_data, self.validation_data)]
        mask_id, why = choose_mask_token(self.tokenizer, self.target.get_input_embeddings().num_embeddings, rows)
        own = self.tokenizer.mask_token_id is not None  # nothing was chosen: said only with -v
        log.log(logging.DEBUG if own else logging.INFO, "mask token: id %d, %s", mask_id, why)
        return mask_id

    @classmethod
    def features_of(cls, drafter, out):
        return {"hidden": concat_layers(out.hidden, drafter.config.target_layer_ids)}

    def extract(self, out):
        return self.features_of(self.model.drafter, out)

    @staticmethod
    def loss_inputs(features: dict) -> tuple:
        """What the drafter's loss takes after the head (DSpark: the target's logits)."""
        return ()

    @classmethod
    def loss_on(cls, model, target, batch, features, generator=None):
        """The block embeddings and the head are the target's own."""
        embed, head = target.get_input_embeddings(), flat_head(target.get_output_embeddings())
        mask = batch["loss_mask"] * batch["attention_mask"]
        return model(features["hidden"].float(), batch["input_ids"], mask, embed, head, *cls.loss_inputs(features),
                     generator=generator, position_ids=batch.get("position_ids"))  # a packed batch's (data/packing.py)

    def loss(self, model, batch, step, micro=0, total_steps=0):
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(
            anchor_seed(self.recipe.train.seed, micro, self.process_index, model.training))
        return self.loss_on(model, self.target, batch, self.features(batch), gen)

    @classmethod
    def step_note(cls, config):
        return (f"{config.num_layers} layers, block {config.block_size}, up to {config.num_anchors} anchors per "
                f"sequence (query rows per sequence <= {config.num_anchors * config.block_size})")

    @classmethod
    def describe(cls, config):
        return (f"B {config.block_size}, gamma {config.gamma:g}, {config.num_anchors} anchors, {config.num_layers} "
                f"layers, {config.num_kv_heads} KV heads, context layers {config.target_layer_ids}")
