"""Issue 44, part B: every file read back is checked at its reader (draftsmith/schema.py), and
every output has its one writer. Each bad file, flag or lock ends in one line naming the file
and the key (or the flag), exit status 2 from the command, and nothing written."""

import json
import math
import os
import sys

import pytest
import torch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import output_lock, write_json
from draftsmith.models.dspark_calibration import STS_FILE, read_sts
from draftsmith.models.export import export_run
from draftsmith.models.latency import TABLE_FORMAT, LatencyTable
from draftsmith.models.native import save_drafter
from draftsmith.models.target import build_tiny_target, freeze, target_shape
from test_faults import one_line_error
from tiny_models import dspark, eagle3
from tiny_runs import ROOT


def refused(call, match: str | None = None) -> str:
    """The one-line DraftsmithError `call` raises (matching `match`)."""
    with pytest.raises(DraftsmithError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)
    return str(caught.value)


def table_of(target, rows=((1.0, 2.0, 3.0),), contexts=(64,), **changes) -> dict:
    """A latency table of `target` as `plan --measure` writes one (the keys its readers read)."""
    s = target_shape(target.config)
    data = {"format": TABLE_FORMAT, "version": 1, "target": "t", "device": "test", "device_type": "cpu",
            "dtype": "float32", "attention": "sdpa", "contexts": list(contexts), "drafts": list(range(len(rows[0]))),
            "verify_ms": [list(r) for r in rows], "head_ms": 0.1,
            "shape": {"layers": s.num_layers, "hidden": s.hidden_size, "heads": s.num_heads,
                      "kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "vocab": s.vocab_size}}
    data.update(changes)
    return data


def written(tmp_path, data, name="latency.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))  # json writes NaN and Infinity as the tokens Python reads back
    return path


# ---------------------------------------------------------------- cause 7: the latency table's check

def without(data: dict, key: str) -> dict:
    return {k: v for k, v in data.items() if k != key}


@pytest.mark.parametrize("change, key", [
    (lambda t: {**t, "contexts": ["64"]}, "contexts[0]"),
    (lambda t: without(t, "device"), "no device"),
    (lambda t: without(t, "shape"), "no shape"),
    (lambda t: {**t, "shape": {**t["shape"], "layers": "6"}}, "shape.layers"),
    (lambda t: {**t, "verify_ms": [[1.0, "2", 3.0]]}, "verify_ms[0][1]"),
    (lambda t: {**t, "verify_ms": [[1.0, math.inf, 3.0]]}, "verify_ms[0][1]: must be a finite number"),
    (lambda t: {**t, "verify_ms": [[1.0, True, 3.0]]}, "verify_ms[0][1]"),
    (lambda t: {**t, "verify_ms": [[1.0, -2.0, 3.0]]}, "verify_ms[0][1]"),
    (lambda t: {**t, "head_ms": math.nan}, "head_ms"),
    (lambda t: {**t, "contexts": [64, 32], "verify_ms": [[1.0, 2.0, 3.0]] * 2}, "must increase"),
    (lambda t: {**t, "tile": {"rows": 128, "tp": 1, "G": "4", "D": 31}}, "tile.G"),
])
def test_a_latency_table_of_the_wrong_types_is_one_line_naming_file_and_key(target, tmp_path, change, key):
    path = written(tmp_path, change(table_of(target)))
    line = refused(lambda: LatencyTable.read(path))
    assert str(path) in line and key in line, line


def test_a_good_table_reads_and_fits_its_own_target_only(target, tmp_path):
    table = LatencyTable.read(written(tmp_path, table_of(target)))
    assert table.check_fits(target.config, "cpu") is table
    refused(lambda: table.check_fits(target.config, "cuda"), "measured on test, eval runs on cuda")
    other = freeze(build_tiny_target(seed=0, arch="llama", vocab_size=128, num_layers=2, hidden_size=32, num_heads=4,
                                     num_kv_heads=1))
    refused(lambda: table.check_fits(other.config), "measured for a target of")


# ---------------------------------------------------------------- cause 3: export checks the table as eval does

@pytest.fixture(scope="module")
def eagle3_native(target, target_dir, tmp_path_factory):
    return save_drafter(eagle3(target), tmp_path_factory.mktemp("e3") / "native", extra={"target": str(target_dir)})


def test_export_refuses_another_targets_latency_table_before_writing(target, eagle3_native, tmp_path, capsys):
    other = table_of(target, shape={**table_of(target)["shape"], "layers": 99})
    out = tmp_path / "out"
    line = one_line_error(capsys, main(["export", str(eagle3_native), "--format", "sglang", "--out", str(out),
                                        "--latency-table", str(written(tmp_path, other))]))
    assert "measured for a target of" in line and "'layers': 99" in line, line
    assert not out.exists()  # refused before the folder is written
    bad = written(tmp_path, table_of(target, head_ms=math.inf), "inf.json")
    line = one_line_error(capsys, main(["export", str(eagle3_native), "--format", "sglang", "--out", str(out),
                                        "--latency-table", str(bad)]))
    assert f"{bad}: head_ms" in line and not out.exists(), line
    # The target's own table is taken, and sizes the printed chain.
    good = written(tmp_path, table_of(target), "good.json")
    assert main(["export", str(eagle3_native), "--format", "sglang", "--out", str(out),
                 "--latency-table", str(good)]) == 0


# ---------------------------------------------------------------- cause 2: DSpark's calibration file

@pytest.fixture(scope="module")
def dspark_native(target, target_dir, tmp_path_factory):
    return save_drafter(dspark(target), tmp_path_factory.mktemp("ds") / "native", extra={"target": str(target_dir)})


@pytest.mark.parametrize("temperatures, key", [
    ([math.nan] * 5, "temperatures[0]: must be a finite number"),
    ([1.0, -1.0, 1.0, 1.0, 1.0], "temperatures[1]: must be greater than 0"),
    ([0.0] * 5, "temperatures[0]: must be greater than 0"),
    (["1.0"] * 5, "temperatures[0]"),
    (2.0, "temperatures: must be a valid list"),
    ([], "temperatures"),
])
def test_bad_calibration_temperatures_are_refused_before_the_sglang_export(dspark_native, tmp_path, temperatures, key):
    folder = tmp_path / "native"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((dspark_native / name).read_bytes())
    (folder / STS_FILE).write_text(json.dumps({"temperatures": temperatures, "dataset": "x", "num_samples": 3}))
    line = refused(lambda: export_run(folder, "sglang", tmp_path / "out"))
    assert f"{folder / STS_FILE}: {key}" in line, line
    assert not (tmp_path / "out").exists()


def test_calibration_files_of_other_tools_keep_their_keys(tmp_path):
    path = tmp_path / STS_FILE
    write_json(path, {"temperatures": [0.5, 2], "ece_after": [0.1, 0.0], "fitted_by": "another tool"})
    assert read_sts(path, 2)["fitted_by"] == "another tool"  # written through to SGLang's folder as it is
    refused(lambda: read_sts(path, 3), "2 temperatures for a drafter of 3 drafts per block")
    write_json(path, {"temperatures": [1.0], "ece_before": [-0.5]})
    refused(lambda: read_sts(path, 1), r"ece_before\[0\]")


# ---------------------------------------------------------------- cause 9: a speculators config.json

@pytest.fixture(scope="module")
def speculators_folder(eagle3_native, tmp_path_factory):
    return export_run(eagle3_native, "speculators", tmp_path_factory.mktemp("spec") / "spec")


@pytest.mark.parametrize("change, key", [
    (lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [str(i) for i in c["eagle_aux_hidden_state_layer_ids"]]},
     "eagle_aux_hidden_state_layer_ids[0]: must be a valid integer"),
    (lambda c: {**c, "eagle_aux_hidden_state_layer_ids": "1,2,3"}, "eagle_aux_hidden_state_layer_ids: must be"),
    (lambda c: {**c, "speculators_config": 3}, "speculators_config: must be a mapping"),
    (lambda c: {**c, "speculators_config": {**c["speculators_config"], "verifier": "Qwen3"}},
     "speculators_config.verifier: must be a mapping"),
    (lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"], "num_attention_heads": "4"}},
     "transformer_layer_config.num_attention_heads"),
    (lambda c: {**c, "transformer_layer_config": [1]}, "transformer_layer_config: must be a mapping"),
])
def test_a_speculators_config_of_the_wrong_types_is_one_line(target, speculators_folder, tmp_path, change, key):
    from draftsmith.models.formats import eagle3 as formats

    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((speculators_folder / "model.safetensors").read_bytes())
    config = json.loads((speculators_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change(config)))
    line = refused(lambda: formats.read(folder, target))
    assert f"{folder}/config.json: {key}" in line, line


def test_the_speculators_folder_as_written_reads_back(target, speculators_folder):
    from draftsmith.models.formats import eagle3 as formats

    assert formats.read(speculators_folder, target).config.target_layer_ids


# ---------------------------------------------------------------- cause 10: report.json read by `draftsmith report`

def setting_report() -> dict:
    return {"target": {"path": "t", "H": 4, "KV": 2, "G": 2, "tile": 128, "D": 63},
            "settings": {"dataset": "embedded", "num_prompts": 1, "max_new_tokens": 8, "temperature": 0.0,
                         "top_k": 0, "top_p": 1.0, "seed": 0},
            "plain": {"tokens_per_s": 20.0, "T_target_ms": 2.0},
            "drafters": [{"name": "ngram", "drafter": "ngram", "num_draft": 1, "tau": 1.5, "verify_passes": 4,
                          "committed_tokens": 6, "per_position_acceptance": [0.5], "accepted_length_hist": [2, 2],
                          "tokens_per_s": 30.0, "speedup": 1.5, "T_draft_ms": 0.1, "T_verify_ms": 2.0}]}


@pytest.mark.parametrize("change, key", [
    (lambda r: without(r, "settings"), "no settings (a required key)"),
    (lambda r: {**r, "settings": {**r["settings"], "temperature": "0"}}, "settings.temperature"),
    (lambda r: {**r, "plain": {**r["plain"], "tokens_per_s": math.nan}}, "plain.tokens_per_s"),
    (lambda r: {**r, "drafters": [{**r["drafters"][0], "tau": None}]}, "drafters[0].tau"),
    (lambda r: {**r, "drafters": 3}, "drafters: must be a valid list"),
])
def test_report_on_a_damaged_report_json_is_one_line(tmp_path, capsys, change, key):
    folder = tmp_path / "eval"
    write_json(folder / "report.json", change(setting_report()))
    line = one_line_error(capsys, main(["report", str(folder), "--out", str(tmp_path / "out")]))
    assert f"{folder / 'report.json'}: {key}" in line, line
    assert not (tmp_path / "out").exists()


def test_an_index_naming_a_damaged_setting_names_that_file(tmp_path, capsys):
    folder = tmp_path / "eval"
    write_json(folder / "report.json", {"runs": {"t0": "t0/report.json"}})
    write_json(folder / "t0" / "report.json", without(setting_report(), "target"))
    line = one_line_error(capsys, main(["report", str(folder), "--out", str(tmp_path / "out")]))
    assert f"{folder / 't0' / 'report.json'}: no target" in line
    write_json(folder / "report.json", {"runs": ["t0"]})
    line = one_line_error(capsys, main(["report", str(folder), "--out", str(tmp_path / "out")]))
    assert f"{folder / 'report.json'}: runs: must be a mapping (a JSON object)" in line


# ---------------------------------------------------------------- causes 5, 6, 11: plan --measure

def plan_measure(target_dir, out, *extra) -> list[str]:
    return ["plan", str(target_dir), "--tile", "16", "--measure", "--out", str(out), "--reps", "1", *extra]


@pytest.mark.parametrize("contexts", ["64,32", "32,32"])
def test_plan_measure_refuses_contexts_no_table_holds_up_front(target_dir, tmp_path, capsys, contexts, monkeypatch):
    from draftsmith.models import latency

    monkeypatch.setattr(latency, "load_measured_target", lambda *a: pytest.fail("the target was loaded"))
    line = one_line_error(capsys, main(plan_measure(target_dir, tmp_path / "lat", "--contexts", contexts)))
    assert f"--contexts {contexts}: the KV lengths must increase, each once (give 32" in line, line
    assert not (tmp_path / "lat").exists()


@pytest.mark.parametrize("device, words", [("bogus", "--device bogus: not a device this machine has"),
                                            ("meta", "--device meta: the meta device runs nothing"),
                                            ("cuda:99", "--device cuda:99: not a device this machine has")])
def test_plan_measure_on_a_device_this_machine_lacks_is_one_line(target_dir, tmp_path, capsys, device, words):
    line = one_line_error(capsys, main(plan_measure(target_dir, tmp_path / "lat", "--device", device)))
    assert words in line, line
    assert not (tmp_path / "lat").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA measures on it")
def test_plan_measure_on_cuda_without_cuda_is_one_line(target_dir, tmp_path, capsys):
    line = one_line_error(capsys, main(plan_measure(target_dir, tmp_path / "lat", "--device", "cuda")))
    assert "--device cuda: not a device this machine has" in line, line


def test_plan_measure_takes_the_output_lock(target_dir, tmp_path, capsys):
    import subprocess

    out = tmp_path / "lat"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom draftsmith.fsutil import output_lock\n"
                               "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)",
                               str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line_error(capsys, main(plan_measure(target_dir, out, "--contexts", "8")))
        assert f"--out {out} is in use by process {holder.pid}" in line, line
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(plan_measure(target_dir, out, "--contexts", "8")) == 0  # free again: measured
    assert LatencyTable.read(out).data["contexts"] == [8]


# ---------------------------------------------------------------- cause 12: a lock that cannot be made

def test_a_lock_that_cannot_be_made_is_one_line(target_dir, tmp_path, capsys):
    out = tmp_path / "lat"
    (tmp_path / ".lat.lock").mkdir()  # a folder where the lock file goes
    line = one_line_error(capsys, main(plan_measure(target_dir, out, "--contexts", "8")))
    assert f"--out {out}: cannot make its lock file {tmp_path / '.lat.lock'} (a folder of that name" in line, line
    report = tmp_path / "eval"
    write_json(report / "report.json", setting_report())
    (tmp_path / ".combined.lock").mkdir()
    line = one_line_error(capsys, main(["report", str(report), "--out", str(tmp_path / "combined")]))
    assert "cannot make its lock file" in line and not (tmp_path / "combined").exists()
    # A name the file system takes whose lock name (`.NAME.lock`) it does not.
    long = tmp_path / ("x" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 2))
    with pytest.raises(DraftsmithError, match="its name is longer than the file system allows") as caught:
        with output_lock(long):
            pass
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- cause 13: the bench scripts

def bench(monkeypatch, name: str):
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module(name)


def test_bench_demo_summarize_only_over_folders_it_cannot_read_is_one_line(monkeypatch, tmp_path):
    demo = bench(monkeypatch, "bench_demo")
    argv = ["--summarize-only", "--seeds", "0", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as caught:  # no run at all
        demo.run_script(lambda: demo.main(argv))
    assert str(caught.value).startswith("error: report ") and "no report.json" in str(caught.value)
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "wall_seconds").write_text("twelve\n")  # what an edit left
    with pytest.raises(SystemExit, match="wall_seconds: expected the run's wall seconds, got 'twelve'"):
        demo.run_script(lambda: demo.main(argv))
    (tmp_path / "seed0" / "wall_seconds").write_text("12\n")
    write_json(tmp_path / "seed0" / "report" / "report.json", without(setting_report(), "plain"))
    with pytest.raises(SystemExit, match="report.json: no plain"):
        demo.run_script(lambda: demo.main(argv))
    assert not (tmp_path / "summary.json").exists()


def test_bench_demo_reads_a_runs_recipe_through_its_schema(monkeypatch, tmp_path):
    demo = bench(monkeypatch, "bench_demo")
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("train:\n  max_steps: ten\n  batch_size: 2\n")
    refused(lambda: demo.run_schedule(run), r"recipe.yaml: train.max_steps: must be a valid integer")
    (run / "recipe.yaml").write_text("train:\n  max_steps: 10\n  batch_size: 2\n")
    assert demo.run_schedule(run)["batch"] == 2
    refused(lambda: demo.run_budget(run), r"recipe.yaml: no train.seq_len")


@pytest.mark.parametrize("budget", ["nan", "inf", "0", "-60"])
def test_bench_budget_refuses_budgets_before_the_feature_cache(monkeypatch, tmp_path, budget):
    script = bench(monkeypatch, "bench_budget")
    monkeypatch.setattr(script.BudgetBench, "cache", lambda *a: pytest.fail("the feature cache was built"))
    refused(lambda: script.main(["--budgets", "60", budget, "--out", str(tmp_path)]), "--budgets")
    assert os.listdir(tmp_path) == []


def test_the_regenerated_answers_cache_is_written_under_its_lock(target_dir, tmp_path, monkeypatch):
    """Two runs answering into one cache file at once would double its answers: the writer holds
    the file's output lock (`.NAME.lock` beside it) while it answers."""
    from draftsmith.data import posthoc_rows, regenerate
    from draftsmith.recipe import load_recipe

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    seen = []

    def answer(settings, target, tokenizer, conversations, out, **kwargs):
        seen.append(sorted(p.name for p in out.parent.iterdir()))
        out.write_text("")

    monkeypatch.setattr(regenerate, "run_regeneration", answer)
    out, _ = posthoc_rows.conversations_file(load_recipe(None, [f"target.path={target_dir}"]), None, None,
                                            target_dir)
    assert seen == [[f".{out.name}.lock"]] and out.is_file() and not (out.parent / f".{out.name}.lock").exists()
