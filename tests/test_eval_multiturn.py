"""Eval beside published figures: every user turn decoded, the second after the target's own
answer to the first (as Spec-Bench and EAGLE score MT-bench), benchmarks by name through
`datasets` (here from an offline hub cache), and the chat settings in every report."""

import json

import pytest

from chat_fixtures import save_tiny_chat_target
from draftsmith.cli import main
from hub_fixtures import add_repo, parquet


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    _, tokenizer = save_tiny_chat_target("qwen3", folder, arch="qwen3")
    return folder, tokenizer


pytestmark = pytest.mark.usefixtures("datasets_cache")  # a datasets cache of each test's own


def run_eval(target, out, *extra):
    assert main(["eval", "--target", str(target), "--drafter", "ngram", "--max-new-tokens", "6",
                 "--out", str(out), *extra]) == 0
    return json.loads((out / "report.json").read_text())


def test_every_turn_is_decoded_after_the_targets_own_answer(qwen3_target, tmp_path):
    folder, tokenizer = qwen3_target
    asked = tmp_path / "mt.jsonl"
    asked.write_text('{"turns": ["What is two plus two?", "And squared?"]}\n{"turns": ["Say hi."]}\n'
                     '{"turns": ["unused"]}\n')
    report = run_eval(folder, tmp_path / "r", "--dataset", str(asked), "--num-prompts", "2")
    settings = report["settings"]
    assert (settings["num_prompts"], settings["conversations"], settings["enable_thinking"]) == (3, 2, False)
    prompts = [p["prompt_ids"] for p in report["prompts"]]
    first_answer = report["prompts"][0]["outputs"]["plain"]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = tokenizer.decode(first_answer[:first_answer.index(stop)] if stop in first_answer else first_answer,
                              skip_special_tokens=True)
    history = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "And squared?"}]
    expected = tokenizer.apply_chat_template(history, add_generation_prompt=True, enable_thinking=False,
                                             tokenize=False)
    assert tokenizer.decode(prompts[1]) == expected and expected.endswith("<think>\n\n</think>\n\n")
    assert tokenizer.decode(prompts[2]).startswith("<|im_start|>user\nSay hi.<|im_end|>")
    # The report states the thinking mode; asked for, the prompts change with it.
    on = run_eval(folder, tmp_path / "on", "--dataset", str(asked), "--num-prompts", "1", "--enable-thinking")
    assert on["settings"]["enable_thinking"] is True
    assert tokenizer.decode(on["prompts"][0]["prompt_ids"]).endswith("<|im_start|>assistant\n")


GSM8K_README = b"""---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: test
    path: socratic/test-*
---
"""


def test_benchmarks_by_name_through_datasets(qwen3_target, hub_cache, tmp_path):
    folder, tokenizer = qwen3_target
    add_repo(hub_cache, "HuggingFaceH4/mt_bench_prompts", {"data/train-00000-of-00001.parquet": parquet(
        {"prompt": [["Write a haiku.", "Now in French."], ["Explain DNS.", "Shorter."]],
         "prompt_id": [81, 82], "category": ["writing", "stem"]})}, repo_type="dataset")
    add_repo(hub_cache, "openai/gsm8k", {
        "README.md": GSM8K_README,
        "main/train-00000-of-00001.parquet": parquet({"question": ["train q"], "answer": ["1"]}),
        "main/test-00000-of-00001.parquet": parquet({"question": ["Tom has 2 apples."], "answer": ["2"]}),
        "socratic/test-00000-of-00001.parquet": parquet({"question": ["socratic q"], "answer": ["3"]}),
    }, repo_type="dataset")
    mt = run_eval(folder, tmp_path / "mt", "--dataset", "mt-bench", "--num-prompts", "2")
    assert (mt["settings"]["num_prompts"], mt["settings"]["conversations"]) == (4, 2)
    assert "Now in French." in tokenizer.decode(mt["prompts"][1]["prompt_ids"])
    gsm = run_eval(folder, tmp_path / "gsm", "--dataset", "gsm8k")
    text = tokenizer.decode(gsm["prompts"][0]["prompt_ids"])
    assert "Tom has 2 apples.\nPlease reason step by step, and put your final answer within \\boxed{}." in text


def test_bad_eval_input_is_one_line_before_any_decoding(qwen3_target, hub_cache, tmp_path, capsys):
    folder, _ = qwen3_target
    llama = tmp_path / "llama"
    save_tiny_chat_target("llama31", llama)
    asked = tmp_path / "a.jsonl"
    asked.write_text('{"turns": ["Hi"]}\n')
    cases = [
        (["--target", str(folder), "--dataset", "humaneval"], "dataset openai/openai_humaneval: not a local path"),
        (["--target", str(llama), "--dataset", str(asked), "--no-enable-thinking"],
         "data.enable_thinking=false: the chat template has no enable_thinking switch"),
        (["--target", str(folder), "--dataset", str(asked), "--chat-template", str(tmp_path / "none.jinja")],
         "none.jinja: no such file, nor a built-in"),
    ]
    for args, message in cases:
        out = tmp_path / "report"
        assert main(["eval", *args, "--drafter", "ngram", "--out", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
        assert not out.exists()
