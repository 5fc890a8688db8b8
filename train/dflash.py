"""DFlash and DSpark drafters trained post hoc against the frozen target.

Features are captured online from the target (never from a second copy); the block
embeddings and the output head are the target's own, frozen. DSpark can start from a
trained DFlash backbone (`method.backbone=RUN`), kept frozen or trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter, check_target, concat_layers
from draftsmith.models.dspark import DSparkConfig, DSparkDrafter
from draftsmith.models.native import load_drafter, save_drafter
from draftsmith.models.target import resolve_model_dir
from draftsmith.train.posthoc import LossForward, PostHocMethod


class DFlashTraining(PostHocMethod):
    """DFlash, or DSpark when method.name is dspark (the same backbone and data path)."""

    def __init__(self, recipe, device):
        super().__init__(recipe, device)
        params = dict(recipe.method.params)
        tile = recipe.target.tile
        self.dspark = recipe.method.name == "dspark"
        backbone = params.pop("backbone", "")
        freeze = params.pop("freeze_backbone", False)
        if self.dspark and backbone:
            if params.get("block_size") == "auto":  # the backbone's block, unless a number is given
                params.pop("block_size")
            dflash = load_drafter(resolve_model_dir(backbone), "dflash")
            try:
                check_target(dflash, self.target)
            except DraftsmithError as exc:
                raise DraftsmithError(f"method.backbone {backbone}: {exc}") from None
            drafter = DSparkDrafter.from_dflash(dflash, freeze_backbone=freeze, backbone=str(backbone), **params)
            drafter.config.freeze_backbone = freeze  # provenance, saved with the config
        else:
            if freeze:
                raise DraftsmithError("method.freeze_backbone=true needs method.backbone=RUN (a trained DFlash run)")
            config_cls, module_cls = (DSparkConfig, DSparkDrafter) if self.dspark else (DFlashConfig, DFlashDrafter)
            if getattr(self.target.config, "mask_token_id", None) is None:
                params.setdefault("mask_token_id", self.tokenizer.mask_token_id)
            config = config_cls.from_target(self.target.config, tile=tile, **params)
            drafter = module_cls(config)
        drafter.gradient_checkpointing = recipe.train.gradient_checkpointing
        self.model = LossForward(drafter.to(device=device, dtype=torch.float32))
        self.layer_ids = list(drafter.config.target_layer_ids)
        head = self.target.get_output_embeddings()
        self.embed = self.target.get_input_embeddings()
        self.head = lambda h: head(h.to(head.weight.dtype))
        self.check_cache()

    def extract(self, out):
        hidden = concat_layers(out.hidden, self.layer_ids)
        return {"hidden": hidden, "logits": out.logits} if self.dspark else {"hidden": hidden}

    def loss(self, model, batch, step):
        f = self.features(batch)
        hidden = f["hidden"].float()
        # Anchors are drawn from a generator seeded by the step, so a resumed run draws
        # the same blocks as the uninterrupted one.
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(
            self.recipe.train.seed * 1_000_003 + step * 2 + (0 if model.training else 1))
        mask = batch["loss_mask"] * batch["attention_mask"]
        if self.dspark:
            return model(hidden, batch["input_ids"], mask, self.embed, self.head, f["logits"], generator=gen)
        return model(hidden, batch["input_ids"], mask, self.embed, self.head, generator=gen)

    def save(self, model, out_dir: Path) -> Path:
        return save_drafter(model.drafter, out_dir / "model", extra={"target": str(self.target_dir)})
