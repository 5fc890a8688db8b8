import pytest
from transformers import AutoTokenizer

from draftsmith.data.corpus import load_embedded_corpus
from draftsmith.data.tokenizer import SPECIAL_TOKENS, train_tokenizer
from draftsmith.errors import DraftsmithError

SAMPLES = [
    "def f(x):\n\treturn {'k': [x ** 2 for _ in range(3)]}  # comment\n\n\n",
    "    indented    spaces   \r\n trailing ",
    "héllo wörld — naïve café, 你好世界, Ελληνικά, 🚀🐍 \u200b\x00",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|mask|><|pad|>",
]


@pytest.fixture(scope="module")
def texts():
    return load_embedded_corpus("train", max_chars=150_000)


@pytest.fixture(scope="module")
def tokenizer(texts):
    return train_tokenizer(texts, vocab_size=1024)


def test_round_trips_code_and_unicode(tokenizer):
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_special_tokens_are_single_ids(tokenizer):
    assert len(tokenizer) == 1024
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.mask_token) == ("<|endoftext|>", "<|pad|>", "<|mask|>")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id) == (0, 3, 4)
    assert tokenizer("a<|im_start|>b<|mask|>")["input_ids"][1::2] == [1, 4]


def test_chatml_template_with_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_saves_and_reloads_with_auto_tokenizer(tokenizer, texts, tmp_path):
    saved = train_tokenizer(texts, vocab_size=1024, out_dir=tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for text in SAMPLES:
        assert loaded(text)["input_ids"] == saved(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.mask_token_id == 4 and loaded.pad_token_id == 3 and loaded.eos_token_id == 0
    assert loaded.chat_template == tokenizer.chat_template


def test_training_is_deterministic(tokenizer, texts):
    again = train_tokenizer(texts, vocab_size=1024)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_bad_vocab_sizes(texts):
    with pytest.raises(DraftsmithError, match="below 261"):
        train_tokenizer(texts, vocab_size=100)
    with pytest.raises(DraftsmithError, match="fewer than vocab_size"):
        train_tokenizer(["tiny text"], vocab_size=1024)
