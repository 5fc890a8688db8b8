"""Rewrite the golden loss curves, tests/golden/<method>.json, from the current code.

    python scripts/update_golden.py [METHOD ...]      # default: every tiny recipe

Run it only when a change is meant to move the losses (a new loss term, another init, a
changed tiny recipe), and say so in the commit: tests/test_golden.py fails on any other
drift. Takes about 15 seconds on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# The test suite's settings (tests/conftest.py): offline, no tracker, one thread.
for key, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(key, value)


def main(argv=None) -> int:
    import tokenizers
    import torch
    import transformers

    import golden_runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", metavar="METHOD",
                        help=f"which curves to rewrite (default: all of {', '.join(golden_runs.METHODS)})")
    methods = parser.parse_args(argv).methods or list(golden_runs.METHODS)
    unknown = sorted(set(methods) - set(golden_runs.METHODS))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)} (known: {', '.join(golden_runs.METHODS)})")
    torch.set_num_threads(1)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    with tempfile.TemporaryDirectory(prefix="draftsmith-golden-") as work:
        os.environ["DRAFTSMITH_CACHE"] = str(Path(work) / "cache")
        curves = golden_runs.run_all(Path(work), methods)
    golden_runs.GOLDEN.mkdir(parents=True, exist_ok=True)
    for method, curve in curves.items():
        path = golden_runs.golden_file(method)
        path.write_text(json.dumps({**golden_runs.record(method, curve), "made_with": versions}, indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}: train/loss {', '.join(f'{x:.4f}' for x in curve['train/loss'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
