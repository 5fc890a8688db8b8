"""DSpark trained post hoc: DFlash's data path (`train/dflash.py`), its own drafter and loss.

The loss also reads the target's logits (the TV and confidence terms). DSpark can start from
a trained DFlash backbone (`method.backbone=RUN`), kept frozen or trained on.
"""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.models.dflash import check_target
from draftsmith.models.dspark import DSparkDrafter
from draftsmith.models.native import load_drafter
from draftsmith.models.target import find_model_dir
from draftsmith.train.dflash import DFlashTraining

log = logging.getLogger(__name__)


class DSparkTraining(DFlashTraining):
    def build_drafter(self, params: dict):
        backbone = params.pop("backbone", "")
        freeze = params.pop("freeze_backbone", False)
        if not backbone:
            if freeze:
                raise DraftsmithError("method.freeze_backbone=true needs method.backbone=RUN (a trained DFlash run)")
            return super().build_drafter(params)
        if params.get("block_size") == "auto":  # the backbone's block, unless a number is given
            params.pop("block_size")
        dflash = load_drafter(find_model_dir(backbone), "dflash")
        try:
            check_target(dflash, self.target)
        except DraftsmithError as exc:
            raise DraftsmithError(f"method.backbone {backbone}: {exc}") from None
        drafter = DSparkDrafter.from_dflash(dflash, freeze_backbone=freeze, backbone=str(backbone), **params)
        drafter.config.freeze_backbone = freeze  # provenance, saved with the config
        return drafter

    def extract(self, out):
        return {**super().extract(out), "logits": out.logits}

    def loss_inputs(self, features: dict) -> tuple:
        return (features["logits"],)

    def save(self, model, out_dir: Path) -> Path:
        """The drafter, then SGLang's confidence calibration fitted on this run's held-out
        rows (models/dspark_calibration.py), which the engine export passes on. A feature
        cache loads only the target's ends, which cannot verify a block: no calibration then."""
        from draftsmith.models.dspark_calibration import write_sts

        folder = super().save(model, out_dir)
        if self.cache is None:
            path = write_sts(model.drafter, self.target, self.tokens_of(self.eval_data), folder,
                             dataset=f"{out_dir} held-out rows")
            log.info("confidence calibration: %s", path)
        else:
            log.info("no confidence calibration: data.feature_cache runs hold no full target to verify with")
        return folder
