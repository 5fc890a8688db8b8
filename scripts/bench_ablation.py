"""The DFlash ablation on the tiny target (recipes/tiny/mtp.yaml, the demo's MTP target): one
factor at a time from the tiny recipe, every row trained for the same wall-clock seconds,
over seeds (issue 21, item 5); with `--recipe eagle3`, EAGLE-3's TTT losses the same way
(issue 31, item 1).

Each row is the tiny recipe (--recipe: dflash, recipes/tiny/dflash.yaml, or eagle3) plus
its overrides (ROWS[recipe]); a row whose drafter and training resolve to base's is skipped.
The training loop has no time limit, so the seconds are turned into steps: per row, once
(seed 0), two short runs of CALIBRATION steps give its seconds per optimizer step net of
start-up, and every seed then trains max(10, round(S / s)) steps, warm-up and schedule as
the recipe says. Every run shares one derived-data cache, and a 1-step run per seed builds
that seed's regenerated answers first, outside any timing. Then one `draftsmith eval` per
seed over every row, as the demo evaluated the tiny target before it moved to SmolLM2, and per row tau's median and range over
seeds at the headline setting (t0.7), greedy tau on text that does not loop, the speedup
(scripts/bench_demo.py's summarize), and each draft position's acceptance, median over
seeds, at both settings. Each training and eval subprocess runs holding the shared CPU
lock, one at a time; it is timed inside the lock.

    python scripts/bench_ablation.py --target runs/ablation/target            # every row, seeds 0 1 2
    python scripts/bench_ablation.py --target runs/ablation/target --rows base block8 --seeds 0 --seconds 10
    python scripts/bench_ablation.py --target runs/ablation/target --summarize-only
    python scripts/bench_ablation.py --target runs/ablation/target --recipe eagle3   # into runs/bench_ablation_eagle3
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_demo import run_script, summarize

from draftsmith.errors import DraftsmithError
from draftsmith.eval.combine import read_runs
from draftsmith.fsutil import atomic_file, output_lock, read_json, write_json
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.tile import read_target_config
from draftsmith.recipe import load_recipe, read_yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {name: ROOT / "recipes" / "tiny" / f"{name}.yaml" for name in ("dflash", "eagle3")}
LOCK = "/tmp/draftsmith-cpu.lock"  # the shared one-job-at-a-time lock of this machine's CPUs

# Recipe -> row name -> overrides of RECIPES[recipe]: one factor at a time from base. Gammas
# are DFlash's for each block (models/dflash_reference.py default_gamma by drafts), given so a base
# gamma cannot leak in.
DFLASH_ROWS: dict[str, tuple[str, ...]] = {
    "base": (),
    "block16": ("method.block_size=16", "method.gamma=7"),
    "block8": ("method.block_size=8", "method.gamma=4"),
    "block4": ("method.block_size=4", "method.gamma=2"),
    "anchors64": ("method.num_anchors=64",),
    "anchors_all": ("method.num_anchors=4096",),  # past any row's valid positions: sample_anchors takes them all
    # The references' density: 512 anchors over rows of 3072 (SpecForge) or 4096 (DeepSpec)
    # tokens, one position in 6 to 8; the demo's answers are at most 96 tokens.
    "anchors16": ("method.num_anchors=16",),
    "anchors32": ("method.num_anchors=32",),
    "layers1": ("method.num_layers=1",),
    "layers2": ("method.num_layers=2",),
    "layers3": ("method.num_layers=3",),
    "kv1": ("method.num_kv_heads=1",),
    "kv8": ("method.num_kv_heads=8",),
    "context1": ("method.num_context_layers=1",),
    "context3": ("method.num_context_layers=3",),
    # DeepSpec's DFlash convention (the anchor slot predicts draft 1) beside z-lab's (base).
    "deepspec": ("method.name=dspark", "method.markov_rank=0", "method.tv_weight=0", "method.bce_weight=0",
                 "method.ce_weight=1"),
    # DFlash's fixed exp(-(k - 1)/gamma) decay beside base's D-PACE (speculators), which the tiny
    # recipe took from this comparison (README "Loss weights by acceptance", run as row dpace
    # against a decay base).
    "decay": ("method.position_weights=decay",),
}
ROWS: dict[str, dict[str, tuple[str, ...]]] = {
    "dflash": DFLASH_ROWS,
    # SpecForge 0.2.0's LK losses on the expected acceptance beside base's soft cross-entropy.
    "eagle3": {"base": (), "lk_lambda": ("method.loss=lk_lambda",), "lk_alpha": ("method.loss=lk_alpha",)},
}
# Steps of the two timing runs: their difference is net of start-up and of the first steps'
# one-off costs; 30 steps apart, since a step's time varies with the machine's other load
# (measured on 2 cores: 4 and 24 steps put block8 at 0.27 s/step, 10 and 40 at 0.65; 8 and
# 28 keep the first steps out at two thirds of the cost).
CALIBRATION = (8, 28)
MIN_STEPS = 10
HEADLINE, GREEDY = "t0.7", "t0"
# The tiny-target evaluation of the demo before it moved to SmolLM2 (README "The tiny target").
EVAL_FLAGS = ["--num-prompts", "16", "--max-new-tokens", "64", "--prompt-chars", "240",
              "--temperature", "0", "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def row_recipe(kind: str, name: str, target: str, extra: tuple[str, ...] = ()):
    return load_recipe(RECIPES[kind], [f"target.path={target}", *ROWS[kind][name], *extra])


def resolve(recipe, target_config: dict):
    """The drafter config training would build (train/<method>.py's `drafter_config`): what a
    run picks from its rows (a mask id) is a placeholder there, the same for every row."""
    return recipe.method.spec.load("training").drafter_config(target_config, recipe.method.params,
                                                              recipe.target.tile)


def plan_rows(kind: str, names: list[str], target: str,
              target_config: dict) -> tuple[dict[str, tuple[str, ...]], dict]:
    """(row -> its overrides to train, skipped row -> why). A row that switches the method
    keeps base's drafts per block (DSpark's block is one shorter for as many drafts). A row
    whose resolved drafter, method and training equal base's is skipped."""
    base_recipe = row_recipe(kind, "base", target)
    base = resolve(base_recipe, target_config)
    planned, skipped = {}, {}
    for name in names:
        extra: tuple[str, ...] = ()
        recipe = row_recipe(kind, name, target)
        config = resolve(recipe, target_config)
        switches = any(o.startswith("method.name=") for o in ROWS[kind][name])
        if switches and not any(o.startswith("method.block_size=") for o in ROWS[kind][name]) \
                and config.drafts_per_block != base.drafts_per_block:
            extra = (f"method.block_size={base.drafts_per_block + config.first_prediction_slot}",)
            recipe = row_recipe(kind, name, target, extra)
            config = resolve(recipe, target_config)
        if name != "base" and _same_run(recipe, config, base_recipe, base):
            skipped[name] = "resolves to base"
            continue
        planned[name] = ROWS[kind][name] + extra
    return planned, skipped


def _same_run(recipe, config, base_recipe, base) -> bool:
    def settings(r):
        d = dataclasses.asdict(r)
        d.pop("method")
        return d
    return (recipe.method.name == base_recipe.method.name and dataclasses.asdict(config) == dataclasses.asdict(base)
            and settings(recipe) == settings(base_recipe))


def describe(recipe, config) -> str:
    """`config` in a line, as the recipe's method describes its drafters (train/<method>.py)."""
    return recipe.method.spec.load("training").describe(config)


class Bench:
    def __init__(self, kind: str, target: str, out: Path, seconds: float):
        self.kind, self.target, self.out, self.seconds = kind, target, out, seconds
        self.recipe, self.extra = RECIPES.get(kind), (f"target.path={target}",)  # what every run trains from
        self.env = dict(os.environ, **ENV, DRAFTSMITH_CACHE=str(out / "cache"))  # one regeneration per seed
        self.logs = out / "logs"

    def locked(self, args: list[str], log_name: str) -> float:
        """Run `args` holding the shared CPU lock (fcntl.flock on LOCK is flock(1)'s lock, so
        other engineers' `flock LOCK ...` jobs run between ours); its seconds inside the lock."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{log_name}.log"
        with open(LOCK, "a") as lock, open(log_path, "w") as log:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # never start this script under `flock LOCK`: it would wait on itself
                print(f"   ({log_name}: waiting for {LOCK})", flush=True)
                fcntl.flock(lock, fcntl.LOCK_EX)
            start = time.monotonic()
            done = subprocess.run(args, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            seconds = time.monotonic() - start
        if done.returncode:
            tail = log_path.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-1:]
            sys.exit(f"{log_name}: exit {done.returncode} ({' '.join(tail)}); see {log_path}")
        return seconds

    def train(self, overrides: tuple[str, ...], run: Path, seed: int, steps: int, log_name: str) -> float:
        resume = ["train.resume=true"] if any((run / "checkpoints").glob("checkpoint_*")) else []
        return self.locked([sys.executable, "-m", "draftsmith.cli", "train", "--recipe", str(self.recipe),
                            *self.extra, *overrides, f"train.output_dir={run}",
                            f"train.seed={seed}", f"train.max_steps={steps}", *resume], log_name)

    def scratch_train(self, overrides: tuple[str, ...], seed: int, steps: int, log_name: str) -> float:
        run = self.out / "scratch" / log_name
        shutil.rmtree(run, ignore_errors=True)
        seconds = self.train(overrides, run, seed, steps, log_name)
        shutil.rmtree(run)
        return seconds

    def warm_data(self, seed: int) -> None:
        """A 1-step run builds the seed's regenerated answers into the shared cache, so no
        timed or budgeted run pays for them."""
        print(f"== seed {seed}: data warm-up (regeneration into {self.out / 'cache'})", flush=True)
        self.scratch_train(ROWS[self.kind]["base"], seed, 1, f"warmup_seed{seed}")

    def calibrate(self, rows: dict[str, tuple[str, ...]]) -> dict[str, dict]:
        """Row -> seconds per step (seed 0), from two runs of CALIBRATION steps; kept in
        OUT/calibration.json and reused while the row's overrides stay the same."""
        path = self.out / "calibration.json"
        known = read_json(path) if path.is_file() else {}
        warm = False
        for name, overrides in rows.items():
            if known.get(name, {}).get("overrides") == list(overrides) and known[name].get("steps") == list(CALIBRATION):
                continue
            if not warm:  # the first run after data was written or read elsewhere pays for page-cache
                # reads (~40 s for a 3.5 GB feature cache): calibrating then made the short run the
                # slower per step (0.59 s/step calibrated against 2.0 to 2.4 s measured in training)
                self.scratch_train(overrides, 0, 1, "calibrate_warmup")
                warm = True
            short, long = (self.scratch_train(overrides, 0, n, f"calibrate_{name}_{n}") for n in CALIBRATION)
            per_step = max(long - short, 1e-3) / (CALIBRATION[1] - CALIBRATION[0])
            known[name] = {"overrides": list(overrides), "steps": list(CALIBRATION), "seconds": [short, long],
                           "sec_per_step": per_step}
            write_json(path, known)
        for name in rows:
            c = known[name]
            print(f"calibration {name}: {c['seconds'][0]:.1f} s for {c['steps'][0]} steps, {c['seconds'][1]:.1f} s "
                  f"for {c['steps'][1]}: {c['sec_per_step']:.3f} s/step -> {self.steps(c)} steps", flush=True)
        return {name: known[name] for name in rows}

    def steps(self, calibration: dict) -> int:
        return max(MIN_STEPS, round(self.seconds / calibration["sec_per_step"]))

    def train_seed(self, seed: int, rows: dict, calibration: dict) -> None:
        for name, overrides in rows.items():
            run, steps = self.out / f"seed{seed}" / name, self.steps(calibration[name])
            if (run / "model").exists():
                check_steps(run, steps)
                print(f"== seed {seed} {name}: reusing {run}", flush=True)
                continue
            print(f"== seed {seed} {name}: {steps} steps", flush=True)
            seconds = self.train(overrides, run, seed, steps, f"train_seed{seed}_{name}")
            print(f"== seed {seed} {name}: {seconds:.0f} s", flush=True)

    def evaluate_seed(self, seed: int, rows: dict) -> None:
        """One eval over the rows no eval folder of this seed has yet (one baseline decode
        for all of them), into seed<N>/eval, or eval-2, ... when rows were added later."""
        folder = self.out / f"seed{seed}"
        have = {name for reports in eval_reports(folder) for block in reports.values() for name in block["names"]}
        missing = [name for name in rows if name not in have]
        if not missing:
            print(f"== seed {seed}: every row evaluated", flush=True)
            return
        folders = eval_folders(folder)
        dest = folder / ("eval" if not folders else f"eval-{len(folders) + 1}")
        drafters = []
        for name in missing:
            method = read_yaml(folder / name / "recipe.yaml")["method"]["name"]
            drafters += ["--drafter", f"{method}:{folder / name}"]
        print(f"== seed {seed}: eval of {', '.join(missing)} into {dest}", flush=True)
        self.locked([sys.executable, "-m", "draftsmith.cli", "eval", "--target", self.target, "--out", str(dest),
                     *EVAL_FLAGS, "--seed", str(seed), *drafters], f"eval_seed{seed}_{dest.name}")


def run_steps(run: Path) -> int:
    return int(read_yaml(run / "recipe.yaml")["train"]["max_steps"])


def check_steps(run: Path, steps: int) -> None:
    trained = run_steps(run)
    if trained != steps:
        raise DraftsmithError(f"{run} was trained for {trained} steps, these seconds plan {steps}: give the seconds "
                              "it was trained with, or remove it (or use another --out) to train it again")


def eval_folders(seed_dir: Path) -> list[Path]:
    return sorted((p for p in seed_dir.glob("eval*") if (p / "report.json").is_file()),
                  key=lambda p: (len(p.name), p.name))


def eval_reports(seed_dir: Path) -> list[dict]:
    """Per eval folder: {setting: {"report": ..., "names": [row, ...]}}, drafters named by
    row (the run folder a `--drafter NAME:RUN` argument points at is named after its row)."""
    found = []
    for folder in eval_folders(seed_dir):
        reports = read_runs(folder)
        for report in reports.values():
            for drafter in report["drafters"]:
                drafter["name"] = Path(drafter["drafter"].rpartition(":")[2]).name
        found.append({label: {"report": r, "names": [d["name"] for d in r["drafters"]]} for label, r in reports.items()})
    return found


def seed_reports(seed_dir: Path, rows: list[str]) -> dict[str, dict]:
    """{setting: one report whose drafters are `rows`}, merged over the seed's eval folders
    (each row's speedup stays against its own eval's plain decoding)."""
    found = eval_reports(seed_dir)
    if not found:
        raise DraftsmithError(f"{seed_dir}: no eval report (train and evaluate that seed, or leave it out of --seeds)")
    merged = {}
    for label in (HEADLINE, GREEDY):
        parts = [f[label]["report"] for f in found if label in f]
        if not parts:
            raise DraftsmithError(f"{seed_dir}: no {label} report")
        by_name = {}
        for part in parts:
            for drafter in part["drafters"]:
                if drafter["name"] in by_name:
                    raise DraftsmithError(f"{seed_dir}: row {drafter['name']} evaluated twice; remove one eval folder")
                by_name[drafter["name"]] = drafter
        absent = [name for name in rows if name not in by_name]
        if absent:
            raise DraftsmithError(f"{seed_dir}: no {label} result for row(s) {', '.join(absent)}")
        merged[label] = {**parts[0], "drafters": [by_name[name] for name in rows]}
    return merged


def summarize_rows(per_seed: dict[int, dict[str, dict]], steps: dict[str, int], calibration: dict) -> dict:
    """Row -> {what, steps, sec_per_step, tau (headline), tau_greedy_no_loop, speedup}, each
    a median/min/max/seeds spread over the seeds, and {acceptance, acceptance_greedy}: per
    draft position, the median over seeds; a row missing from a seed is an error."""
    summary = summarize(per_seed)
    head, greedy = summary[HEADLINE], summary[GREEDY]
    return {name: {"what": " ".join(o.removeprefix("method.") for o in calibration[name]["overrides"]) or "-",
                   "steps": steps[name], "sec_per_step": calibration[name]["sec_per_step"],
                   "tau": head["drafters"][name], "tau_greedy_no_loop": greedy["drafters_no_loop"].get(name),
                   "speedup": head["speedup"][name], "acceptance": acceptance(per_seed, HEADLINE, name),
                   "acceptance_greedy": acceptance(per_seed, GREEDY, name)}
            for name in steps}


def acceptance(per_seed: dict[int, dict[str, dict]], label: str, name: str) -> list[float]:
    """Row `name`'s acceptance per draft position at `label`, median over seeds (every prompt:
    the report keeps no per-position split by looping)."""
    series = [next(d for d in reports[label]["drafters"] if d["name"] == name)["per_position_acceptance"]
              for reports in per_seed.values()]
    return [statistics.median(values) for values in zip(*series)]


def _cell(spread: dict | None, unit: str = "") -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:.2f}{unit} ({spread['min']:.2f}-{spread['max']:.2f})"


def markdown(rows: dict, seconds: float, seeds: list[int], base: str, skipped: dict) -> str:
    lines = [f"Each row trained for {seconds:g} s (steps from its s/step at seed 0), seeds {' '.join(map(str, seeds))}: "
             "median (min-max) over seeds. tau at temperature 0.7 / top-p 0.8 / top-k 20; greedy tau on the prompts "
             "whose plain text does not loop; speedup at t0.7 against plain decoding in the same eval; acceptance "
             "of draft positions 1, 2, ... (median over seeds, every prompt).", "",
             f"base: {base}.", "",
             "| row | what changed | steps | s/step | tau t0.7 | tau greedy, no loop | speedup t0.7 | acceptance t0.7 "
             "| acceptance greedy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, r in rows.items():
        accept = [" ".join(f"{a:.2f}" for a in r[key]) for key in ("acceptance", "acceptance_greedy")]
        lines.append(f"| {name} | {r['what']} | {r['steps']} | {r['sec_per_step']:.3f} | {_cell(r['tau'])} "
                     f"| {_cell(r['tau_greedy_no_loop'])} | {_cell(r['speedup'], 'x')} | {accept[0]} | {accept[1]} |")
    if skipped:
        lines += ["", "Not run (same drafter and training as base): " + ", ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the trained demo target (a run folder or model folder)")
    parser.add_argument("--seconds", type=float, default=90.0, help="training seconds per row (default 90)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", choices=list(RECIPES), default="dflash",
                        help="the tiny recipe whose rows to run (default dflash)")
    # Each recipe has its own base and calibration.json keyed by row name: its own folder.
    parser.add_argument("--out", type=Path, help="default runs/bench_ablation (dflash), runs/bench_ablation_<recipe>")
    parser.add_argument("--rows", nargs="+", metavar="ROW", help="rows to run (default all): " + "; ".join(
        f"{kind}: {' '.join(table)}" for kind, table in ROWS.items()))
    parser.add_argument("--summarize-only", action="store_true", help="read finished runs; run nothing")
    args = parser.parse_args(argv)
    kind, names = args.recipe, args.rows or list(ROWS[args.recipe])
    unknown = [name for name in names if name not in ROWS[kind]]
    if unknown:
        parser.error(f"--rows: {', '.join(unknown)} not among {kind}'s rows ({' '.join(ROWS[kind])})")
    target = str(Path(args.target).resolve())
    out = (args.out or ROOT / "runs" / ("bench_ablation" if kind == "dflash" else f"bench_ablation_{kind}")).resolve()
    with output_lock(out):  # one bench into one folder at a time
        target_config = read_target_config(find_model_dir(target, require="target"))
        rows, skipped = plan_rows(kind, list(dict.fromkeys(names)), target, target_config)
        for name, why in skipped.items():
            print(f"{name}: {why}; not run", flush=True)
        base_recipe = row_recipe(kind, "base", target)
        base = describe(base_recipe, resolve(base_recipe, target_config))
        bench = Bench(kind, target, out, args.seconds)

        if args.summarize_only:
            calibration = read_json(out / "calibration.json")
            missing = [name for name in rows if name not in calibration]
            if missing:
                sys.exit(f"{out / 'calibration.json'}: no calibration for {', '.join(missing)}")
            for seed in args.seeds:
                for name in rows:
                    if (out / f"seed{seed}" / name / "model").exists():
                        check_steps(out / f"seed{seed}" / name, bench.steps(calibration[name]))
        else:
            bench.warm_data(0)
            calibration = bench.calibrate(rows)
            for seed in args.seeds:
                if seed != 0:
                    bench.warm_data(seed)
                bench.train_seed(seed, rows, calibration)
                bench.evaluate_seed(seed, rows)
        per_seed = {seed: seed_reports(out / f"seed{seed}", list(rows)) for seed in args.seeds}
        steps = {name: run_steps(out / f"seed{args.seeds[0]}" / name) for name in rows}
        summary = summarize_rows(per_seed, steps, calibration)
        text = markdown(summary, args.seconds, args.seeds, base, skipped)
        write_json(out / "ablation.json", {"recipe": kind, "seconds": args.seconds, "seeds": args.seeds, "base": base,
                                           "rows": summary, "skipped": skipped})
        with atomic_file(out / "ablation.md") as handle:
            handle.write(text)
    print(text)


if __name__ == "__main__":
    run_script(main)
