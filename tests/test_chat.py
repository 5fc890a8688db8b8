import copy
import itertools
import json

import pytest

from draftsmith.data.chat import end_of_turn_ids, pack_texts, render_conversation, tokenize_conversations
from draftsmith.data.corpus import load_embedded_corpus
from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.errors import DraftsmithError

CHAT = [
    {"role": "system", "content": "Answer in Python."},
    {"role": "user", "content": "Square a number?"},
    {"role": "assistant", "content": "def square(x):\n    return x * x\n"},
    {"role": "user", "content": "And café in UTF-8?"},
    {"role": "assistant", "content": "'café'.encode()  →  b'caf\\xc3\\xa9'"},
]
USER_ONLY = [{"role": "user", "content": "no reply here"}]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(load_embedded_corpus("train", max_chars=150_000), vocab_size=1024)


@pytest.fixture(scope="module")
def plain_chatml(tokenizer):
    """The same ChatML layout with no generation markers, as most hub templates are."""
    return tokenizer.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")


def masked_runs(tokenizer, row):
    """The decoded text of each run of consecutive masked tokens."""
    runs = itertools.groupby(zip(row["input_ids"], row["loss_mask"]), key=lambda pair: pair[1])
    return [tokenizer.decode([i for i, _ in group]) for masked, group in runs if masked]


def test_mask_is_assistant_replies_and_end_of_turn(tokenizer):
    row = render_conversation(tokenizer, CHAT)
    assert masked_runs(tokenizer, row) == [CHAT[2]["content"] + "<|im_end|>", CHAT[4]["content"] + "<|im_end|>"]
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(CHAT, tokenize=False)


def test_template_without_generation_markers_gives_the_same_mask(tokenizer, plain_chatml):
    with_markers = render_conversation(tokenizer, CHAT)
    assert render_conversation(tokenizer, CHAT, chat_template=plain_chatml) == with_markers
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tokenizer) == end_of_turn_ids(tokenizer, plain_chatml) == [im_end]


def test_plain_text_masks_the_replies(tokenizer):
    messages = [{"role": "user", "content": "import os\n"}, {"role": "assistant", "content": "import sys\n"}]
    row = render_conversation(tokenizer, messages, untemplated=True)
    assert tokenizer.decode(row["input_ids"]) == "import os\nimport sys\n"
    assert masked_runs(tokenizer, row) == ["import sys\n"]


def test_max_len_cuts_the_row(tokenizer):
    full = render_conversation(tokenizer, CHAT)
    cut = render_conversation(tokenizer, CHAT, max_len=10)
    assert cut == {key: value[:10] for key, value in full.items()}


def test_missing_template_is_an_error(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DraftsmithError, match="has no chat template"):
        render_conversation(bare, CHAT)
    with pytest.raises(DraftsmithError, match="has no chat template"):
        tokenize_conversations([CHAT], bare, max_len=64)


def test_padded_rows(tokenizer, plain_chatml):
    rows = tokenize_conversations([CHAT, USER_ONLY, CHAT[:3]], tokenizer, max_len=64, chat_template=plain_chatml)
    assert len(rows) == 2  # the user-only conversation has nothing to learn
    first = render_conversation(tokenizer, CHAT, max_len=64)
    length = len(first["input_ids"])
    assert rows[0]["input_ids"][:length] == first["input_ids"] and rows[0]["loss_mask"][:length] == first["loss_mask"]
    for row in rows:
        assert all(len(row[key]) == 64 for key in ("input_ids", "loss_mask", "attention_mask"))
        n = sum(row["attention_mask"])
        assert row["attention_mask"] == [1] * n + [0] * (64 - n)
        assert set(row["input_ids"][n:]) <= {tokenizer.pad_token_id} and not any(row["loss_mask"][n:])


def test_packed_rows(tokenizer):
    conversations = [CHAT, CHAT[:3], CHAT]
    rows = tokenize_conversations(conversations, tokenizer, max_len=32, pack=True)
    rendered = [render_conversation(tokenizer, c) for c in conversations]
    ids = [t for r in rendered for t in r["input_ids"]]
    mask = [m for r in rendered for m in r["loss_mask"]]
    # Conversations end to end in 32-token rows; rows with nothing to learn are left out.
    chunks = [ids[s:s + 32] for s in range(0, len(ids), 32) if any(mask[s:s + 32])]
    assert [row["input_ids"][: sum(row["attention_mask"])] for row in rows] == chunks
    assert all(len(row[key]) == 32 for row in rows for key in ("input_ids", "loss_mask", "attention_mask"))
    assert sum(sum(row["loss_mask"]) for row in rows) == sum(mask)


def test_no_assistant_turns_is_an_error(tokenizer):
    with pytest.raises(DraftsmithError, match="no assistant turns"):
        tokenize_conversations([USER_ONLY, USER_ONLY], tokenizer, max_len=64)


def test_file_backed_data_is_cached(tokenizer, tmp_path, datasets_cache):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [CHAT, CHAT[:3]]))
    first = tokenize_conversations(path, tokenizer, max_len=48)
    again = tokenize_conversations(str(path), tokenizer, max_len=48)
    assert first._fingerprint == again._fingerprint and first.cache_files == again.cache_files
    assert first.cache_files and first[:] == again[:]
    assert tokenize_conversations(path, tokenizer, max_len=40)._fingerprint != first._fingerprint


def test_pack_texts_is_deterministic_with_eos_between_documents(tokenizer):
    texts = load_embedded_corpus("validation", max_chars=20_000)
    rows = pack_texts(texts, tokenizer, seq_len=128)
    assert rows[:] == pack_texts(texts, tokenizer, seq_len=128)[:]
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert len(rows) == len(stream) // 128 and rows.column_names == ["input_ids", "attention_mask", "loss_mask"]
    assert [t for row in rows["input_ids"] for t in row] == stream[: len(rows) * 128]
    assert all(sum(row) == 128 for row in rows["loss_mask"]) and all(sum(row) == 128 for row in rows["attention_mask"])
    assert len(pack_texts(["too short"], tokenizer, seq_len=128)) == 0
