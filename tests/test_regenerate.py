import json

import pytest
import torch

from draftsmith.data import regenerate as regen
from draftsmith.data.corpus import load_embedded_corpus
from draftsmith.data.regenerate import Regeneration, embedded_conversations, regenerate, regenerate_command
from draftsmith.data.reply_decoding import ReplyDecoding, stop_token_ids
from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.errors import DraftsmithError
from draftsmith.models.target import build_tiny_target
from draftsmith.recipe import DataSection

CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "import os"},
     {"role": "assistant", "content": "a human reply, to be replaced"}, {"role": "user", "content": "and sys?"}],
    [{"role": "user", "content": "class A:"}],
    [{"role": "user", "content": "for i in range(3):"}],
    [{"role": "user", "content": "x = [1, 2,"}],
]
NEW_TOKENS = 6
GREEDY = ReplyDecoding(max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(load_embedded_corpus("train", max_chars=150_000), vocab_size=512)


@pytest.fixture(scope="module")
def corpus_target(tokenizer):
    model = build_tiny_target(vocab_size=len(tokenizer), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1)
    return model.eval()


def greedy_reply(target, tokenizer, messages, untemplated=False):
    """The target's own greedy continuation of one conversation, unbatched and unpadded."""
    if untemplated:
        ids = tokenizer("".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    stops = stop_token_ids(target.generation_config, tokenizer, untemplated=untemplated)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    end = next((k for k, t in enumerate(out) if t in stops), len(out))
    return tokenizer.decode(out[:end], skip_special_tokens=True)


def read(path):
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_greedy_replies_are_the_targets_turn_by_turn(corpus_target, tokenizer, tmp_path):
    out = regenerate(corpus_target, tokenizer, CONVERSATIONS, tmp_path / "regen.jsonl", GREEDY, batch_size=3)
    records = read(out)
    assert len(records) == len(CONVERSATIONS) and not list(tmp_path.glob(".*partial"))
    for original, record in zip(CONVERSATIONS, records):
        asked = [m for m in original if m["role"] != "assistant"]
        assert [m for m in record if m["role"] != "assistant"] == asked
        # Every user turn is followed by the target's reply to the conversation so far.
        for i, message in enumerate(record):
            if message["role"] == "user":
                assert record[i + 1]["role"] == "assistant"
                assert record[i + 1]["content"] == greedy_reply(corpus_target, tokenizer, record[: i + 1])
    assert records[1][3]["content"] != "a human reply, to be replaced"


def test_embedded_prompts_are_continued_as_plain_text(corpus_target, tokenizer, tmp_path):
    conversations = embedded_conversations(4, max_chars=200)
    assert conversations == embedded_conversations(4, max_chars=200)
    records = read(regenerate(corpus_target, tokenizer, conversations, tmp_path / "plain.jsonl", GREEDY, batch_size=4,
                              untemplated=True))
    for (prompt,), (user, reply) in zip(conversations, records):
        assert user == prompt and reply["role"] == "assistant"
        assert reply["content"] == greedy_reply(corpus_target, tokenizer, [prompt], untemplated=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resume_after_an_interruption_gives_the_same_file(corpus_target, tokenizer, tmp_path, monkeypatch, temperature):
    settings = dict(how=ReplyDecoding(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=7), batch_size=2)
    whole = regenerate(corpus_target, tokenizer, CONVERSATIONS, tmp_path / "whole.jsonl", **settings).read_bytes()

    answer, calls = regen._answer, []

    def interrupted(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return answer(*args, **kwargs)

    out = tmp_path / "resumed.jsonl"
    monkeypatch.setattr(regen, "_answer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regenerate(corpus_target, tokenizer, CONVERSATIONS, out, **settings)
    (partial,) = tmp_path.glob(".resumed.jsonl.*.partial")
    assert not out.exists() and len(partial.read_text().splitlines()) == 4
    with partial.open("a") as handle:  # a record the interruption cut short
        handle.write('{"messages": [{"role": "us')

    monkeypatch.setattr(regen, "_answer", answer)
    assert regenerate(corpus_target, tokenizer, CONVERSATIONS, out, **settings).read_bytes() == whole
    assert not partial.exists()


def test_bad_inputs(corpus_target, tokenizer, tmp_path):
    with pytest.raises(DraftsmithError, match="conversation 1 has no user turn"):
        regenerate(corpus_target, tokenizer, [CONVERSATIONS[0], [{"role": "system", "content": "hi"}]], tmp_path / "x.jsonl",
                   GREEDY)
    with pytest.raises(DraftsmithError, match="temperature"):
        regenerate(corpus_target, tokenizer, CONVERSATIONS, tmp_path / "x.jsonl", ReplyDecoding(temperature=-1))
    with pytest.raises(DraftsmithError, match="no conversations"):
        regenerate(corpus_target, tokenizer, [], tmp_path / "x.jsonl", GREEDY)


def test_command_answers_a_conversation_file(corpus_target, tokenizer, tmp_path):
    corpus_target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    dataset = tmp_path / "bench.jsonl"
    dataset.write_text('{"turns": ["def f():", "and g?"]}\n{"prompt": "import re"}\n{"prompt": "unused"}\n')
    out = regenerate_command(str(tmp_path / "target"), str(tmp_path / "out.jsonl"), Regeneration(GREEDY),
                             DataSection(dataset=str(dataset)), limit=2)
    records = read(out)
    assert [[m["role"] for m in r] for r in records] == [["user", "assistant"] * 2, ["user", "assistant"]]
    assert records[1][1]["content"] == greedy_reply(corpus_target, tokenizer, records[1][:1])
    with pytest.raises(DraftsmithError, match="cannot load the tokenizer"):
        (tmp_path / "bare").mkdir()
        corpus_target.save_pretrained(tmp_path / "bare")
        regenerate_command(str(tmp_path / "bare"), str(tmp_path / "y.jsonl"), Regeneration(GREEDY), DataSection())


def test_sampled_regeneration_is_reproducible_from_its_seed(corpus_target, tokenizer, tmp_path):
    settings = dict(max_new_tokens=12, temperature=0.7, top_p=0.8, top_k=20)

    def sampled(name, **how):
        return regenerate(corpus_target, tokenizer, CONVERSATIONS, tmp_path / name, ReplyDecoding(**{**settings, **how}),
                          batch_size=2)

    first, again, other = (sampled(name, seed=seed).read_bytes() for name, seed in (("a.jsonl", 3), ("b.jsonl", 3), ("c.jsonl", 4)))
    assert first == again and first != other
    # top_k reaches the sampler: sampling among the single likeliest token is greedy decoding.
    greedy = read(regenerate(corpus_target, tokenizer, CONVERSATIONS, tmp_path / "g.jsonl", ReplyDecoding(max_new_tokens=12),
                             batch_size=2))
    assert read(sampled("k1.jsonl", seed=5, top_k=1)) == greedy
    for bad, message in ((dict(top_p=0.0), "top_p must be in \\(0, 1\\]"), (dict(top_p=1.5), "top_p must be in"),
                         (dict(top_k=-1), "top_k must be >= 0")):
        with pytest.raises(DraftsmithError, match=message):
            sampled("x.jsonl", **bad)


def test_post_hoc_recipes_regenerate_sampled_and_key_the_cache_on_it():
    from draftsmith.data.posthoc_rows import rows_settings
    from draftsmith.recipe import recipe_from_dict

    base = recipe_from_dict({"method": {"name": "eagle3"}})
    assert (base.data.regen_temperature, base.data.regen_top_p, base.data.regen_top_k) == (0.7, 0.8, 20)
    for key, value in (("regen_top_p", 0.9), ("regen_top_k", 50), ("regen_temperature", 0.0)):
        changed = recipe_from_dict({"method": {"name": "eagle3"}, "data": {key: value}})
        assert rows_settings(changed) != rows_settings(base), key


# ---------------------------------------------------------------- chat templates and thinking

@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    """A tiny target folder that chats as Qwen3 does (its template, tokens and end of turn)."""
    from chat_fixtures import save_tiny_chat_target

    folder = tmp_path_factory.mktemp("qwen3-target")
    model, tokenizer = save_tiny_chat_target("qwen3", folder)
    return folder, model, tokenizer


def test_qwen3_is_answered_without_thinking_unless_asked(qwen3_target, tmp_path):
    folder, model, tokenizer = qwen3_target
    asked = [[{"role": "user", "content": "What is two plus two?"}],
             [{"role": "user", "content": "Squared?"}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": "And cubed?"}]]
    stops = stop_token_ids(model.generation_config, tokenizer, template_kwargs={"enable_thinking": False})
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops

    def reply(history, thinking):
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True, enable_thinking=thinking)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        end = next((k for k, t in enumerate(out) if t in stops), len(out))
        return tokenizer.decode(out[:end], skip_special_tokens=True)

    for thinking, name in ((None, "default"), (True, "on")):
        records = read(regenerate(model, tokenizer, asked, tmp_path / f"{name}.jsonl", GREEDY,
                                  enable_thinking=thinking))
        for record in records:  # every turn answered to the prompt the switch renders
            for k, message in enumerate(record):
                if message["role"] == "assistant":
                    assert message["content"] == reply(record[:k], bool(thinking))


def test_server_requests_carry_the_thinking_switch(qwen3_target, tmp_path):
    """vLLM and SGLang read `chat_template_kwargs`: a loopback stand-in records every request."""
    import http.server
    import threading

    folder, _, tokenizer = qwen3_target
    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"object": "list", "data": [{"id": str(folder), "object": "model"}]})

        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._send({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Four."},
                                     "finish_reason": "stop"}]})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dataset = tmp_path / "asked.jsonl"
        dataset.write_text('{"turns": ["Two plus two?", "Squared?"]}\n')
        out = regenerate_command(str(folder), str(tmp_path / "out.jsonl"), Regeneration(
            ReplyDecoding(max_new_tokens=4), servers=(f"http://127.0.0.1:{server.server_address[1]}/v1",), in_flight=1),
            DataSection(dataset=str(dataset)))
    finally:
        server.shutdown()
        server.server_close()
    assert [m["content"] for m in read(out)[0] if m["role"] == "assistant"] == ["Four.", "Four."]
    chats = [b for b in bodies if "messages" in b]
    assert chats and all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in chats)


def test_thinking_switch_on_a_template_without_one_writes_nothing(tmp_path):
    from chat_fixtures import save_tiny_chat_target

    save_tiny_chat_target("llama31", tmp_path / "llama")
    dataset = tmp_path / "asked.jsonl"
    dataset.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(DraftsmithError, match="data.enable_thinking=false: the chat template has no enable_thinking"):
        regenerate_command(str(tmp_path / "llama"), str(tmp_path / "out.jsonl"),
                           Regeneration(GREEDY, enable_thinking=False), DataSection(dataset=str(dataset)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["asked.jsonl", "llama"]
