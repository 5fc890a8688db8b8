"""The demo's figures over seeds: `make demo`'s training and evaluation, once per seed.

Each seed runs `scripts/demo.sh` whole (target pretraining, every drafter, the report) in
its own folder and derived-data cache, one after another (two jobs on a 2-core machine run
ten times slower, not two). Then, per decoding setting and drafter: D, tau's median and
range over the seeds with the seeds' own values, tau pooled over every seed's verify
passes with its standard error, and the speedup's median and range; the wall time of each
run; each trained run's budget (steps, rows, epochs, tokens, its stage's seconds); and
published small-target figures, for calibration only. The README's demo table quotes it.

    python scripts/bench_demo.py                     # seeds 0 1 2, into runs/bench_demo
    python scripts/bench_demo.py --seeds 0 1 2 3 --out runs/bench_demo
    python scripts/bench_demo.py --summarize-only    # re-read finished runs, train nothing
"""

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.eval.combine import read_runs
from draftsmith.eval.proposers import split_label
from draftsmith.eval.report import setting_name
from draftsmith.fsutil import atomic_file, open_safetensors, output_lock, read_json, write_json
from draftsmith.models.run_weights import BEST, BEST_RECORD
from draftsmith.recipe import read_yaml
from draftsmith.schema import Count, PositiveInt, Schema, validated

ROOT = Path(__file__).resolve().parent.parent
STAGE_LINE = re.compile(r"^== (\w+): (\d+) s$", re.M)  # scripts/demo.sh's line when a stage ends
SHARED_STAGE = "features"  # the target's answers and one pass of it over them, for every post-hoc drafter
# Published acceptance lengths of fully trained drafters on small targets, shown beside ours for
# calibration only: other targets, data (hundreds of thousands of conversations), budgets and engines.
PUBLISHED = (
    ("EAGLE-3", "Qwen3-1.7B", "-", "about 2.1 to 2.2", "Tencent AngelSlim's vLLM table for its Qwen3-1.7B EAGLE-3"),
    ("DSpark", "Llama-3.2-1B-Instruct", "8", "3.15 mean, 2.64 to 4.57 by subset",
     "rasyosef/Llama-3.2-1B-Instruct-DSpark (github.com/vllm-project/speculators/issues/1135)"),
)


def run_seed(seed: int, out: Path, overrides: str) -> float:
    """One demo run into out/seed<seed>; its wall time in seconds (the recorded one when reused whole)."""
    runs = out / f"seed{seed}"
    if (runs / "report" / "report.json").is_file():
        print(f"== seed {seed}: reusing {runs}", flush=True)
        return _recorded_seconds(runs)
    env = dict(os.environ, RUNS=str(runs), SEED=str(seed), DRAFTSMITH_CACHE=str(runs / "cache"),
               DEMO_OVERRIDES=overrides)
    print(f"== seed {seed}: scripts/demo.sh into {runs}", flush=True)
    runs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(runs / "demo.log", "a") as log:  # a rerun reuses finished stages: keep their times
        done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, stdout=log,
                              stderr=subprocess.STDOUT, cwd=ROOT)
    seconds = time.monotonic() - start
    if done.returncode:
        sys.exit(f"seed {seed}: the demo failed (exit {done.returncode}); see {runs / 'demo.log'}")
    (runs / "wall_seconds").write_text(f"{seconds:.0f}\n")
    print(f"== seed {seed}: {seconds:.0f} s", flush=True)
    return seconds


def _recorded_seconds(runs: Path) -> float:
    path = runs / "wall_seconds"
    if not path.is_file():
        return 0.0
    text = path.read_text(errors="replace").strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):  # what a crash or an edit left: say which file
        raise DraftsmithError(f"{path}: expected the run's wall seconds, got {text[:40]!r}; remove it to leave "
                              "the run untimed")
    return seconds


# What the summary reads of a finished run (scripts/demo.sh's run folders), checked where read.
# (No `from __future__ import annotations` here: pydantic resolves these nested types from the
# module, which the tests load without registering it.)
class _TrainRecord(Schema):  # what run_schedule reads
    max_steps: PositiveInt
    batch_size: PositiveInt
    grad_accum: PositiveInt = 1


class _ScheduleRecipe(Schema):
    train: _TrainRecord


class _BudgetTrain(_TrainRecord):  # and run_budget
    seq_len: PositiveInt


class _BudgetRecipe(Schema):
    train: _BudgetTrain
    data: dict
    method: dict = {}


class _BestRecord(Schema):
    step: Count


class _Splits(Schema):
    train: PositiveInt


class _Manifest(Schema):
    splits: _Splits
    rows_file: str


def _run_recipe(run: Path, schema: type[Schema]) -> dict:
    recipe = read_yaml(run / "recipe.yaml")
    validated(schema, recipe, str(run / "recipe.yaml"))
    return recipe


def stage_seconds(runs: Path) -> dict[str, float]:
    """Each stage's wall seconds in one demo run, from its log (scripts/demo.sh ends a stage
    with `== NAME: N s`, NAME the run folder it trains; a stage it reused prints no time).
    The log is appended to, so a stage timed before a failed run stays timed; the last wins."""
    log = runs / "demo.log"
    text = log.read_text() if log.is_file() else ""  # no log: every stage untimed
    return {name: float(seconds) for name, seconds in STAGE_LINE.findall(text)}


def run_schedule(run: Path, recipe: dict | None = None) -> dict:
    """A run's optimizer steps, rows per step (batch x accumulation), and the step of the
    weights eval loaded: RUN/best when the run kept one (eval reads it first), else the last.
    `recipe`: the run's recipe.yaml when the caller has read it already."""
    train = (recipe or _run_recipe(run, _ScheduleRecipe))["train"]
    trained = int(train["max_steps"])
    best = run / BEST / BEST_RECORD
    evaluated = validated(_BestRecord, read_json(best), str(best)).step if best.is_file() else trained
    return {"trained_steps": trained, "eval_step": evaluated,
            "batch": int(train["batch_size"]) * int(train.get("grad_accum", 1))}


def run_budget(run: Path) -> dict:
    """What the weights eval loaded had seen: rows (evaluated steps x rows per step) and
    about how many tokens. A run on a feature cache reads its training split (the first
    `splits.train` rows): epochs over those rows, and their mean answer (loss-masked) tokens
    per row times the rows seen; a pretraining run packs its rows full, so every position
    of every row seen is a token. `builds_on`: the run a frozen backbone came from."""
    recipe = _run_recipe(run, _BudgetRecipe)
    schedule = run_schedule(run, recipe)
    rows = schedule["eval_step"] * schedule["batch"]
    backbone = recipe.get("method", {}).get("backbone")
    budget = {**schedule, "rows_seen": rows, "train_rows": None, "epochs": None,
              "tokens_seen": float(rows * int(recipe["train"]["seq_len"])),
              "builds_on": Path(backbone).name if backbone else None}
    if recipe["data"].get("feature_cache"):  # its manifest and rows file: the features may be gone by now
        cache = ROOT / recipe["data"]["feature_cache"]
        manifest = read_json(cache / "manifest.json")
        validated(_Manifest, manifest, str(cache / "manifest.json"))
        n_train = int(manifest["splits"]["train"])
        with open_safetensors(cache / manifest["rows_file"]) as stored:
            answer_tokens = float(stored.get_slice("loss_mask")[:n_train].sum())
        budget.update(train_rows=n_train, epochs=rows / n_train, tokens_seen=rows * answer_tokens / n_train)
    return budget


def budgets(per_seed: dict[int, dict[str, dict]], out: Path) -> dict:
    """{"runs": {run folder: {"name", "drafters": [names], "builds_on", "trained_steps",
    "batch", and per seed `eval_step`, `rows_seen`, `train_rows`, `epochs`, `tokens_seen`,
    `seconds` as spreads}}, "shared_seconds": spread or None}: every trained run a drafter row
    names (its `--drafter NAME:RUN` argument; rows sharing a run, such as the EAGLE-3 chain and
    tree, share its entry), with the seconds of the demo stage that trained it (none where no
    run of the demo ever logged that stage's time), and the shared stage (the target's answers
    and its one pass over them) once. A drafter without a local run (n-gram lookup, a hub
    drafter) has none."""
    runs: dict[str, dict] = {}
    shared = {}
    for seed, reports in sorted(per_seed.items()):
        seconds = stage_seconds(out / f"seed{seed}")
        shared[seed] = seconds.get(SHARED_STAGE)
        for row in next(iter(reports.values()))["drafters"]:
            run = ROOT / split_label(row["drafter"])[1].partition(":")[2]
            if not (run / "recipe.yaml").is_file():
                continue
            key = os.path.relpath(run.resolve(), (out / f"seed{seed}").resolve())  # one run's entry across seeds
            entry = runs.setdefault(key, {"name": run.name, "drafters": [], "per_seed": {}})
            if row["name"] not in entry["drafters"]:
                entry["drafters"].append(row["name"])
            if seed not in entry["per_seed"]:  # rows sharing a run read it once
                entry["per_seed"][seed] = {**run_budget(run), "seconds": seconds.get(run.name)}
    for entry in runs.values():
        seeds = entry.pop("per_seed")
        first = next(iter(seeds.values()))
        entry.update(builds_on=first["builds_on"], batch=first["batch"],
                     trained_steps=sorted({b["trained_steps"] for b in seeds.values()}))
        for key in ("eval_step", "rows_seen", "train_rows", "epochs", "tokens_seen", "seconds"):
            values = {seed: b[key] for seed, b in seeds.items() if b[key] is not None}
            entry[key] = _spread(values) if values else None
    timed = {seed: s for seed, s in shared.items() if s is not None}
    return {"runs": runs, "shared_seconds": _spread(timed) if timed else None}


def summarize(per_seed: dict[int, dict[str, dict]]) -> dict:
    """{setting: {"drafters": {name: {median, min, max, seeds}}, "speedup": {name: ...}, "distinct_4gram": {...}}}
    from {seed: read_runs(...)} (eval/combine.py); a drafter missing from any seed's report is an error."""
    settings = sorted({label for reports in per_seed.values() for label in reports})
    summary = {}
    for label in settings:
        taus: dict[str, dict[int, float]] = {}
        no_loop: dict[str, dict[int, float]] = {}  # prompts whose plain text does not loop
        speedup: dict[str, dict[int, float]] = {}
        num_draft: dict[str, set[int]] = {}  # D per drafter (one value unless eval chose it per seed)
        seed_rows: dict[str, list[dict]] = {}  # each seed's row: its committed tokens and accepted drafts per pass
        distinct, looping = {}, {}
        for seed, reports in sorted(per_seed.items()):
            if label not in reports:
                raise DraftsmithError(f"seed {seed} has no {label} report")
            report = reports[label]
            distinct[seed] = report["plain"]["distinct_4gram"]
            looping[seed] = report["plain"].get("looping_prompts")
            for row in report["drafters"]:
                taus.setdefault(row["name"], {})[seed] = row["tau"]
                speedup.setdefault(row["name"], {})[seed] = row["speedup"]
                num_draft.setdefault(row["name"], set()).add(row["num_draft"])
                seed_rows.setdefault(row["name"], []).append(row)
                if row.get("tau_no_loop") is not None:
                    no_loop.setdefault(row["name"], {})[seed] = row["tau_no_loop"]
        for name, values in taus.items():
            if len(values) != len(per_seed):
                raise DraftsmithError(f"{label}: drafter {name} is missing from some seeds' reports")
        summary[label] = {
            "settings": next(iter(per_seed.values()))[label]["settings"],
            "distinct_4gram": _spread(distinct),
            "looping_prompts": looping,
            "drafters": {name: _spread(values) for name, values in taus.items()},
            "drafters_no_loop": {name: _spread(values) for name, values in no_loop.items()},
            "speedup": {name: _spread(values) for name, values in speedup.items()},
            "num_draft": {name: sorted(values) for name, values in num_draft.items()},
            "pooled": {name: pooled(rows) for name, rows in seed_rows.items()},
        }
    return summary


def pooled(rows: list[dict]) -> dict:
    """tau over every verify pass of every seed (committed tokens over passes, as each report
    counts it) with its standard error, the spread of accepted drafts per pass over
    sqrt(passes): whether two rows differ by more than their noise. Passes of one text are
    not independent, so the error is a lower bound."""
    hists = [row["accepted_length_hist"] for row in rows]
    counts = [sum(h[i] for h in hists if i < len(h)) for i in range(max(map(len, hists)))]
    n = sum(counts)
    mean = sum(i * c for i, c in enumerate(counts)) / n
    variance = sum(c * (i - mean) ** 2 for i, c in enumerate(counts)) / max(n - 1, 1)
    return {"tau": sum(row["committed_tokens"] for row in rows) / n, "se": math.sqrt(variance / n), "passes": n}


def _spread(values: dict[int, float]) -> dict:
    series = list(values.values())
    return {"median": statistics.median(series), "min": min(series), "max": max(series),
            "seeds": {str(k): v for k, v in values.items()}}


def _seeds(values: dict) -> str:
    return " ".join("-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v) for v in values.values())


def markdown(summary: dict, seconds: dict[int, float]) -> str:
    lines = []
    for label, block in summary.items():
        sampling = setting_name(block["settings"])
        d4 = block["distinct_4gram"]
        lines += [f"## {label}: {sampling}", "",
                  f"Plain decoding's distinct 4-grams: median {d4['median']:.2f} "
                  f"(range {d4['min']:.2f} to {d4['max']:.2f}; 1 = no repeats, near 0 = a loop). "
                  f"Prompts whose plain text loops, per seed: {_seeds(block['looping_prompts'])}.", "",
                  "| drafter | D | tau median | range | per seed | pooled tau ± se | tau, no loop: median | range "
                  "| per seed | speedup: median | range |",
                  "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
        for name, t in sorted(block["drafters"].items(), key=lambda kv: -kv[1]["median"]):
            n, s = block["drafters_no_loop"].get(name), block["speedup"].get(name)
            split = f"{n['median']:.2f} | {n['min']:.2f} to {n['max']:.2f} | {_seeds(n['seeds'])}" if n else "- | - | -"
            fast = f"{s['median']:.2f}x | {s['min']:.2f}x to {s['max']:.2f}x" if s else "- | -"
            d = "/".join(map(str, block["num_draft"][name]))
            pool = block["pooled"][name]
            lines.append(f"| {name} | {d} | {t['median']:.2f} | {t['min']:.2f} to {t['max']:.2f} | {_seeds(t['seeds'])} "
                         f"| {pool['tau']:.3f} ± {pool['se']:.3f} | {split} | {fast} |")
        lines.append("")
    timed = [v for v in seconds.values() if v]
    if timed:
        lines.append(f"Wall time per demo run: median {statistics.median(timed):.0f} s "
                     f"(range {min(timed):.0f} to {max(timed):.0f} s), seeds run one at a time.")
    return "\n".join(lines) + "\n"


def budget_markdown(budget: dict) -> str:
    """The training each run had (medians over seeds), then the published small-target
    figures, for calibration only."""
    lines = ["## Training budget per run (medians over seeds)", "",
             "| drafters | run | builds on | steps evaluated / trained x batch | rows seen | unique rows | epochs "
             "| tokens seen, about | seconds | range |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in budget["runs"].values():
        trained = "/".join(map(str, b["trained_steps"]))
        unique = ("- | -" if b["train_rows"] is None
                  else f"{b['train_rows']['median']:g} | {b['epochs']['median']:.1f}")
        seconds = b["seconds"]
        timed = (f"{seconds['median']:.0f} | {seconds['min']:.0f} to {seconds['max']:.0f}" if seconds
                 else "reused, untimed | -")
        lines.append(f"| {', '.join(b['drafters'])} | {b['name']} | {b['builds_on'] or '-'} | "
                     f"{b['eval_step']['median']:g} / {trained} x {b['batch']} | {b['rows_seen']['median']:g} | "
                     f"{unique} | {b['tokens_seen']['median']:.0f} | {timed} |")
    lines += ["", "Steps: those of the weights eval loaded (the run's best by validation) of those trained; "
              "rows, epochs and tokens count up to them. Tokens: a run on the feature cache, its rows' "
              "mean answer tokens times the rows seen; a pretraining run (MTP: the tiny target and its "
              "heads trained together), every position of its packed rows. Seconds: the run's demo stage, "
              "wall time with loading, all its steps; a refiner's excludes its frozen backbone's run."]
    shared = budget["shared_seconds"]
    shared_text = (f"median {shared['median']:.0f} s (range {shared['min']:.0f} to {shared['max']:.0f} s)"
                   if shared else "reused, untimed")
    lines += [f"Shared by the post-hoc drafters, once: the target's answers and its one pass over them "
              f"(`{SHARED_STAGE}`), {shared_text}.", "",
              "## Published figures on small targets (calibration only: other targets, data, budgets, engines)",
              "", "| method | target | D | tau (bonus token counted) | source |", "| --- | --- | ---: | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in PUBLISHED]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_demo")
    parser.add_argument("--overrides", default="", help="DEMO_OVERRIDES for every run, e.g. train.max_steps=20")
    parser.add_argument("--summarize-only", action="store_true", help="read finished runs; run nothing")
    args = parser.parse_args(argv)

    out = args.out.resolve()  # demo.sh runs from the repository root: its RUNS and ours must agree
    with output_lock(out):  # one bench into one folder at a time (a second would mix their seeds' runs)
        seconds = {}
        for seed in args.seeds:
            seconds[seed] = (_recorded_seconds(out / f"seed{seed}") if args.summarize_only
                             else run_seed(seed, out, args.overrides))
        per_seed = {seed: read_runs(out / f"seed{seed}" / "report") for seed in args.seeds}
        summary, budget = summarize(per_seed), budgets(per_seed, out)
        text = markdown(summary, seconds) + "\n" + budget_markdown(budget)
        write_json(out / "summary.json", {"summary": summary, "budget": budget, "wall_seconds": seconds})
        with atomic_file(out / "summary.md") as handle:
            handle.write(text)
    print(text)


def run_script(main) -> None:
    """A bench script's entry: a DraftsmithError (a run folder it cannot read, a bad flag) is
    one line and exit status 1."""
    try:
        main()
    except DraftsmithError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    run_script(main)
