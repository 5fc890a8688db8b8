"""Compare the per-step training losses of runs with a reference run's.

    python scripts/compare_losses.py [--rtol 1e-4] REFERENCE_RUN NAME=RUN|NAME=!REASON ...

Prints one row per logged step, and one ("val") for the last validation loss: the
reference's loss, then each run's, marked ! beyond rtol. NAME=!REASON is a column that did
not run and prints REASON; one starting with FAILED fails the comparison. Exits 0 only when
every run logged exactly the reference's steps, each within rtol of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def losses(run: Path) -> dict[str, float]:
    """{"1": loss, "2": ..., "val": last validation loss} from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [(str(r["step"]), r["train/loss"]) for r in rows if "train/loss" in r]
    if len(train) != len(dict(train)):  # every process logged: they never formed one group
        raise ValueError(f"{run}/metrics.jsonl logs a step more than once")
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    return dict(train) | ({"val": val[-1]} if val else {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("reference", type=Path)
    parser.add_argument("runs", nargs="+", metavar="NAME=RUN")
    args = parser.parse_args(argv)

    ref = losses(args.reference)
    runs, notes = {}, {}
    for spec in args.runs:
        name, _, where = spec.partition("=")
        if where.startswith("!"):
            notes[name] = where[1:]
            continue
        try:
            runs[name] = losses(Path(where))
        except (OSError, ValueError, KeyError) as exc:
            notes[name] = f"FAILED: no metrics ({exc})"
    ok = not any(note.startswith("FAILED") for note in notes.values())
    deviation = {name: {step: abs(got[step] - want) / max(abs(want), 1e-12) if step in got else float("inf")
                        for step, want in ref.items()} for name, got in runs.items()}

    names = [spec.partition("=")[0] for spec in args.runs]
    print(f"{'step':>5} {'single':>12} " + " ".join(f"{name:>12}" for name in names))
    for step, want in ref.items():
        cells = [f"{'-':>12}" if name in notes else f"{'missing':>12}" if step not in runs[name]
                 else f"{runs[name][step]:12.6f}" + (" !" if deviation[name][step] > args.rtol else "")
                 for name in names]
        print(f"{step:>5} {want:12.6f} " + " ".join(cells))
    for name in names:
        if name in notes:
            print(f"{name}: {notes[name]}")
            continue
        extra = sorted(set(runs[name]) - set(ref))
        worst = max(deviation[name].values())
        ok &= worst <= args.rtol and not extra
        print(f"{name}: max relative deviation {worst:.2e} (rtol {args.rtol:g})"
              + (f"; steps the reference lacks: {', '.join(extra)}" if extra else ""))
    print("agree" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
