"""The one training loop, shared by every method, on accelerate.

accelerate supplies devices, DDP/DeepSpeed/FSDP (from `accelerate launch --config_file`),
mixed precision, gradient accumulation, checkpoints (`save_state`) and trackers; this
file only orders them. Steps count optimizer updates. The data order is a function of
(seed, epoch) alone, so a resumed run sees exactly the batches the uninterrupted run
would have seen.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import atomic_file, ensure_writable_dir
from draftsmith.recipe import Recipe, dump_recipe, validate
from draftsmith.train.launch_checks import check_launch, process_group_kwargs
from draftsmith.train.method import build_method

CHECKPOINTS = "checkpoints"


def mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    # CPU autocast to bf16 is slow and lossy on most CPUs; bf16 only where a GPU has it.
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def make_accelerator(recipe: Recipe, out_dir: Path):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    report_to = recipe.tracking.report_to
    if report_to not in ("wandb", "tensorboard", "none"):
        raise DraftsmithError(f"tracking.report_to: expected wandb, tensorboard or none, got {report_to!r}")
    if report_to == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")  # no key: keep the run local, sync later
    # DeepSpeed clips inside its engine (clip_grad_norm_ does nothing there) and fills its
    # "auto" gradient_clipping from this variable; unset, accelerate puts 1.0.
    os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(recipe.train.clip)
    return Accelerator(
        mixed_precision=mixed_precision(recipe.train.mixed_precision),
        gradient_accumulation_steps=recipe.train.grad_accum,
        log_with=None if report_to == "none" else report_to,
        project_config=ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir / "logs")),
        # The data order is a function of train.seed alone, whatever else drew random numbers.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.train.seed),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=process_group_kwargs(),
    )


def cosine_with_warmup(optimizer, recipe: Recipe):
    t = recipe.train
    warmup = max(0, round(t.warmup_ratio * t.max_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, t.max_steps - warmup))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def latest_checkpoint(out_dir: Path) -> Path | None:
    folder = out_dir / CHECKPOINTS
    done = sorted(p for p in folder.glob("step-*") if (p / "step.json").is_file()) if folder.is_dir() else []
    return done[-1] if done else None


def _other_checkpoints(path: Path) -> str:
    others = [str(p) for p in sorted(path.parent.glob("step-*")) if p != path and (p / "step.json").is_file()]
    if not others:
        return "no earlier checkpoint to resume from"
    return f"resume from an earlier one with train.resume=PATH ({', '.join(others)})"


def check_checkpoint(path: Path) -> int:
    """The step of checkpoint `path`, once every file its save recorded is there, whole."""
    meta_file = path / "step.json"
    if not meta_file.is_file():
        raise DraftsmithError(f"train.resume: {path} is not a checkpoint (no step.json; checkpoints are "
                              f"RUN/{CHECKPOINTS}/step-NNNNNNN)")
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


def save_checkpoint(accelerator, out_dir: Path, step: int, keep: int, window: dict | None = None) -> None:
    """save_state into a temporary folder, renamed into place once every rank is done.

    step.json, written last, lists every file with its size, so that a resume names a file
    lost or cut short later. `window` (each rank's unlogged metric sums) lets a resumed run
    log the same windows as an uninterrupted one. A write that fails (a full disk) removes
    the temporary folder and stops the run; the previous checkpoint is left as it was."""
    folder = out_dir / CHECKPOINTS
    final = folder / f"step-{step:07d}"
    tmp = folder / f".tmp-step-{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        (tmp / f"window-{accelerator.process_index}.json").write_text(json.dumps(window or {}))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
            with atomic_file(tmp / "step.json") as f:
                json.dump({"step": step, "files": files}, f)
    except Exception as exc:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        # torch.save reports a full disk as a RuntimeError ("file write failed"), others as OSError.
        if not isinstance(exc, OSError) and "writ" not in str(exc).lower():
            raise
        previous = latest_checkpoint(out_dir)
        reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0]
        raise DraftsmithError(f"cannot write the checkpoint of step {step} in {folder} ({reason}); "
                              + (f"the previous checkpoint {previous} is intact" if previous
                                 else "no earlier checkpoint exists")) from None
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in sorted(folder.glob("step-*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def evaluate(method, model, loader, max_batches: int, step: int, accelerator) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    count = 0
    with torch.no_grad():
        # zip stops before fetching a batch past max_batches: fetching one more would end the
        # loader's pass and make gather_for_metrics cut its input to the last batch's remainder.
        for _, batch in zip(range(max_batches), loader):
            loss, metrics = method.loss(model, batch, step)
            for k, v in {"loss": loss.item(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    model.train()
    means = {f"val/{k}": v / max(1, count) for k, v in sums.items()}
    if "val/loss_main" in means:
        means["val/ppl"] = math.exp(min(50.0, means["val/loss_main"]))
    # One row of means per process (not per sample): plain gather, never gather_for_metrics.
    gathered = accelerator.gather(torch.tensor(list(means.values()), device=accelerator.device))
    gathered = gathered.view(-1, len(means)).mean(0).tolist() if means else []
    return dict(zip(means, gathered))


def check_positions(recipe: Recipe) -> None:
    """Refuse rows longer than the target takes, before any data is prepared."""
    t = recipe.target
    if t.path:
        from draftsmith.models.target import resolve_model_dir
        from draftsmith.models.tile import read_target_config

        folder = resolve_model_dir(t.path)
        if not isinstance(folder, Path):  # a hub name: the target's own load names what is wrong
            return
        positions, where = read_target_config(folder).get("max_position_embeddings"), f"target {t.path}"
    else:
        positions, where = t.max_position_embeddings, "target.max_position_embeddings"
    if positions and recipe.train.seq_len > positions:
        raise DraftsmithError(f"train.seq_len={recipe.train.seq_len} is beyond the {positions} positions of {where}")


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
        return _train(recipe)
    except BaseException:
        if fresh:  # a run that failed before writing anything leaves no empty run folder
            _remove_empty(Path(recipe.train.output_dir))
        raise


def _train(recipe: Recipe) -> Path:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    t = recipe.train
    out_dir = ensure_writable_dir(t.output_dir)
    if t.resume is True:
        resume_from = latest_checkpoint(out_dir)
        if resume_from is None:
            raise DraftsmithError(f"train.resume=true but {out_dir}/{CHECKPOINTS} holds no checkpoint")
    else:
        resume_from = Path(t.resume) if t.resume else None
    resume_step = check_checkpoint(resume_from) if resume_from is not None else 0
    check_positions(recipe)
    check_launch(recipe.method.name)

    accelerator = make_accelerator(recipe, out_dir)
    if accelerator.is_main_process:  # what an interrupted save left (one run per folder)
        for stale in (out_dir / CHECKPOINTS).glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
    set_seed(t.seed)
    method = build_method(recipe, accelerator.device)

    gen = torch.Generator().manual_seed(t.seed)
    train_loader = DataLoader(method.train_data, batch_size=t.batch_size, shuffle=True, drop_last=True, generator=gen)
    eval_loader = DataLoader(method.eval_data, batch_size=t.batch_size, shuffle=False)
    if len(train_loader) == 0:
        raise DraftsmithError(f"data.dataset {recipe.data.dataset!r}: fewer training rows than train.batch_size={t.batch_size}")
    params = [p for p in method.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, t.adam_beta2), weight_decay=t.weight_decay)
    scheduler = cosine_with_warmup(optimizer, recipe)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        method.model, optimizer, train_loader, eval_loader, scheduler)

    step = 0
    window: dict[str, float] = {}
    window_n, tokens, elapsed = 0, 0, 0.0
    if resume_from is not None:
        try:
            accelerator.load_state(str(resume_from))
        except Exception as exc:  # another model shape, a damaged file: the checkpoint, not our bug
            raise DraftsmithError(f"cannot resume from {resume_from}: {first_lines(exc)}") from None
        step = resume_step
        saved = resume_from / f"window-{accelerator.process_index}.json"
        if saved.is_file():
            w = json.loads(saved.read_text())
            window, window_n, tokens, elapsed = w.get("sums", {}), w.get("n", 0), w.get("tokens", 0), w.get("s", 0.0)
        accelerator.print(f"resumed from {resume_from} at step {step}")
    history = out_dir / "metrics.jsonl"
    if accelerator.is_main_process:  # after a resume has loaded: a refused one leaves the run's recipe
        with atomic_file(out_dir / "recipe.yaml") as f:
            f.write(dump_recipe(recipe))
        accelerator.init_trackers(recipe.tracking.project, config=_flat(recipe),
                                  init_kwargs={"wandb": {"name": recipe.tracking.run_name or out_dir.name,
                                                         "dir": str(out_dir)}})
        _truncate_history(history, step)  # drop what an interrupted run logged past its checkpoint
    micro = step * t.grad_accum
    # Epochs hold whole optimizer steps only: a short accumulation at an epoch's end would
    # differ between one and several processes, and break `micro = step * grad_accum` on resume.
    per_epoch = len(train_loader) - len(train_loader) % t.grad_accum
    if per_epoch == 0:
        raise DraftsmithError(f"data.dataset {recipe.data.dataset!r}: {len(train_loader)} batches per epoch, "
                              f"fewer than train.grad_accum={t.grad_accum}")
    bar = tqdm(total=t.max_steps, initial=step, desc=f"train {recipe.method.name}",
               disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    started = time.perf_counter() - elapsed
    model.train()
    while step < t.max_steps:
        epoch, skip = divmod(micro, per_epoch)
        train_loader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for batch in loader:
            with accelerator.accumulate(model):
                loss, metrics = method.loss(model, batch, step)
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.clip > 0:
                    metrics["grad_norm"] = float(accelerator.clip_grad_norm_(model.parameters(), t.clip))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            micro += 1
            tokens += method.tokens_in(batch) * accelerator.num_processes
            for k, v in {"loss": loss.item(), **metrics}.items():
                window[k] = window.get(k, 0.0) + v
            window_n += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            bar.update(1)
            if step % t.log_every == 0 or step == t.max_steps:
                elapsed = time.perf_counter() - started
                # Each process saw its own shard of the global batch: log the mean over processes.
                means = accelerator.reduce(torch.tensor([v / window_n for v in window.values()],
                                                        device=accelerator.device), reduction="mean")
                logs = {f"train/{k}": v for k, v in zip(window, means.tolist())}
                logs["train/lr"] = scheduler.get_last_lr()[0]
                logs["train/tokens_per_s"] = tokens / max(elapsed, 1e-9)
                _log(accelerator, history, step, logs)
                bar.set_postfix(loss=f"{logs['train/loss']:.3f}", tok_s=f"{logs['train/tokens_per_s']:.0f}")
                window, window_n, tokens, started = {}, 0, 0, time.perf_counter()
            if step % t.eval_every == 0 or step == t.max_steps:
                val = evaluate(method, model, eval_loader, t.eval_batches, step, accelerator)
                _log(accelerator, history, step, val)
                if val:
                    bar.write(f"step {step}: " + ", ".join(f"{k[4:]} {v:.4g}" for k, v in val.items()
                                                             if k in ("val/loss", "val/ppl", "val/tau_est")))
            if step % t.save_every == 0 or step == t.max_steps:
                save_checkpoint(accelerator, out_dir, step, t.keep_checkpoints,
                                {"sums": window, "n": window_n, "tokens": tokens,
                                 "s": time.perf_counter() - started})
            if step >= t.max_steps or micro % per_epoch == 0:
                break
    bar.close()
    accelerator.wait_for_everyone()
    final = None
    if accelerator.is_main_process:
        final = method.save(accelerator.unwrap_model(model), out_dir)
        accelerator.print(f"wrote {final}")
    accelerator.end_training()
    return final or out_dir


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
