import json
from pathlib import Path

import pytest

from draftsmith.data import conversations
from draftsmith.data.conversations import first_user_prompts, load_conversations
from draftsmith.errors import DraftsmithError

# The shared evaluation prompts (Spec-Bench `turns` shape): file -> (records, turns each).
SHARED_EVAL = Path("/work/shared/eval")
EVAL_FILES = {"gsm8k-200.jsonl": (200, 1), "humaneval.jsonl": (164, 1), "mt-bench.jsonl": (80, 2)}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("name", sorted(EVAL_FILES))
def test_spec_bench_eval_files(name, tmp_path):
    records, turns = EVAL_FILES[name]
    path = SHARED_EVAL / name
    if not path.is_file():  # not on this machine: the same check on a sample of that shape
        records = 3
        sample = [{"turns": [f"question {i}, turn {t}" for t in range(turns)]} for i in range(records)]
        path = write_jsonl(tmp_path / name, sample)
    convs = load_conversations(path)
    assert len(convs) == records
    assert all(len(c) == turns and all(m["role"] == "user" and m["content"] for m in c) for c in convs)
    prompts = first_user_prompts(convs)
    assert prompts[0] == convs[0][0]["content"]
    assert len(load_conversations(path, limit=2)) == 2


def test_sharegpt(tmp_path):
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"id": "a", "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello."},
        ]},
    ])
    assert load_conversations(path) == [[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]]
    assert first_user_prompts(load_conversations(path)) == ["Hi"]


def test_openai_messages_in_a_json_array(tmp_path):
    # Mixed content types (text and parts) must not turn the reply "4" into a number.
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hello"}, {"type": "text", "text": " there"},
        ]}]},
    ]))
    convs = load_conversations(path)
    assert convs[0] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert convs[1] == [{"role": "user", "content": "Hello there"}]


def test_prompt_and_mixed_shapes(tmp_path):
    # Columns that do not fit one arrow table fall back to the plain reader.
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "one"}, {"turns": ["two", "three"]}])
    assert load_conversations(path) == [
        [{"role": "user", "content": "one"}],
        [{"role": "user", "content": "two"}, {"role": "user", "content": "three"}],
    ]


def test_loads_through_datasets(tmp_path, monkeypatch):
    def refuse(path):
        raise AssertionError("plain reader used")

    monkeypatch.setattr(conversations, "_read_plain", refuse)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert first_user_prompts(load_conversations(path, limit=1)) == ["a"]


def test_missing_file(tmp_path):
    with pytest.raises(DraftsmithError, match="nope.jsonl: conversation file not found"):
        load_conversations(tmp_path / "nope.jsonl")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DraftsmithError, match="empty.jsonl: no records"):
        load_conversations(path)


def test_unknown_shape_names_keys_and_shapes(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DraftsmithError) as err:
        load_conversations(path)
    message = str(err.value)
    assert "odd.jsonl" in message and "keys answer, question" in message
    assert "turns, conversations, messages, prompt" in message and "\n" not in message


@pytest.mark.parametrize("speaker", ["human", "user", "gpt", "chatgpt", "bing", "bard", "assistant", "system"])
def test_sharegpt_speakers_as_specforge_maps_them(tmp_path, speaker):
    role = {"human": "user", "user": "user", "system": "system"}.get(speaker, "assistant")
    path = write_jsonl(tmp_path / "speakers.jsonl", [{"conversations": [{"from": speaker, "value": "text"}]}])
    assert load_conversations(path) == [[{"role": role, "content": "text"}]]


def test_rows_with_unmappable_roles_are_skipped_and_counted_in_one_line(tmp_path, capsys):
    good = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bing", "value": "Hello."}]}
    path = write_jsonl(tmp_path / "crawl.jsonl", [
        good,
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "beep"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."}]},
        {"messages": [{"role": "narrator", "content": "Once"}]},
        {"conversations": [{"from": "robot", "value": "again"}]},
    ])
    assert load_conversations(path) == [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."}],
    ]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "crawl.jsonl: skipped 3 of 5 records" in err
    assert "'robot' (first in record 1), 'narrator' (first in record 3)" in err


@pytest.mark.parametrize("record", [
    {"conversations": [{"from": "robot", "value": "beep"}]},
    {"messages": [{"role": "narrator", "content": "Once"}]},
])
def test_a_file_of_nothing_but_unmappable_roles_is_an_error(tmp_path, record):
    path = write_jsonl(tmp_path / "roles.jsonl", [record])
    with pytest.raises(DraftsmithError, match=r"roles.jsonl: every record has a role that maps to none of user, "
                                              r"assistant, system: '(robot|narrator)' \(first in record 0\)"):
        load_conversations(path)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DraftsmithError, match="broken.jsonl:2: invalid JSON"):
        load_conversations(path)


def test_conversation_without_user_message():
    with pytest.raises(DraftsmithError, match="conversation 0 has no user message"):
        first_user_prompts([[{"role": "system", "content": "s"}]])
