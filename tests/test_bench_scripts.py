"""The benchmark scripts and the GPU check run on a CPU at their tiniest sizes and print
tables that parse. Nothing is timed here: a number only has to be a number (speed is
measured by the scripts themselves, as ratios inside one run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN = ["--device", "cpu", "--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "1",
              "--vocab", "256", "--draft-vocab", "128", "--seq", "32", "--batch", "1", "--anchors", "4",
              "--warmup", "0", "--repeats", "1", "--threads", "1", "--project-layers", "8"]


def run(args, **env) -> str:
    proc = subprocess.run(args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text`, as rows of {header: cell}."""
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    lines, tables, i = text.splitlines(), [], 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and set(lines[i + 1]) <= set("|-: ") and "-" in lines[i + 1]:
            header, i, rows = split(lines[i]), i + 2, []
            while i < len(lines) and lines[i].startswith("|"):
                cells = split(lines[i])
                assert len(cells) == len(header), f"ragged row: {lines[i]}"
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def number(cell: str) -> float:
    return float(cell.rstrip("x"))


def test_bench_train_prints_its_table(tmp_path):
    out = run([sys.executable, "scripts/bench_train.py", *TINY_TRAIN, "--out", str(tmp_path / "train.md")])
    [table] = md_tables(out)
    assert [row["phase"] for row in table] == ["target forward (no grad)", "eagle3", "dflash", "dspark"]
    for row in table:
        for key in ("ms (median)", "paired fwd ms", "x target fwd", "x fwd @8L (est.)", "tok/s", "state MiB"):
            assert number(row[key]) > 0, (key, row)
        number(row["peak extra MiB"])  # RSS-based on a CPU: any number, even 0
    assert table[0]["x target fwd"] == "1.00" and table[0]["online tok/s"] == "-"
    assert all(number(row["online tok/s"]) <= number(row["tok/s"]) for row in table[1:])
    assert md_tables((tmp_path / "train.md").read_text()) == [table]


def test_gpu_check_dry_run_writes_its_report(tmp_path):
    run(["bash", "scripts/gpu_check.sh", "--cpu-dry-run"], OUT=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decoder_acceptance.png", "decoder_speedup.png", "gpu_check.log", "gpu_check.md", "verify.json", "verify.png"]
    report = (tmp_path / "gpu_check.md").read_text()
    assert "skipped" in report.split("## pytest -m gpu")[1].split("##")[0]  # GPU tests collected, skipped
    edges, sweep, decoder, train = md_tables(report)
    assert [row["G"] for row in edges] == ["4", "8", "16"]
    assert [row["Q"] for row in sweep] == [str(q) for q in range(1, 7)]
    assert all(number(row[f"G={g} wall"]) > 0 and number(row[f"G={g} attn"]) > 0 for row in sweep for g in (4, 8, 16))
    names = [row["drafter"] for row in decoder]
    assert names == ["plain decoding", "ngram", "draft_lm", "oracle", "eagle3", "dflash", "dspark", "eagle3_tree"]
    assert all(1.0 <= number(row["tau"]) <= 1 + number(row["D"]) for row in decoder[1:])
    assert [row["phase"] for row in train] == ["target forward (no grad)", "eagle3", "dflash", "dspark"]
    assert (tmp_path / "verify.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "verify.json").read_text())
    assert sorted(result["sweep"], key=int) == ["4", "8", "16"] and len(result["decoder"]["drafters"]) == 7
