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
        "baseline": {"tokens_per_s": 40.0, "T_target_ms": 25.0},
        "drafters": [
            drafter("eagle3", 3, 2.5, 4.0, 30.0, 1.6),
            drafter("dspark", 5, 3.25, 3.0, 31.0, 2.1, extra={"early_stop_rate": 0.125}),
        ],
        "prompts": [{"prompt_ids": [1, 2, 3], "outputs": {"baseline": [4, 5], "eagle3": [4, 5], "dspark": [4, 5]}}],
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
    results["baseline"].update(distinct_4gram=0.4, looping_prompts=3)
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
            run["baseline"].update(distinct_4gram=0.5 + seed / 10, looping_prompts=seed)
            for row, tau in zip(run["drafters"], taus):
                row["tau"] = tau + temperature
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
    assert "| eagle3 | 3.00 | 2.00 to 4.00 | 2.00 4.00 3.00 | 1.50 | 1.00 to 2.00 | 1.00 2.00 1.50 |" in text
    assert "Prompts whose plain text loops, per seed: 0 1 2." in text
    assert "median 650 s" in text
    del per_seed[2]["t0"]["drafters"][0]  # a drafter missing from one seed is an error, not a gap
    with pytest.raises(ValueError, match="eagle3 is missing"):
        bench.summarize(per_seed)


def _eval_folder(results, folder, temperatures, **baseline):
    """An eval output folder: one report per temperature under an index, as eval writes it."""
    runs = []
    for temperature in temperatures:
        run = copy.deepcopy(results)
        run["settings"]["temperature"] = temperature
        run["baseline"].update(baseline)
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
