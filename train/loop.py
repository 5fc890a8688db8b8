"""The one training loop, shared by every method, on accelerate.

accelerate supplies devices, DDP/DeepSpeed/FSDP (from `accelerate launch --config_file`),
mixed precision, gradient accumulation, checkpoints (`save_state`) and trackers; this
file only orders them. Steps count optimizer updates. The data order is a function of
(seed, epoch) alone, so a resumed run sees exactly the batches the uninterrupted run
would have seen. Beside it: checkpoints.py (save, resume), finite.py (the stop on a NaN),
loaders.py, preflight.py (the checks before any work), run_folder.py, tracking.py
(trackers and metrics.jsonl), best.py (RUN/best).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import IterableDataset

from draftsmith.data.stream import PackedStream
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file, ensure_writable_dir, link_tree
from draftsmith.logs import show_progress
from draftsmith.models.model_dir import target_folder
from draftsmith.models.run_weights import MODEL
from draftsmith.recipe import Recipe, dump_recipe
from draftsmith.train.best import BestWeights
from draftsmith.train.checkpoints import (
    load_checkpoint,
    remove_unfinished_checkpoints,
    resume_point,
    save_checkpoint,
)
from draftsmith.train.finite import first_not_finite, stop_if_not_finite, weights_problem
from draftsmith.train.launch_checks import process_group_kwargs, set_fsdp_wrap_classes
from draftsmith.train.loaders import make_loaders
from draftsmith.train.method import build_method
from draftsmith.train.preflight import check_before_work
from draftsmith.train.run_folder import claim_run_folder, record_changes, remove_empty, start_run
from draftsmith.train.schedule import make_scheduler, total_steps
from draftsmith.train.tracking import log_metrics, start_trackers, tracker_config, truncate_history

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


def validation_metrics(method, model, loader, max_batches: int, step: int, accelerator,
                       run_steps: int = 0) -> dict[str, float]:
    """The method's loss and metrics over the first `max_batches` held-out batches, as `val/`
    means over every process."""
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


def train(recipe: Recipe) -> Path:
    """Train `recipe`, validated once as it was loaded (`load_recipe`)."""
    fresh = not Path(recipe.train.output_dir).exists()
    try:
        with claim_run_folder(recipe) as run:  # the folder's lock, and refusal of another run's folder
            return _train(recipe, run)
    except BaseException:
        if fresh:  # a run that failed before writing anything leaves no empty run folder
            remove_empty(Path(recipe.train.output_dir))
        raise


def _train(recipe: Recipe, run: dict) -> Path:
    out_dir = ensure_writable_dir(recipe.train.output_dir)
    resume_from, resumed_at = resume_point(recipe.train.resume, out_dir)
    if resume_from is not None:
        run = record_changes(recipe, run, resume_from, resumed_at)
    target_dir = target_folder(recipe.target.path)  # once for the run: its checks and its method read it
    check_before_work(recipe, target_dir)
    training = Training(recipe, out_dir, target_dir)
    training.resume(resume_from, resumed_at)
    training.start_records(run, resumed_at)
    training.run()
    return training.finish()


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


class Training:
    """One run, phase by phase: setup (here), `resume`, `start_records`, `run` (each optimizer
    step: `micro_batch`, `end_step`, and on their steps `log_window`, `validate`, `save`), `finish`."""

    def __init__(self, recipe: Recipe, out_dir: Path, target_dir: Path | str | None = None):
        from accelerate.utils import set_seed

        self.recipe, self.out_dir = recipe, out_dir
        self.accelerator = make_accelerator(recipe, out_dir)
        if self.accelerator.is_main_process:  # what an interrupted save left (one run per folder)
            remove_unfinished_checkpoints(out_dir)
        set_seed(recipe.train.seed)
        self.method = build_method(recipe, self.accelerator.device, target_dir)
        adamw = self._prepare()
        self._schedule(adamw)
        self.step = 0
        self.window = Window()
        self.problem: str | None = None  # the first non-finite loss or gradient norm of the current optimizer step

    def _prepare(self) -> torch.optim.Optimizer:
        """The model, its optimizer and the loaders, as accelerate wraps them; the optimizer unwrapped."""
        from accelerate.utils import DistributedType

        t, method, accelerator = self.recipe.train, self.method, self.accelerator
        train_loader, validation_loader = make_loaders(method, self.recipe)
        params = [p for p in method.model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, t.adam_beta2), weight_decay=t.weight_decay)
        if accelerator.distributed_type == DistributedType.FSDP:  # shard units from the model being trained
            set_fsdp_wrap_classes(method.model)
        self.model, self.optimizer, self.train_loader, self.validation_loader = accelerator.prepare(
            method.model, adamw, train_loader, validation_loader)
        self.stream = method.train_data if isinstance(method.train_data, IterableDataset) else None
        # A PackedStream (data.streaming) knows its resume points; any other stream restarts from row 0.
        self.resumable = self.stream if isinstance(self.stream, PackedStream) else None
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
        self.window = Window.from_saved(load_checkpoint(self.accelerator, checkpoint))
        self.step = step
        if self.accelerator.is_main_process:
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
            start_trackers(accelerator, recorded.tracking, out_dir, tracker_config(recorded), text, resumed_at)
            truncate_history(self.history, self.step)  # drop what an interrupted run logged past its checkpoint
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
        if self.step % t.validation_every == 0 or last:
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
        log_metrics(accelerator, self.history, self.step, logs)
        self.bar.set_postfix(loss=f"{logs['train/loss']:.3f}", tok_s=f"{logs['train/tokens_per_s']:.0f}")
        self.window = Window()

    def validate(self) -> None:
        """Validation metrics, logged; the weights kept as the best if they beat it."""
        from tqdm.contrib.logging import logging_redirect_tqdm

        step = self.step
        val = validation_metrics(self.method, self.model, self.validation_loader, self.recipe.train.validation_batches,
                                 step, self.accelerator, self.max_steps)
        log_metrics(self.accelerator, self.history, step, val)
        if self.best.offer(val, step, self.weights.at(step)):
            self.weights.written[step] = self.best.folder / MODEL  # where that write came to rest
        if val and self.accelerator.is_main_process:
            with logging_redirect_tqdm([logging.getLogger("draftsmith")]):  # the CLI's handler
                log.info("step %d: %s", step, ", ".join(f"{k[4:]} {v:.4g}" for k, v in val.items()
                                                        if k in ("val/loss", "val/ppl", "val/tau_est")))

    def save(self) -> None:
        stop_if_not_finite(self.accelerator, weights_problem(self.model), self.step, self.out_dir)
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


