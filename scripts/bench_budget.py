"""What training buys on the real target: EAGLE-3, DFlash and DSpark trained against
SmolLM2-135M-Instruct for the same seconds at several budgets, each evaluated as
scripts/demo.sh evaluates, tau and speedup plotted against training seconds, one line per
method (n-gram lookup, untrained, as a level line).

Every run trains from one feature cache of the demo's rows (the target's answers to
`stdlib-instructions`, one pass of the target for the asked methods; `--conversations` for
more answers than the demo's 80), built first and outside any budget. Seconds become steps as in scripts/bench_ablation.py: per method, two
short runs give its seconds per optimizer step net of start-up; each budget then trains its
own run of round(B / s) steps, warm-up and schedule as the recipe says (what a user with
that budget gets, not a checkpoint along a longer run). Then one `draftsmith eval` of every
run (one plain decode for all), greedy and at temperature 0.7 / top-p 0.8 / top-k 20, D = 7.
Training and eval subprocesses run one at a time under the shared CPU lock.

    python scripts/bench_budget.py                          # 300, 900 and 2700 s: 5, 15, 45 minutes of 2 cores
    python scripts/bench_budget.py --budgets 60 180 --methods dflash eagle3 --out runs/bench_budget_small
    python scripts/bench_budget.py --features runs/demo/features   # the demo's cache (same rows, same seed)
    python scripts/bench_budget.py --methods dflash --budgets 360 --conversations 320 --out runs/bench_rows
                                                            # four times the demo's rows, same seconds
    python scripts/bench_budget.py --summarize-only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_ablation import CALIBRATION, MIN_STEPS, Bench, check_steps, run_script
from bench_demo import run_schedule

from draftsmith.data.feature_cache import FeatureCache
from draftsmith.data.posthoc_rows import rows_settings
from draftsmith.errors import DraftsmithError
from draftsmith.eval.combine import read_runs
from draftsmith.eval.report import setting_name
from draftsmith.fields import finite
from draftsmith.fsutil import atomic_file, output_lock, read_json, write_json
from draftsmith.recipe import load_recipe, read_yaml

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "recipes" / "smollm2_135m"
TARGET = "smollm2-135m-instruct"
METHODS = ("eagle3", "dflash", "dspark")
# scripts/demo.sh's rows and evaluation (tests/test_bench_scripts.py holds them to it)
DEMO_CONVERSATIONS = 80


def demo_rows(conversations: int = DEMO_CONVERSATIONS) -> tuple[str, ...]:
    return (f"data.num_conversations={conversations}", "train.seq_len=384")


DEMO_ROWS = demo_rows()
EVAL_FLAGS = ["--dataset", "stdlib-instructions", "--num-prompts", "7", "--max-new-tokens", "40", "--num-draft", "7",
              "--temperature", "0", "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]


class BudgetBench(Bench):
    """bench_ablation's Bench (the CPU lock, logs, calibration) on a real-target recipe,
    every run reading one feature cache of `conversations` of the target's answers;
    `seconds` is the largest budget (calibration's printed step count)."""

    def __init__(self, method: str, out: Path, features: Path, seed: int, seconds: float,
                 conversations: int = DEMO_CONVERSATIONS):
        super().__init__(method, TARGET, out, seconds)
        self.features, self.seed, self.conversations = features, seed, conversations
        self.rows = demo_rows(conversations)
        self.recipe, self.extra = REAL / f"{method}.yaml", (*self.rows, f"data.feature_cache={features}")

    def scratch_train(self, overrides, seed: int, steps: int, log_name: str) -> float:
        # Calibration trains at seed 0; the cache's rows are this bench's seed's (train.seed keys them).
        return super().scratch_train(overrides, self.seed, steps, log_name)

    def cache(self, methods) -> None:
        """The feature cache of `methods` over the bench's rows, unless it is there and complete;
        a complete one made for other methods or another number of answers is refused."""
        manifest = self.features / "manifest.json"
        if manifest.is_file() and read_json(manifest).get("complete"):
            cache = FeatureCache(self.features)  # the rows check a training run makes, before any run
            cache.expect(rows_settings(load_recipe(self.recipe, [*self.extra, f"train.seed={self.seed}"])), "rows")
            missing = [m for m in methods if m not in cache.manifest["methods"]]
            if missing:
                raise DraftsmithError(f"feature cache {self.features} holds {', '.join(cache.manifest['methods'])}; "
                                      f"this bench needs {', '.join(missing)} too: give another --features (or --out)")
            return
        recipes = [a for m in methods for a in ("--recipe", str(REAL / f"{m}.yaml"))]
        print(f"== feature cache into {self.features} (the target's answers first)", flush=True)
        self.locked([sys.executable, "-m", "draftsmith.cli", "data", "cache-hidden", *recipes, *self.rows,
                     f"train.seed={self.seed}", "--out", str(self.features)], "cache_hidden")

    def budget_runs(self, budgets: list[float]) -> dict[float, Path]:
        """One run per budget, trained unless its model is there (with the steps planned)."""
        sec_per_step = self.calibrate({"base": ()})["base"]["sec_per_step"]
        runs = {}
        for budget in budgets:
            steps = max(MIN_STEPS, round(budget / sec_per_step))
            run = self.out / f"{budget:g}s"
            if (run / "model").exists():
                check_steps(run, steps)
                trained = read_yaml(run / "recipe.yaml")
                if (trained["data"].get("feature_cache"), trained["data"]["num_conversations"],
                        trained["train"]["seed"]) != (str(self.features), self.conversations, self.seed):
                    raise DraftsmithError(f"{run} was trained from other rows than this bench's ({self.features}, "
                                          f"{self.conversations} conversations, seed {self.seed}): remove it (or use "
                                          "another --out) to train it again")
            else:
                print(f"== {self.kind} {budget:g} s: {steps} steps", flush=True)
                self.train((), run, self.seed, steps, f"train_{budget:g}s")
            runs[budget] = run
        return runs


def label(method: str, budget: float) -> str:
    return f"{method}_{budget:g}s"


def summarize(reports: dict[str, dict], runs: dict[str, dict[float, Path]], train_rows: int) -> dict:
    """{setting: {"ngram": row, method: [{budget, steps, epochs, validation, tau, speedup,
    acceptance}, ...]}}; epochs over the cache's `train_rows`."""
    trained = {run: _training(run, train_rows) for per_budget in runs.values() for run in per_budget.values()}
    summary = {}
    for setting, report in reports.items():
        rows = {d["name"]: d for d in report["drafters"]}
        block = {"settings": report["settings"], "ngram": _point(rows["ngram"])}
        for method, per_budget in runs.items():
            block[method] = [{"budget_s": budget, **trained[run], **_point(rows[label(method, budget)])}
                             for budget, run in sorted(per_budget.items())]
        summary[setting] = block
    return summary


def _training(run: Path, train_rows: int) -> dict:
    """Steps, epochs, and the step eval loaded (RUN/best when the run kept one: eval reads
    it first) with that validation's first-draft accuracy and loss (`ce_1`, or EAGLE-3's
    `loss_1` over its draft vocabulary: the two are not on one scale, accuracy is)."""
    schedule = run_schedule(run)
    steps, evaluated = schedule["trained_steps"], schedule["eval_step"]
    val = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "val/acc_1" in r and r["step"] == evaluated]
    if not val:
        raise DraftsmithError(f"{run}/metrics.jsonl: no validation logged at step {evaluated} (val/acc_1)")
    return {"steps": steps, "epochs": steps * schedule["batch"] / train_rows, "eval_step": evaluated, "val_acc_1": val[-1]["val/acc_1"],
            "val_loss_1": val[-1].get("val/ce_1", val[-1].get("val/loss_1", float("nan")))}


def _point(row: dict) -> dict:
    return {"tau": row["tau"], "speedup": row["speedup"], "acceptance": row["per_position_acceptance"][:4]}


def markdown(summary: dict) -> str:
    lines = []
    for setting, block in summary.items():
        n = block["ngram"]
        lines += [f"## {setting}: {setting_name(block['settings'])}", "",
                  f"n-gram lookup (no training): tau {n['tau']:.2f}, speedup {n['speedup']:.2f}x.", "",
                  "| method | budget s | steps | epochs | evaluated step | val acc 1 | val loss 1 | tau | speedup | accepted 1-4 |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for method in (m for m in block if m not in ("settings", "ngram")):
            for p in block[method]:
                accepted = " ".join(f"{a:.2f}" for a in p["acceptance"])
                lines.append(f"| {method} | {p['budget_s']:g} | {p['steps']} | {p['epochs']:.1f} | {p['eval_step']} | {p['val_acc_1']:.2f} "
                             f"| {p['val_loss_1']:.2f} | {p['tau']:.2f} | {p['speedup']:.2f}x | {accepted} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, out: Path) -> None:
    """Per setting, tau and speedup against training seconds: a line per method, n-gram level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for setting, block in summary.items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key in zip(axes, ("tau", "speedup")):
            for method in (m for m in block if m not in ("settings", "ngram")):
                points = block[method]
                ax.plot([p["budget_s"] for p in points], [p[key] for p in points], marker="o", label=method)
            ax.axhline(block["ngram"][key], color="grey", linestyle="--", label="ngram (no training)")
            ax.set(xscale="log", xlabel="training seconds (2 CPU cores)", ylabel=key)
            ax.legend()
        fig.suptitle(f"SmolLM2-135M-Instruct, {setting_name(block['settings'])}, D = 7")
        fig.tight_layout()
        fig.savefig(out / f"budget_{setting}.png", dpi=100)
        plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[300.0, 900.0, 2700.0],
                        help="training seconds per run (default 300 900 2700)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=DEMO_CONVERSATIONS,
                        help="the target's answers to train on (data.num_conversations; default the demo's 80)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_budget")
    parser.add_argument("--features", type=Path, help="the feature cache (default OUT/features, built if absent)")
    parser.add_argument("--summarize-only", action="store_true", help="read finished runs and their eval; run nothing")
    args = parser.parse_args(argv)
    for budget in args.budgets:  # before the feature cache, which takes longer than a small budget
        if not (finite(budget, "--budgets") > 0):
            raise DraftsmithError(f"--budgets: each is training seconds, more than 0; got {budget:g}")
    out = args.out.resolve()
    with output_lock(out):  # one bench into one folder at a time
        _bench(args, out)


def _bench(args, out: Path) -> None:
    features = (args.features or out / "features").resolve()
    benches = {m: BudgetBench(m, out / m, features, args.seed, max(args.budgets), args.conversations)
               for m in args.methods}
    if args.summarize_only:
        runs = {m: {b: out / m / f"{b:g}s" for b in args.budgets} for m in args.methods}
    else:
        next(iter(benches.values())).cache(args.methods)  # the asked methods' features (DSpark's logits are most of a cache)
        runs = {m: bench.budget_runs(args.budgets) for m, bench in benches.items()}
        drafters = [a for m, per in runs.items() for b, run in per.items()
                    for a in ("--drafter", f"{label(m, b)}={m}:{run}")]
        Bench("eval", TARGET, out, 0.0).locked([sys.executable, "-m", "draftsmith.cli", "eval", "--target", TARGET,
                                                "--out", str(out / "eval"), *EVAL_FLAGS, "--seed", str(args.seed),
                                                "--drafter", "ngram", *drafters], "eval")
    train_rows = read_json(features / "manifest.json")["splits"]["train"]
    summary = summarize(read_runs(out / "eval"), runs, train_rows)
    write_json(out / "budget.json", {"budgets": args.budgets, "calibration_steps": list(CALIBRATION),
                                     "summary": summary})
    text = markdown(summary)
    with atomic_file(out / "budget.md") as handle:
        handle.write(text)
    plot(summary, out)
    print(text)


if __name__ == "__main__":
    run_script(main)
