"""The benchmark scripts and the GPU check run on a CPU at their tiniest sizes and print
tables that parse. Nothing is timed here: a number only has to be a number (speed is
measured by the scripts themselves, as ratios inside one run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# 43 s of the suite's 10-minute budget on 2 cores: `make test-slow` (and the GPU check itself) runs it.
@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_report(tmp_path):
    run(["bash", "scripts/gpu_check.sh", "--cpu-dry-run"], OUT=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decoder_acceptance.png", "decoder_speedup.png", "gpu_check.log", "gpu_check.md", "plan_G4", "verify.json",
        "verify.png"]
    report = (tmp_path / "gpu_check.md").read_text()
    for g in (4,):  # the dry run measures one grouping (a GPU all four); D = 128 // G - 1, d = 0 .. 4 timed
        table = json.loads((tmp_path / f"plan_G{g}" / "latency.json").read_text())
        assert table["tile"]["G"] == g and table["tile"]["D"] == 128 // g - 1 and table["drafts"] == [0, 1, 2, 3, 4]
        assert f"- G={g}, context 64: largest rise" in report
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


def bench_script(monkeypatch, name: str):
    """A scripts/ module imported as its own script imports its siblings (bench_demo)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module(name)


# The demo target's shape (recipes/tiny/mtp.yaml): 4 layers, 8 query heads over 1 KV head.
DEMO_TARGET = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
               "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 704, "vocab_size": 2048,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_ablation_rows_are_recipes_one_factor_from_base(monkeypatch, kind):
    import dataclasses

    from draftsmith.models.dflash_reference import default_gamma

    bench = bench_script(monkeypatch, "bench_ablation")
    table = bench.ROWS[kind]
    for name, overrides in table.items():  # load_recipe refuses unknown keys and bad values
        params = bench.row_recipe(kind, name, "runs/t").method.params
        if "block_size" in params and any(o.startswith("method.block_size=") for o in overrides):
            assert params["gamma"] == default_gamma(params["block_size"] - 1), name
    rows, skipped = bench.plan_rows(kind, list(table), "runs/t", DEMO_TARGET)
    assert "base" in rows and set(rows) | set(skipped) == set(table)
    resolved = lambda overrides: bench.resolve(  # noqa: E731
        bench.load_recipe(bench.RECIPES[kind], ["target.path=runs/t", *overrides]), DEMO_TARGET)
    base = dataclasses.asdict(resolved(()))
    base_type = {"dflash": "DFlashConfig", "eagle3": "Eagle3Config"}[kind]
    for name, overrides in rows.items():
        config = resolved(overrides)
        changed = {k for k, v in dataclasses.asdict(config).items() if v != base.get(k, v)}
        assert (name == "base") == (not changed and type(config).__name__ == base_type), (name, changed)
        if kind == "dflash" and not name.startswith("block"):  # every other row drafts as many tokens as base
            assert config.drafts_per_block == base["block_size"] - 1, name
    if kind == "dflash":
        assert resolved(rows["deepspec"]).first_prediction_slot == 0
        assert resolved(rows["decay"]).position_weights == "decay" and base["position_weights"] == "dpace"
    else:
        assert {resolved(rows[name]).loss for name in rows} == {"ce", "lk_lambda", "lk_alpha"}
    for name in skipped:
        assert dataclasses.asdict(resolved(table[name])) == base, name
    # A row restating base's resolved values is the same run: skipped, not trained twice.
    restated = ((f"method.block_size={base['block_size']}", f"method.num_layers={base['num_layers']}")
                if kind == "dflash" else (f"method.ttt_length={base['ttt_length']}",))
    monkeypatch.setitem(table, "restated", restated)
    assert bench.plan_rows(kind, ["base", "restated"], "runs/t", DEMO_TARGET)[1] == {"restated": "resolves to base"}


def test_ablation_summary_is_median_and_range_over_seeds(monkeypatch, tmp_path):
    from draftsmith.errors import DraftsmithError
    from draftsmith.eval.report import write_index
    from draftsmith.fsutil import write_json

    bench = bench_script(monkeypatch, "bench_ablation")

    def eval_folder(folder, rows: dict[str, float]):
        """An eval folder as `draftsmith eval` writes it for `--drafter METHOD:seedN/ROW` args:
        per row (tau at t0.7), greedy tau_no_loop = tau - 1 and speedup = tau / 4."""
        runs = []
        for temperature in (0.0, 0.7):
            drafters = [{"name": f"dflash:{folder.parent / row}", "drafter": f"dflash:{folder.parent / row}",
                         "num_draft": 1, "tau": tau + temperature, "tau_no_loop": tau - 1, "verify_passes": 4,
                         "committed_tokens": 8, "per_position_acceptance": [0.5], "accepted_length_hist": [2, 2],
                         "tokens_per_s": 10.0, "speedup": (tau + temperature) / 4, "T_draft_ms": 1.0,
                         "T_verify_ms": 2.0} for row, tau in rows.items()]
            runs.append((f"t{temperature:g}", {
                "target": {"path": "t", "H": 8, "KV": 1, "G": 8, "tile": 128, "D": 1},
                "settings": {"dataset": "embedded", "num_prompts": 1, "max_new_tokens": 8, "temperature": temperature,
                             "top_k": 20, "top_p": 0.8, "seed": 0},
                "plain": {"tokens_per_s": 20.0, "T_target_ms": 2.0, "distinct_4gram": 0.5, "looping_prompts": 0},
                "drafters": drafters}))
        folder.mkdir(parents=True)
        for label, results in runs:
            write_json(folder / label / "report.json", results)
        write_index(runs, folder)

    for seed, (base, block8) in enumerate([(2.0, 1.5), (3.0, 1.0), (2.5, 2.0)]):
        eval_folder(tmp_path / f"seed{seed}" / "eval", {"base": base})
        eval_folder(tmp_path / f"seed{seed}" / "eval-2", {"block8": block8})  # a row added later: merged
    rows = ["base", "block8"]
    per_seed = {seed: bench.seed_reports(tmp_path / f"seed{seed}", rows) for seed in range(3)}
    calibration = {"base": {"overrides": [], "sec_per_step": 0.3},
                   "block8": {"overrides": ["method.block_size=8", "method.gamma=4"], "sec_per_step": 0.25}}
    summary = bench.summarize_rows(per_seed, {"base": 300, "block8": 360}, calibration)
    tau = summary["base"]["tau"]
    assert (tau["median"], tau["min"], tau["max"]) == pytest.approx((3.2, 2.7, 3.7))  # t0.7
    greedy = summary["block8"]["tau_greedy_no_loop"]
    assert (greedy["median"], greedy["min"], greedy["max"]) == pytest.approx((0.5, 0.0, 1.0))
    assert summary["block8"]["speedup"]["median"] == pytest.approx(2.2 / 4)
    [table] = md_tables(bench.markdown(summary, 90, [0, 1, 2], "B 16", {}))
    assert [(r["row"], r["what changed"], r["steps"], r["s/step"]) for r in table] == [
        ("base", "-", "300", "0.300"), ("block8", "block_size=8 gamma=4", "360", "0.250")]
    assert table[0]["tau t0.7"] == "3.20 (2.70-3.70)" and table[1]["speedup t0.7"] == "0.55x (0.42-0.68)"
    with pytest.raises(DraftsmithError, match="no eval report"):  # a seed never evaluated
        bench.seed_reports(tmp_path / "seed3", rows)
    with pytest.raises(DraftsmithError, match="no t0.7 result for row.s. block4"):
        bench.seed_reports(tmp_path / "seed0", [*rows, "block4"])


def test_budget_summary_plots_tau_and_speedup_against_training_seconds(monkeypatch, tmp_path):
    """scripts/bench_budget.py reads the one eval of every (method, budget) run and n-gram
    lookup: a table per setting and a tau/speedup plot against training seconds."""
    from draftsmith.eval.combine import read_runs
    from draftsmith.eval.report import write_index
    from draftsmith.fsutil import write_json

    bench = bench_script(monkeypatch, "bench_budget")
    runs, taus = {}, {"ngram": 1.4}
    for method, base in (("eagle3", 1.2), ("dflash", 1.3)):
        for budget, gain in ((60.0, 0.0), (180.0, 0.4)):
            run = tmp_path / method / f"{budget:g}s"
            run.mkdir(parents=True)
            (run / "recipe.yaml").write_text(f"train:\n  max_steps: {int(budget / 2)}\n  batch_size: 4\n")
            val = {"val/acc_1": base - 1, ("val/ce_1" if method == "dflash" else "val/loss_1"): 9 - budget / 60}
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
                {"step": 1, "train/loss": 9.0}, {"step": 1, "val/acc_1": 0.0, "val/ce_1": 0.0},
                {"step": int(budget / 2), **val})))
            if budget == 180.0:  # a kept best: eval loads it, so its step's validation is the one reported
                (run / "best").mkdir()
                (run / "best" / "best.json").write_text(json.dumps({"step": 1}))
            runs.setdefault(method, {})[budget] = run
            taus[bench.label(method, budget)] = base + gain
    settings = []
    for temperature in (0.0, 0.7):
        drafters = [{"name": name, "drafter": name, "num_draft": 2, "tau": tau, "verify_passes": 4,
                     "committed_tokens": 8, "per_position_acceptance": [tau - 1, 0.1],
                     "accepted_length_hist": [1, 2, 1],
                     "tokens_per_s": 10.0 * tau, "speedup": tau / 2, "T_draft_ms": 1.0, "T_verify_ms": 2.0}
                    for name, tau in taus.items()]
        settings.append((f"t{temperature:g}", {
            "target": {"path": "smollm2-135m-instruct", "H": 9, "KV": 3, "G": 3, "tile": 128, "D": 41},
            "settings": {"dataset": "stdlib-instructions", "num_prompts": 1, "max_new_tokens": 8,
                         "temperature": temperature, "top_k": 20, "top_p": 0.8, "seed": 0},
            "plain": {"tokens_per_s": 20.0, "T_target_ms": 2.0}, "drafters": drafters}))
    for label, results in settings:
        write_json(tmp_path / "eval" / label / "report.json", results)
    write_index(settings, tmp_path / "eval")
    summary = bench.summarize(read_runs(tmp_path / "eval"), runs, train_rows=15)
    assert summary["t0"]["ngram"]["tau"] == 1.4
    assert [(p["budget_s"], p["steps"], p["epochs"], p["tau"]) for p in summary["t0.7"]["dflash"]] == [
        (60.0, 30, 8.0, 1.3), (180.0, 90, 24.0, pytest.approx(1.7))]
    assert summary["t0"]["dflash"][0]["val_loss_1"] == 8.0  # the last validation, ce_1 or EAGLE-3's loss_1
    assert (summary["t0"]["dflash"][1]["eval_step"], summary["t0"]["dflash"][1]["val_loss_1"]) == (1, 0.0)
    tables = md_tables(bench.markdown(summary))
    assert len(tables) == 2 and [r["method"] for r in tables[0]] == ["eagle3", "eagle3", "dflash", "dflash"]
    assert tables[0][1] == {"method": "eagle3", "budget s": "180", "steps": "90", "epochs": "24.0", "evaluated step": "1",
                            "val acc 1": "0.00", "val loss 1": "0.00", "tau": "1.60", "speedup": "0.80x", "accepted 1-4": "0.60 0.10"}
    bench.plot(summary, tmp_path)
    for label in ("t0", "t0.7"):
        assert (tmp_path / f"budget_{label}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_budget_trains_and_evaluates_as_the_demo_does(monkeypatch):
    """Its rows are the demo's (so `--features` takes the demo's cache) and so is its eval."""
    import re

    bench = bench_script(monkeypatch, "bench_budget")
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    alone = re.search(r"^CONVERSATIONS=\$\{CONVERSATIONS:-(\d+)\}$", demo, re.M).group(1)  # CONVERSATIONS unset
    rows = set(re.search(r"^ROWS=\((.*)\)$", demo, re.M).group(1).replace('"$CONVERSATIONS"', alone).split())
    assert {r for r in rows if not r.startswith("train.seed=")} == set(bench.DEMO_ROWS)
    sampling = re.search(r"^sampling=\((.*)\)$", demo, re.M).group(1)
    command = []  # the eval line and its continuation lines
    for line in demo.split("timed eval draftsmith eval")[1].splitlines():
        command.append(line.rstrip("\\"))
        if not line.endswith("\\"):
            break
    # the engine's columns (`--engine vllm` where it is installed) are the demo's alone: a budget's
    # eval measures our decoder
    words = " ".join(command).replace('"${sampling[@]}"', sampling).replace('"${engine[@]}"', "").split()
    pairs = sorted(zip(words[::2], words[1::2]))  # the demo's eval: --flag value pairs
    mine = [p for p in pairs if p[0] not in ("--target", "--seed", "--out", "--drafter")]
    assert mine == sorted(zip(bench.EVAL_FLAGS[::2], bench.EVAL_FLAGS[1::2]))


def budget_bench_recording(monkeypatch, commands: list):
    """bench_budget with every subprocess recorded into `commands` instead of run, and a
    calibration of 2 s a step."""
    bench = bench_script(monkeypatch, "bench_budget")
    monkeypatch.setattr(bench.Bench, "locked", lambda self, args, log_name: commands.append(args) or 1.0)
    monkeypatch.setattr(bench.BudgetBench, "calibrate", lambda self, rows: {"base": {"sec_per_step": 2.0}})
    return bench


def test_bench_budget_conversations_reach_the_cache_and_every_run(monkeypatch, tmp_path):
    """`--conversations N` trains on N of the target's answers: the cache it builds holds N
    rows of the asked methods only, and every run reads that cache at N."""
    commands = []
    bench = budget_bench_recording(monkeypatch, commands)
    monkeypatch.setattr(bench, "read_json", lambda path: (_ for _ in ()).throw(SystemExit("stop after eval")))
    with pytest.raises(SystemExit, match="stop after eval"):
        bench.main(["--methods", "dflash", "--budgets", "60", "--conversations", "320", "--out", str(tmp_path)])
    cache, train, evaluate = commands
    assert evaluate[evaluate.index("--drafter", evaluate.index("ngram")) + 1] == f"dflash_60s=dflash:{tmp_path / 'dflash' / '60s'}"
    assert "data.num_conversations=320" in cache and "data.num_conversations=80" not in cache
    assert [a for a in cache if a.endswith(".yaml")] == [str(bench.REAL / "dflash.yaml")]
    assert "data.num_conversations=320" in train and f"data.feature_cache={tmp_path / 'features'}" in train
    assert "train.max_steps=30" in train


def test_bench_budget_reuses_only_a_cache_and_runs_of_its_own_rows(monkeypatch, tmp_path):
    """A complete cache of the bench's rows holding the asked methods is read as it is; one of
    other answers or without a method, or a run trained from other rows, is refused in one
    line before anything trains."""
    from draftsmith.data.feature_cache import FeatureCache
    from draftsmith.data.posthoc_rows import rows_settings
    from draftsmith.errors import DraftsmithError
    from draftsmith.fsutil import read_json, write_json

    commands = []
    bench = budget_bench_recording(monkeypatch, commands)
    monkeypatch.setattr(bench, "read_runs", lambda folder: (_ for _ in ()).throw(SystemExit("stop after eval")))

    def manifest_only(path):  # the real checks over a manifest, without writing 3 GB of features
        cache = FeatureCache.__new__(FeatureCache)
        cache.path, cache.manifest = path, read_json(path / "manifest.json")
        return cache

    monkeypatch.setattr(bench, "FeatureCache", manifest_only)
    demo = bench.load_recipe(bench.REAL / "dflash.yaml", [*bench.DEMO_ROWS, "train.seed=0"])
    write_json(tmp_path / "features" / "manifest.json", {"complete": True, "methods": {"dflash": {}, "eagle3": {}},
                                                         "rows": rows_settings(demo), "splits": {"train": 76}})
    with pytest.raises(SystemExit, match="stop after eval"):  # the demo's cache: read as it is, nothing rebuilt
        bench.main(["--methods", "eagle3", "--budgets", "60", "--out", str(tmp_path)])
    assert [args[3] for args in commands] == ["train", "eval"]
    for argv, refusal in ((["--conversations", "320"], "holds data.num_conversations=80; this run needs "
                                                        "data.num_conversations=320"),
                          (["--methods", "dspark"], "holds dflash, eagle3; this bench needs dspark too")):
        with pytest.raises(DraftsmithError, match=refusal):
            bench.main(["--budgets", "60", "--out", str(tmp_path), *argv])
    trained = tmp_path / "dflash" / "60s"  # a run of the same steps from another seed's rows
    (trained / "model").mkdir(parents=True)
    (trained / "recipe.yaml").write_text(f"data:\n  feature_cache: {tmp_path / 'features'}\n  num_conversations: 80\n"
                                         "train:\n  max_steps: 30\n  seed: 1\n")
    with pytest.raises(DraftsmithError, match="trained from other rows than this bench's"):
        bench.main(["--methods", "dflash", "--budgets", "60", "--out", str(tmp_path)])
    (trained / "recipe.yaml").write_text((trained / "recipe.yaml").read_text().replace("seed: 1", "seed: 0"))
    commands.clear()
    with pytest.raises(SystemExit, match="stop after eval"):  # the same rows: reused, not trained again
        bench.main(["--methods", "dflash", "--budgets", "60", "--out", str(tmp_path)])
    assert [args[3] for args in commands] == ["eval"]
