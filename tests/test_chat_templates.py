"""Chats rendered and masked as Qwen3 and Llama 3.1 render them: their public templates on
tiny vocabularies (tests/chat_fixtures.py), checked against hand-written text token by token."""

import itertools

import pytest

from chat_fixtures import TEMPLATES, tiny_chat_tokenizer
from draftsmith.data.chat import (
    chat_format,
    end_of_turn_ids,
    load_chat_template,
    render_conversation,
    render_text,
    thinking_kwargs,
    tokenize_conversations,
)
from draftsmith.errors import DraftsmithError

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And squared?"},
    {"role": "assistant", "content": "Sixteen."},
]
# Qwen3 without thinking: the last reply carries the empty think block its generation prompt
# wrote; the earlier one does not (the template drops it from history), so the template is
# not prefix-preserving. The masked runs are the replies and their <|im_end|>, never the block.
QWEN3_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
              "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd squared?<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nSixteen.<|im_end|>\n")
LLAMA31_TEXT = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                "What is two plus two?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nAnd squared?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nSixteen.<|eot_id|>")
EXPECTED = {
    "qwen3": (QWEN3_TEXT, ["Four.<|im_end|>", "Sixteen.<|im_end|>"]),
    "llama31": (LLAMA31_TEXT, ["Four.<|eot_id|>", "Sixteen.<|eot_id|>"]),
}


@pytest.fixture(scope="module", params=["qwen3", "llama31"])
def family(request):
    return request.param, tiny_chat_tokenizer(request.param)


def token_pieces(tokenizer, row):
    """Each token's own text, with its mask bit."""
    return [(tokenizer.decode([i]), m) for i, m in zip(row["input_ids"], row["loss_mask"])]


def expected_bits(text: str, masked: list[str], pieces: list[str]) -> list[int]:
    """Per token: 1 when its characters lie inside one of the `masked` strings, found in order."""
    spans, cursor = [], 0
    for reply in masked:
        start = text.index(reply, cursor)
        spans.append((start, start + len(reply)))
        cursor = start + len(reply)
    bits, at = [], 0
    for piece in pieces:
        bits.append(int(any(s <= at and at + len(piece) <= e for s, e in spans)))
        at += len(piece)
    return bits


def test_two_turns_render_and_mask_token_by_token(family):
    name, tokenizer = family
    text, masked = EXPECTED[name]
    template, kwargs = chat_format(tokenizer)
    row = render_conversation(tokenizer, TWO_TURNS, template_kwargs=kwargs)
    pieces = token_pieces(tokenizer, row)
    assert "".join(p for p, _ in pieces) == text
    assert [m for _, m in pieces] == expected_bits(text, masked, [p for p, _ in pieces])
    runs = itertools.groupby(pieces, key=lambda pair: pair[1])
    assert ["".join(p for p, _ in group) for bit, group in runs if bit] == masked
    assert end_of_turn_ids(tokenizer, template, kwargs) == [tokenizer.convert_tokens_to_ids(masked[0][5:])]


def test_qwen3_defaults_to_no_thinking_and_a_set_switch_reaches_the_template():
    tokenizer = tiny_chat_tokenizer("qwen3")
    ask = TWO_TURNS[:2]
    template, kwargs = chat_format(tokenizer)
    assert kwargs == {"enable_thinking": False}
    off = render_text(tokenizer, ask, template, add_generation_prompt=True, template_kwargs=kwargs)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    _, on_kwargs = chat_format(tokenizer, enable_thinking=True)
    on = render_text(tokenizer, ask, template, add_generation_prompt=True, template_kwargs=on_kwargs)
    assert on.endswith("<|im_start|>assistant\n")


def test_thinking_replies_keep_their_last_reasoning_in_the_mask_and_drop_the_earlier():
    tokenizer = tiny_chat_tokenizer("qwen3")
    chat = [{"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
            {"role": "user", "content": "Squared?"},
            {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\nSixteen."}]
    template, kwargs = chat_format(tokenizer, enable_thinking=True)
    row = render_conversation(tokenizer, chat, template_kwargs=kwargs)
    pieces = token_pieces(tokenizer, row)
    text = "".join(p for p, _ in pieces)
    assert "Add them." not in text  # earlier turns' reasoning is dropped by the template
    runs = itertools.groupby(pieces, key=lambda pair: pair[1])
    assert ["".join(p for p, _ in group) for bit, group in runs if bit] == [
        "Four.<|im_end|>", "<think>\nMultiply.\n</think>\n\nSixteen.<|im_end|>"]


def test_multi_turn_qwen3_rows_are_tokenized_not_refused():
    tokenizer = tiny_chat_tokenizer("qwen3")
    template, kwargs = chat_format(tokenizer)
    rows = tokenize_conversations([TWO_TURNS, TWO_TURNS[:3]], tokenizer, max_len=96, chat_template=template,
                                  template_kwargs=kwargs)
    assert len(rows) == 2
    whole = render_conversation(tokenizer, TWO_TURNS, template_kwargs=kwargs)
    n = len(whole["input_ids"])
    assert rows[0]["input_ids"][:n] == whole["input_ids"] and rows[0]["loss_mask"][:n] == whole["loss_mask"]


def test_the_thinking_switch_set_for_a_template_without_one_is_one_line():
    tokenizer = tiny_chat_tokenizer("llama31")
    assert chat_format(tokenizer)[1] == {}
    for value in (True, False):
        with pytest.raises(DraftsmithError) as err:
            chat_format(tokenizer, enable_thinking=value)
        assert str(err.value) == (f"data.enable_thinking={str(value).lower()}: the chat template has no "
                                  "enable_thinking switch (leave it unset)")
    with pytest.raises(DraftsmithError, match="no enable_thinking switch"):
        thinking_kwargs(None, True)  # plain text has no switch either


def test_chat_template_from_a_file_or_a_builtin_and_bad_ones(tmp_path):
    qwen3 = TEMPLATES / "qwen3.jinja"
    assert load_chat_template(str(qwen3)) == qwen3.read_text()
    assert "{%- generation %}" in load_chat_template("chatml")
    assert load_chat_template("") is None
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(DraftsmithError) as err:
        load_chat_template(str(broken))
    assert str(err.value).startswith(f"chat template {broken}: line 2: ") and "\n" not in str(err.value)
    with pytest.raises(DraftsmithError, match="no such file, nor a built-in"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    # The override wins over the tokenizer's own template.
    tokenizer = tiny_chat_tokenizer("llama31")
    template, kwargs = chat_format(tokenizer, str(qwen3))
    assert template == qwen3.read_text() and kwargs == {"enable_thinking": False}


def test_a_post_hoc_run_on_a_qwen3_target_records_and_uses_no_thinking(tmp_path):
    import json

    import yaml

    from chat_fixtures import save_tiny_chat_target
    from draftsmith.train.loop import train
    from tiny_runs import tiny_recipe

    save_tiny_chat_target("qwen3", tmp_path / "qwen3", arch="qwen3")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": "old"},
        {"from": "human", "value": "And then?"}, {"from": "chatgpt", "value": "old"}]}) + "\n" for i in range(10)))
    run = tmp_path / "run"
    recipe = tiny_recipe("eagle3", run, target__path=str(tmp_path / "qwen3"), data__dataset=str(data),
                         data__regen_max_new_tokens=4, data__regen_temperature=0.0, train__seq_len=96,
                         train__max_steps=2, train__batch_size=2, method__draft_vocab_size=64, method__ttt_length=2)
    train(recipe)
    recorded = yaml.safe_load((run / "recipe.yaml").read_text())["data"]
    assert recorded["enable_thinking"] is False and recorded["chat_template"] == ""
    assert recipe.data.enable_thinking is None  # decided by the run and recorded, never written into the recipe

    save_tiny_chat_target("llama31", tmp_path / "llama")
    with pytest.raises(DraftsmithError, match="data.enable_thinking=true: the chat template has no enable_thinking"):
        train(tiny_recipe("eagle3", tmp_path / "refused", target__path=str(tmp_path / "llama"),
                          data__dataset=str(data), data__enable_thinking=True))
    assert not (tmp_path / "refused").exists()
