"""DSpark's serving calibration for SGLang: the confidence head's per-position temperatures
(sequential temperature scaling, `--speculative-dspark-confidence-sts-path`) and the verify
cost table (`--speculative-dspark-sps-table-path`). Without them SGLang's DSpark planner
verifies every draft; with them it sizes each verify by the calibrated survival and the cost.

What SGLang reads and how it uses it (sglang 0.5.23 on PyPI, read in its wheel;
tests/test_dspark_calibration.py restates the parsers):
- srt/speculative/dspark_components/dspark_sts.py `DSparkStsCalibration`: a JSON object with
  `temperatures` (non-empty, each > 0) and optional `dataset`, `num_samples`, `ece_before`,
  `ece_after`; dspark_planner.py refuses it unless len(temperatures) == gamma (the drafts per
  block), and srt/models/dspark.py applies `sigmoid(logit_k / T_k)`, the survival of a block
  being the running product over positions. The fit (benchmark/dspark_sts_fit.py) is
  sequential: position by position, the temperature on a log grid of 41 values in [0.1, 10]
  whose running survival has the least expected calibration error (15 equal bins) against
  "drafts 0..k all accepted" (its recorder's `prefix_mask`: position < accepted drafts).
- dspark_sps.py `SpsCostTable`: `sample_batch_tokens` (strictly increasing, >= 1: verify
  tokens in a batch), `sample_steps_per_sec` (as many: 1 / seconds of one step there) and
  `max_batch_tokens` (>= the largest probe).

The statistic is fitted here on held-out rows: the run's own validation split, at the end of
training (train/dspark.py), where the rows and the full target are at hand. Each block is drafted
as the decoder drafts it (greedy, refiner on) from an anchor inside an answer, and verified
greedily by one target forward over the context and the block: acceptance at temperature 0.

For our own decoder, `best_threshold` chooses the confidence threshold together with D on
`eval --num-draft auto`'s calibration passes (eval/proposers/dspark.py: DSparkTuning).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from pydantic import Field

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import read_json, write_json
from draftsmith.models.target import target_forward
from draftsmith.schema import Count, NonNegativeFloat, PositiveFloat, Schema, validated

STS_FILE = "dspark_sts.json"
SPS_FILE = "dspark_sps.json"
GRID = (0.1, 10.0, 41)  # SGLang's temperature grid: log-spaced, ends included
BINS = 15


@torch.no_grad()
def collect(drafter, target, rows: dict, max_blocks: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Confidence logits [n, gamma] of greedily drafted blocks and which prefixes the target
    accepted [n, gamma] (1 where drafts 0..k were all accepted), from rows {input_ids,
    loss_mask, attention_mask} [N, T]: anchors spread over each row's answer tokens."""
    from draftsmith.models.dflash import ContextCache, concat_layers

    device = next(target.parameters()).device
    drafter = drafter.to(device).eval()
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    gamma, ids_of = drafter.drafts_per_block, rows["input_ids"]
    per_row = max(1, math.ceil(max_blocks / max(1, len(ids_of))))
    logits, prefix = [], []
    for i in range(len(ids_of)):
        length = int(rows["attention_mask"][i].sum())
        ids = ids_of[i, :length].to(device)[None]
        answer = rows["loss_mask"][i, 1:length].nonzero().flatten()  # anchor a predicts the answer token a + 1
        anchors = answer[answer >= 1]
        if anchors.numel() == 0:
            continue
        anchors = anchors[torch.linspace(0, anchors.numel() - 1, min(per_row, anchors.numel())).long()].tolist()
        feats = concat_layers(target_forward(target, ids, capture=drafter.config.target_layer_ids).hidden,
                              drafter.config.target_layer_ids)
        for a in anchors:
            cache = ContextCache()
            cache.extend(drafter, feats[:, :a], 0)
            hidden = drafter.decode_hidden(ids[:, a], cache, embed)
            base = head(hidden.to(head.weight.dtype)).float()
            tokens, _, conf = drafter.refine(hidden, base, ids[:, a], lambda step, k: step.argmax(-1))
            verify = target_forward(target, torch.cat([ids[:, :a + 1], tokens], 1)).logits[0, a:a + gamma]
            accepted = int((tokens[0] == verify.argmax(-1)).long().cumprod(0).sum())
            logits.append(conf[0].float().cpu())
            prefix.append((torch.arange(gamma) < accepted).float())
    if not logits:
        raise DraftsmithError("DSpark calibration: the held-out rows have no answer tokens to anchor a block on")
    return torch.stack(logits), torch.stack(prefix)


def calibration_error(probs: torch.Tensor, hits: torch.Tensor, bins: int = BINS) -> float:
    """Expected calibration error over equal-width probability bins."""
    probs = probs.double().clamp(1e-8, 1 - 1e-8)
    which = (probs * bins).long().clamp(0, bins - 1)
    gap = (torch.bincount(which, probs, bins) - torch.bincount(which, hits.double(), bins)).abs()
    return float(gap.sum() / max(1, probs.numel()))


def fit_sts(logits: torch.Tensor, prefix: torch.Tensor) -> dict:
    """Per-position temperatures, each chosen (given the ones before it) so that the running
    survival prod_j sigmoid(c_j / T_j) is best calibrated against the accepted prefixes."""
    low, high, steps = GRID
    grid = torch.logspace(math.log10(low), math.log10(high), steps, dtype=torch.float64).tolist()
    logits = logits.double()
    before = torch.ones(logits.shape[0], dtype=torch.float64)
    fitted = before.clone()
    out = {"temperatures": [], "ece_before": [], "ece_after": []}
    for k in range(logits.shape[1]):
        before = before * logits[:, k].sigmoid()
        out["ece_before"].append(calibration_error(before, prefix[:, k]))
        errors = [(calibration_error(fitted * (logits[:, k] / t).sigmoid(), prefix[:, k]), t) for t in grid]
        error, best = min(errors, key=lambda pair: pair[0])  # the first of equal errors: the lowest T
        out["temperatures"].append(float(best))
        out["ece_after"].append(error)
        fitted = fitted * (logits[:, k] / best).sigmoid()
    return out


def write_sts(drafter, target, rows: dict, folder: str | Path, dataset: str = "held-out rows") -> Path:
    """Fit the calibration on `rows` and write it into `folder` (beside the drafter)."""
    logits, prefix = collect(drafter, target, rows)
    fit = fit_sts(logits, prefix)
    path = Path(folder) / STS_FILE
    write_json(path, {**fit, "dataset": dataset, "num_samples": int(logits.shape[0])})
    return path


class StsCalibration(Schema):
    """A dspark_sts.json as SGLang's DSparkStsCalibration reads it (the module doc), ours or
    another tool's: every temperature positive and finite (NaN passes no `> 0` there and would
    reach the sigmoid), at least one; other keys are kept and written through."""

    temperatures: list[PositiveFloat] = Field(min_length=1)
    dataset: str = ""
    num_samples: Count = 0
    ece_before: list[NonNegativeFloat] = []
    ece_after: list[NonNegativeFloat] = []


def read_sts(path: str | Path, gamma: int) -> dict:
    """A drafter's calibration file, checked (StsCalibration) for a drafter of `gamma` drafts
    per block: the one reader of the file, before the export writes it into SGLang's folder."""
    data = read_json(path)
    temperatures = validated(StsCalibration, data, str(path)).temperatures
    if len(temperatures) != gamma:
        raise DraftsmithError(f"{path}: {len(temperatures)} temperatures for a drafter of {gamma} drafts per block "
                              "(SGLang's gamma)")
    return data


def sps_table(latency_table: str | Path) -> dict:
    """SGLang's steps-per-second table from a `draftsmith plan TARGET --measure` latency table
    (models/latency.py): one probe per measured draft count d, its batch tokens the 1 + d
    verify rows of one sequence, its steps per second 1 / the verify time (the median over
    the measured contexts: SGLang's table has no context axis)."""
    from draftsmith.models.latency import LatencyTable

    table = LatencyTable.read(latency_table)
    rows = table.data["verify_ms"]
    steps = [1000.0 / sorted(row[d] for row in rows)[len(rows) // 2] for d in table.data["drafts"]]
    probes = [d + 1 for d in table.data["drafts"]]
    return {"sample_batch_tokens": probes, "sample_steps_per_sec": steps, "max_batch_tokens": probes[-1]}


# ---- the threshold `eval --num-draft auto` chooses with D (eval/proposers/dspark.py: DSparkTuning)

# Thresholds `best_threshold` tries: DeepSpec's rule compares the confidence sigmoid with them.
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(20))


def best_threshold(records: list[tuple[list[float], int]], pass_ms, max_draft: int) -> dict:
    """DSpark's draft length and confidence threshold maximising expected tokens/s: each
    recorded pass (the draft's confidences, the drafts accepted) would draft L = the drafts
    before the first confidence below the threshold (at most d) and commit 1 + min(accepted,
    L), at pass_ms(L). Returns the best pair and, per threshold, its best d (the curve)."""
    if not records:
        return {"num_draft": 0, "confidence_threshold": 0.0, "tokens_per_s": 0.0, "curve": []}
    curve = []
    for threshold in THRESHOLDS:
        best = None
        for d in range(min(max_draft, max(len(c) for c, _ in records)) + 1):
            tokens = ms = 0.0
            for confidences, accepted in records:
                length = next((k for k, c in enumerate(confidences[:d]) if c < threshold), min(d, len(confidences)))
                tokens += 1 + min(accepted, length)
                ms += pass_ms(length)
            point = {"d": d, "tokens_per_s": 1000.0 * tokens / ms, "expected_tokens": tokens / len(records)}
            if best is None or point["tokens_per_s"] > best["tokens_per_s"]:
                best = point
        curve.append({"confidence_threshold": threshold, **best})
    top = max(curve, key=lambda p: (p["tokens_per_s"], -p["confidence_threshold"]))
    return {"num_draft": top["d"], "confidence_threshold": top["confidence_threshold"],
            "tokens_per_s": top["tokens_per_s"], "curve": curve}
