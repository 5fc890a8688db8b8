"""The golden loss curves: the first steps of every tiny recipe on fixed, generated data.

Shared by tests/test_golden.py (which compares) and scripts/update_golden.py (which
writes tests/golden/<method>.json). Everything a run reads is made here from constants:
the corpus and conversations come from a fixed linear congruential generator and the
tokenizer is trained on that corpus, so the curves depend on neither the Python version
(the embedded corpus is the installed stdlib) nor the `random` module. Precision is fixed
too (float32, no mixed precision: "auto" picks bf16 on CPUs that have it).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.recipe import load_recipe
from draftsmith.registry import method_spec, trainable
from draftsmith.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
STEPS = 6
# Every trainable method of the registry; mtp first: it trains the target the others train against.
TARGET_RUN = "mtp"  # the session's target: trained first on the corpus, every other run trains against it
METHODS = (TARGET_RUN, *(m for m in trainable() if m != TARGET_RUN))

# {work} is the folder of one golden session (data, tokenizer, runs).
COMMON = [
    "target.num_layers=4", "target.hidden_size=64", "target.num_heads=4", "target.num_kv_heads=1",
    "target.dtype=float32", "data.tokenizer={work}/tokenizer", f"train.max_steps={STEPS}", "train.batch_size=4",
    "train.seq_len=64", "train.lr=3e-3", "train.warmup_ratio=0.0", "train.log_every=1", f"train.validation_every={STEPS}",
    "train.validation_batches=1", "train.save_every=100", 'train.mixed_precision="no"', "tracking.report_to=none",
    "train.output_dir={work}/{method}",
]
POSTHOC = ["target.path={work}/mtp", "data.dataset={work}/conversations.jsonl", "data.regenerate=false"]
CORPUS = "data.dataset={work}/corpus.txt"


def extra(method: str) -> list[str]:
    """What `method`'s golden run adds to COMMON: its data (the target's answers where it trains on
    the target's features, else the corpus), the target it trains against, and its registered
    `test_keys` (draftsmith/registry.py), so a registered method needs no line here."""
    spec = method_spec(method)
    if method == TARGET_RUN:
        data = [CORPUS]
    else:
        data = POSTHOC if spec.reads_target_features else ["target.path={work}/mtp", CORPUS]
    return [*data, *(f"method.{k}={v}" for k, v in spec.test_keys.items())]

_WORDS = ("the", "a", "river", "stone", "reads", "writes", "tree", "over", "under", "seven", "blue", "quiet",
          "model", "token", "draft", "verify", "accepts", "rejects", "block", "layer", "fast", "slow", "and",
          "then", "because", "every", "small", "large", "head", "tail", "count", "sum", "of", "to", "from")


def _words(seed: int, count: int) -> list[str]:
    """`count` words from the LCG x -> 1664525 x + 1013904223 mod 2^32, stable everywhere."""
    out, x = [], seed
    for _ in range(count):
        x = (1664525 * x + 1013904223) % 2**32
        out.append(_WORDS[(x >> 16) % len(_WORDS)])
    return out


def _sentence(seed: int) -> str:
    words = _words(seed, 6 + seed % 9)
    return " ".join(words).capitalize() + "."


def make_data(work: Path) -> None:
    """corpus.txt (one document per line), conversations.jsonl and the tokenizer."""
    from draftsmith.data.tokenizer import train_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    docs = [" ".join(_sentence(100 * d + s) for s in range(8)) for d in range(400)]
    (work / "corpus.txt").write_text("\n".join(docs) + "\n")
    with open(work / "conversations.jsonl", "w") as f:
        for c in range(64):
            messages = [{"role": "user", "content": _sentence(7919 * c)},
                        {"role": "assistant", "content": " ".join(_sentence(7919 * c + s) for s in range(1, 4))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    train_tokenizer(docs, vocab_size=320, out_dir=work / "tokenizer")


def settings(method: str) -> list[str]:
    """The overrides of `method`'s golden run."""
    return [*COMMON, *extra(method)]


def overrides(method: str, work: Path) -> list[str]:
    return [o.format(work=work, method=method) for o in settings(method)]


def run(method: str, work: Path) -> dict:
    """Train the first STEPS steps; the per-step training losses and the final validation loss."""
    recipe = load_recipe(ROOT / "recipes" / "tiny" / f"{method}.yaml", overrides(method, work))
    train(recipe)
    rows = [json.loads(line) for line in (Path(recipe.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"train/loss": [r["train/loss"] for r in rows if "train/loss" in r],
            "val/loss": [r["val/loss"] for r in rows if "val/loss" in r]}


def golden_file(method: str) -> Path:
    return GOLDEN / f"{method}.json"


def record(method: str, curves: dict) -> dict:
    """What a golden file holds: the curves and the settings they came from."""
    return {"method": method, "steps": STEPS, "overrides": settings(method), **curves}


def run_all(work: Path, methods=METHODS) -> dict[str, dict]:
    """Data, then each method in order (mtp first: the others train against its target)."""
    import torch

    make_data(work)
    curves = {}
    for method in METHODS:
        if method in methods or method == "mtp":
            torch.manual_seed(0)  # the loop seeds from train.seed too; this keeps any stray draw fixed
            curves[method] = run(method, work)
    return {m: c for m, c in curves.items() if m in methods}
