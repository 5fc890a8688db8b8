"""The feature cache written in-process against the vLLM engine (`data cache-hidden` and
`data cache-hidden --engine vllm`), same recipes, same rows, same run.

Each path runs as its own `draftsmith data cache-hidden` command into a fresh folder; the
in-process one runs first (it answers and renders the rows, kept in the rows cache), then the
engine, then the in-process one again, whose figures are the ones compared (the same warm rows
cache as the engine's). Rows per minute come from the commands' own lines: the feature-writing
stage alone, and the whole command (loading the target, rendering the rows, and for the engine
its start). The two caches' stored tensors are compared at the rows' real positions.

    python scripts/bench_capture.py [--target smollm2-135m-instruct] [--conversations 80] [--seq-len 384]
                                    [--batch-size 16] [--recipes eagle3,dflash,dspark] [key.sub=value ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WRITTEN = re.compile(r"features of (\d+) rows written in ([0-9.]+) s")
READY = re.compile(r"engine ready in ([0-9.]+) s")


def run(out: Path, args, engine: bool) -> dict:
    recipes = sum((["--recipe", str(ROOT / "recipes" / "smollm2_135m" / f"{m}.yaml")]
                   for m in args.recipes.split(",")), [])
    command = [sys.executable, "-m", "draftsmith.cli", "data", "cache-hidden", *recipes,
               f"target.path={args.target}", f"data.num_conversations={args.conversations}",
               f"train.seq_len={args.seq_len}", *args.overrides, "--batch-size", str(args.batch_size), "--out", str(out),
               *(["--engine", "vllm"] if engine else [])]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    rows, stage = WRITTEN.search(done.stderr).groups()
    ready = READY.search(done.stderr)
    return {"rows": int(rows), "stage_s": float(stage), "wall_s": wall, "start_s": float(ready.group(1)) if ready else 0.0}


def compare(ours: Path, theirs: Path) -> list[str]:
    from safetensors.torch import load_file

    def tensors(cache: Path) -> dict:  # every stored tensor, its shards in row order
        shards = [load_file(s) for s in sorted(cache.glob("shard-*.safetensors"))]
        return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}

    real = load_file(ours / "rows.safetensors")["attention_mask"].bool()
    a, b = tensors(ours), tensors(theirs)
    lines = []
    for key in sorted(a):
        x, y = a[key][real].float(), b[key][real].float()
        lines.append(f"  {key}: {(x != y).float().mean().item():.3%} of stored (bfloat16) values differ, "
                     f"largest difference {(x - y).abs().max().item():.3g} of {x.abs().max().item():.3g}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=80, help="the demo's rows")
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per forward, and requests in flight")
    parser.add_argument("--recipes", default="eagle3,dflash,dspark")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="more recipe overrides for both paths")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run(tmp / "warm", args, engine=False)
        engine = run(tmp / "engine", args, engine=True)
        ours = run(tmp / "ours", args, engine=False)
        print(f"{args.target}, {ours['rows']} rows of {args.seq_len} tokens, {args.recipes}, "
              f"batch {args.batch_size}, {torch.get_num_threads()} threads")
        for name, r in (("in-process", ours), ("vLLM", engine)):
            print(f"  {name:10s} features {r['stage_s']:7.1f} s ({60 * r['rows'] / r['stage_s']:6.1f} rows/min)"
                  f"   whole command {r['wall_s']:7.1f} s ({60 * r['rows'] / r['wall_s']:6.1f} rows/min)"
                  + (f", of which the engine's start {r['start_s']:.1f} s" if r["start_s"] else ""))
        print(f"  vLLM over in-process: {ours['stage_s'] / engine['stage_s']:.2f}x the feature stage, "
              f"{ours['wall_s'] / engine['wall_s']:.2f}x the whole command")
        print("\n".join(compare(tmp / "ours", tmp / "engine")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
