"""A run folder belongs to one run.

`run.json` records the run that owns the folder (an id and when it started); a fresh run
into a folder that holds another run's checkpoints, model or metrics is refused in one line
unless it continues that run (`train.resume`) or replaces it (`train.overwrite`), since it
would otherwise mix its files with the old run's: the old metrics wiped, the checkpoints
of both rotated together, and a later resume continuing the wrong one. While a run is
under way the folder's lock file keeps a second process out (draftsmith/fsutil.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import ensure_writable_dir, folder_lock, read_json, write_json
from draftsmith.models.run_weights import BEST, MODEL
from draftsmith.recipe import RENAMED, Recipe
from draftsmith.train.checkpoints import CHECKPOINTS, checkpoint_folders, checkpoint_step

RUN_FILE = "run.json"
ABANDONED = "abandoned"  # checkpoints past the step a run was resumed from
# What a run writes in its folder; `train.overwrite` removes exactly these.
RUN_OUTPUTS = (CHECKPOINTS, ABANDONED, MODEL, BEST, "metrics.jsonl", "logs", "wandb", "tracking.json", "recipe.yaml", RUN_FILE)

log = logging.getLogger(__name__)


def held_run(out_dir: Path) -> list[str]:
    """What of a run `out_dir` holds: its checkpoints, its model, its logged metrics."""
    held = []
    folder = out_dir / CHECKPOINTS
    saved = [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []
    if saved:
        latest = (checkpoint_folders(out_dir) or sorted(saved))[-1]
        held.append(f"{len(saved)} checkpoint(s), the latest {latest.name}")
    held += [f"{name}/" for name in (MODEL, BEST) if (out_dir / name).exists()]
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        held.append("metrics.jsonl")
    return held


def _inside(path: Path, folder: Path) -> bool:
    return folder.resolve() in (path.resolve(), *path.resolve().parents)


def check_owner(recipe: Recipe, out_dir: Path) -> dict:
    """The record of the run about to write `out_dir`: the folder's own when it is continued,
    a new one when it is fresh. Read-only, so every process of a launch decides alike."""
    t = recipe.train
    held = held_run(out_dir)
    record = read_json(out_dir / RUN_FILE) if (out_dir / RUN_FILE).is_file() else {}
    if not isinstance(record, dict):
        record = {}
    continuing = t.resume is True or (isinstance(t.resume, str) and _inside(Path(t.resume), out_dir))
    if t.overwrite and continuing:
        raise DraftsmithError(f"train.overwrite=true would remove the run that train.resume={t.resume} continues; "
                              "ask for one of them")
    if continuing and record.get("run_id"):
        return record
    if held and not t.overwrite and not continuing:
        owner = f"run {record['run_id']}, " if record.get("run_id") else ""
        resumed = "train.resume=true to continue it" if not t.resume else "a new folder to continue that checkpoint in"
        raise DraftsmithError(f"train.output_dir {out_dir} holds another run ({owner}{', '.join(held)}); "
                              f"give a new folder, {resumed}, or train.overwrite=true to replace it")
    return {"run_id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "replaces": record.get("run_id") if held else None}


# Keys that say how to run, not what: never recorded as a change.
RESUME_IGNORED = ("train.output_dir", "train.resume", "train.overwrite", "train.resume_changes")
# Keys a resume may change freely (recorded): when and how much is validated, saved, logged and
# tracked, memory (gradient checkpointing), and where things are; none moves the trajectory.
RESUME_FREE = {"train.validation_every", "train.validation_batches", "train.save_every", "train.keep_checkpoints",
               "train.log_every", "train.dist_timeout", "train.gradient_checkpointing", "data.num_proc", "data.feature_cache",
               "target.attn_implementation"}
RESUME_FREE_SECTIONS = ("tracking.", "eval.")
RESUME_LONGER = ("train.max_steps", "train.num_epochs")  # free upward: the run goes on further
# Written back into recipe.yaml once resolved (unset: off where the template has the switch).
RESUME_RESOLVED = ("data.enable_thinking",)
_UNSET = "(unset)"


def _flat_recipe(tree: dict) -> dict:
    return {f"{section}.{key}": value for section, values in tree.items() if isinstance(values, dict)
            for key, value in values.items()}


def resume_changes(recipe: Recipe, checkpoint: Path, step: int) -> list[dict]:
    """How `recipe` differs from the recipe of the run whose `checkpoint` it continues (that
    run folder's recipe.yaml), each change as {step, key, was, now}. A change of what the run
    trains on, its shapes or its trajectory (anything but `RESUME_FREE`, and a shorter run) is
    refused unless train.resume_changes=allow: the run folder would otherwise record one recipe
    for steps trained under two. A key one side leaves unset is compared at the value the run
    used (its saved drafter config, else the default), so restating it is no change. The
    caller records the changes in run.json."""
    from draftsmith.recipe import recipe_to_dict

    recorded = checkpoint.parent.parent / "recipe.yaml"
    old = _recorded_recipe(recorded, checkpoint, recipe.train.resume_changes == "allow")
    if old is None:
        return []
    new = _flat_recipe(recipe_to_dict(recipe))
    defaults = _defaults(recipe)
    used = {**defaults, **_saved_config(checkpoint)}  # what the run used where its record says nothing
    changes, guarded = [], []
    for key in sorted(old.keys() | new.keys()):
        was, now = old.get(key, used.get(key, _UNSET)), new.get(key, defaults.get(key, _UNSET))
        if was == now or key in RESUME_IGNORED:
            continue
        if key in RESUME_RESOLVED and now is None:
            continue
        changes.append({"step": step, "key": key, "was": was, "now": now})
        longer = key in RESUME_LONGER and isinstance(was, (int, float)) and isinstance(now, (int, float)) \
            and (now >= was > 0)
        if not (key in RESUME_FREE or key.startswith(RESUME_FREE_SECTIONS) or longer):
            guarded.append(f"{key} from {was!r} to {now!r}")
    if guarded and recipe.train.resume_changes != "allow":
        more = f" (and {len(guarded) - 1} more: {'; '.join(guarded[1:])})" if len(guarded) > 1 else ""
        raise DraftsmithError(f"cannot resume from {checkpoint}: the recipe changes {guarded[0]}{more} of the run it "
                              f"continues ({recorded}), which changes what it trains on, its shapes or its "
                              "trajectory; give the run's values, or set train.resume_changes=allow to continue "
                              "with the change recorded in run.json")
    return changes


def _recorded_recipe(recorded: Path, checkpoint: Path, allow: bool) -> dict | None:
    """The flat recipe the run recorded. Missing or damaged, nothing says what the run trained
    with, so the resume is refused in one line, or (train.resume_changes=allow) goes on
    unchecked, said so: None, and the run's recipe.yaml is written anew from this recipe."""
    import yaml

    try:
        tree = yaml.safe_load(recorded.read_text())
        problem = _record_problem(tree)
    except FileNotFoundError:
        problem = "is missing"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        problem = f"cannot be read ({first_lines(exc, 1)})"
    if not problem:  # a run recorded before a key's rename is read under the key's new name
        return {RENAMED.get(key, key): value for key, value in _flat_recipe(tree).items()}
    if not allow:
        raise DraftsmithError(f"cannot resume from {checkpoint}: the run's recipe record {recorded} {problem}, so "
                              "nothing says what the run trained with; restore it, or set train.resume_changes=allow "
                              "to resume unchecked (recipe.yaml is then written from this recipe)")
    log.warning("draftsmith: resuming from %s unchecked (train.resume_changes=allow): the run's recipe record %s %s; "
                "it is written anew from this recipe", checkpoint, recorded, problem)
    return None


def _record_problem(tree) -> str:
    """What is wrong with a parsed recipe.yaml ("" when it is a mapping of sections)."""
    if tree is None:
        return "is empty"
    if isinstance(tree, dict) and tree and all(isinstance(v, dict) for v in tree.values()):
        return ""
    return f"is not a mapping of recipe sections ({str(tree)[:40]!r})"


def _defaults(recipe: Recipe) -> dict:
    """Each key's default: the recipe sections' fields and the method config's (a recipe
    records only the method keys it set; the config derives the rest)."""
    import dataclasses

    def value(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    sections = {k: v for k, v in _flat_recipe(dataclasses.asdict(Recipe())).items() if not k.startswith("method.")}
    config = recipe.method.spec.load("config") if recipe.method.name else None
    method = {f"method.{f.name}": value(f) for f in dataclasses.fields(config)} if config else {}
    return {**sections, **{k: v for k, v in method.items() if v is not None and v is not dataclasses.MISSING}}


def _saved_config(checkpoint: Path) -> dict:
    """The method keys as the run resolved them: its drafter's config as the checkpoint saved
    it (models/native.py; what the method derived, a width from the target or a default);
    {} for a model saved in another format."""
    saved = checkpoint / MODEL / "config.json"
    meta = read_json(saved) if saved.is_file() else {}
    config = meta.get("config") if meta.get("format") == "draftsmith" else None
    return {f"method.{k}": v for k, v in config.items()} if isinstance(config, dict) else {}


def set_aside_later_checkpoints(out_dir: Path, step: int) -> None:
    """A run resumed from step `step` of its folder abandons the trajectory past it: its later
    checkpoints move to ABANDONED, out of the rotation (which would keep them as the newest
    and delete the resumed run's own) and out of a later `train.resume=true`, but not lost."""
    later = [p for p in checkpoint_folders(out_dir) if checkpoint_step(p) > step]
    if not later:
        return
    aside = out_dir / ABANDONED
    aside.mkdir(exist_ok=True)
    for folder in later:
        dest = aside / folder.name
        if dest.exists():  # set aside by an earlier resume too: keep both
            dest = aside / f"{folder.name}-{uuid.uuid4().hex[:6]}"
        os.rename(folder, dest)
    log.warning("draftsmith: resumed at step %d; the later checkpoints %s of the abandoned trajectory are kept in %s",
                step, ", ".join(p.name for p in later), aside)


def start_run(out_dir: Path, record: dict, overwrite: bool, resume_step: int | None = None) -> None:
    """Main process, once the run is about to write: remove the run it replaces (asked for
    with train.overwrite), set aside checkpoints past a resumed step, record the folder's owner."""
    if resume_step is not None:
        set_aside_later_checkpoints(out_dir, resume_step)
    held = held_run(out_dir) if overwrite else []
    if held:
        log.warning("draftsmith: train.overwrite: removing the run in %s (%s)", out_dir, ", ".join(held))
        for name in RUN_OUTPUTS:
            path = out_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    write_json(out_dir / RUN_FILE, {k: v for k, v in record.items() if v is not None})


@contextlib.contextmanager
def claim_run_folder(recipe: Recipe) -> Iterator[dict]:
    """Create the run folder, hold its lock (main process only; the others write nothing
    before it has checked) and check which run owns it. Yields the run's record."""
    out_dir = ensure_writable_dir(recipe.train.output_dir)
    main = int(os.environ.get("RANK", "0")) == 0  # set by accelerate launch / torchrun; no process group yet
    lock = folder_lock(out_dir, "train.output_dir") if main else contextlib.nullcontext()
    with lock as ended:
        if ended:
            log.warning("draftsmith: taking over the lock of process %s in %s, which has ended", ended, out_dir)
        yield check_owner(recipe, out_dir)


def record_changes(recipe: Recipe, run: dict, resume_from: Path, step: int) -> dict:
    """The run's record with the recipe's changes since `resume_from` (a change that moves the
    trajectory is refused), each with the step it took effect."""
    changes = resume_changes(recipe, resume_from, step)
    if not changes:
        return run
    log.info("resuming at step %d with %s", step, "; ".join(f"{c['key']} {c['was']!r} -> {c['now']!r}" for c in changes))
    return {**run, "changes": [*run.get("changes", []), *changes]}


def remove_empty(folder: Path) -> None:
    """Remove `folder` if it (and every folder in it) is empty."""
    if not folder.is_dir():
        return
    for sub in sorted(folder.rglob("*"), reverse=True):
        if sub.is_dir():
            try:
                sub.rmdir()
            except OSError:
                return
    try:
        folder.rmdir()
    except OSError:
        pass
