"""The demo's figures over seeds: `make demo`'s training and evaluation, once per seed.

Each seed runs `scripts/demo.sh` whole (target pretraining, every drafter, the report) in
its own folder and derived-data cache, one after another (two jobs on a 2-core machine run
ten times slower, not two). Then, per decoding setting and drafter, tau's median and range
over the seeds, the seeds' own values, and the wall time of each run. The README's demo
table quotes this output.

    python scripts/bench_demo.py                     # seeds 0 1 2, into runs/bench_demo
    python scripts/bench_demo.py --seeds 0 1 2 3 --out runs/bench_demo
    python scripts/bench_demo.py --summarize-only    # re-read finished runs, train nothing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.eval.combine import read_runs
from draftsmith.eval.report import setting_name

ROOT = Path(__file__).resolve().parent.parent


def run_seed(seed: int, out: Path, overrides: str) -> float:
    """One demo run into out/seed<seed>; its wall time in seconds (0 when reused whole)."""
    runs = out / f"seed{seed}"
    if (runs / "report" / "report.json").is_file():
        print(f"== seed {seed}: reusing {runs}", flush=True)
        return _recorded_seconds(runs)
    env = dict(os.environ, RUNS=str(runs), SEED=str(seed), DRAFTSMITH_CACHE=str(runs / "cache"),
               DEMO_OVERRIDES=overrides)
    print(f"== seed {seed}: scripts/demo.sh into {runs}", flush=True)
    runs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(runs / "demo.log", "w") as log:
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
    return float(path.read_text()) if path.is_file() else 0.0


def summarize(per_seed: dict[int, dict[str, dict]]) -> dict:
    """{setting: {"drafters": {name: {median, min, max, seeds}}, "speedup": {name: ...}, "distinct_4gram": {...}}}
    from {seed: read_runs(...)} (eval/combine.py); a drafter missing from any seed's report is an error."""
    settings = sorted({label for reports in per_seed.values() for label in reports})
    summary = {}
    for label in settings:
        taus: dict[str, dict[int, float]] = {}
        no_loop: dict[str, dict[int, float]] = {}  # prompts whose plain text does not loop
        speedup: dict[str, dict[int, float]] = {}
        distinct, looping = {}, {}
        for seed, reports in sorted(per_seed.items()):
            if label not in reports:
                raise ValueError(f"seed {seed} has no {label} report")
            report = reports[label]
            distinct[seed] = report["baseline"]["distinct_4gram"]
            looping[seed] = report["baseline"].get("looping_prompts")
            for row in report["drafters"]:
                taus.setdefault(row["name"], {})[seed] = row["tau"]
                speedup.setdefault(row["name"], {})[seed] = row["speedup"]
                if row.get("tau_no_loop") is not None:
                    no_loop.setdefault(row["name"], {})[seed] = row["tau_no_loop"]
        for name, values in taus.items():
            if len(values) != len(per_seed):
                raise ValueError(f"{label}: drafter {name} is missing from some seeds' reports")
        summary[label] = {
            "settings": next(iter(per_seed.values()))[label]["settings"],
            "distinct_4gram": _spread(distinct),
            "looping_prompts": looping,
            "drafters": {name: _spread(values) for name, values in taus.items()},
            "drafters_no_loop": {name: _spread(values) for name, values in no_loop.items()},
            "speedup": {name: _spread(values) for name, values in speedup.items()},
        }
    return summary


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
                  "| drafter | tau median | range | per seed | tau, no loop: median | range | per seed "
                  "| speedup: median | range |",
                  "| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
        for name, t in sorted(block["drafters"].items(), key=lambda kv: -kv[1]["median"]):
            n, s = block["drafters_no_loop"].get(name), block["speedup"].get(name)
            split = f"{n['median']:.2f} | {n['min']:.2f} to {n['max']:.2f} | {_seeds(n['seeds'])}" if n else "- | - | -"
            fast = f"{s['median']:.2f}x | {s['min']:.2f}x to {s['max']:.2f}x" if s else "- | -"
            lines.append(f"| {name} | {t['median']:.2f} | {t['min']:.2f} to {t['max']:.2f} | {_seeds(t['seeds'])} "
                         f"| {split} | {fast} |")
        lines.append("")
    timed = [v for v in seconds.values() if v]
    if timed:
        lines.append(f"Wall time per demo run: median {statistics.median(timed):.0f} s "
                     f"(range {min(timed):.0f} to {max(timed):.0f} s), seeds run one at a time.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_demo")
    parser.add_argument("--overrides", default="", help="DEMO_OVERRIDES for every run, e.g. train.max_steps=20")
    parser.add_argument("--summarize-only", action="store_true", help="read finished runs; run nothing")
    args = parser.parse_args(argv)

    seconds = {}
    for seed in args.seeds:
        seconds[seed] = (_recorded_seconds(args.out / f"seed{seed}") if args.summarize_only
                         else run_seed(seed, args.out, args.overrides))
    per_seed = {seed: read_runs(args.out / f"seed{seed}" / "report") for seed in args.seeds}
    summary = summarize(per_seed)
    text = markdown(summary, seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"summary": summary, "wall_seconds": seconds}, indent=1))
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
