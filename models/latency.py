"""What a verify pass costs on the device that runs it, and the draft length that pays most.

The tile rule (models/tile.py) gives the ceiling: past `D = T // G - 1` drafts a verify
launches a second attention tile. Below it the best D depends on two measured things:

- the latency table (`measure_latency`, `draftsmith plan TARGET --measure`): one target
  forward over `1 + d` query tokens as the decoder runs it (a DynamicCache holding `context`
  tokens, the full logits of every row, the dtype and attention backend eval loads the
  target with), for every d from 0 to past the tile boundary, at a few context lengths;
- a drafter's acceptance: `a_k`, the fraction of verify passes that accepted its first k
  drafts (eval's per-position acceptance), and what drafting d tokens costs it.

Expected committed tokens per pass at d drafts are `E(d) = 1 + sum_{k<=d} a_k`, a pass costs
`T(d) = T_verify(d) + T_draft(d)`, and `best_draft` picks the d maximising `E(d) / T(d)`,
tokens per second (`d = 0` is plain decoding, kept when no draft length pays).

The table's JSON shape (`TABLE_FORMAT`, version 1) is pinned in docs/design.md section 3.
"""

from __future__ import annotations

import bisect
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, model_validator

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import read_json
from draftsmith.schema import Count, NonNegativeFloat, PositiveFloat, PositiveInt, Schema, validated

TABLE_FORMAT = "draftsmith-verify-latency"
TABLE_VERSION = 1
TABLE_FILE = "latency.json"
PLOT_FILE = "latency.png"
DEFAULT_CONTEXTS = (256, 1024, 4096)
# Drafts measured past the tile rule's D by default: enough to see a second tile start.
PAST_TILE = 8


# ---- measuring --------------------------------------------------------------------------

def device_name(device) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_latency(model, contexts, max_draft: int, reps: int = 5, plan=None, target_name: str = "",
                    progress=None) -> dict:
    """The latency table of `model` as loaded (its device, dtype, attention), as a dict in
    `TABLE_FORMAT`. Every rep sweeps all d in turn, so load that comes and goes hits every d
    alike; each entry is the median of `reps` timed forwards after one untimed one."""
    import torch
    import transformers

    from draftsmith.models.target import target_forward, target_shape
    from draftsmith.models.target_cache import crop_cache, new_cache

    if max_draft < 0 or reps < 1 or contexts_problem(contexts):
        raise DraftsmithError(f"latency table: need max_draft >= 0, reps >= 1 and positive, increasing contexts, "
                              f"got {max_draft}, {reps}, {list(contexts)}")
    param = next(model.parameters())
    device, vocab = param.device, model.config.vocab_size
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(contexts) + max_draft + 1 > limit:
        raise DraftsmithError(f"latency table: context {max(contexts)} + {max_draft + 1} verify tokens exceeds the "
                              f"target's max_position_embeddings {limit}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for context in contexts:
            cache = new_cache(model, rollback=max_draft + 1)
            prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
            for start in range(0, context, 1024):  # the prefill in chunks: bounded activations
                target_forward(model, prompt[:, start:start + 1024], cache=cache, logits_to_keep=1)
            inputs = torch.randint(0, vocab, (1, max_draft + 1), generator=gen).to(device)
            samples: list[list[float]] = [[] for _ in range(max_draft + 1)]
            for rep in range(reps + 1):
                for d in range(max_draft + 1):
                    _sync(device)
                    t0 = time.perf_counter()
                    target_forward(model, inputs[:, : d + 1], cache=cache)
                    _sync(device)
                    if rep:  # the first sweep warms up
                        samples[d].append(1000.0 * (time.perf_counter() - t0))
                    crop_cache(cache, context)
            rows.append([statistics.median(s) for s in samples])
            if progress:
                progress(f"context {context}: {rows[-1][0]:.2f} ms at d = 0, {rows[-1][-1]:.2f} ms at d = {max_draft}")
        head = model.get_output_embeddings()
        hidden = torch.zeros(1, 1, head.in_features, dtype=head.weight.dtype, device=device)
        head(hidden)
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            head(hidden)
            _sync(device)
            times.append(1000.0 * (time.perf_counter() - t0))
    shape = target_shape(model.config)
    table = {
        "format": TABLE_FORMAT, "version": TABLE_VERSION, "target": str(target_name),
        "shape": {"layers": shape.num_layers, "hidden": shape.hidden_size, "heads": shape.num_heads,
                  "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab": shape.vocab_size},
        "device": device_name(device), "device_type": device.type, "dtype": str(param.dtype).removeprefix("torch."),
        "attention": getattr(model.config, "_attn_implementation", None) or "eager", "cache": "dynamic",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": reps,
        "contexts": list(contexts), "drafts": list(range(max_draft + 1)), "verify_ms": rows,
        "head_ms": statistics.median(times),
    }
    if plan is not None:
        table["tile"] = {"rows": plan.tile, "tp": plan.tp, "G": plan.G, "D": plan.D}
    table["tile_step"] = tile_steps(table)
    return table


def tile_steps(table: dict) -> list[dict]:
    """Per context: the rise from the tile rule's D to D + 1 (where a second tile starts)
    beside the median rise between neighbouring d, and where the largest rise is."""
    D = (table.get("tile") or {}).get("D")
    out = []
    for context, row in zip(table["contexts"], table["verify_ms"]):
        rises = [b - a for a, b in zip(row, row[1:])]
        if not rises:
            continue
        largest = max(range(len(rises)), key=rises.__getitem__)
        entry = {"context": context, "median_rise_ms": statistics.median(rises),
                 "largest_rise_at": largest, "largest_rise_ms": rises[largest]}
        if D is not None and D < len(rises):
            entry["rise_at_tile_ms"] = rises[D]
        out.append(entry)
    return out


# ---- the table as data ------------------------------------------------------------------

class _Shape(Schema):
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    vocab: PositiveInt


class _Tile(Schema):
    rows: PositiveInt
    tp: PositiveInt
    G: PositiveInt
    D: Count


class TableSchema(Schema):
    """What eval and export read of a TABLE_FORMAT version 1 table (docs/design.md section 3):
    the target's shape and the device it was measured for (`check_fits` compares them), and
    one positive, finite time per context and draft count."""

    shape: _Shape
    device: str
    device_type: str
    dtype: str
    attention: str
    contexts: list[PositiveInt] = Field(min_length=1)
    drafts: list[Count] = Field(min_length=1)
    verify_ms: list[list[PositiveFloat]]
    head_ms: NonNegativeFloat
    tile: _Tile | None = None

    @model_validator(mode="after")
    def _rows_agree(self) -> "TableSchema":
        problem = contexts_problem(self.contexts, "contexts")
        if problem:
            raise ValueError(problem)
        if self.drafts != list(range(len(self.drafts))):
            raise ValueError(f"drafts {_short(self.drafts)} must be 0, 1, ... (every draft count from 0)")
        if len(self.verify_ms) != len(self.contexts) or any(len(r) != len(self.drafts) for r in self.verify_ms):
            raise ValueError(f"contexts ({len(self.contexts)}), drafts ({len(self.drafts)}) and verify_ms (rows of "
                             f"{sorted({len(r) for r in self.verify_ms})} times) do not agree: one row per context, "
                             "one time per draft count")
        return self


def contexts_problem(contexts, what: str = "--contexts") -> str | None:
    """Why `contexts` are no table's KV lengths (None when they are): positive, increasing,
    each once. A table interpolates between neighbours, so `plan --measure --contexts 64,32`
    (or 32,32) is refused before measuring rather than written for every reader to refuse."""
    contexts = list(contexts)
    if not contexts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in contexts):
        return f"{what} {contexts}: need at least one KV length, each a positive whole number"
    if contexts != sorted(set(contexts)):
        return (f"{what} {','.join(map(str, contexts))}: the KV lengths must increase, each once "
                f"(give {','.join(map(str, sorted(set(contexts))))})")
    return None


def _short(values: list) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"


@dataclass
class LatencyTable:
    """A latency table read back; `verify_ms(d, context)` interpolates linearly in the
    context between measured ones (the nearest outside them)."""

    data: dict
    source: str = ""

    @classmethod
    def read(cls, path: str | Path) -> "LatencyTable":
        path = Path(path)
        if path.is_dir():
            path = path / TABLE_FILE
        return cls.check(read_json(path), str(path))

    @classmethod
    def check(cls, data: dict, source: str = "latency table") -> "LatencyTable":
        """The one check of a table's contents, for every reader (TableSchema)."""
        if data.get("format") != TABLE_FORMAT or data.get("version") != TABLE_VERSION:
            raise DraftsmithError(f"{source}: not a latency table (format {data.get('format')!r} version "
                                  f"{data.get('version')!r}; expected {TABLE_FORMAT!r} {TABLE_VERSION}: "
                                  "draftsmith plan TARGET --measure writes one)")
        validated(TableSchema, data, source)
        return cls(data, source)

    def check_fits(self, target, device_type: str | None = None) -> "LatencyTable":
        """Refuse a table measured for another target (`target`: its transformers config, or
        its folder) or, given `device_type`, on another kind of device: it prices the wrong
        passes. The one check of both `eval --latency-table` and `export --latency-table`."""
        from draftsmith.models.target import target_shape

        shape = target_shape(_config_of(target))
        mine = {"layers": shape.num_layers, "hidden": shape.hidden_size, "heads": shape.num_heads,
                "kv_heads": shape.num_kv_heads, "vocab": shape.vocab_size}
        theirs = {k: self.data["shape"][k] for k in mine}
        if theirs != mine:
            raise DraftsmithError(f"{self.source}: measured for a target of {theirs}, this one is {mine}")
        if device_type is not None and self.data["device_type"] != device_type:
            raise DraftsmithError(f"{self.source}: measured on {self.data['device']}, eval runs on {device_type}")
        return self

    @property
    def max_draft(self) -> int:
        return self.data["drafts"][-1]

    @property
    def tile_D(self) -> int | None:
        return (self.data.get("tile") or {}).get("D")

    @property
    def on_gpu(self) -> bool:
        return self.data.get("device_type") == "cuda"

    def verify_ms(self, d: int, context: float) -> float:
        if not 0 <= d <= self.max_draft:
            raise DraftsmithError(f"{self.source}: measured for 0 .. {self.max_draft} drafts, asked for {d}")
        contexts, rows = self.data["contexts"], self.data["verify_ms"]
        i = bisect.bisect_left(contexts, context)
        if i == 0:
            return rows[0][d]
        if i == len(contexts):
            return rows[-1][d]
        c0, c1 = contexts[i - 1], contexts[i]
        w = (context - c0) / (c1 - c0)
        return rows[i - 1][d] * (1 - w) + rows[i][d] * w


def _config_of(target):
    """A target's transformers config (as eval's loaded target has it), read from its folder
    where a folder is given."""
    if not isinstance(target, (str, Path)):
        return target
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(target))
    except (OSError, ValueError, KeyError) as exc:
        raise DraftsmithError(f"target {target}: cannot read its config.json ({first_lines(exc, 1)})") from None


# ---- the choice -------------------------------------------------------------------------

@dataclass
class DraftChoice:
    num_draft: int
    curve: list[dict]  # per d: expected_tokens, pass_ms, tokens_per_s

    def at(self, d: int) -> dict | None:
        return next((p for p in self.curve if p["d"] == d), None)


def expected_tokens(acceptance: list[float], d: int) -> float:
    """E(d) = 1 + sum_{k<=d} a_k: committed tokens per pass, the bonus token included."""
    return 1.0 + sum(acceptance[:d])


def best_draft(acceptance: list[float], pass_ms, max_draft: int) -> DraftChoice:
    """The d in 0 .. min(max_draft, len(acceptance)) maximising E(d) / pass_ms(d) (the
    smaller d on a tie); `pass_ms(d)`: milliseconds of one pass at d drafts."""
    top = min(max_draft, len(acceptance))
    curve = []
    for d in range(top + 1):
        ms = pass_ms(d)
        if not ms > 0:
            raise DraftsmithError(f"draft length choice: a pass at d = {d} costs {ms} ms; times must be positive")
        tokens = expected_tokens(acceptance, d)
        curve.append({"d": d, "expected_tokens": tokens, "pass_ms": ms, "tokens_per_s": 1000.0 * tokens / ms})
    best = max(curve, key=lambda p: (p["tokens_per_s"], -p["d"]))
    return DraftChoice(best["d"], curve)


def linear_cost(at_low: tuple[int, float], at_high: tuple[int, float]):
    """d -> ms through two measured points (d, ms), 0 at d = 0 (nothing drafted), never
    negative: a drafter's cost per pass between and beyond the draft lengths it was timed at."""
    (d0, t0), (d1, t1) = at_low, at_high
    slope = (t1 - t0) / (d1 - d0) if d1 != d0 else 0.0

    def cost(d: int) -> float:
        return 0.0 if d == 0 else max(0.0, t0 + slope * (d - d0))
    return cost


def chain_step_ms(table: LatencyTable, context: float, head_fraction: float = 1.0) -> float:
    """What one step of a chained one-layer drafter (EAGLE-3, an MTP module) costs on the
    table's device, from the table alone: one target-shaped decoder layer (the target's
    single-token step less its head, over its layers) plus its own head (`head_fraction`
    of the target's: its draft vocabulary over the target's)."""
    layers = table.data["shape"]["layers"]
    head = float(table.data.get("head_ms") or 0.0)
    layer = max(0.0, table.verify_ms(0, context) - head) / max(1, layers)
    return layer + head * head_fraction


# ---- writing ----------------------------------------------------------------------------

def write_table(table: dict, out_dir: str | Path) -> Path:
    """latency.json and latency.png into `out_dir`, whole or not at all."""
    from draftsmith.fsutil import atomic_dir, write_json

    with atomic_dir(out_dir) as tmp:
        write_json(tmp / TABLE_FILE, table)
        plot_table(table, tmp / PLOT_FILE)
    return Path(out_dir)


def plot_table(table: dict, path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for context, row in zip(table["contexts"], table["verify_ms"]):
        ax.plot(table["drafts"], row, marker=".", label=f"context {context}")
    tile = table.get("tile")
    if tile:
        ax.axvline(tile["D"] + 0.5, color="grey", linestyle="--",
                   label=f"tile rule: D = {tile['D']} (G = {tile['G']}, {tile['rows']}-row tile)")
    ax.set(xlabel="drafts d (verify of 1 + d tokens)", ylabel="verify forward, ms (median)", ylim=(0, None))
    ax.set_title(f"verify latency: {table['device']}, {table['dtype']}, {table['attention']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def format_table(table: dict) -> str:
    """The table for people: a few d per context, and where the verify cost steps up."""
    tile = table.get("tile") or {}
    D = tile.get("D")
    lines = [f"device {table['device']}, {table['dtype']}, attention {table['attention']}, "
             f"torch {table['torch']}, transformers {table['transformers']}"]
    shown = sorted({0, 1, 2, 4, 8, 16, 32, 64, table["drafts"][-1], *([D, D + 1] if D is not None else [])}
                   & set(table["drafts"]))
    lines += ["", "| context | " + " | ".join(f"d={d}" + (" (D)" if d == D else "") for d in shown) + " |",
              "|---:|" + "---:|" * len(shown)]
    for context, row in zip(table["contexts"], table["verify_ms"]):
        lines.append(f"| {context} | " + " | ".join(f"{row[d]:.2f}" for d in shown) + " |")
    lines.append("")
    lines.append("milliseconds per verify forward of 1 + d tokens (median of "
                 f"{table['reps']}); output head alone {table['head_ms']:.3f} ms per row")
    for step in table.get("tile_step", []):
        where = step["largest_rise_at"]
        text = (f"context {step['context']}: largest rise {step['largest_rise_ms']:.2f} ms from d = {where} to "
                f"{where + 1}, median rise {step['median_rise_ms']:.3f} ms")
        if "rise_at_tile_ms" in step:
            at_tile = "at" if where == D else "not at"
            text += (f"; D -> D + 1 ({D} -> {D + 1}, the second tile) rises {step['rise_at_tile_ms']:.2f} ms: the "
                     f"largest rise is {at_tile} the tile boundary")
        lines.append(text)
    return "\n".join(lines)


# ---- `draftsmith plan TARGET --measure` ---------------------------------------------------

def load_measured_target(source: str, device):
    """The target as eval loads it (models/target.py: load_target, dtype and attention from
    its config); a config.json alone gives random weights of that shape, which time the same."""
    import torch

    from draftsmith.models.model_dir import find_model_dir
    from draftsmith.models.target import freeze, load_target

    path = Path(source)
    if path.is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(str(path))
        except Exception as exc:  # a foreign or broken config: the user's file
            raise DraftsmithError(f"{source}: cannot read it as a transformers config ({exc})") from None
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return freeze(model.eval())
    return load_target(find_model_dir(source, require="target"), device=device)


def measure_device(name: str | None):
    """The device `plan --measure` times on: `name` (cpu, cuda, cuda:1, ...), else CUDA where
    there is one. A name torch does not know, or a device this machine lacks (CUDA on a machine
    without it, an index past its GPUs), is one line naming the flag."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
        torch.empty(1, device=device)  # reach it: torch raises here for a device it cannot use
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise DraftsmithError(f"--device {name}: not a device this machine has ({first_lines(exc, 1)})") from None
    if device.type == "meta":  # holds no data: nothing to time
        raise DraftsmithError(f"--device {name}: the meta device runs nothing; give cpu or cuda")
    return device


def measure_command(target_path: str, tile: int, tp: int, out: str, contexts=None, max_draft: int | None = None,
                    reps: int = 5, device: str | None = None) -> str:
    """Measure, write `out`/latency.json and latency.png, and return what `plan` prints."""
    import logging

    from draftsmith.fsutil import check_replaceable
    from draftsmith.models.tile import plan_tile, read_target_config

    problem = contexts_problem(contexts) if contexts is not None else None
    if problem:  # before the target loads, and before a table every reader refuses is written
        raise DraftsmithError(f"plan --measure: {problem}")
    check_replaceable(out, TABLE_FILE, "latency table")
    plan = plan_tile(read_target_config(target_path), tile=tile, tp=tp)
    model = load_measured_target(target_path, measure_device(device))
    max_draft = plan.D + PAST_TILE if max_draft is None else max_draft
    limit = getattr(model.config, "max_position_embeddings", None) or max(DEFAULT_CONTEXTS) + max_draft + 1
    contexts = list(contexts) if contexts is not None else [c for c in DEFAULT_CONTEXTS if c + max_draft + 1 <= limit]
    if not contexts:
        raise DraftsmithError(f"{target_path}: max_position_embeddings {limit} leaves no room for the default contexts "
                              f"{', '.join(map(str, DEFAULT_CONTEXTS))}; give --contexts")
    log = logging.getLogger(__name__)
    table = measure_latency(model, contexts, max_draft, reps, plan=plan, target_name=target_path, progress=log.info)
    write_table(table, out)
    return f"{format_table(table)}\n\nwrote {Path(out) / TABLE_FILE} and {Path(out) / PLOT_FILE}"


# ---- the serve lines' chain length (models/serve.py) -------------------------------------

def run_acceptance(model_folder: str | Path) -> list[float]:
    """a_k = prod_{j<=k} acc_j from the validation record of the weights in `model_folder`
    (the last at or before their step in the metrics.jsonl of the run that trained them:
    `val/acc_1` ..., the drafter's per-position greedy accuracy on held-out rows, never
    evaluation prompts); [] where the run logged none. The run folder, not the folder of the
    weights: a run's best (RUN/best/model) and checkpoints sit below it."""
    import json

    from draftsmith.models.run_weights import weights_run

    folder = Path(model_folder)
    run, step = weights_run(folder) or (None, None)
    metrics = next((p / "metrics.jsonl" for p in (run, folder, folder.parent)
                    if p is not None and (p / "metrics.jsonl").is_file()), None)
    if metrics is None:
        return []
    last = {}
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by an interrupted run
            continue
        if isinstance(record, dict) and "val/acc_1" in record and (step is None or _at_or_before(record, step)):
            last = record
    out, running = [], 1.0
    for k in range(1, len(last) + 1):
        value = last.get(f"val/acc_{k}")
        if not isinstance(value, (int, float)):
            break
        running *= float(value)
        out.append(running)
    return out


def _at_or_before(record: dict, step: int) -> bool:
    """Whether a metrics record was logged by the step `step`'s weights or before them (a
    record without a number for its step is not)."""
    logged = record.get("step")
    return isinstance(logged, (int, float)) and not isinstance(logged, bool) and logged <= step


def chain_steps(model_folder, export_dir, table_path, tile_D: int) -> tuple[int | None, str]:
    """(steps, why) for an EAGLE-style chain served on the table's device: the rule of
    `best_draft` with the run's validation acceptance, the table's verify at each d and one
    chained drafter step per draft (`chain_step_ms`, at the table's middle context), capped
    by the tile rule's D on a GPU. (None, why) where the acceptance or the table is missing."""
    table = LatencyTable.read(table_path)
    acceptance = run_acceptance(model_folder)
    if not acceptance:
        return None, "the run logged no validation acceptance (val/acc_k)"
    config = read_json(Path(export_dir) / "config.json")
    vocab = config.get("vocab_size") or table.data["shape"]["vocab"]
    head_fraction = (config.get("draft_vocab_size") or vocab) / vocab
    contexts = table.data["contexts"]
    context = contexts[len(contexts) // 2]
    step = chain_step_ms(table, context, head_fraction)
    cap = min(tile_D, table.max_draft) if table.on_gpu else table.max_draft
    choice = best_draft(acceptance, lambda d: table.verify_ms(d, context) + d * step, cap)
    steps = max(1, choice.num_draft)
    why = (f"{steps} chain steps: the most expected tokens/s on {table.data['device']} ({table.source}, context "
           f"{context}) from the run's validation acceptance over {len(acceptance)} positions, "
           f"{step:.2f} ms per drafter step")
    if choice.num_draft == 0:
        why += "; no chain length beats plain decoding there, 1 step printed"
    return steps, why
