"""Compare the per-step training losses of runs against a single-process reference.

    python scripts/compare_losses.py --rtol 1e-4 REF_RUN NAME=RUN|NAME=!REASON ...

Prints one row per step (and one for the last validation loss): the reference's loss, then
each run's, marked ! where it deviates by more than rtol. NAME=!REASON is a column that did
not run and prints REASON; a REASON starting with FAILED fails the comparison. Exits 0 only
when every run logged exactly the reference's steps, each within rtol.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def losses(run: Path) -> dict[str, float]:
    """{"1": loss, "2": ..., "val": last validation loss} from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    if len(steps) != len(set(steps)):  # every process logged: they did not form one group
        raise ValueError(f"{run}/metrics.jsonl logs a step more than once")
    out = {str(r["step"]): r["train/loss"] for r in rows if "train/loss" in r}
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    return {**out, "val": val[-1]} if val else out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("reference", type=Path)
    parser.add_argument("runs", nargs="+", metavar="NAME=RUN")
    args = parser.parse_args(argv)

    ref = losses(args.reference)
    columns, skipped, ok = {}, {}, True
    for spec in args.runs:
        name, _, where = spec.partition("=")
        if where.startswith("!"):  # did not run: "not run on CPU: why" is fine, "FAILED ..." is not
            skipped[name] = where[1:]
            ok &= not where[1:].startswith("FAILED")
            continue
        try:
            columns[name] = losses(Path(where))
        except (OSError, ValueError, KeyError) as exc:
            skipped[name] = f"FAILED: no metrics ({exc})"
            ok = False

    names = [spec.partition("=")[0] for spec in args.runs]
    print(f"{'step':>5} {'single':>12} " + " ".join(f"{n:>12}" for n in names))
    for step, expected in ref.items():
        cells = []
        for name in names:
            if name in skipped:
                cells.append(f"{'-':>12}")
                continue
            got = columns[name].get(step)
            dev = float("inf") if got is None else abs(got - expected) / max(abs(expected), 1e-12)
            ok &= dev <= args.rtol
            cells.append(f"{'missing':>12}" if got is None else f"{got:12.6f}" + ("" if dev <= args.rtol else " !"))
        print(f"{step:>5} {expected:12.6f} " + " ".join(cells))
    for name in names:
        if name in columns:
            extra = sorted(set(columns[name]) - set(ref), key=lambda s: (len(s), s))
            ok &= not extra
            worst = max((abs(columns[name][s] - v) / max(abs(v), 1e-12) for s, v in ref.items()
                         if s in columns[name]), default=float("inf"))
            print(f"{name}: max relative deviation {worst:.2e} (rtol {args.rtol:g})"
                  + (f"; steps not in the reference: {extra}" if extra else ""))
        else:
            print(f"{name}: {skipped[name]}")
    print("agree" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
