"""`draftsmith eval` end to end on tiny trained runs: the report, the lossless check, and
bad input that stops before anything is written."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.eval.report import loops
from draftsmith.train.loop import train
from tiny_runs import tiny_recipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train(tiny_recipe("mtp", root / "mtp", train__max_steps=30, train__validation_every=100, train__save_every=100))
    train(tiny_recipe("draft_lm", root / "draft_lm", target__path=str(root / "mtp"), train__max_steps=20,
                      train__validation_every=100, train__save_every=100, method__hidden_size=32, method__num_heads=2))
    return root


def eval_args(runs, out, *extra):
    return ["eval", "--target", str(runs / "mtp"), "--out", str(out), "--num-prompts", "2",
            "--max-new-tokens", "12", *extra]


def test_report_compares_drafters_side_by_side(runs, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(eval_args(runs, out, "--drafter", "ngram", "--drafter", f"draft_lm:{runs / 'draft_lm'}",
                          "--drafter", f"mtp:{runs / 'mtp'}", "--num-draft", "3"))
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    names = [d["name"] for d in report["drafters"]]
    assert names == ["ngram", "draft_lm", "mtp"]
    for d in report["drafters"]:
        assert 1.0 <= d["tau"] <= 4.0 and d["num_draft"] == 3
        assert len(d["per_position_acceptance"]) == 3 and sum(d["accepted_length_hist"]) == d["verify_passes"]
    # G = 4 query heads over 1 KV head: the tile rule would give 128 // 4 - 1 = 31.
    assert report["target"]["G"] == 4
    for prompt in report["prompts"]:
        outs = prompt["outputs"]
        assert outs["ngram"] == outs["plain"] == outs["mtp"] == outs["draft_lm"]
        assert prompt["loops"] == loops(outs["plain"])
    # tau over all prompts and over those whose plain text does not loop, from the per-prompt steps.
    assert report["plain"]["looping_prompts"] == sum(p["loops"] for p in report["prompts"])
    for d in report["drafters"]:
        steps = [p["steps"][d["name"]] for p in report["prompts"]]
        assert d["tau"] == pytest.approx(sum(c for c, _ in steps) / sum(v for _, v in steps))
        kept = [s for s, p in zip(steps, report["prompts"]) if not p["loops"]]
        assert d["tau_no_loop"] == (pytest.approx(sum(c for c, _ in kept) / sum(v for _, v in kept)) if kept else None)
    printed = capsys.readouterr().out
    assert "| ngram" in printed and "report.md" in printed
    assert (out / "report.md").is_file() and (out / "acceptance.png").stat().st_size > 0


def test_greedy_and_sampled_reports_side_by_side(runs, tmp_path):
    out = tmp_path / "both"
    assert main(eval_args(runs, out, "--drafter", f"mtp:{runs / 'mtp'}", "--drafter", "ngram",
                          "--temperature", "0", "--temperature", "1.0", "--num-draft", "2")) == 0
    index = json.loads((out / "report.json").read_text())["runs"]
    assert set(index) == {"t0", "t1"}
    assert json.loads((out / "t1" / "report.json").read_text())["settings"]["temperature"] == 1.0
    front = (out / "report.md").read_text()
    assert "Greedy" in front and "Temperature 1" in front and "t1/report.md" in front


def test_labels_name_two_checkpoints_of_one_method(runs, tmp_path):
    out = tmp_path / "labels"
    assert main(eval_args(runs, out, "--drafter", f"mtp:{runs / 'mtp'}", "--drafter", f"mtp_k1=mtp_nextn:{runs / 'mtp'}",
                          "--drafter", "lookup=ngram", "--num-draft", "2")) == 0
    rows = json.loads((out / "report.json").read_text())["drafters"]
    assert [(r["name"], r["drafter"]) for r in rows] == [
        ("mtp", f"mtp:{runs / 'mtp'}"), ("mtp_k1", f"mtp_k1=mtp_nextn:{runs / 'mtp'}"), ("lookup", "lookup=ngram")]


@pytest.mark.parametrize("make_args, message", [
    (lambda r: ["--drafter", "medusa"], "unknown name 'medusa'"),
    (lambda r: ["--drafter", f"mtp:{r / 'draft_lm'}"], "has no MTP modules"),
    (lambda r: ["--drafter", "draft_lm"], "needs a path"),
    (lambda r: ["--drafter", f"draft_lm:{r / 'nowhere'}"], "not found"),
    (lambda r: ["--drafter", "ngram", "--max-new-tokens", "100000"], "exceeds the target's context"),
    (lambda r: ["--drafter", "ngram", "--min-prompt-tokens", "100000"], "--min-prompt-tokens 100000: 0 of 16"),
    (lambda r: ["--drafter", "ngram", "--min-prompt-tokens", "-1"], "--min-prompt-tokens"),
])
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, capsys, make_args, message):
    out = tmp_path / "report"
    assert main(eval_args(runs, out) + make_args(runs)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_long_context_eval_takes_only_prompts_of_the_length_asked(runs, tmp_path):
    """--min-prompt-tokens: long prompts only (a sliding-window drafter's test), of the embedded
    excerpts and of a conversation dataset's first turns alike, and the report says so."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"turns": [text]}) + "\n" for text in ("hi", "tell me " * 40, "ok " * 3)))
    for dataset, count, longest in (("embedded", "2", "60"), (str(chats), "1", "30")):
        out = tmp_path / f"r{count}"
        assert main(eval_args(runs, out, "--drafter", "ngram", "--dataset", dataset, "--min-prompt-tokens", longest,
                              "--num-prompts", count, "--prompt-chars", "400")) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["settings"]["min_prompt_tokens"] == int(longest)
        assert all(len(p["prompt_ids"]) >= int(longest) for p in report["prompts"]) and report["prompts"]


def test_bad_datasets_are_named(runs, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"question": "hi"}\n')
    for data, message in ((empty, "empty"), (odd, "question")):
        assert main(eval_args(runs, tmp_path / "r", "--drafter", "ngram", "--dataset", str(data))) == 2
        err = capsys.readouterr().err
        assert message in err and str(data) in err
    assert not (tmp_path / "r").exists()


def test_a_draft_model_with_another_vocabulary_is_refused(runs, tmp_path, capsys):
    other = tmp_path / "other"
    train(tiny_recipe("draft_lm", other, target__path="", method__distill_weight=0.0, data__vocab_size=300,
                      train__max_steps=1, method__hidden_size=32, method__num_heads=2))
    assert main(eval_args(runs, tmp_path / "r", "--drafter", f"draft_lm:{other}")) == 2
    assert "must share the target's tokenizer" in capsys.readouterr().err


def test_a_recipes_eval_section_gives_the_defaults_and_flags_win(runs, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval:\n  num_prompts: 1\n  max_new_tokens: 5\n  num_draft: 2\n")
    out = tmp_path / "from_recipe"
    assert main(["eval", "--target", str(runs / "mtp"), "--out", str(out), "--recipe", str(recipe),
                 "--drafter", "ngram"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["num_prompts"] == 1 and report["settings"]["max_new_tokens"] == 5
    assert report["target"]["D"] == 2
    out2 = tmp_path / "flags_win"
    assert main(["eval", "--target", str(runs / "mtp"), "--out", str(out2), "--recipe", str(recipe),
                 "--drafter", "ngram", "--num-prompts", "2"]) == 0
    assert json.loads((out2 / "report.json").read_text())["settings"]["num_prompts"] == 2


def _latency_table(runs, tmp_path, rows, device_type="cpu", **shape):
    """A hand-made latency table of the mtp run's target (verify_ms per d at one context)."""
    from draftsmith.models.latency import TABLE_FORMAT
    from draftsmith.models.target import load_target, target_shape

    s = target_shape(load_target(runs / "mtp" / "model").config)
    table = {"format": TABLE_FORMAT, "version": 1, "target": "mtp", "device": "test", "device_type": device_type,
             "dtype": "float32", "attention": "sdpa", "cache": "dynamic", "torch": "x", "transformers": "x",
             "reps": 1, "head_ms": 0.0, "contexts": [64], "drafts": list(range(len(rows))), "verify_ms": [rows],
             "shape": {"layers": s.num_layers, "hidden": s.hidden_size, "heads": s.num_heads,
                       "kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "vocab": s.vocab_size, **shape}}
    path = tmp_path / f"latency-{len(rows)}-{device_type}.json"
    path.write_text(json.dumps(table))
    return path


def test_num_draft_auto_picks_each_drafters_d_from_its_calibration(runs, tmp_path):
    # Verify costs 1 ms up to two drafts, then 1000 ms: no acceptance pays for a third draft.
    table = _latency_table(runs, tmp_path, [1.0, 1.0, 1.0] + [1000.0] * 37)
    out = tmp_path / "auto"
    assert main(eval_args(runs, out, "--drafter", "ngram", "--drafter", f"mtp:{runs / 'mtp'}", "--num-draft", "auto",
                          "--latency-table", str(table), "--calibration-prompts", "2")) == 0
    report = json.loads((out / "report.json").read_text())
    how = report["num_draft_auto"]
    assert "validation split" in how["calibration"] and how["calibration_prompts"] == 2
    assert how["tile_rule_D"] == report["target"]["D"] == 31 and how["cap"] == 39  # CPU: the table's d, no tile
    for row in report["drafters"]:
        auto = row["num_draft_auto"]
        assert row["num_draft"] == auto["chosen"] <= 2 and len(row["per_position_acceptance"]) == row["num_draft"]
        assert auto["tile_rule_D"] == 31 and [p["d"] for p in auto["curve"]] == list(range(40))
        best = max(auto["curve"], key=lambda p: p["tokens_per_s"])
        assert best["d"] == auto["chosen"] and len(auto["acceptance"]) == 39
        assert set(auto["draft_and_host_ms"]) == {"1", "39"}
    md = (out / "report.md").read_text()
    assert "--num-draft auto" in md and "num_draft.png" in md
    assert (out / "num_draft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_num_draft_auto_calibrates_on_every_turn_of_conversations_after_the_evaluated(runs, tmp_path):
    """Later turns (rework the answer) are where copying drafters accept: calibrating on first
    turns alone would price them low. Each calibration conversation is decoded as eval decodes
    one, every turn after the target's own answers to the turns before it."""
    table = _latency_table(runs, tmp_path, [1.0] * 40)
    data = tmp_path / "two_turns.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"question {i}", "say it again"]}) + "\n" for i in range(4)))
    out = tmp_path / "auto"
    assert main(eval_args(runs, out, "--drafter", "ngram", "--num-draft", "auto", "--dataset", str(data),
                          "--num-prompts", "1", "--calibration-prompts", "2", "--latency-table", str(table))) == 0
    how = json.loads((out / "report.json").read_text())["num_draft_auto"]
    assert how["calibration"].startswith("every turn of conversations 2..3") and how["calibration_prompts"] == 4


def _tuned(runs, tmp_path, drafter: str) -> tuple[dict, str]:
    """(report.json row, report.md) of `drafter` evaluated at --num-draft auto against a table
    whose verify costs 1 + d / 2 ms."""
    table = _latency_table(runs, tmp_path, [1.0 + 0.5 * d for d in range(40)])
    out = tmp_path / "auto"
    assert main(eval_args(runs, out, "--drafter", drafter, "--num-draft", "auto", "--latency-table", str(table),
                          "--calibration-prompts", "2")) == 0
    return json.loads((out / "report.json").read_text())["drafters"][0], (out / "report.md").read_text()


def test_num_draft_auto_chooses_dsparks_threshold_with_its_d(runs, tmp_path):
    """DSpark's confidence head can end a draft early: auto prices each calibration pass at the
    length every threshold would leave, picks the pair, and the evaluated drafter uses it."""
    from draftsmith.models.dspark import DSparkConfig, DSparkDrafter
    from draftsmith.models.native import save_drafter
    from draftsmith.models.target import load_target

    target = load_target(runs / "mtp" / "model")
    config = DSparkConfig.from_target(target.config, mask_token_id=3, num_layers=1, num_context_layers=1,
                                      block_size=5, markov_rank=4, confidence_threshold=0.97)  # not on the grid
    native = save_drafter(DSparkDrafter(config), tmp_path / "dspark", extra={"target": str(runs / "mtp" / "model")})
    row, md = _tuned(runs, tmp_path, f"dspark:{native}")
    auto = row["num_draft_auto"]
    assert [p["confidence_threshold"] for p in auto["threshold_curve"]] == [round(0.05 * i, 2) for i in range(20)]
    best = max(auto["threshold_curve"], key=lambda p: p["tokens_per_s"])
    assert auto["predicted_tokens_per_s"] == best["tokens_per_s"] and auto["chosen"] == row["num_draft"]
    # what the evaluated drafter used (its checkpoint's own 0.97 is not on the grid)
    assert row["extra"]["confidence_threshold"] == auto["confidence_threshold"] != 0.97
    assert "| threshold |" in md


def test_num_draft_auto_chooses_the_trees_width_and_depth_with_its_d(runs, tmp_path):
    """The EAGLE-2 tree: auto prices every (topk, depth, D) on the calibration's recorded trees
    and the evaluated drafter drafts the best of them."""
    from draftsmith.models.eagle3 import Eagle3Drafter
    from draftsmith.models.native import save_drafter
    from draftsmith.models.target import load_target

    deep = tmp_path / "runs"  # EAGLE-3 reads three layers of a target of four or more
    train(tiny_recipe("mtp", deep / "mtp", target__num_layers=4, train__max_steps=4))
    target = load_target(deep / "mtp" / "model")
    native = save_drafter(Eagle3Drafter.from_target(target), tmp_path / "eagle3",
                          extra={"target": str(deep / "mtp" / "model")})
    row, md = _tuned(deep, tmp_path, f"eagle3_tree:{native}")
    auto = row["num_draft_auto"]
    best = auto["tree_curve"][0]
    assert best == max(auto["tree_curve"], key=lambda p: p["tokens_per_s"]) and auto["passes_priced"] > 0
    assert auto["chosen"] == row["num_draft"] == best["d"] and auto["predicted_tokens_per_s"] == best["tokens_per_s"]
    assert auto["options"] == ({"topk": best["topk"], "depth": best["depth"]} if best["d"] else {})
    assert "| topk |" in md and "width (topk), depth and node budget" in md


def test_num_draft_auto_refuses_a_table_of_another_target_or_device(runs, tmp_path, capsys):
    for table, message in ((_latency_table(runs, tmp_path, [1.0] * 40, layers=99), "measured for a target"),
                           (_latency_table(runs, tmp_path, [1.0] * 41, device_type="cuda"), "measured on test")):
        assert main(eval_args(runs, tmp_path / "r", "--drafter", "ngram", "--num-draft", "auto",
                              "--latency-table", str(table))) == 2
        assert message in capsys.readouterr().err
    assert main(eval_args(runs, tmp_path / "r", "--drafter", "ngram", "--latency-table", str(table))) == 2
    assert "give both or neither" in capsys.readouterr().err
    # A conversation dataset calibrates on the conversations after the evaluated ones: there must be some.
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(3)))
    assert main(eval_args(runs, tmp_path / "r", "--drafter", "ngram", "--num-draft", "auto", "--dataset",
                          str(data))) == 2
    assert "left for the 4 calibration prompts" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
