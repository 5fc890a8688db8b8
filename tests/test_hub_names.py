"""Hub names wherever a path is taken (targets, `plan`, `eval --drafter METHOD:ORG/NAME`,
`data.dataset`), resolved offline through a Hugging Face cache laid out as huggingface_hub
writes it (tests/hub_fixtures.py)."""

import json

import pytest

from chat_fixtures import save_tiny_chat_target
from draftsmith.cli import main
from draftsmith.data.conversations import load_conversations
from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers import parse_drafter_arg
from draftsmith.models.model_dir import find_model_dir
from hub_fixtures import add_folder, add_repo


@pytest.fixture
def cached_target(hub_cache, tmp_path):
    model, tokenizer = save_tiny_chat_target("llama31", tmp_path / "made")
    return add_folder(hub_cache, "meta-tiny/Llama-3.1-tiny-Instruct", tmp_path / "made"), model


def test_target_and_plan_by_hub_name(cached_target, capsys):
    snapshot, model = cached_target
    name = "meta-tiny/Llama-3.1-tiny-Instruct"
    assert find_model_dir(name) == snapshot == find_model_dir(name, require="target")
    assert main(["plan", name]) == 0
    assert "H = 4 query, KV = 1\nG      4\n" in capsys.readouterr().out


def test_names_not_in_the_cache_offline_are_one_line(hub_cache, capsys):
    assert find_model_dir("nobody/nothing") == "nobody/nothing"  # left for the loader to name
    with pytest.raises(DraftsmithError) as err:
        find_model_dir("nobody/nothing", require="target")
    assert str(err.value).startswith("target nobody/nothing: no such folder (a model folder or a training run "
                                     "folder), nor a hub model: not a local path, and not in the Hugging Face cache")
    with pytest.raises(DraftsmithError, match="drafter 'eagle3:nobody/drafter': nobody/drafter not found"):
        parse_drafter_arg("eagle3:nobody/drafter")
    assert main(["plan", "nobody/nothing"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "not in the local Hugging Face cache" in lines[0]


def test_eval_with_a_hub_target_and_a_published_drafter_by_name(cached_target, hub_cache, tmp_path):
    from draftsmith.models.eagle3 import Eagle3Drafter
    from draftsmith.models.native import save_drafter

    _, model = cached_target
    drafter = save_drafter(Eagle3Drafter.from_target(model, draft_vocab_size=64), tmp_path / "drafter")
    add_folder(hub_cache, "someone/EAGLE3-tiny", drafter)
    assert parse_drafter_arg("eagle3:someone/EAGLE3-tiny")[1] == next((hub_cache / "models--someone--EAGLE3-tiny" / "snapshots").iterdir())
    prompts = tmp_path / "asked.jsonl"
    prompts.write_text('{"turns": ["What is two plus two?", "And squared?"]}\n')
    out = tmp_path / "report"
    assert main(["eval", "--target", "meta-tiny/Llama-3.1-tiny-Instruct", "--drafter", "eagle3:someone/EAGLE3-tiny",
                 "--dataset", str(prompts), "--max-new-tokens", "6", "--num-draft", "3", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["num_prompts"] == 2 and report["drafters"][0]["tau"] >= 1.0


def test_data_dataset_by_hub_name(hub_cache, datasets_cache):
    record = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    add_repo(hub_cache, "someone/chats", {"data/train.jsonl": (json.dumps(record) + "\n").encode()},
             repo_type="dataset")
    assert load_conversations("someone/chats") == [record["messages"]]
    with pytest.raises(DraftsmithError, match="dataset someone/other: not a local path, and not in the Hugging Face"):
        load_conversations("someone/other")


def test_a_text_corpus_by_hub_name(hub_cache, datasets_cache):
    from draftsmith.data.corpus import load_text_dataset

    add_repo(hub_cache, "someone/corpus", {"train.jsonl": b'{"text": "one"}\n{"text": "two"}\n'}, repo_type="dataset")
    assert load_text_dataset("someone/corpus") == ["one", "two"]
