"""`eval --engine vllm` without vLLM: the engine's counters read as tau, its tokens compared with
ours, its refusals kept as one line in the report, and how each drafter is served, against a
stand-in server (tests/fake_vllm.py). tests/test_engine.py runs the real engine."""

import json
import sys

import pytest

from draftsmith.cli import main
from draftsmith.data.corpus import load_embedded_corpus
from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.eval import engine
from draftsmith.models.target import build_tiny_target
from tiny_runs import ROOT


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    tokenizer = train_tokenizer(load_embedded_corpus("train", max_chars=60_000), vocab_size=300)
    folder = tmp_path_factory.mktemp("target") / "tiny"
    build_tiny_target(vocab_size=len(tokenizer), num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=1
                      ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """DRAFTSMITH_ENGINE_PYTHON as a script: the version probe answers, `-m vllm...` runs the stand-in."""
    script = tmp_path / "engine-python"
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo '["0.0.fake", false, true]'; exit 0; fi
shift 2
exec {sys.executable} {ROOT / 'tests' / 'fake_vllm.py'} "$@"
""")
    script.chmod(0o755)
    monkeypatch.setenv(engine.ENGINE_PYTHON, str(script))
    return script


def run_eval(tiny_dir, out, *drafters):
    return main(["-q", "eval", "--target", str(tiny_dir), "--num-prompts", "2", "--max-new-tokens", "8",
                 "--num-draft", "3", "--temperature", "0", *sum((["--drafter", d] for d in drafters), []),
                 "--engine", "vllm", "--out", str(out)])


def test_the_engine_beside_our_decoder_in_the_report(tiny_dir, fake_engine, tmp_path):
    assert run_eval(tiny_dir, tmp_path / "r", "ngram", "ngram_earliest") == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    plain = report["plain"]["engine"]
    assert plain["engine"] == "vllm 0.0.fake (cpu)" and plain["greedy_equal"] is True and plain["prompts_equal"] == "2/2"
    for d in report["drafters"]:
        record = d["engine"]
        assert record["greedy_equal"] is True and record["tau"] == pytest.approx(1.0), record
        assert record["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 4, "prompt_lookup_min": 1}
        assert record["mean_acceptance_length"] == pytest.approx(1.0) and record["speedup"] > 0
        assert ("earliest" in record.get("note", "")) == (d["name"] == "ngram")
        # the stand-in accepts no draft: every pass of ours that kept one differs (each prompt's last aside)
        ours = [p["accepted"][d["name"]] for p in report["prompts"]]
        assert record["step_check"]["passes_differing"] == sum(a != 0 for steps in ours for a in steps[:-1])
    md = (tmp_path / "r" / "report.md").read_text()
    assert "vLLM tau" in md and "## The serving engine" in md and "yes (2/2)" in md


def test_a_refusing_engine_is_one_line_in_its_row_and_the_report_is_kept(tiny_dir, fake_engine, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_REFUSE", "ngram")
    assert run_eval(tiny_dir, tmp_path / "r", "ngram") == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    refused = report["drafters"][0]["engine"]["refused"]
    assert "Model Runner V1 does not support: ngram speculative decoding" in refused
    assert report["plain"]["engine"]["greedy_equal"] is True  # plain decoding served all the same
    md = (tmp_path / "r" / "report.md").read_text()
    assert "does not support: ngram" in md and "| refused |" in md


def test_no_engine_is_one_line_before_any_decoding(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(engine.ENGINE_PYTHON, str(tmp_path / "no-such-python"))
    assert run_eval(tiny_dir, tmp_path / "r", "ngram") == 2
    assert "does not run" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_counters_are_read_as_our_tau_and_vllms_mean_acceptance_length(monkeypatch):
    text = "\n".join(['# HELP vllm:spec_decode_num_drafts_total drafts', 'vllm:spec_decode_num_drafts_total{engine="0"} 8.0',
                      'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 6.0',
                      'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4.0',
                      'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2.0',
                      'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0',
                      'vllm:iteration_tokens_total_count{engine="0"} 12.0'])
    monkeypatch.setattr(engine, "loopback_get", lambda url: text)
    after = engine.read_counters("http://x")
    assert after["vllm:spec_decode_num_drafts_total"] == 8 and after["per_pos"] == {0: 4.0, 1: 2.0}
    # Two outputs of 9 and 7 tokens: 14 committed past the prefills' tokens in the 12 - 2 = 10
    # steps that were not prefills (the accepted counter also holds drafts accepted past a stop
    # token, which the outputs do not keep); 6 drafts, so vLLM's own figure, over the passes
    # that drafted, is 1 + 6 / 6.
    before = {"per_pos": {}, "vllm:spec_decode_num_drafts_total": 2.0}
    got = engine.figures(after, before, [[1] * 9, [1] * 7], num_draft=2)
    assert got["tau"] == pytest.approx(14 / 10) and got["mean_acceptance_length"] == pytest.approx(1 + 6 / 6)
    assert got["per_position_acceptance"] == pytest.approx([4 / 10, 2 / 10])
    del after[engine.STEPS]  # an engine without the steps histogram: passes from the accepted counter
    assert engine.figures(after, before, [[1] * 9, [1] * 7], num_draft=2)["tau"] == pytest.approx(14 / 8)


def test_a_printed_vllm_line_and_the_stop_token_convention():
    line = """vllm serve /t --dtype float32 --speculative-config '{"method": "eagle3", "model": "/x", "num_speculative_tokens": 3}'"""
    assert engine.parse_vllm_line(line) == ("/t", "float32", {"method": "eagle3", "model": "/x",
                                                              "num_speculative_tokens": 3})
    # whether the stop token comes back is the engine's convention, not another answer
    assert engine.same_tokens([[5, 6, 2], [5, 7]], [[5, 6, 2, 9], [5, 6]], {2}) == [True, False]


def test_a_variant_the_engine_does_not_draft_is_one_line(tmp_path):
    (served,) = engine.served_for(f"eagle3_tree:{tmp_path}", 3, tmp_path, every_layout=True)
    assert "no engine equivalent" in served.refused and served.speculative_config is None


def test_every_vllm_layout_a_method_declares_is_one_of_its_exports():
    from draftsmith.registry import METHODS

    for spec in METHODS.values():
        assert set(spec.vllm_layouts) <= set(spec.exports), spec.name
        assert set(spec.vllm_variants) <= set(spec.variants), spec.name
        assert not (spec.vllm_layouts and spec.vllm_config), spec.name


def test_the_engines_own_words_are_found_in_its_log(tmp_path):
    from draftsmith.data.local_server import why_it_failed

    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) WARNING 12-07 [x.py:1] OSError: [Errno 24] survived\n"
                   "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                   "  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error, "
                   "input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]\n"
                   "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert why_it_failed(log, "-") == "Model Runner V1 does not support: dspark speculative decoding"
    log.write_text("Traceback (most recent call last):\n  File \"x\"\ntorch.OutOfMemoryError: no room\n")
    assert why_it_failed(log, "-") == "OutOfMemoryError: no room"
    assert why_it_failed(tmp_path / "none.log", "no log") == "no log"


def test_a_cpu_engine_serves_eager_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(engine.ENGINE_ARGS, raising=False)
    assert engine.server_flags({"device": "cpu"}) == ["--enforce-eager"]
    assert engine.server_flags({"device": "cuda"}) == []
    monkeypatch.setenv(engine.ENGINE_ARGS, "-tp 8 --max-num-seqs 4")
    assert engine.server_flags({"device": "cpu"}) == ["-tp", "8", "--max-num-seqs", "4"]
    monkeypatch.setenv(engine.ENGINE_ARGS, "")
    assert engine.server_flags({"device": "cpu"}) == []  # set but empty: the export line alone


def test_passes_are_matched_by_where_they_start_and_the_last_is_left_out():
    assert engine.step_differences([[1, 2, 7], [3]], [[1, 2, 5], [3]]) == {
        "passes_compared": 2, "passes_differing": 0, "passes_out_of_step": 0, "first_difference": None}
    # the engine accepts 0 where we accept 2 at token 2, then catches up: both pass at token 5
    got = engine.step_differences([[1, 0, 1, 3, 1]], [[1, 2, 3, 1]])
    assert got == {"passes_compared": 3, "passes_differing": 1, "passes_out_of_step": 1,
                   "first_difference": {"prompt": 0, "position": 2, "ours": 2, "engine": 0}}
    # out of step for good: only the passes that start together are compared
    got = engine.step_differences([[3, 3, 3]], [[2, 2, 2, 2]])
    assert got["passes_compared"] == 1 and got["passes_differing"] == 1 and got["passes_out_of_step"] == 1 + 2
    assert engine.step_differences([None], [[1]]) is None


def test_a_crash_at_one_temperature_keeps_the_others_records(tiny_dir, fake_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_CRASH_TOP_K", "1")
    assert main(["-q", "eval", "--target", str(tiny_dir), "--num-prompts", "1", "--max-new-tokens", "6",
                 "--num-draft", "2", "--temperature", "0", "--temperature", "0.7", "--top-k", "20",
                 "--drafter", "ngram", "--engine", "vllm", "--out", str(tmp_path / "r")]) == 0
    greedy = json.loads((tmp_path / "r" / "t0" / "report.json").read_text())["drafters"][0]["engine"]
    sampled = json.loads((tmp_path / "r" / "t0.7" / "report.json").read_text())["drafters"][0]["engine"]
    assert greedy["greedy_equal"] is True and "refused" not in greedy
    # the root cause from the engine's log, not its front end's "see the stack trace above"
    assert sampled["refused"].startswith("RuntimeError: index -16 is out of bounds"), sampled
