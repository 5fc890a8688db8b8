"""What one drafter training step costs, against one forward of the frozen target.

For every method trained on a frozen target's features (registry.posthoc(): EAGLE-3, DFlash
and DSpark), its step built through its training class's faces (train/method.py: `new_drafter`,
`features_of`, `loss_on`), so the script names no method: the time and memory of one training
step of the drafter (the loss forward, backward, gradient clipping and an AdamW step at the
lr and clip of the method's tiny recipe, what train/loop.py does per batch) beside one no-grad
forward of the frozen target over the same batch (the feature forward train/posthoc.py runs
before each step). The target forward is listed
separately, not inside the step: a run on cached features (data/feature_cache.py) pays
the step alone, an online run pays both, which the `online tok/s` column adds up. What a
method extracts from the forward (EAGLE-3's draft-vocabulary logits) is taken once,
outside both.

Each step is timed back to back with a target forward (target, step, target, step, ...),
after warm-up, and the ratio of a row is the median of its steps over the median of the
forwards paired with them, so that drift (a shared CPU, clocks) hits both alike.

Memory. CUDA: torch.cuda.max_memory_allocated over the phase, minus what was allocated
when it began (`peak extra`: activations, gradients, the optimizer's update). CPU: the
process's peak resident set (VmHWM), reset through /proc/self/clear_refs before each
phase after returning freed heap to the OS (malloc_trim), minus the resident set at its
start. tracemalloc is no use here: it sees only Python's allocator, and torch allocates
tensor memory outside it (a 200 MB tensor shows as 0); ru_maxrss is a lifetime high-water
mark that an earlier, larger phase would hide. `state MiB` is counted from the tensors:
parameters, buffers and optimizer state (for the target, its weights).

Shapes. CPU (default): a scaled-down target (hidden 512, 8 layers, 8 query heads over 2
KV heads, vocab 8192; draft vocab 4096; seq 256, batch 2, 64 DFlash anchors per sequence:
the anchor density of 512 at 2048). CUDA: hidden 4096, 32 query heads over 8 (G = 4, as
Llama-3.1-8B), vocab 128256, draft vocab 32000, seq 2048, batch 1, 512 anchors, 5 drafter
layers where a drafter stacks them (DFlash's, reading 4 target layers, all a 4-layer target
has); the target has 4 layers, and `x fwd @32L` projects the ratio onto a 32-layer one from the time its decoder layers took
(timed by hooks on the first and last layer). On CUDA the target runs in bf16 and the
drafters keep fp32 weights under bf16 autocast; on a CPU everything is fp32, as the loop.

    python scripts/bench_train.py [--device cuda] [--repeats 5] [--hidden 512 ...]

Padding (`--padding`): real (non-padding) tokens per second of whole online steps (target
forward + drafter step) over the same rows batched four ways, side by side: padded to
seq_len (as train/posthoc.py's rows were batched before), each batch cut to its longest
row, cut with rows grouped by length (data.group_by_length), and each batch's rows packed
end to end into rows of seq_len (data.packing). The rows are synthetic,
with chat-shaped lengths (log-normal, median a quarter of seq_len, long tail, cut at seq_len);
the three batchings run interleaved, batch by batch, so that drift hits all alike.

    python scripts/bench_train.py --padding [--padding-rows 64] [--padding-batch 8]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from draftsmith.fields import DEFAULT_TILE
from draftsmith.models.target import decoder_layers, freeze, target_forward, tiny_config
from draftsmith.recipe import load_recipe
from draftsmith.registry import config_class, method_spec, posthoc
from draftsmith.train.method import StepShape

ROOT = Path(__file__).resolve().parent.parent
METHODS = tuple(posthoc())  # the methods trained on target features
PRESETS = {
    "cpu": dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=None, vocab=8192, draft_vocab=4096,
                seq=256, batch=2, anchors=64, drafter_layers=None, project_layers=0),
    "cuda": dict(hidden=4096, layers=4, heads=32, kv_heads=8, intermediate=14336, vocab=128256, draft_vocab=32000,
                 seq=2048, batch=1, anchors=512, drafter_layers=5, project_layers=32),
}


# ---- shared with scripts/bench_verify.py ------------------------------------------------


def write_report(out: Path, text: str) -> None:
    """--out written whole, by one bench at a time (fsutil's output lock)."""
    from draftsmith.fsutil import atomic_file, output_lock

    with output_lock(out), atomic_file(out) as f:
        f.write(text)

def build_target(device, dtype, attn: str = "sdpa", seed: int = 0, **shape):
    """A random Llama-style target built directly on `device` (a 128k-vocabulary model
    initialised on the CPU first would take longer than the measurements)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch="llama", **shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return freeze(model.to(device))


class Clock:
    """Marks in time: CUDA events on a GPU (no host sync inside a timed region), the host
    clock on a CPU, where every op has finished when it returns. `process=True` (CPU only)
    reads the process's CPU seconds instead: on a shared machine other tenants' load then
    stays out of the numbers (with one torch thread it equals wall time on an idle one)."""

    def __init__(self, device: torch.device, process: bool = False):
        self.cuda = device.type == "cuda"
        self.now = time.process_time if process and not self.cuda else time.perf_counter

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.now()

    def ms(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


class Memory:
    """Peak memory of a phase above what was in use when it began (see module doc)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.how = "torch.cuda.max_memory_allocated"
        self._trim = None
        if not self.cuda:
            try:
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
                self._reset_hwm()
                self.how = "VmHWM after clear_refs + malloc_trim"
            except OSError:  # not Linux/glibc: a lifetime high-water mark is all there is
                self.how = "ru_maxrss (lifetime peak: a phase shows 0 unless it sets a new one)"

    @staticmethod
    def _reset_hwm():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status_kib(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        gc.collect()
        if self._trim is not None:
            self._trim(0)
            self._reset_hwm()
            self.base = self._status_kib("VmRSS") * 1024
        else:
            import resource

            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak_extra(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if self._trim is not None:
            return self._status_kib("VmHWM") * 1024 - self.base
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


def state_bytes(*modules, optimizer=None) -> int:
    seen, total = set(), 0
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# ---- the measured pieces ----------------------------------------------------------------

def make_batch(vocab: int, batch: int, seq: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens (the mask token, vocab - 1, excluded); the first quarter is the
    prompt, unsupervised, as a chat row's user turn."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (batch, seq), generator=g)
    loss_mask = torch.ones(batch, seq, dtype=torch.long)
    loss_mask[:, : seq // 4] = 0
    return {"input_ids": ids.to(device), "loss_mask": loss_mask.to(device),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device)}


def training(method: str):
    """The method's TrainMethod class (train/<method>.py), whose faces build its step."""
    return method_spec(method, "training").load("training")


def method_keys(method: str, args, backend: str | None) -> dict:
    """The recipe keys (`method.*`) that give the method's drafter this benchmark's sizes."""
    shape = StepShape(vocab_size=args.vocab, draft_vocab_size=args.draft_vocab, anchors=args.anchors,
                      drafter_layers=args.drafter_layers or 0, target_layers=args.layers)
    keys = training(method).step_keys(shape)
    if backend is None:
        return keys
    if "attention_backend" not in {f.name for f in dataclasses.fields(config_class(method))}:
        sys.exit("bench_train: --drafter-attention needs drafter configs with an attention_backend field")
    return {**keys, "attention_backend": backend}


def layer_ids(method: str, target, args) -> list[int]:
    config = training(method).drafter_config(target.config, method_keys(method, args, None), DEFAULT_TILE)
    return list(config.target_layer_ids)


def optimizer_settings(method: str) -> tuple[float, float]:
    """(lr, clip) of the method's tiny recipe (a step's time does not depend on them)."""
    train = load_recipe(ROOT / "recipes" / "tiny" / f"{method}.yaml").train
    return train.lr, train.clip


def build_drafter(method: str, target, args, backend: str | None):
    """A fresh drafter, fp32, built on the target's device as train/<method>.py builds it
    (its `new_drafter`; created there directly: a real-size one initialised on the CPU would take seconds)."""
    with torch.device(next(target.parameters()).device):
        drafter = training(method).new_drafter(target, method_keys(method, args, backend), DEFAULT_TILE)
    drafter = drafter.to(dtype=torch.float32).train()
    drafter.gradient_checkpointing = args.grad_ckpt
    return drafter


def loss_fn(method: str, drafter, target, batch, out):
    """train/<method>.py's loss (its `loss_on`) on features taken once from `out` (its `features_of`)."""
    method_class = training(method)
    with torch.no_grad():  # what a run reads of the frozen target, as a feature cache stores it
        features = method_class.features_of(drafter, out)

    def run():
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(0)  # the same draws every repeat
        return method_class.loss_on(drafter.loss, target, batch, features, gen)

    return run


class TargetForward:
    """The frozen target's feature forward, timed whole and over its decoder layers."""

    def __init__(self, target, batch, capture, clock: Clock):
        self.target, self.batch, self.capture, self.clock = target, batch, capture, clock
        layers = decoder_layers(target)
        self.marks = {}
        layers[0].register_forward_pre_hook(lambda *_: self.marks.__setitem__("first", clock.mark()))
        layers[-1].register_forward_hook(lambda *_: self.marks.__setitem__("last", clock.mark()))

    @torch.no_grad()
    def __call__(self):
        return target_forward(self.target, self.batch["input_ids"], attention_mask=self.batch["attention_mask"],
                              capture=self.capture)

    def timed(self) -> tuple[float, float]:
        """(whole forward ms, decoder layers ms)."""
        start = self.clock.mark()
        self()
        end = self.clock.mark()
        return self.clock.ms(start, end), self.clock.ms(self.marks["first"], self.marks["last"])


def measure(method, label, target, fwd: TargetForward, batch, args, clock, memory, backend):
    drafter = build_drafter(method, target, args, backend)
    lr, clip = optimizer_settings(method)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if clock.cuda else contextlib.nullcontext())
    out = fwd()  # the features, computed once; every step reads the same ones
    loss = loss_fn(method, drafter, target, batch, out)

    def step():
        with autocast:
            value, _ = loss()  # noqa: F821 (deleted after the loop)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()  # noqa: F821
        optimizer.zero_grad(set_to_none=True)  # noqa: F821

    steps, paired, peaks = [], [], []
    for i in range(args.warmup + args.repeats):
        fwd_ms, _ = fwd.timed()
        memory.start()
        start = clock.mark()
        step()
        end = clock.mark()
        step_ms, peak = clock.ms(start, end), memory.peak_extra()
        if i >= args.warmup:
            steps.append(step_ms)
            paired.append(fwd_ms)
            peaks.append(peak)
    row = {"phase": label, "ms": statistics.median(steps), "fwd_ms": statistics.median(paired), "paired": paired,
           "state": state_bytes(drafter, optimizer=optimizer), "peak": max(peaks)}
    row["note"] = f"{label}: {training(method).step_note(drafter.config)}"
    del drafter, optimizer, out, loss
    gc.collect()
    if clock.cuda:
        torch.cuda.empty_cache()
    return row


def chat_rows(n: int, vocab: int, seq: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` rows padded to `seq`, with chat-shaped real lengths (see the module doc): random
    tokens, the first quarter of each row's real tokens its prompt, the rest supervised."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(n, generator=g) * 0.8).exp().mul(seq / 4).clamp(16, seq).long().tolist()
    rows = []
    for length in lengths:
        ids = torch.zeros(seq, dtype=torch.long)
        ids[:length] = torch.randint(0, vocab - 1, (length,), generator=g)
        real = (torch.arange(seq) < length).long()
        loss_mask = real * (torch.arange(seq) >= length // 4).long()
        rows.append({"input_ids": ids, "loss_mask": loss_mask, "attention_mask": real})
    return rows


def batchings(rows, batch: int, seed: int = 0) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The rows' batches each way, as the loop makes them (data/batching.py)."""
    from torch.utils.data import default_collate

    from draftsmith.data.batching import LengthGroupedSampler, batches_of, real_length, trim_padding
    from draftsmith.data.packing import pack_rows

    shuffled = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    lengths = real_length(torch.stack([r["attention_mask"] for r in rows])).tolist()
    grouped = list(LengthGroupedSampler(lengths, batch, seed))
    ways = {"padded to seq_len": (default_collate, shuffled), "cut to longest row": (trim_padding, shuffled),
            "cut, grouped by length": (trim_padding, grouped), "packed": (pack_rows, shuffled)}
    return {name: [collate([rows[i] for i in b]) for b in batches_of(order, batch)]
            for name, (collate, order) in ways.items()}


def measure_padding(method, target, ways, args, clock, capture) -> dict[str, dict]:
    """Online steps (target forward + drafter step) over every batch of each batching,
    interleaved, after one untimed step on each batching's first batch: every batching is
    timed over the same rows."""
    drafter = build_drafter(method, target, args, None)
    lr, clip = optimizer_settings(method)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if clock.cuda else contextlib.nullcontext()
    device = next(target.parameters()).device

    def step(batch) -> float:
        batch = {k: v.to(device) for k, v in batch.items()}
        start = clock.mark()
        packed = batch.get("position_ids")  # by positions alone, as train/posthoc.py feeds a packed batch
        with torch.no_grad():
            out = target_forward(target, batch["input_ids"], position_ids=packed, capture=capture,
                                 attention_mask=batch["attention_mask"] if packed is None else None)
        with autocast:
            value, _ = loss_fn(method, drafter, target, batch, out)()
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock.ms(start, clock.mark())

    for batches in ways.values():
        step(batches[0])
    totals = {name: {"ms": 0.0, "real": 0, "positions": 0} for name in ways}
    for i in range(len(next(iter(ways.values())))):
        for name, batches in ways.items():
            totals[name]["ms"] += step(batches[i])
            totals[name]["real"] += int(batches[i]["attention_mask"].sum())
            totals[name]["positions"] += batches[i]["attention_mask"].numel()
    return totals


def padding_markdown(results: dict[str, dict[str, dict]]) -> str:
    head = ["method", "batching", "padding %", "real tok/s", "x padded"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, totals in results.items():
        base = None
        for name, t in totals.items():
            rate = t["real"] * 1e3 / max(t["ms"], 1e-9)
            base = base or rate
            cells = [method, name, f"{100 * (1 - t['real'] / max(1, t['positions'])):.0f}", f"{rate:.0f}",
                     f"{rate / base:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def padding_main(args, methods, target, clock, head) -> int:
    rows = chat_rows(args.padding_rows, args.vocab, args.seq)
    ways = batchings(rows, args.padding_batch)
    if not next(iter(ways.values())):
        sys.exit("bench_train: --padding-rows makes no whole batch of --padding-batch")
    head = [head[0], head[1].split("; batch")[0] + f"; seq_len {args.seq}; clock: {'CUDA events' if clock.cuda else 'wall'}",
            f"padding: {args.padding_rows} rows in batches of {args.padding_batch}, every batch timed once after "
            "one untimed step per batching; real tok/s = non-padding tokens / time of whole online steps "
            "(target forward + drafter step); x padded = against rows padded to seq_len"]
    print("\n".join(head) + "\n", flush=True)
    results = {}
    for method in methods:
        capture = layer_ids(method, target, args)
        results[method] = measure_padding(method, target, ways, args, clock, capture)
        gc.collect()  # the method's drafter and optimizer, gone with measure_padding's frame
        if clock.cuda:
            torch.cuda.empty_cache()
        print(f"{method}: done", flush=True)
    table = padding_markdown(results)
    print("\n" + table)
    if args.out:
        write_report(args.out, "\n\n".join(head) + "\n\n" + table + "\n")
    return 0


def markdown(rows, fwd_row, tokens, project_layers, num_layers) -> str:
    """One Markdown table; every ratio is against the target forwards paired with the row."""
    head = ["phase", "ms (median)", "paired fwd ms", "x target fwd"]
    if project_layers:
        head.append(f"x fwd @{project_layers}L (est.)")
    head += ["tok/s", "online tok/s", "state MiB", "peak extra MiB", "peak x target fwd"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mib = 2**20

    # How much longer a project_layers-deep target's forward is: decoder layers scaled, the
    # rest as measured; applied to each row's paired forwards like the plain ratio.
    deeper = 1 + fwd_row["layers_ms"] / fwd_row["ms"] * (project_layers / max(num_layers, 1) - 1)

    for row in [fwd_row, *rows]:
        is_fwd = row is fwd_row
        cells = [row["phase"], f"{row['ms']:.1f}", f"{row['fwd_ms']:.1f}", f"{row['ms'] / row['fwd_ms']:.2f}"]
        if project_layers:
            cells.append(f"{row['ms'] / (row['fwd_ms'] * deeper):.3f}")
        online = "-" if is_fwd else f"{tokens * 1e3 / (row['ms'] + row['fwd_ms']):.0f}"
        cells += [f"{tokens * 1e3 / row['ms']:.0f}", online, f"{row['state'] / mib:.1f}",
                  f"{row['peak'] / mib:.1f}", f"{row['peak'] / max(fwd_row['peak'], 1):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (scaled-down shape) or cuda (real-size shape)")
    for name in PRESETS["cpu"]:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="default: the device's preset")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--drafter-attention", default=None,
                    help="comma list of drafter attention backends to compare (sdpa, flex, auto); "
                         "default: the configs' own")
    ap.add_argument("--grad-ckpt", action="store_true", help="drafters recompute activations in backward")
    ap.add_argument("--attn", default="sdpa", help="the target's attn_implementation")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall",
                    help="CPU only: process = the process's CPU time, immune to other load (use with --threads 1)")
    ap.add_argument("--out", type=Path, help="also write the report (Markdown) to this file")
    ap.add_argument("--padding", action="store_true",
                    help="compare real tokens/s of rows padded to seq_len, cut to each batch's longest row, "
                         "and grouped by length (see the module doc)")
    ap.add_argument("--padding-rows", type=int, default=None, help="--padding: rows (default: 8 batches)")
    ap.add_argument("--padding-batch", type=int, default=8, help="--padding: rows per batch")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    for name, value in PRESETS[device.type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    if unknown := sorted(set(methods) - set(METHODS)):
        ap.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    backends = args.drafter_attention.split(",") if args.drafter_attention else [None]

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(device, dtype, args.attn, vocab_size=args.vocab, num_layers=args.layers,
                          hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                          intermediate_size=args.intermediate, max_position_embeddings=max(2048, args.seq + 256))
    batch = make_batch(args.vocab, args.batch, args.seq, device)
    tokens = args.batch * args.seq
    clock, memory = Clock(device, process=args.clock == "process"), Memory(device)
    # One forward captures what every drafter reads (a run captures its own; hooks cost nothing).
    capture = {i for m in methods for i in layer_ids(m, target, args)}
    fwd = TargetForward(target, batch, sorted(capture), clock)

    threads = torch.get_num_threads()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else f"{threads} thread{'s' if threads > 1 else ''}"
    head = [f"device {device} ({gpu}), target {str(dtype).removeprefix('torch.')}, attn {args.attn}; drafters fp32"
            f"{' under bf16 autocast' if device.type == 'cuda' else ''}",
            f"target: hidden {args.hidden}, {args.layers} layers, {args.heads} q / {args.kv_heads} kv heads, "
            f"vocab {args.vocab}; batch {args.batch} x seq {args.seq} = {tokens} tokens; "
            f"warm-up {args.warmup}, repeats {args.repeats} (median); "
            f"clock: {'CUDA events' if clock.cuda else 'process CPU time' if args.clock == 'process' else 'wall'}; "
            f"memory: {memory.how}",
            "step = loss forward + backward + clip + AdamW step on precomputed features; the target's feature "
            "forward is its own row, and each step's ratio is against the forwards timed between its steps "
            "(paired fwd); online tok/s = tokens / (step + paired fwd)"]
    if args.padding:
        args.padding_rows = args.padding_rows or 8 * args.padding_batch
        return padding_main(args, methods, target, clock, head)
    print("\n".join(head) + "\n", flush=True)

    rows, failed, fwd_samples, fwd_layers, fwd_peaks = [], [], [], [], []
    for i in range(args.warmup + args.repeats):  # the target alone: its own memory and layer split
        memory.start()
        ms, layers_ms = fwd.timed()
        if i >= args.warmup:
            fwd_samples.append(ms)
            fwd_layers.append(layers_ms)
            fwd_peaks.append(memory.peak_extra())
    for method in methods:
        for backend in backends:
            label = method if backend is None else f"{method} [{backend}]"
            try:
                rows.append(measure(method, label, target, fwd, batch, args, clock, memory, backend))
            except torch.OutOfMemoryError:  # one method too big for the card must not cost the others
                failed.append(f"{label}: out of memory")
                gc.collect()
                torch.cuda.empty_cache()
                continue
            fwd_samples += rows[-1]["paired"]
            print(f"{label}: step {rows[-1]['ms']:.1f} ms, paired target forward {rows[-1]['fwd_ms']:.1f} ms "
                  f"(medians of {args.repeats})", flush=True)
    fwd_row = {"phase": "target forward (no grad)", "ms": statistics.median(fwd_samples),
               "fwd_ms": statistics.median(fwd_samples), "layers_ms": statistics.median(fwd_layers),
               "state": state_bytes(target), "peak": max(fwd_peaks)}
    table = markdown(rows, fwd_row, tokens, args.project_layers, args.layers)
    notes = [row["note"] for row in rows] + failed
    if args.project_layers:
        notes.append(f"x fwd @{args.project_layers}L: against a {args.project_layers}-layer target of this width, "
                     f"the {args.layers} decoder layers ({fwd_row['layers_ms']:.1f} of {fwd_row['ms']:.1f} ms) "
                     "scaled linearly, the rest (embedding, final norm, head) as measured")
    print("\n" + table + "\n\n" + "\n".join(notes))
    if args.out:
        write_report(args.out, "\n\n".join(head) + "\n\n" + table + "\n\n" + "\n\n".join(notes) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
