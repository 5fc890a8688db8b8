import json

import pytest

from draftsmith.data import corpus
from draftsmith.data.corpus import SPLITS, corpus_prompts, embedded_split, load_embedded_corpus, load_text_dataset
from draftsmith.errors import DraftsmithError


def test_split_is_by_module_disjoint_and_complete():
    names = {split: [name for name, _ in embedded_split(split)] for split in SPLITS}
    sets = {split: set(n) for split, n in names.items()}
    assert sets["train"].isdisjoint(sets["validation"]) and sets["train"].isdisjoint(sets["test"])
    assert sets["validation"].isdisjoint(sets["test"])
    assert set().union(*sets.values()) == {name for name, _ in corpus._documents()}
    total = sum(map(len, names.values()))
    assert 0.8 < len(names["train"]) / total < 0.97 and len(names["test"]) >= 10


def test_split_is_the_same_across_runs_and_machines():
    before = embedded_split("test")
    corpus._documents.cache_clear()
    assert embedded_split("test") == before
    # sha256, not hash(): Python salts str hashes per process.
    assert [corpus._bucket(name) for name in ("json", "asyncio.tasks", "pydoc_data.topics:for")] == [7, 84, 35]


def test_corpus_holds_sources_and_topics_but_no_tests_or_generated_files():
    names = {name for name, _ in corpus._documents()}
    assert {"json", "collections", "asyncio.tasks", "pydoc_data.topics:for"} <= names
    assert not any(".test." in n or ".tests." in n or n.startswith(("test.", "site-packages")) for n in names)
    assert not {"token", "stringprep", "encodings.cp1252", "pydoc_data.topics"} & names


def test_max_chars_caps_the_corpus_at_line_boundaries():
    small, large = load_embedded_corpus("train", 50_000), load_embedded_corpus("train", 120_000)
    assert sum(map(len, small)) <= 50_000 < sum(map(len, large)) <= 120_000
    assert small[:-1] == large[: len(small) - 1] and large[len(small) - 1].startswith(small[-1])
    assert small[-1].endswith("\n")


def test_corpus_prompts_are_line_aligned_excerpts_of_held_out_modules():
    held_out = [text for _, text in embedded_split("test")]
    prompts = corpus_prompts(50, max_chars=300)
    assert prompts == corpus_prompts(50, max_chars=300) and len(set(prompts)) == 50
    assert all(0 < len(p) <= 300 and p.strip() for p in prompts)
    assert all(any(p in text for text in held_out) for p in prompts)
    # Spread over the split, not each module's opening (mostly licence headers): many
    # modules, and module openings only in their fair share.
    modules = {next(i for i, text in enumerate(held_out) if p in text) for p in prompts}
    openings = sum(any(text.startswith(p) for text in held_out) for p in prompts)
    assert len(modules) >= len(held_out) // 2 and openings <= 5
    with pytest.raises(DraftsmithError, match="fewer than"):
        corpus_prompts(10**6, max_chars=300)
    with pytest.raises(DraftsmithError, match="unknown split 'dev'"):
        corpus_prompts(1, split="dev")


def test_load_text_dataset_reads_local_files(tmp_path, datasets_cache):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": f"doc {i}"}) + "\n" for i in range(40)))
    parts = {split: load_text_dataset(str(jsonl), split) for split in SPLITS}  # the only string column
    assert parts["train"] + parts["validation"] + parts["test"] == [f"doc {i}" for i in range(40)]
    assert [len(part) for part in parts.values()] == [36, 2, 2]
    assert load_text_dataset(str(jsonl), "train[:1]", text_field="body") == ["doc 0"]
    txt = tmp_path / "lines.txt"
    txt.write_text("first line\nsecond line\n")
    assert load_text_dataset(str(txt), "train[:100%]") == ["first line", "second line"]


def test_load_text_dataset_errors_are_one_line(tmp_path, datasets_cache):
    with pytest.raises(DraftsmithError, match="missing.jsonl: no such file"):
        load_text_dataset(str(tmp_path / "missing.jsonl"))
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"a": 1, "b": "x", "c": "y"}\n')
    with pytest.raises(DraftsmithError, match=r"no text column \(columns: a, b, c\)") as err:
        load_text_dataset(str(numbers))
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DraftsmithError, match="empty.txt is empty"):
        load_text_dataset(str(empty))
