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
from draftsmith.registry import trainable
from draftsmith.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
STEPS = 6
# Every trainable method of the registry; mtp first: it trains the target the others train against.
METHODS = ("mtp", *(m for m in trainable() if m != "mtp"))

# {work} is the folder of one golden session (data, tokenizer, runs).
COMMON = [
    "target.num_layers=4", "target.hidden_size=64", "target.num_heads=4", "target.num_kv_heads=1",
    "target.dtype=float32", "data.tokenizer={work}/tokenizer", f"train.max_steps={STEPS}", "train.batch_size=4",
    "train.seq_len=64", "train.lr=3e-3", "train.warmup_ratio=0.0", "train.log_every=1", f"train.eval_every={STEPS}",
    "train.eval_batches=1", "train.save_every=100", 'train.mixed_precision="no"', "tracking.report_to=none",
    "train.output_dir={work}/{method}",
]
POSTHOC = ["target.path={work}/mtp", "data.dataset={work}/conversations.jsonl", "data.regenerate=false"]
EXTRA = {
    "mtp": ["data.dataset={work}/corpus.txt"],
    "draft_lm": ["target.path={work}/mtp", "data.dataset={work}/corpus.txt", "method.hidden_size=64"],
    "eagle3": [*POSTHOC, "method.draft_vocab_size=128", "method.ttt_length=2"],
    "dflash": [*POSTHOC, "method.block_size=4", "method.num_anchors=8"],
    "dspark": [*POSTHOC, "method.block_size=4", "method.num_anchors=8", "method.markov_rank=16"],
}

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
    """The overrides of `method`'s golden run; a registered method without any fails naming itself."""
    if method not in EXTRA:
        raise AssertionError(f"method {method!r} has no golden-curve settings: add it to EXTRA in tests/golden_runs.py "
                             "and run `python scripts/update_golden.py`")
    return [*COMMON, *EXTRA[method]]


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
