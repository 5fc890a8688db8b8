"""DSpark's serving calibration for SGLang (models/dspark_calibration.py): the confidence
temperatures fitted on held-out rows and the steps-per-second table from a latency table,
checked against SGLang's parsers restated from sglang 0.5.23 (PyPI wheel):
srt/speculative/dspark_components/dspark_sts.py (`DSparkStsCalibration`), dspark_sps.py
(`SpsCostTable`, `load_sps_table_from_path`) and dspark_planner.py (temperatures must number
gamma, the drafts per block); the printed SGLang line passes both files."""

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.models.dspark_calibration import SPS_FILE, STS_FILE, collect, fit_sts, write_sts
from draftsmith.models.native import save_drafter
from tiny_models import MASK, dspark, one_line_error


def sglang_sts_reads(data: dict, gamma: int) -> list[float]:
    """DSparkStsCalibration (a msgspec Struct: `temperatures` required, `dataset` str,
    `num_samples` int, `ece_before`/`ece_after` lists of floats; every temperature > 0, at least
    one) and the planner's check that there are gamma of them."""
    temperatures = data["temperatures"]
    assert isinstance(temperatures, list) and temperatures, "requires at least one temperature"
    assert all(isinstance(t, (int, float)) and t > 0 for t in temperatures), "temperatures must all be > 0"
    assert isinstance(data.get("dataset", ""), str) and isinstance(data.get("num_samples", 0), int)
    for key in ("ece_before", "ece_after"):
        assert all(isinstance(v, (int, float)) for v in data.get(key, []))
    assert len(temperatures) == gamma, "DSpark STS calibration was fit for another gamma"
    return temperatures


def sglang_sps_reads(data: dict) -> dict:
    """SpsCostTable (all three fields required; load_sps_table_from_path takes the additive
    table instead when the text has "bias_seconds")."""
    assert '"bias_seconds"' not in json.dumps(data)
    tokens, sps, top = data["sample_batch_tokens"], data["sample_steps_per_sec"], data["max_batch_tokens"]
    assert tokens, "requires at least one probe"
    assert tokens == sorted(set(tokens)), "sample_batch_tokens must be strictly increasing"
    assert len(tokens) == len(sps) and top >= tokens[-1]
    return dict(zip(tokens, sps))


def held_out_rows(target, count=3, length=40, seed=0):
    """Rows whose answers are the target's own greedy continuation (so that a drafter that
    copies the target is accepted), the prompt half masked out."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, MASK, (count, length // 2), generator=gen)
    with torch.no_grad():
        full = target.generate(rows, max_new_tokens=length - length // 2, do_sample=False,
                               attention_mask=torch.ones_like(rows))
    loss_mask = torch.zeros_like(full)
    loss_mask[:, length // 2:] = 1
    return {"input_ids": full, "loss_mask": loss_mask, "attention_mask": torch.ones_like(full)}


def test_sts_fit_recovers_a_known_temperature_and_lowers_the_error():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 3, generator=gen) * 3
    # Draft k survives with probability prod_j sigmoid(c_j / 2): the calibrated temperature is 2.
    alive = torch.ones(4000)
    prefix = []
    for k in range(3):
        alive = alive * (torch.rand(4000, generator=gen) < (logits[:, k] / 2).sigmoid()).float()
        prefix.append(alive)
    fit = fit_sts(logits, torch.stack(prefix, 1))
    assert fit["temperatures"][0] == pytest.approx(2.0, rel=0.15)
    assert all(after <= before for before, after in zip(fit["ece_before"], fit["ece_after"]))
    assert fit["ece_after"][0] < fit["ece_before"][0]


def test_collect_counts_what_a_greedy_verify_accepts(target):
    """One row per block: gamma confidences and an accepted prefix (ones, then zeros)."""
    rows = held_out_rows(target)
    drafter = dspark(target, block_size=4)
    logits, prefix = collect(drafter, target, rows, max_blocks=12)
    assert logits.shape == prefix.shape == (12, 4)
    # prefix rows are prefixes: 1s, then 0s
    assert torch.equal(prefix, prefix.cummin(1).values)


def test_export_writes_the_calibration_and_cost_table_sglang_reads(target, target_dir, tmp_path, capsys):
    drafter = dspark(target)  # anchor first: gamma = block_size = 5
    native = save_drafter(drafter, tmp_path / "native", extra={"target": str(target_dir)})
    write_sts(drafter, target, held_out_rows(target), native)
    from draftsmith.models.target import target_shape

    shape = target_shape(target.config)  # a table of this target (export refuses another's, as eval does)
    latency = {"format": "draftsmith-verify-latency", "version": 1, "contexts": [64, 256], "drafts": [0, 1, 2, 3],
               "verify_ms": [[10.0, 11.0, 12.0, 20.0], [12.0, 13.0, 14.0, 22.0]], "head_ms": 0.5,
               "device": "test", "device_type": "cuda", "dtype": "bfloat16", "attention": "sdpa",
               "shape": {"layers": shape.num_layers, "hidden": shape.hidden_size, "heads": shape.num_heads,
                         "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab": shape.vocab_size}}
    (tmp_path / "latency.json").write_text(json.dumps(latency))
    capsys.readouterr()
    out = tmp_path / "sglang"
    assert main(["export", str(native), "--format", "sglang", "--out", str(out),
                 "--latency-table", str(tmp_path / "latency.json")]) == 0
    printed = capsys.readouterr().out
    assert len(sglang_sts_reads(json.loads((out / STS_FILE).read_text()), gamma=drafter.drafts_per_block)) == 5
    table = sglang_sps_reads(json.loads((out / SPS_FILE).read_text()))
    # one sequence's 1 + d verify rows; the median of the contexts' times (two: the upper one)
    assert table == pytest.approx({1: 1000 / 12.0, 2: 1000 / 13.0, 3: 1000 / 14.0, 4: 1000 / 22.0})
    sglang = next(line for line in printed.splitlines() if "sglang.launch_server" in line)
    assert f"--speculative-dspark-confidence-sts-path {out / STS_FILE}" in sglang
    assert f"--speculative-dspark-sps-table-path {out / SPS_FILE}" in sglang
    # A calibration fitted for another block is refused, nothing written.
    calibration = json.loads((native / STS_FILE).read_text())
    (native / STS_FILE).write_text(json.dumps({**calibration, "temperatures": [1.0] * 3}))
    one_line_error(lambda: __import__("draftsmith.models.export", fromlist=["export_run"]).export_run(
        native, "sglang", tmp_path / "x"), "3 temperatures for a drafter of 5 drafts")
    assert not (tmp_path / "x").exists()
