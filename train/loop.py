"""The one training loop, shared by every method, on accelerate.

accelerate supplies devices, DDP/DeepSpeed/FSDP (from `accelerate launch --config_file`),
mixed precision, gradient accumulation, checkpoints (`save_state`) and trackers; this
file only orders them. Steps count optimizer updates. The data order is a function of
(seed, epoch) alone, so a resumed run sees exactly the batches the uninterrupted run
would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader, IterableDataset

from draftsmith.data.batching import LengthGroupedSampler, real_length, trim_padding
from draftsmith.data.packing import pack_rows
from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import (
    apply_user_modes,
    atomic_file,
    ensure_writable_dir,
    full_disk_reason,
    is_disk_full,
    link_tree,
    open_safetensors,
    write_failure,
)
from draftsmith.logs import show_progress
from draftsmith.models.run_weights import MODEL
from draftsmith.recipe import Recipe, dump_recipe, validate
from draftsmith.train.best import BestWeights
from draftsmith.train.checkpoints import CHECKPOINTS, checkpoint_folders, checkpoint_name, saved_checkpoints
from draftsmith.train.launch_checks import check_launch, process_group_kwargs, set_fsdp_wrap_classes
from draftsmith.train.method import build_method
from draftsmith.train.run_folder import claim_run_folder, resume_changes, start_run
from draftsmith.train.schedule import check_schedule, make_scheduler, total_steps
from draftsmith.train.tracking import check_tracking, start_trackers

log = logging.getLogger(__name__)



def mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    # CPU autocast to bf16 is slow and lossy on most CPUs; bf16 only where a GPU has it.
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def make_accelerator(recipe: Recipe, out_dir: Path):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    report_to = recipe.tracking.report_to
    # DeepSpeed clips inside its engine (clip_grad_norm_ does nothing there) and fills its
    # "auto" gradient_clipping from this variable; unset, accelerate puts 1.0.
    os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(recipe.train.clip)
    # accelerate keeps one state per process and refuses a second Accelerator of another
    # precision; a launch trains once, but a second train() in one process (a notebook, the
    # rehearsal tests) may ask for another. The process group (PartialState) is kept.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return Accelerator(
        mixed_precision=mixed_precision(recipe.train.mixed_precision),
        gradient_accumulation_steps=recipe.train.grad_accum,
        log_with=None if report_to == "none" else report_to,
        # accelerate names checkpoints (RUN/checkpoints/checkpoint_<step>: save_checkpoint sets the
        # number) and deletes the oldest beyond total_limit before it writes a new one.
        project_config=ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir / "logs"),
                                            automatic_checkpoint_naming=True,
                                            total_limit=recipe.train.keep_checkpoints or None),
        # The data order is a function of train.seed alone, whatever else drew random numbers.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.train.seed),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=process_group_kwargs(recipe.train.dist_timeout),
    )


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = saved_checkpoints(out_dir)
    return done[-1] if done else None


def _other_checkpoints(path: Path) -> str:
    others = [str(p) for p in saved_checkpoints(path.parent.parent) if p != path]
    if not others:
        return "no earlier checkpoint to resume from"
    return f"resume from an earlier one with train.resume=PATH ({', '.join(others)})"


def check_checkpoint(path: Path) -> int:
    """The step of checkpoint `path`, once every file its save recorded is there, whole."""
    meta_file = path / "step.json"
    if not meta_file.is_file():
        raise DraftsmithError(f"train.resume: {path} is not a checkpoint (no step.json; checkpoints are "
                              f"RUN/{CHECKPOINTS}/checkpoint_STEP)")
    try:
        meta = json.loads(meta_file.read_text())
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError):
        raise DraftsmithError(f"checkpoint {path}: step.json is damaged; {_other_checkpoints(path)}") from None
    for name, size in meta.get("files", {}).items():  # absent in checkpoints from before the manifest
        file = path / name
        if not file.is_file():
            raise DraftsmithError(f"checkpoint {path}: {name} is missing; {_other_checkpoints(path)}")
        if file.stat().st_size != size:
            raise DraftsmithError(f"checkpoint {path}: {name} is truncated ({file.stat().st_size} of {size} bytes); "
                                  f"{_other_checkpoints(path)}")
    return step


def save_checkpoint(accelerator, out_dir: Path, step: int, window: dict | None = None,
                    weights: Callable[[Path], object] | None = None) -> None:
    """accelerate's save_state into RUN/checkpoints/checkpoint_<step>, the method's model
    (`weights(folder)` writes folder/model, which export and eval read), then step.json.

    accelerate picks the folder from its save iteration, set here to the step, and first
    deletes the oldest checkpoints beyond train.keep_checkpoints (its total_limit). step.json,
    written last and atomically once every process has saved, lists every file with its size:
    a folder without it is a save that did not finish, never resumed from, and a resume
    names a file lost or cut short later. `window` (each rank's unlogged metric sums) lets a
    resumed run log the same windows as an uninterrupted one. A write that fails (a full
    disk) removes its folder and stops the run; the previous checkpoints are left as they were."""
    folder = out_dir / CHECKPOINTS
    final = folder / checkpoint_name(step)
    if accelerator.is_main_process and final.exists():  # this step of a later run abandoned by a resume
        shutil.rmtree(final)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.iteration = step
    try:
        # Under automatic naming accelerate derives this same folder itself; it is passed for clarity.
        accelerator.save_state(str(final))
        (final / f"window-{accelerator.process_index}.json").write_text(json.dumps(window or {}))
        if accelerator.is_main_process and weights is not None:
            weights(final)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            apply_user_modes(final)  # safetensors leaves its files 0600, unreadable by a server of another user
            files = {str(f.relative_to(final)): f.stat().st_size for f in sorted(final.rglob("*")) if f.is_file()}
            with atomic_file(final / "step.json") as f:
                json.dump({"step": step, "files": files}, f)
            log.debug("saved %s", final)
    except Exception as exc:
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
        # torch.save reports a full disk as a RuntimeError ("unexpected pos", "file write failed").
        if not isinstance(exc, OSError) and not is_disk_full(exc):
            raise
        previous = latest_checkpoint(out_dir)
        reason = (f"{write_failure(exc)}: {full_disk_reason(exc)}" if is_disk_full(exc)
                  else exc.strerror or first_lines(exc, 1))
        raise DraftsmithError(f"cannot write the checkpoint of step {step} in {folder} ({reason}); "
                              + (f"the previous checkpoint {previous} is intact" if previous
                                 else "no earlier checkpoint exists")) from None
    accelerator.wait_for_everyone()


def remove_unfinished_checkpoints(out_dir: Path) -> None:
    """Main process, before a run starts: the folders of saves that did not finish (no
    step.json). accelerate's rotation would count them, and they hold nothing to resume."""
    for folder in checkpoint_folders(out_dir):
        if not (folder / "step.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)


def evaluate(method, model, loader, max_batches: int, step: int, accelerator, run_steps: int = 0) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    count = 0
    with torch.no_grad():
        # zip stops before fetching a batch past max_batches: fetching one more would end the
        # loader's pass and make gather_for_metrics cut its input to the last batch's remainder.
        for index, batch in zip(range(max_batches), loader):
            loss, metrics = method.loss(model, batch, step, micro=index, total_steps=run_steps)
            for k, v in {"loss": loss.item(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    model.train()
    means = {f"val/{k}": v / max(1, count) for k, v in sums.items()}
    if "val/loss_main" in means:  # capped against overflow; min() would turn a NaN into exp(50)
        loss_main = means["val/loss_main"]
        means["val/ppl"] = loss_main if math.isnan(loss_main) else math.exp(min(50.0, loss_main))
    # One row of means per process (not per sample): plain gather, never gather_for_metrics.
    gathered = accelerator.gather(torch.tensor(list(means.values()), device=accelerator.device))
    gathered = gathered.view(-1, len(means)).mean(0).tolist() if means else []
    return dict(zip(means, gathered))


def _weights_problem(model) -> str | None:
    """What is wrong with the weights, if any is NaN or infinite (one device read)."""
    # FSDP2 holds DTensors: each process checks its own shard (stop_if_not_finite gathers the verdict).
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]
    flags = [p.isfinite().all() for p in local if p.numel()]
    return None if not flags or bool(torch.stack(flags).all()) else "weights hold NaN or infinity"


def stop_if_not_finite(accelerator, problem: str | None, step: int, out_dir: Path) -> None:
    """End the run in one line at the first step whose loss, gradient or weights are not finite
    (on any process), before that step is logged or saved: a NaN would otherwise train on
    silently and be written as the model. The checkpoints already saved are kept as they are."""
    bad = problem is not None
    if accelerator.num_processes > 1:  # every process stops together, or the others would wait forever
        bad = bool(accelerator.reduce(torch.tensor([float(bad)], device=accelerator.device), reduction="sum").item())
    if not bad:
        return
    previous, bad = last_finite_checkpoint(out_dir)
    kept = (f"the last good checkpoint {previous} is kept (resume from it, e.g. with a lower train.lr)" if previous
            else "no checkpoint with finite weights had been saved")
    if bad:
        kept += f"; the later {', '.join(p.name for p in bad)} hold NaN, infinite or unreadable weights"
    problem = problem or "loss or weights of another process are not finite"
    raise DraftsmithError(f"step {step}: the training {problem}; stopped, {kept}")


def last_finite_checkpoint(out_dir: Path) -> tuple[Path | None, list[Path]]:
    """The newest checkpoint whose saved weights are all finite, and the newer ones that are not:
    a run stopped by a NaN names as good only a checkpoint that is (weights in safetensors files
    are read; a checkpoint without any is taken as it is)."""
    bad = []
    for folder in reversed(saved_checkpoints(out_dir)):
        if all(_finite_file(f) for f in sorted(folder.rglob("*.safetensors"))):
            return folder, bad
        bad.append(folder)
    return None, bad


def _finite_file(file: Path) -> bool:
    try:
        with open_safetensors(file) as f:
            return all(not t.is_floating_point() or bool(t.isfinite().all()) for t in map(f.get_tensor, f.keys()))
    except DraftsmithError:  # damaged since it was saved: no good either
        return False


def make_loaders(method, recipe: Recipe) -> tuple[DataLoader, DataLoader]:
    """The training and evaluation loaders: each batch cut to its longest row (data/batching.py),
    or its conversations packed into rows with data.packing (data/packing.py);
    training rows shuffled, or grouped by length with data.group_by_length, from train.seed."""
    t = recipe.train
    if isinstance(method.train_data, IterableDataset):  # a stream (data.streaming): rows in corpus order
        order = {}
    elif recipe.data.group_by_length:
        lengths = real_length(method.train_tokens()["attention_mask"]).tolist()
        order = {"sampler": LengthGroupedSampler(lengths, t.batch_size, t.seed)}
    else:  # accelerate swaps in its seedable sampler (DataLoaderConfiguration in make_accelerator)
        order = {"shuffle": True, "generator": torch.Generator().manual_seed(t.seed)}
    if recipe.data.packing and not method.packs:
        raise DraftsmithError(f"data.packing: method {recipe.method.name} does not read packed rows "
                              "(its loss takes no per-conversation positions)")
    collate = pack_rows if recipe.data.packing else trim_padding
    train_loader = DataLoader(method.train_data, batch_size=t.batch_size, drop_last=True, collate_fn=collate,
                              **order)
    eval_loader = DataLoader(method.eval_data, batch_size=t.batch_size, shuffle=False, collate_fn=collate)
    if not isinstance(method.train_data, IterableDataset) and len(train_loader) == 0:
        raise DraftsmithError(f"data.dataset {recipe.data.dataset!r}: fewer training rows than train.batch_size={t.batch_size}")
    return train_loader, eval_loader


def check_positions(recipe: Recipe) -> None:
    """Refuse rows longer than the target takes, before any data is prepared."""
    t = recipe.target
    if t.path:
        from draftsmith.models.target import find_model_dir
        from draftsmith.models.tile import read_target_config

        folder = find_model_dir(t.path)
        if not isinstance(folder, Path):  # a hub name: the target's own load names what is wrong
            return
        positions, where = read_target_config(folder).get("max_position_embeddings"), f"target {t.path}"
    else:
        positions, where = t.max_position_embeddings, "target.max_position_embeddings"
    if positions and recipe.train.seq_len > positions:
        raise DraftsmithError(f"train.seq_len={recipe.train.seq_len} is beyond the {positions} positions of {where}")


def check_method_shape(recipe: Recipe) -> None:
    """The method's keys against the shape of a target at a path (its config.json alone), before
    any data is prepared: the drafter config's `check_params` names the key (models/<method>.py)."""
    check = getattr(recipe.method.spec.load("config"), "check_params", None)
    if check is None or not recipe.target.path:
        return
    from draftsmith.models.target import find_model_dir

    folder = find_model_dir(recipe.target.path)
    if not (isinstance(folder, Path) and folder.is_dir()):
        return
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - a broken config: the target's own load names it
        return
    check(recipe.method.params, seq_len=recipe.train.seq_len, target_config=config)


def say_what_is_off(recipe: Recipe) -> None:
    """Settings a run takes as asked but that a user may not mean, said once at the start: with
    train.lr=0 the weights never change (a dry run of the pipeline), and train.eval_batches=0
    turns validation off (no val/ metrics are logged)."""
    t = recipe.train
    if t.lr == 0:
        log.warning("train.lr=0: the weights will not change (a dry run); set train.lr to train")
    if t.eval_batches == 0:
        log.warning("train.eval_batches=0: validation is off, no val/ metrics will be logged")


def _remove_empty(folder: Path) -> None:
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


def train(recipe: Recipe) -> Path:
    validate(recipe)
    fresh = not Path(recipe.train.output_dir).exists()
    try:
        with claim_run_folder(recipe) as run:  # the folder's lock, and refusal of another run's folder
            return _train(recipe, run)
    except BaseException:
        if fresh:  # a run that failed before writing anything leaves no empty run folder
            _remove_empty(Path(recipe.train.output_dir))
        raise


def _train(recipe: Recipe, run: dict) -> Path:
    out_dir = ensure_writable_dir(recipe.train.output_dir)
    resume_from, resumed_at = resume_point(recipe.train.resume, out_dir)
    if resume_from is not None:
        run = _with_changes(recipe, run, resume_from, resumed_at)
    check_before_work(recipe)
    training = Training(recipe, out_dir)
    training.resume(resume_from, resumed_at)
    training.start_records(run, resumed_at)
    training.run()
    return training.finish()


def resume_point(resume: bool | str, out_dir: Path) -> tuple[Path | None, int | None]:
    """The checkpoint train.resume names (true: the run folder's latest) and its step; (None, None) for a fresh run."""
    if resume is True:
        path = latest_checkpoint(out_dir)
        if path is None:
            raise DraftsmithError(f"train.resume=true but {out_dir}/{CHECKPOINTS} holds no checkpoint")
    elif resume:
        path = Path(resume)
    else:
        return None, None
    return path, check_checkpoint(path)


def _with_changes(recipe: Recipe, run: dict, resume_from: Path, step: int) -> dict:
    """The run's record with the recipe's changes since `resume_from` (a change that moves the
    trajectory is refused), each with the step it took effect."""
    changes = resume_changes(recipe, resume_from, step)
    if not changes:
        return run
    log.info("resuming at step %d with %s", step, "; ".join(f"{c['key']} {c['was']!r} -> {c['now']!r}" for c in changes))
    return {**run, "changes": [*run.get("changes", []), *changes]}


def check_before_work(recipe: Recipe) -> None:
    """Everything the recipe alone can refuse, before a process group, a model or data is made."""
    check_positions(recipe)
    check_method_shape(recipe)
    say_what_is_off(recipe)
    check_launch(recipe.method.spec)
    check_schedule(recipe.train.lr_schedule)
    check_tracking(recipe.tracking.report_to, recipe.tracking.mode)


@dataclasses.dataclass
class Window:
    """What the run did since the last logged step: metric sums over `n` micro-batches, the
    tokens read and the seconds taken. Saved in each checkpoint, so that a resumed run logs
    the same windows as an uninterrupted one."""

    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    n: int = 0
    tokens: int = 0
    before: float = 0.0  # seconds counted before `started` (a resumed window's)
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, metrics: dict[str, float], tokens: int) -> None:
        self.tokens += tokens
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.n += 1

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.started

    def saved(self) -> dict:
        return {"sums": self.sums, "n": self.n, "tokens": self.tokens, "s": self.seconds()}

    @classmethod
    def from_saved(cls, w: dict) -> Window:
        return cls(w.get("sums", {}), w.get("n", 0), w.get("tokens", 0), w.get("s", 0.0))


def first_not_finite(metrics: dict[str, float]) -> str | None:
    """The loss or gradient norm of one micro-batch that is NaN or infinite, in words."""
    for name, what in (("loss", "loss"), ("grad_norm", "gradient norm")):
        if not math.isfinite(metrics.get(name, 0.0)):
            return f"{what} is {metrics[name]}"
    return None


class Training:
    """One run, phase by phase: setup (here), `resume`, `start_records`, `run` (each optimizer
    step: `micro_batch`, `end_step`, and on their steps `log_window`, `validate`, `save`), `finish`."""

    def __init__(self, recipe: Recipe, out_dir: Path):
        from accelerate.utils import set_seed

        self.recipe, self.out_dir = recipe, out_dir
        self.accelerator = make_accelerator(recipe, out_dir)
        if self.accelerator.is_main_process:  # what an interrupted save left (one run per folder)
            remove_unfinished_checkpoints(out_dir)
        set_seed(recipe.train.seed)
        self.method = build_method(recipe, self.accelerator.device)
        adamw = self._prepare()
        self._schedule(adamw)
        self.step = 0
        self.window = Window()
        self.problem: str | None = None  # the first non-finite loss or gradient norm of the current optimizer step

    def _prepare(self) -> torch.optim.Optimizer:
        """The model, its optimizer and the loaders, as accelerate wraps them; the optimizer unwrapped."""
        from accelerate.utils import DistributedType

        t, method, accelerator = self.recipe.train, self.method, self.accelerator
        train_loader, eval_loader = make_loaders(method, self.recipe)
        params = [p for p in method.model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, t.adam_beta2), weight_decay=t.weight_decay)
        if accelerator.distributed_type == DistributedType.FSDP:  # shard units from the model being trained
            set_fsdp_wrap_classes(method.model)
        self.model, self.optimizer, self.train_loader, self.eval_loader = accelerator.prepare(
            method.model, adamw, train_loader, eval_loader)
        self.stream = method.train_data if isinstance(method.train_data, IterableDataset) else None
        self.resumable = self.stream if hasattr(self.stream, "resume_at") else None  # data/stream.py's PackedStream
        if self.resumable is not None:  # its resume points go into every checkpoint
            accelerator.register_for_checkpointing(self.resumable)
        return adamw

    def _schedule(self, adamw: torch.optim.Optimizer) -> None:
        """The run's length in micro-batches per epoch and optimizer steps, and its lr schedule."""
        t, accelerator = self.recipe.train, self.accelerator
        # Epochs hold whole optimizer steps only: a short accumulation at an epoch's end would
        # differ between one and several processes, and break `micro = step * grad_accum` on resume.
        if self.stream is not None:  # a stream is read once, as far as the run goes
            self.per_epoch = t.max_steps * t.grad_accum
        else:
            self.per_epoch = len(self.train_loader) - len(self.train_loader) % t.grad_accum
        if self.per_epoch == 0:
            raise DraftsmithError(f"data.dataset {self.recipe.data.dataset!r}: {len(self.train_loader)} batches per "
                                  f"epoch, fewer than train.grad_accum={t.grad_accum}")
        # The length in steps is known once the prepared loader says how many batches a process reads.
        self.max_steps = total_steps(t.max_steps, t.num_epochs, self.per_epoch // t.grad_accum)
        self.scheduler = accelerator.prepare(make_scheduler(adamw, t.lr_schedule, self.max_steps, t.warmup_ratio,
                                                            t.min_lr_ratio))
        if accelerator.is_main_process:
            log.info("train %s: %d optimizer steps of %d rows (%d per epoch), %s schedule", self.recipe.method.name,
                     self.max_steps, t.batch_size * t.grad_accum * accelerator.num_processes,
                     self.per_epoch // t.grad_accum, t.lr_schedule)

    def resume(self, checkpoint: Path | None, step: int | None) -> None:
        """Load the optimizer, scheduler, RNG and data state of `checkpoint` (none: a fresh run)."""
        if checkpoint is None:
            return
        accelerator = self.accelerator
        try:
            accelerator.load_state(str(checkpoint))
        except Exception as exc:  # another model shape, a damaged file: the checkpoint, not our bug
            raise DraftsmithError(f"cannot resume from {checkpoint}: {first_lines(exc)}") from None
        self.step = step
        saved = checkpoint / f"window-{accelerator.process_index}.json"
        if saved.is_file():
            self.window = Window.from_saved(json.loads(saved.read_text()))
        if accelerator.is_main_process:
            log.info("resumed from %s at step %d", checkpoint, step)

    def start_records(self, run: dict, resumed_at: int | None) -> None:
        """The run folder's record, recipe, trackers, metrics history and best weights. After a
        resume has loaded: a refused one leaves the run's recipe as it was."""
        accelerator, out_dir = self.accelerator, self.out_dir
        self.history = out_dir / "metrics.jsonl"
        if accelerator.is_main_process:
            recorded = self.method.recipe  # with what the method decided for keys left unset
            text = dump_recipe(recorded)
            start_run(out_dir, run, self.recipe.train.overwrite, resumed_at)
            with atomic_file(out_dir / "recipe.yaml") as f:
                f.write(text)
            start_trackers(accelerator, recorded.tracking, out_dir, _flat(recorded), text, resumed_at)
            _truncate_history(self.history, self.step)  # drop what an interrupted run logged past its checkpoint
        self.best = BestWeights(out_dir, resumed_at, accelerator.is_main_process)
        self.weights = StepWeights(self.method, accelerator, self.model)

    def run(self) -> None:
        """Optimizer steps from the resumed one (or 0) to the last, epoch by epoch."""
        from tqdm.auto import tqdm

        self.micro = self.step * self.recipe.train.grad_accum
        self.bar = tqdm(total=self.max_steps, initial=self.step, desc=f"train {self.recipe.method.name}",
                        dynamic_ncols=True, disable=not self.accelerator.is_local_main_process or not show_progress())
        self.window.started = time.perf_counter()  # the clock counts training, not the setup before it
        self.model.train()
        while self.step < self.max_steps:
            self._epoch()
        self.bar.close()

    def _epoch(self) -> None:
        """The rest of one pass over the data, or of the run if it ends first."""
        t = self.recipe.train
        epoch, skip = divmod(self.micro, self.per_epoch)
        for batch in self._batches(epoch, skip):
            self.micro_batch(batch)
            if not self.accelerator.sync_gradients:
                continue
            self.end_step()
            if self.step >= self.max_steps or self.micro % self.per_epoch == 0:
                return
        # only a stream ends before its pass does: the corpus is shorter than the run
        raise DraftsmithError(f"data.dataset {self.recipe.data.dataset!r}: the corpus ended after {self.micro} "
                              f"batches of train.batch_size={t.batch_size}, before step {self.max_steps} "
                              "(train.max_steps)")

    def _batches(self, epoch: int, skip: int):
        """Epoch `epoch`'s batches past its first `skip` (those a resumed run already trained on)."""
        self.train_loader.set_epoch(epoch)
        if skip and self.resumable is not None:  # restarts near its row, not from row 0
            self.resumable.resume_at(skip * self.recipe.train.batch_size * self.accelerator.num_processes)
            return self.train_loader
        return self.accelerator.skip_first_batches(self.train_loader, skip) if skip else self.train_loader

    def micro_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """Forward and backward of one micro-batch; the optimizer steps on the last of an accumulation."""
        accelerator, model, clip = self.accelerator, self.model, self.recipe.train.clip
        with accelerator.accumulate(model):
            loss, metrics = self.method.loss(model, batch, self.step, micro=self.micro, total_steps=self.max_steps)
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip > 0:
                metrics["grad_norm"] = float(accelerator.clip_grad_norm_(model.parameters(), clip))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.micro += 1
        metrics = {"loss": loss.item(), **metrics}
        self.window.add(metrics, self.method.tokens_in(batch) * accelerator.num_processes)
        self.problem = self.problem or first_not_finite(metrics)

    def end_step(self) -> None:
        """An optimizer step done: stop on a non-finite one, else count it, and log, validate
        and save on the steps the recipe says (and the last)."""
        t = self.recipe.train
        stop_if_not_finite(self.accelerator, self.problem, self.step + 1, self.out_dir)
        self.scheduler.step()
        self.step += 1
        self.bar.update(1)
        last = self.step == self.max_steps
        if self.step % t.log_every == 0 or last:
            self.log_window()
        if self.step % t.eval_every == 0 or last:
            self.validate()
        if self.step % t.save_every == 0 or last:
            self.save()

    def log_window(self) -> None:
        accelerator, window = self.accelerator, self.window
        elapsed = window.seconds()
        # Each process saw its own shard of the global batch: log the mean over processes.
        means = accelerator.reduce(torch.tensor([v / window.n for v in window.sums.values()],
                                                device=accelerator.device), reduction="mean")
        logs = {f"train/{k}": v for k, v in zip(window.sums, means.tolist())}
        logs["train/lr"] = self.scheduler.get_last_lr()[0]
        logs["train/tokens_per_s"] = window.tokens / max(elapsed, 1e-9)
        _log(accelerator, self.history, self.step, logs)
        self.bar.set_postfix(loss=f"{logs['train/loss']:.3f}", tok_s=f"{logs['train/tokens_per_s']:.0f}")
        self.window = Window()

    def validate(self) -> None:
        """Validation metrics, logged; the weights kept as the best if they beat it."""
        from tqdm.contrib.logging import logging_redirect_tqdm

        step = self.step
        val = evaluate(self.method, self.model, self.eval_loader, self.recipe.train.eval_batches, step,
                       self.accelerator, self.max_steps)
        _log(self.accelerator, self.history, step, val)
        if self.best.offer(val, step, self.weights.at(step)):
            self.weights.written[step] = self.best.folder / MODEL  # where that write came to rest
        if val and self.accelerator.is_main_process:
            with logging_redirect_tqdm([logging.getLogger("draftsmith")]):  # the CLI's handler
                log.info("step %d: %s", step, ", ".join(f"{k[4:]} {v:.4g}" for k, v in val.items()
                                                        if k in ("val/loss", "val/ppl", "val/tau_est")))

    def save(self) -> None:
        stop_if_not_finite(self.accelerator, _weights_problem(self.model), self.step, self.out_dir)
        save_checkpoint(self.accelerator, self.out_dir, self.step, self.window.saved(), self.weights.at(self.step))

    def finish(self) -> Path:
        """The last weights, RUN/model (its folder; the run folder on the other processes)."""
        self.accelerator.wait_for_everyone()
        final = None
        if self.accelerator.is_main_process:
            final = self.weights.at(self.step)(self.out_dir)
            log.info("wrote %s", final)
        self.accelerator.end_training()
        return final or self.out_dir


class StepWeights:
    """The method's model as export and eval read it (`method.save`), written once per step:
    the checkpoint, the best and the last weights of one step share its files (hard links)."""

    def __init__(self, method, accelerator, model):
        self.method, self.accelerator, self.model = method, accelerator, model
        self.written: dict[int, Path] = {}  # step -> the folder its model was written to

    def at(self, step: int) -> Callable[[Path], Path]:
        def write(folder: Path) -> Path:
            source = self.written.get(step)
            if source is not None and source.is_dir():
                return link_tree(source, folder / source.name)
            self.written[step] = self.method.save(self.accelerator.unwrap_model(self.model), folder)
            return self.written[step]

        return write


def _log(accelerator, history: Path, step: int, logs: dict[str, float]) -> None:
    if not logs:
        return
    accelerator.log(logs, step=step)
    if accelerator.is_main_process:
        with history.open("a") as f:
            f.write(json.dumps({"step": step, **logs}) + "\n")


def _truncate_history(history: Path, step: int) -> None:
    if not history.is_file():
        return
    lines = history.read_text(errors="replace").splitlines()
    keep = []
    for number, line in enumerate(lines, start=1):
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            if number == len(lines):  # the line an interruption cut short
                break
            raise DraftsmithError(f"{history}:{number}: not a metrics record; remove the line to resume") from None
        if row_step <= step:
            keep.append(line)
    with atomic_file(history) as f:
        f.write("".join(line + "\n" for line in keep))


def _flat(recipe: Recipe) -> dict:
    from draftsmith.recipe import recipe_to_dict

    flat = {}
    for section, values in recipe_to_dict(recipe).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat
