"""`draftsmith data prepare NAME`: the references' training sets, read offline from a hub
cache holding small fixtures with each dataset's own files, splits and columns."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.data.prepare import SOURCES, prepare
from draftsmith.errors import DraftsmithError
from hub_fixtures import add_repo, parquet

pytestmark = pytest.mark.usefixtures("datasets_cache")  # a datasets cache of each test's own


def turn(who, text):
    return {"from": who, "value": text}


# ShareGPT (Aeala/ShareGPT_Vicuna_unfiltered): one JSON array at the repository's root.
SHAREGPT = [
    {"id": "a", "conversations": [turn("human", "Hi"), turn("gpt", "Hello."), turn("human", "More?"),
                                  turn("chatgpt", "Sure.")]},
    {"id": "b", "conversations": [turn("system", "Be brief."), turn("human", "Name one."), turn("bing", "One.")]},
    {"id": "c", "conversations": [turn("human", "Run it"), turn("tool", "done")]},  # unmappable: skipped
    {"id": "d", "conversations": [turn("user", "Why?"), turn("bard", "Because.")]},
]
# UltraChat-200k: parquet shards per split under data/, OpenAI messages.
ULTRACHAT = {"prompt": ["Q1", "Q2"], "prompt_id": ["1", "2"],
             "messages": [[{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
                          [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"},
                           {"role": "user", "content": "Q3"}, {"role": "assistant", "content": "A3"}]]}
# open-perfectblend (DeepSpec's DSpark data): ShareGPT turns in parquet, with their source.
PERFECTBLEND = {"conversations": [[turn("human", "2+2?"), turn("gpt", "4")],
                                  [turn("human", "Code?"), turn("gpt", "print(1)")]],
                "source": ["math", "code"]}


def fill(cache):
    add_repo(cache, SOURCES["sharegpt"].hub_id,
             {"ShareGPT_V4.3_unfiltered_cleaned_split.json": json.dumps(SHAREGPT).encode(),
              "README.md": b"---\nlicense: apache-2.0\n---\nShareGPT\n"}, repo_type="dataset")
    other = {"prompt": ["X"], "prompt_id": ["9"], "messages": [[{"role": "user", "content": "X"}]]}
    add_repo(cache, SOURCES["ultrachat"].hub_id,
             {"data/train_sft-00000-of-00001.parquet": parquet(ULTRACHAT),
              "data/test_sft-00000-of-00001.parquet": parquet(other),
              "data/train_gen-00000-of-00001.parquet": parquet(other)}, repo_type="dataset")
    add_repo(cache, SOURCES["perfectblend"].hub_id,
             {"data/train-00000-of-00001.parquet": parquet(PERFECTBLEND)}, repo_type="dataset")


def read(path):
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_each_dataset_prepared_from_the_hub_cache_as_messages(hub_cache, tmp_path, caplog):
    fill(hub_cache)
    sharegpt = read(prepare("sharegpt", tmp_path / "sharegpt.jsonl"))
    assert sharegpt == [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Sure."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name one."},
         {"role": "assistant", "content": "One."}],
        [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}],
    ]
    assert "skipped 1 of 4 records" in caplog.text  # a warning, however logging was set up before
    assert read(prepare("ultrachat", tmp_path / "ultrachat.jsonl")) == ULTRACHAT["messages"]  # train_sft only
    assert read(prepare("perfectblend", tmp_path / "blend.jsonl", limit=1)) == [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]


def test_command_line_and_a_local_copy(hub_cache, tmp_path, capsys):
    fill(hub_cache)
    out = tmp_path / "u.jsonl"
    assert main(["data", "prepare", "ultrachat", "--out", str(out), "--limit", "1"]) == 0
    assert read(out) == ULTRACHAT["messages"][:1] and f"wrote {out}" in capsys.readouterr().out
    # --source: a copy laid out as the hub serves it (here: the cached snapshot itself).
    copy = next((hub_cache / "datasets--mlabonne--open-perfectblend" / "snapshots").iterdir())
    assert len(read(prepare("perfectblend", tmp_path / "b.jsonl", source=copy))) == 2


def test_bad_input_is_one_line_and_writes_nothing(hub_cache, tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    with pytest.raises(DraftsmithError) as err:
        prepare("ultrachat", out)
    assert str(err.value).startswith("dataset HuggingFaceH4/ultrachat_200k: not a local path, and not in the "
                                     f"Hugging Face cache ({hub_cache}); offline")
    with pytest.raises(DraftsmithError, match="unknown dataset 'alpaca' \\(known: sharegpt, ultrachat, perfectblend\\)"):
        prepare("alpaca", out)
    with pytest.raises(DraftsmithError, match="--source .*: no such folder"):
        prepare("sharegpt", out, source=tmp_path / "nowhere")
    assert main(["data", "prepare", "sharegpt", "--out", str(out)]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "not in the Hugging Face cache" in err_lines[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "datasets-cache") == ["hf-hub"]
