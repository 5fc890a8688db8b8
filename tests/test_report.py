import copy
import json
import shutil

import pytest

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval import report
from draftsmith.eval.combine import read_runs
from draftsmith.eval.report import format_table, speedup_bound, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def drafter(name, num_draft, tau, t_draft, t_verify, speedup, extra=None):
    accept = [round(0.9 ** (k + 1), 4) for k in range(num_draft)]
    hist = [5 * (i + 1) for i in range(num_draft + 1)]
    entry = {
        "name": name, "drafter": f"runs/{name}", "num_draft": num_draft, "tau": tau,
        "verify_passes": sum(hist), "committed_tokens": round(tau * sum(hist)),
        "per_position_acceptance": accept, "accepted_length_hist": hist,
        "tokens_per_s": 40.0 * speedup, "speedup": speedup,
        "bound": speedup_bound(tau, 25.0, t_draft, t_verify),
        "T_draft_ms": t_draft, "T_verify_ms": t_verify,
    }
    if extra is not None:
        entry["extra"] = extra
    return entry


@pytest.fixture
def results():
    return {
        "target": {"path": "runs/tiny-target", "H": 8, "KV": 1, "G": 8, "tile": 128, "D": 15},
        "settings": {"dataset": "mt-bench.jsonl", "num_prompts": 4, "max_new_tokens": 64,
                     "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0},
        "plain": {"tokens_per_s": 40.0, "T_target_ms": 25.0},
        "drafters": [
            drafter("eagle3", 3, 2.5, 4.0, 30.0, 1.6),
            drafter("dspark", 5, 3.25, 3.0, 31.0, 2.1, extra={"early_stop_rate": 0.125}),
        ],
        "prompts": [{"prompt_ids": [1, 2, 3], "outputs": {"plain": [4, 5], "eagle3": [4, 5], "dspark": [4, 5]}}],
    }


def test_speedup_bound():
    assert speedup_bound(tau=3.0, t_target=20.0, t_draft=5.0, t_verify=25.0) == pytest.approx(2.0)
    assert speedup_bound(1.0, 20.0, 0.0, 20.0) == pytest.approx(1.0)  # plain decoding
    with pytest.raises(DraftsmithError, match="must be positive"):
        speedup_bound(2.0, 20.0, 0.0, 0.0)


def test_writes_json_md_and_plots(results, tmp_path):
    out = write_report(results, tmp_path / "report")
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.json", "report.md", *report.PLOTS])
    assert json.loads((out / "report.json").read_text()) == results

    md = (out / "report.md").read_text()
    assert "H = 8 query heads, KV = 1 KV heads, G = 8" in md and "D = 15" in md
    assert "tau counts the bonus token" in md and "gpt-fast print tau - 1" in md
    assert "| mt-bench.jsonl | 4 | 64 | 0.0 | 0 | 1.0 | 0 |" in md
    # bound = tau * T_target / (T_draft + T_verify) = 2.5 * 25 / 34
    assert "| eagle3 | 3 | 2.50 | 64.0 | 1.60x | 1.84x | 4.00 | 30.00 | - |" in md
    assert "| dspark | 5 | 3.25 | 84.0 | 2.10x | 2.39x | 3.00 | 31.00 | 0.125 |" in md
    assert "early stop rate" in md
    assert "| 4 | - | 0.656 |" in md  # position 4: past eagle3's D, dspark's 0.9**4
    for png in report.PLOTS:
        assert f"]({png})" in md
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_format_table_for_the_terminal(results):
    table = format_table(results).splitlines()
    assert table[0].startswith("| drafter | D | tau | tokens/s | speedup | bound | T_draft ms | T_verify ms |")
    assert table[2].startswith("| plain decoding | 0 | 1.00 | 40.0 | 1.00x |")
    assert len(table) == 2 + 1 + 2


def test_missing_key_leaves_nothing_behind(results, tmp_path):
    del results["drafters"][1]["tau"]
    with pytest.raises(DraftsmithError, match=r"results have no drafters\[1\]\.tau"):
        write_report(results, tmp_path / "report")
    assert list(tmp_path.iterdir()) == []


def test_failure_while_plotting_keeps_the_previous_report(results, tmp_path, monkeypatch):
    out = write_report(results, tmp_path / "report")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "_plot_accepted_lengths", broken)
    changed = copy.deepcopy(results)
    changed["settings"]["seed"] = 1
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(changed, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no temporary folder left


def test_bound_from_another_convention_is_refused(results, tmp_path):
    d = results["drafters"][0]
    d["bound"] = speedup_bound(d["tau"] - 1, 25.0, d["T_draft_ms"], d["T_verify_ms"])
    with pytest.raises(DraftsmithError, match=r"drafters\[0\]\.bound"):
        write_report(results, tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_lengths_must_match_num_draft(results):
    results["drafters"][0]["accepted_length_hist"].pop()
    with pytest.raises(DraftsmithError, match=r"drafters\[0\] \(eagle3\).*num_draft 3"):
        format_table(results)


def test_distinct_4grams_tell_a_loop_from_text():
    loop = [7, 8] * 20
    assert report.distinct_4gram_ratio([loop]) == pytest.approx(2 / 37)
    assert report.distinct_4gram_ratio([list(range(40))]) == 1.0
    assert report.distinct_4gram_ratio([loop, list(range(40))]) == pytest.approx((2 / 37 + 1) / 2)
    assert report.loops(loop) and not report.loops(list(range(40)))
    assert report.loops(list(range(10)) + [7] * 30) and not report.loops(list(range(30)) + [7] * 10)


def test_markdown_splits_tau_by_whether_the_text_loops(results, tmp_path):
    results["plain"].update(distinct_4gram=0.4, looping_prompts=3)
    results["drafters"][0]["tau_no_loop"] = 1.75
    results["drafters"][1]["tau_no_loop"] = None  # every prompt looped
    md = (write_report(results, tmp_path / "report") / "report.md").read_text()
    assert "On 3 of the 4 prompts it loops" in md
    assert "| drafter | D | tau | tau, no loop | tokens/s |" in md
    assert "| eagle3 | 3 | 2.50 | 1.75 |" in md and "| dspark | 5 | 3.25 | - |" in md


def test_bench_demo_summarizes_seeds_from_report_folders(results, tmp_path):
    """scripts/bench_demo.py reads each seed's eval folder (greedy and sampled reports
    under one index) and prints tau's median and range per setting and drafter."""
    import importlib.util

    from draftsmith.eval.report import write_index
    from tiny_runs import ROOT

    spec = importlib.util.spec_from_file_location("bench_demo", ROOT / "scripts" / "bench_demo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    per_seed = {}
    for seed, taus in enumerate([(2.0, 3.0), (4.0, 3.5), (3.0, 5.0)]):
        runs = []
        for temperature in (0.0, 0.7):
            run = copy.deepcopy(results)
            run["settings"].update(temperature=temperature, top_p=0.8, top_k=20)
            run["plain"].update(distinct_4gram=0.5 + seed / 10, looping_prompts=seed)
            for row, tau in zip(run["drafters"], taus):
                row["tau"] = tau + temperature
                row["committed_tokens"] = round(row["tau"] * row["verify_passes"])
                row["tau_no_loop"] = tau / 2
                row["bound"] = speedup_bound(row["tau"], 25.0, row["T_draft_ms"], row["T_verify_ms"])
            runs.append((f"t{temperature:g}", run))
        folder = tmp_path / f"seed{seed}"
        for label, run in runs:
            write_report(run, folder / label)
        write_index(runs, folder)
        per_seed[seed] = read_runs(folder)
    summary = bench.summarize(per_seed)
    assert set(summary) == {"t0", "t0.7"}
    eagle = summary["t0"]["drafters"]["eagle3"]
    assert (eagle["median"], eagle["min"], eagle["max"]) == (3.0, 2.0, 4.0)
    assert summary["t0.7"]["drafters"]["dspark"]["median"] == pytest.approx(4.2)
    assert summary["t0"]["distinct_4gram"]["median"] == pytest.approx(0.6)
    text = bench.markdown(summary, {0: 600.0, 1: 700.0, 2: 650.0})
    assert "## t0.7: temperature 0.7, top-p 0.8, top-k 20" in text
    # eagle3 committed 2, 4 and 3 tokens a pass over 50 passes a seed; the passes accepted 0..3
    # drafts 5, 10, 15 and 20 times (spread 1, the standard error's)
    assert summary["t0"]["pooled"]["eagle3"] == pytest.approx({"tau": 3.0, "se": (150 / 149 / 150) ** 0.5,
                                                               "passes": 150})
    assert summary["t0.7"]["pooled"]["eagle3"]["tau"] == pytest.approx(3.7)  # committed over passes, as tau is
    assert ("| eagle3 | 3 | 3.00 | 2.00 to 4.00 | 2.00 4.00 3.00 | 3.000 ± 0.082 | 1.50 | 1.00 to 2.00 "
            "| 1.00 2.00 1.50 |") in text
    assert "Prompts whose plain text loops, per seed: 0 1 2." in text
    assert "median 650 s" in text
    del per_seed[2]["t0"]["drafters"][0]  # a drafter missing from one seed is an error, not a gap
    with pytest.raises(DraftsmithError, match="eagle3 is missing"):
        bench.summarize(per_seed)


def test_bench_demo_reports_each_runs_training_budget(results, tmp_path, monkeypatch):
    """The budget table: per trained run (rows sharing one share it) the steps eval loaded
    of those trained, rows and epochs over the feature cache's training split, its answer
    tokens (a pretraining run: every packed position), its demo stage's seconds over seeds
    (untimed where no run logged them); the shared stage once; n-gram nothing."""
    import importlib.util
    import os

    import torch
    import yaml
    from safetensors.torch import save_file

    from draftsmith.fsutil import write_json
    from tiny_runs import ROOT

    spec = importlib.util.spec_from_file_location("bench_demo", ROOT / "scripts" / "bench_demo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cache = tmp_path / "features"
    cache.mkdir()
    loss_mask = torch.zeros(5, 8, dtype=torch.int64)
    loss_mask[0, :3] = loss_mask[1, :5] = loss_mask[2, :4] = 1  # 12 answer tokens over 3 training rows
    loss_mask[3:] = 1  # validation rows: not counted
    rows = {"input_ids": torch.zeros(5, 8, dtype=torch.int64), "loss_mask": loss_mask}
    save_file(rows, str(cache / "rows.safetensors"))
    save_file({"dflash.hidden": torch.zeros(5, 8, 2)}, str(cache / "shard-0.safetensors"))
    write_json(cache / "manifest.json", {"format": "draftsmith-feature-cache/2", "complete": True, "num_rows": 5,
                                         "shards": [{"file": "shard-0.safetensors", "rows": [0, 5]}],
                                         "rows_file": "rows.safetensors", "splits": {"train": 3, "eval": 2}})
    relative = os.path.relpath(tmp_path, ROOT)  # as demo.sh writes them: from the repository root
    for name, data, train in (
            ("dflash", {"feature_cache": f"{relative}/features"}, {"max_steps": 6, "batch_size": 2}),
            ("mtp", {}, {"max_steps": 10, "batch_size": 4, "grad_accum": 2, "seq_len": 16})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "recipe.yaml").write_text(yaml.safe_dump({"data": data, "train": {"seq_len": 8, **train}}))
    (tmp_path / "dflash" / "best").mkdir()  # eval loads the best weights: they saw 4 steps of the 6 trained
    write_json(tmp_path / "dflash" / "best" / "best.json", {"step": 4})
    per_seed = {}
    for seed, seconds in enumerate((100, 140)):
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "demo.log").write_text(
            f"== features: draftsmith data cache-hidden ...\nsome output\n== features: {300 + seed} s\n"
            f"== dflash: draftsmith train ...\n== dflash: {seconds} s\n== mtp: reusing runs/x/mtp\n")
        run = copy.deepcopy(results)
        run["drafters"][0].update(name="ngram", drafter="ngram")
        run["drafters"][1].update(name="fast", drafter=f"fast=dflash:{relative}/dflash")
        run["drafters"] += [{**run["drafters"][1], "name": "fast_tree", "drafter": f"fast_tree=dflash:{relative}/dflash"},
                            {**run["drafters"][1], "name": "mtp", "drafter": f"mtp:{tmp_path / 'mtp'}"}]
        per_seed[seed] = {"t0": run}
    monkeypatch.chdir(tmp_path / "seed0")  # paths resolve from the repository root, not from where it runs
    budget = bench.budgets(per_seed, tmp_path)
    runs = {entry["name"]: entry for entry in budget["runs"].values()}
    assert list(runs) == ["dflash", "mtp"]
    dflash = runs["dflash"]
    assert (dflash["drafters"], dflash["trained_steps"], dflash["batch"]) == (["fast", "fast_tree"], [6], 2)
    assert (dflash["eval_step"]["median"], dflash["rows_seen"]["median"], dflash["train_rows"]["median"]) == (4, 8, 3)
    assert dflash["epochs"]["median"] == pytest.approx(8 / 3)
    assert dflash["tokens_seen"]["median"] == pytest.approx(8 * 12 / 3)
    assert (dflash["seconds"]["median"], dflash["seconds"]["min"], dflash["seconds"]["max"]) == (120, 100, 140)
    mtp = runs["mtp"]
    assert mtp["rows_seen"]["median"] == 80 and mtp["tokens_seen"]["median"] == 80 * 16
    assert mtp["train_rows"] is None and mtp["seconds"] is None  # never timed (reused): untimed, not an error
    assert budget["shared_seconds"]["median"] == pytest.approx(300.5)
    text = bench.budget_markdown(budget)
    assert "| fast, fast_tree | dflash | - | 4 / 6 x 2 | 8 | 3 | 2.7 | 32 | 120 | 100 to 140 |" in text
    assert "| mtp | mtp | - | 10 / 10 x 8 | 80 | - | - | 1280 | reused, untimed | - |" in text
    assert "median 300 s (range 300 to 301 s)" in text and "speculators/issues/1135" in text


def _eval_folder(results, folder, temperatures, **plain):
    """An eval output folder: one report per temperature under an index, as eval writes it."""
    runs = []
    for temperature in temperatures:
        run = copy.deepcopy(results)
        run["settings"]["temperature"] = temperature
        run["plain"].update(plain)
        runs.append((report.temperature_label(temperature), run))
    for label, run in runs:
        write_report(run, folder / label)
    report.write_index(runs, folder)
    return folder


def test_report_puts_drafters_of_two_targets_on_one_page(results, tmp_path, capsys):
    """`draftsmith report`: the demo's real-target drafters and its tiny target's MTP rows, per
    setting, each row priced against its own target's plain decoding."""
    real = _eval_folder(results, tmp_path / "eval" / "real", (0.0, 0.7))
    tiny = copy.deepcopy(results)
    tiny["target"]["path"] = "runs/demo/mtp"
    tiny["drafters"] = [drafter("mtp", 2, 2.0, 1.0, 9.0, 0.8)]
    del tiny["drafters"][0]["bound"]  # eval would have written it against the tiny target's own 5 ms
    tiny_dir = _eval_folder(tiny, tmp_path / "eval" / "tiny", (0.0, 0.7), T_target_ms=5.0, tokens_per_s=200.0)
    out = tmp_path / "report"
    assert main(["report", str(real), str(tiny_dir), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    header = "| drafter | target | D | tau | tokens/s | speedup | bound | " + " | ".join(
        f"accepted {k}" for k in range(1, 5)) + " |"
    assert md.count(header) == 2
    table = md.split(header)[1].split("\n\n")[0].splitlines()[2:]
    assert table == [
        "| plain decoding | `runs/tiny-target` | 0 | 1.00 | 40.0 | 1.00x | - | - | - | - | - |",
        "| eagle3 | `runs/tiny-target` | 3 | 2.50 | 64.0 | 1.60x | 1.84x | 0.90 | 0.81 | 0.73 | - |",
        "| dspark | `runs/tiny-target` | 5 | 3.25 | 84.0 | 2.10x | 2.39x | 0.90 | 0.81 | 0.73 | 0.66 |",
        "| plain decoding (tiny) | `runs/demo/mtp` | 0 | 1.00 | 200.0 | 1.00x | - | - | - | - | - |",
        # 2.0 * 5 / (1 + 9): the tiny target's own step time, not the primary target's 25 ms.
        "| mtp (tiny) | `runs/demo/mtp` | 2 | 2.00 | 32.0 | 0.80x | 1.00x | 0.90 | 0.81 | - | - |"]
    assert "## Greedy" in md and "## Temperature 0.7" in md and "[tiny](../eval/tiny/report.md)" in md
    for label in ("t0", "t0.7"):
        assert all((out / label / plot).read_bytes().startswith(PNG_MAGIC)
                   for plot in ("tau.png", "speedup.png", "acceptance.png"))
    # The combined folder reads back as an eval folder does (scripts/bench_demo.py sums seeds of it).
    runs = read_runs(out)
    assert [d["name"] for d in runs["t0.7"]["drafters"]] == ["eagle3", "dspark", "mtp (tiny)"]
    assert runs["t0"]["drafters"][2]["target_name"] == "runs/demo/mtp" and runs["t0"]["drafters"][2]["report"] == 1

    capsys.readouterr()
    only_greedy = _eval_folder(tiny, tmp_path / "eval" / "greedy", (0.0,))
    assert main(["report", str(real), str(only_greedy), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no t0.7 setting" in err[0] and not (tmp_path / "refused").exists()
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "refused")]) == 2
    assert "no report.json" in capsys.readouterr().err
    # Never written over a report it reads, nor over a (previous report's) folder holding one.
    holder = tmp_path / "holder"
    shutil.copytree(real, holder / "real")
    (holder / "report.json").write_text("{}")
    kept = (real / "report.md").read_text()
    for out, first in ((real, real), (holder, holder / "real")):
        assert main(["report", str(first), str(tiny_dir), "--out", str(out)]) == 2
        assert "writing it would replace it" in capsys.readouterr().err
    assert (real / "report.md").read_text() == kept and (holder / "real" / "report.md").read_text() == kept


def test_report_names_other_reports_by_as_much_of_their_path_as_tells_them_apart(results, tmp_path, capsys):
    first = _eval_folder(results, tmp_path / "a" / "eval", (0.0,))
    second = _eval_folder(results, tmp_path / "b" / "eval", (0.0,))
    assert main(["report", str(first), str(second), "--out", str(tmp_path / "both")]) == 0
    names = [d["name"] for d in read_runs(tmp_path / "both")["t0"]["drafters"]]
    assert names == ["eagle3", "dspark", "eagle3 (b/eval)", "dspark (b/eval)"]


def test_report_refuses_inputs_it_cannot_put_side_by_side(results, tmp_path, capsys):
    real = _eval_folder(results, tmp_path / "real", (0.0, 0.7))
    other = copy.deepcopy(results)
    other["settings"].update(top_p=0.9)
    sampled_otherwise = _eval_folder(other, tmp_path / "other", (0.0, 0.7))
    assert main(["report", str(real), str(_eval_folder(results, tmp_path / "b", (0.0, 0.7))),
                 "--out", str(tmp_path / "combined")]) == 0

    def refused(args, pattern):
        capsys.readouterr()
        assert main(["report", *map(str, args), "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and pattern in err[0], err
        assert not (tmp_path / "refused").exists()

    refused([real, sampled_otherwise], "decoded t0.7 as temperature 0.7, top-p 0.9")
    refused([real, tmp_path / "combined"], "is a combined report: give the eval folders it was made from")
    refused([real, real], "given twice")


def test_reports_written_before_plain_was_named_plain_are_still_read(results, tmp_path):
    """Reports written before plain decoding was named "plain" hold it under "baseline" (its
    figures, each prompt's outputs, a combined report's `others`): `read_runs` and `draftsmith
    report` read them as this version names them."""
    def old(data):
        text = json.dumps(data).replace('"plain": {"tokens_per_s"', '"baseline": {"tokens_per_s"')
        return json.loads(text.replace('"outputs": {"plain"', '"outputs": {"baseline"'))

    new = _eval_folder(results, tmp_path / "new", (0.0,))
    older = _eval_folder(results, tmp_path / "old", (0.0,))
    (older / "t0" / "report.json").write_text(json.dumps(old(read_runs(new)["t0"])))
    assert "baseline" in (older / "t0" / "report.json").read_text()
    assert read_runs(older) == read_runs(new)
    assert main(["report", str(new), str(older), "--out", str(tmp_path / "both")]) == 0
    combined = tmp_path / "both" / "t0" / "report.json"
    combined.write_text(json.dumps(old(json.loads(combined.read_text()))))
    runs = read_runs(tmp_path / "both")["t0"]
    assert runs["plain"] == results["plain"] and runs["others"][0]["plain"] == results["plain"]
    assert runs["prompts"][0]["outputs"]["plain"] == [4, 5]


def test_the_auto_section_shows_what_each_tuning_chose(results, tmp_path):
    """--num-draft auto's table: a drafter whose tuning (eval/proposers/base.py: Tuning) chose
    options with D has their columns and its note; the others show "-" there."""
    curve = [{"d": d, "expected_tokens": 1.0 + d, "pass_ms": 10.0, "tokens_per_s": 100.0 + d} for d in range(6)]
    for d, tuned in zip(results["drafters"], ({}, {"columns": {"threshold": 0.35}, "note": "Chosen with D."})):
        d["num_draft_auto"] = {"chosen": d["num_draft"], "tile_rule_D": 4, "cap": 5, "curve": curve,
                               "predicted_tokens_per_s": 104.5, **tuned}
    md = (write_report(results, tmp_path / "report") / "report.md").read_text()
    assert "\nChosen with D.\n" in md
    assert ("| drafter | chosen D | threshold | predicted tokens/s | tile rule D | predicted tokens/s at it | "
            "measured tokens/s |") in md
    assert "| eagle3 | 3 | - | 104.5 | 4 | 104.0 | 64.0 |" in md and "| dspark | 5 | 0.35 | 104.5 | 4 | 104.0 | 84.0 |" in md
