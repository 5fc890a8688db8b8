"""What the recipe alone can refuse, checked before a process group, a model or data is made.

The target's positions and shape (its config.json alone), the launch, the schedule and the
trackers: each mistake is one line at the start instead of a failure hours into a run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.recipe import Recipe
from draftsmith.train.launch_checks import check_launch
from draftsmith.train.schedule import check_schedule
from draftsmith.train.tracking import check_tracking

log = logging.getLogger(__name__)


def check_positions(recipe: Recipe, folder: Path | str | None) -> None:
    """Refuse rows longer than the target (at `folder`, its target.path resolved) takes, before
    any data is prepared."""
    t = recipe.target
    if t.path:
        from draftsmith.models.tile import read_target_config

        if not isinstance(folder, Path):  # a hub name: the target's own load names what is wrong
            return
        positions, where = read_target_config(folder).get("max_position_embeddings"), f"target {t.path}"
    else:
        positions, where = t.max_position_embeddings, "target.max_position_embeddings"
    if positions and recipe.train.seq_len > positions:
        raise DraftsmithError(f"train.seq_len={recipe.train.seq_len} is beyond the {positions} positions of {where}")


def check_method_shape(recipe: Recipe, folder: Path | str | None) -> None:
    """The method's keys against the shape of a target at a path (its config.json alone), before
    any data is prepared: the drafter config's `check_params` names the key (models/<method>.py)."""
    if not recipe.target.path:
        return
    if not (isinstance(folder, Path) and folder.is_dir()):
        return
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - a broken config: the target's own load names it
        return
    recipe.method.spec.load("config").check_params(recipe.method.params, seq_len=recipe.train.seq_len,
                                                   target_config=config)


def say_what_is_off(recipe: Recipe) -> None:
    """Settings a run takes as asked but that a user may not mean, said once at the start: with
    train.lr=0 the weights never change (a dry run of the pipeline), and train.validation_batches=0
    turns validation off (no val/ metrics are logged)."""
    t = recipe.train
    if t.lr == 0:
        log.warning("train.lr=0: the weights will not change (a dry run); set train.lr to train")
    if t.validation_batches == 0:
        log.warning("train.validation_batches=0: validation is off, no val/ metrics will be logged")


def check_before_work(recipe: Recipe, target_dir: Path | str | None) -> None:
    """Everything the recipe alone can refuse, before a process group, a model or data is made
    (`target_dir`: its target.path resolved, None without one)."""
    check_positions(recipe, target_dir)
    check_method_shape(recipe, target_dir)
    say_what_is_off(recipe)
    check_launch(recipe.method.spec)
    check_schedule(recipe.train.lr_schedule)
    check_tracking(recipe.tracking.report_to, recipe.tracking.mode)
