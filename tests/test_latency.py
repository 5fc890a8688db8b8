"""The verify latency table (`plan --measure`), the draft-length rule built on it, and the
EAGLE-3 chain length `export` prints from it. Nothing here is timed against a bound: the
tests check the table's shape, the rule's arithmetic and where each number goes."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.models.latency import (
    TABLE_FORMAT,
    LatencyTable,
    best_draft,
    chain_step_ms,
    linear_cost,
    measure_latency,
)
from draftsmith.models.target import build_tiny_target, freeze
from draftsmith.models.tile import plan_tile


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    freeze(build_tiny_target(seed=0, arch="llama", vocab_size=128, num_layers=2, hidden_size=32, num_heads=4,
                             num_kv_heads=1)).save_pretrained(folder)
    return folder


def table(rows, contexts=(256,), device_type="cuda", D=3, head_ms=0.0, layers=4):
    return {"format": TABLE_FORMAT, "version": 1, "target": "t", "device": "test", "device_type": device_type,
            "dtype": "bfloat16", "attention": "sdpa", "cache": "dynamic", "torch": "x", "transformers": "x",
            "contexts": list(contexts), "drafts": list(range(len(rows[0]))), "verify_ms": rows, "reps": 1,
            "head_ms": head_ms, "tile": {"rows": 16, "tp": 1, "G": 4, "D": D},
            "shape": {"layers": layers, "hidden": 32, "heads": 4, "kv_heads": 1, "head_dim": 8, "vocab": 128}}


def test_measure_writes_a_table_of_every_d_and_context(tiny_dir, tmp_path, capsys):
    out = tmp_path / "lat"
    assert main(["plan", str(tiny_dir), "--tile", "16", "--measure", "--out", str(out), "--contexts", "8,32",
                 "--reps", "1"]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "latency.json").read_text())
    # G = 4 at a 16-row tile: D = 3, measured to D + 8 past it.
    assert data["tile"] == {"rows": 16, "tp": 1, "G": 4, "D": 3} and data["drafts"] == list(range(12))
    assert data["contexts"] == [8, 32] and [len(r) for r in data["verify_ms"]] == [12, 12]
    assert data["device_type"] == "cpu" and data["dtype"] == "float32" and data["attention"] == "sdpa"
    assert all(v > 0 for row in data["verify_ms"] for v in row) and data["head_ms"] > 0
    assert [s["context"] for s in data["tile_step"]] == [8, 32] and "rise_at_tile_ms" in data["tile_step"][0]
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "d=3 (D)" in printed and "tile boundary" in printed and str(out / "latency.json") in printed
    LatencyTable.read(out)  # reads back as a table
    # A folder that holds something else is never replaced; --measure needs --out.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    assert main(["plan", str(tiny_dir), "--measure", "--out", str(tmp_path / "other")]) == 2
    assert main(["plan", str(tiny_dir), "--measure"]) == 2
    assert "--out" in capsys.readouterr().err


def test_a_config_alone_is_timed_with_random_weights(tiny_dir):
    from draftsmith.models.latency import load_measured_target

    model = load_measured_target(str(tiny_dir / "config.json"), "cpu")
    data = measure_latency(model, [4], 2, reps=1, plan=plan_tile(model.config.to_dict(), tile=16))
    assert data["shape"]["layers"] == 2 and data["tile"]["D"] == 3 and len(data["verify_ms"][0]) == 3


def test_table_reads_refuse_what_is_not_one(tmp_path):
    bad = tmp_path / "latency.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(DraftsmithError, match="not a latency table"):
        LatencyTable.read(tmp_path)
    ragged = table([[1.0, 2.0]])
    ragged["verify_ms"] = [[1.0]]
    with pytest.raises(DraftsmithError, match="do not agree"):
        LatencyTable.check(ragged)
    with pytest.raises(DraftsmithError, match="measured for 0 .. 1 drafts"):
        LatencyTable.check(table([[1.0, 2.0]])).verify_ms(5, 256)


def test_verify_time_is_interpolated_between_contexts():
    t = LatencyTable.check(table([[1.0, 2.0], [3.0, 6.0]], contexts=(100, 300)))
    assert t.verify_ms(1, 200) == pytest.approx(4.0)
    assert t.verify_ms(0, 50) == 1.0 and t.verify_ms(0, 900) == 3.0  # the nearest outside


def test_best_draft_maximises_expected_tokens_per_second():
    acceptance = [0.9, 0.8, 0.5, 0.1, 0.05]
    verify = [10, 10, 10, 10, 20, 20]  # a second tile from d = 4 on

    def pass_ms(d):
        return verify[d] + 0.5 * d

    choice = best_draft(acceptance, pass_ms, max_draft=5)
    rates = [(1 + sum(acceptance[:d])) / pass_ms(d) for d in range(6)]
    assert choice.num_draft == max(range(6), key=rates.__getitem__)
    assert [p["d"] for p in choice.curve] == list(range(6))
    assert choice.at(2)["expected_tokens"] == pytest.approx(2.7)
    # Capped: never past max_draft, nor past the positions acceptance was measured at.
    assert best_draft(acceptance, pass_ms, max_draft=1).num_draft <= 1
    assert len(best_draft(acceptance[:2], pass_ms, max_draft=5).curve) == 3
    # Where no draft pays for itself, no drafts.
    assert best_draft([0.01, 0.01], lambda d: 10 + 10 * d, 2).num_draft == 0


def test_costs_between_and_beyond_the_measured_lengths():
    cost = linear_cost((1, 2.0), (9, 10.0))
    assert cost(0) == 0.0 and cost(1) == 2.0 and cost(5) == pytest.approx(6.0) and cost(12) == pytest.approx(13.0)
    # One chained step: a target layer's share of the single-token pass plus the head's share.
    t = LatencyTable.check(table([[9.0, 9.0]], head_ms=1.0, layers=4))
    assert chain_step_ms(t, 256, head_fraction=0.5) == pytest.approx((9.0 - 1.0) / 4 + 0.5)


def test_export_prints_the_chain_the_rule_chooses(tmp_path, capsys):
    from draftsmith.models.eagle3 import Eagle3Drafter
    from draftsmith.models.native import save_drafter

    target_dir = tmp_path / "target"
    freeze(build_tiny_target(seed=1, arch="qwen3", vocab_size=128, num_layers=4, hidden_size=32, num_heads=4,
                             num_kv_heads=1)).save_pretrained(target_dir)
    from draftsmith.models.target import load_target

    target = load_target(target_dir)
    run = tmp_path / "run"
    save_drafter(Eagle3Drafter.from_target(target).eval(), run / "model", extra={"target": str(target_dir)})
    accs = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "val/acc_1": 0.1}) + "\n"
                                       + json.dumps({"step": 8, **{f"val/acc_{k + 1}": a for k, a in enumerate(accs)}})
                                       + "\n")

    def printed_steps(head_ms):
        # A GPU table of this target: verify flat at 4 ms up to past D = 31 (G = 4), so only the drafter's
        # step limits the chain: a layer's share (4 ms less the head, over 4 layers) plus its full-vocabulary head.
        lat = tmp_path / f"lat{head_ms}"
        lat.mkdir()
        (lat / "latency.json").write_text(json.dumps(table([[4.0] * 40], D=31, layers=4, head_ms=head_ms)))
        assert main(["export", str(run), "--format", "sglang", "--out", str(tmp_path / f"out{head_ms}"),
                     "--latency-table", str(lat)]) == 0
        out = capsys.readouterr().out
        sglang = next(line for line in out.splitlines() if "sglang.launch_server" in line)
        steps = int(sglang.split("--speculative-num-steps ")[1].split()[0])
        assert f"--speculative-num-draft-tokens {steps + 1}" in sglang and "EAGLE-3 chain:" in out
        return steps

    # The rule, done by hand: a_k = prod acc_j, E(d) / (T_verify + d * step).
    a, running = [], 1.0
    for acc in accs:
        running *= acc
        a.append(running)
    chosen = []
    for head_ms in (0.0, 3.0):
        step = (4.0 - head_ms) / 4 + head_ms
        rates = [(1 + sum(a[:d])) / (4.0 + d * step) for d in range(8)]
        chosen.append(printed_steps(head_ms))
        assert chosen[-1] == max(1, max(range(8), key=rates.__getitem__))
    assert chosen[0] > chosen[1]  # a dearer step buys a shorter chain
    # Without acceptance in the run: the references' 3 steps, said so.
    (run / "metrics.jsonl").write_text(json.dumps({"step": 8, "val/loss": 1.0}) + "\n")
    assert main(["export", str(run), "--format", "sglang", "--out", str(tmp_path / "plain"),
                 "--latency-table", str(tmp_path / "lat0.0")]) == 0
    out = capsys.readouterr().out
    assert "--speculative-num-steps 3 " in out and "no validation acceptance" in out


def test_best_threshold_drafts_long_where_confidence_says_it_pays():
    """Two kinds of pass: confident drafts all accepted, unconfident ones all rejected. A fixed
    length pays for the second kind's drafts; a threshold between their confidences drafts
    the first kind fully and the second not at all, which no fixed length can."""
    from draftsmith.models.dspark_calibration import best_threshold

    records = [([0.9, 0.9, 0.9, 0.9], 4), ([0.1, 0.1, 0.1, 0.1], 0)] * 3
    choice = best_threshold(records, lambda length: 10.0 + 2.0 * length, max_draft=4)
    assert choice["num_draft"] == 4 and choice["confidence_threshold"] == 0.15  # the lowest that stops the second
    fixed = next(p for p in choice["curve"] if p["confidence_threshold"] == 0.0)
    assert fixed["d"] == 4 and abs(fixed["tokens_per_s"] - 1000 * 6 / 36) < 1e-9  # (5 + 1) tokens in 18 + 18 ms
    assert abs(choice["tokens_per_s"] - 1000 * 6 / 28) < 1e-9  # the second kind's pass costs 10 ms, not 18
    # Past what the drafts' confidences say, nothing pays: no drafting at all is kept.
    assert best_threshold([([0.5, 0.5], 0)] * 2, lambda length: 10.0 + 5.0 * length, 2)["num_draft"] == 0
    assert best_threshold([], lambda length: 1.0, 4) == {"num_draft": 0, "confidence_threshold": 0.0,
                                                       "tokens_per_s": 0.0, "curve": []}
