"""DSpark trained post hoc: DFlash's data path (`train/dflash.py`), its own drafter and loss.

The loss also reads the target's logits (the TV and confidence terms). DSpark can start from
a trained DFlash backbone (`method.backbone=RUN`), kept frozen or trained on.
"""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.models.dspark import DSparkDrafter
from draftsmith.train.dflash import DFlashTraining

log = logging.getLogger(__name__)


class DSparkTraining(DFlashTraining):
    drafter_class = DSparkDrafter

    def drafter_params(self) -> dict:
        # A backbone (method.backbone) brings its own mask token: none is chosen for it.
        params = self.recipe.method.params
        return dict(params) if params.get("backbone") else super().drafter_params()

    @classmethod
    def features_of(cls, drafter, out):
        return {**super().features_of(drafter, out), "logits": out.logits}

    @staticmethod
    def loss_inputs(features: dict) -> tuple:
        return (features["logits"],)

    def save(self, model, out_dir: Path) -> Path:
        """The drafter, then SGLang's confidence calibration fitted on this run's held-out
        rows (models/dspark_calibration.py), which the engine export passes on. A feature
        cache loads only the target's ends, which cannot verify a block: no calibration then."""
        from draftsmith.models.dspark_calibration import write_sts

        folder = super().save(model, out_dir)
        if self.feature_cache is None:
            path = write_sts(model.drafter, self.target, self.tokens_of(self.validation_data), folder,
                             dataset=f"{self.recipe.train.output_dir} held-out rows")
            log.info("confidence calibration: %s", path)
        else:
            log.info("no confidence calibration: data.feature_cache runs hold no full target to verify with")
        return folder
