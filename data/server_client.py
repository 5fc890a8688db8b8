"""A checked server (`ServerClient`): the model id it serves the target under, the tokenizer
probe, the request form, and its answers checked for shape and length.

ReplyDecoding settings reach the engine in the first request form it accepts (probed once at
start): vLLM/SGLang's extra fields (`top_k`, `stop_token_ids`, `repetition_penalty`),
then `transformers serve`'s `generation_config` (which refuses unknown fields with 422, so
the probe tells the two apart), then plain OpenAI fields (no top-k, the server's own stop
tokens). An engine that silently ignores unknown fields (TGI, say) gets the first form and
whatever it honours of it; the probe cannot see that. Fields beyond the OpenAI API travel in
the client's `extra_body` (`_forms`, and `chat_template_kwargs` in `ServerClient._body`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from draftsmith.data.conversations import replace_surrogates
from draftsmith.data.reply_decoding import ReplyDecoding
from draftsmith.data.server_endpoint import Endpoint, Limits, Refused, excerpt
from draftsmith.errors import DraftsmithError

# Mixed scripts, digits, code and whitespace: two different tokenizers all but never
# count the same number of tokens for it (and its chat rendering).
PROBE = "Probe 1: déjà vu, 東京, ∑x², `def f(a, b):\n\treturn a ** b  # 42`"


# The fields the OpenAI API defines for both endpoints; everything else goes in `extra_body`.
STANDARD_FIELDS = ("max_tokens", "temperature", "top_p")


def _forms(sampling: ReplyDecoding, max_tokens: int) -> dict[str, dict]:
    """The request fields that carry `sampling`, per engine family, most complete first;
    the engines' own fields under "extra_body"."""
    base = {"max_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    # vLLM and SGLang: -1 is "no top-k" in both; the repetition penalty is pinned because a
    # model's generation_config may suggest one, and it would change the distribution.
    engine = {"top_k": sampling.top_k or -1, "stop_token_ids": list(sampling.stop_ids), "repetition_penalty": 1.0,
              "skip_special_tokens": True}
    config = {"max_new_tokens": max_tokens, "do_sample": sampling.temperature > 0, "top_k": sampling.top_k,
              "top_p": sampling.top_p, "repetition_penalty": 1.0, "eos_token_id": list(sampling.stop_ids),
              "pad_token_id": sampling.pad_id}
    if sampling.temperature > 0:
        config["temperature"] = sampling.temperature
    forms = {"vllm/sglang": {**base, "extra_body": engine},
             "transformers": {**base, "extra_body": {"generation_config": json.dumps(config)}}}
    if not sampling.top_k:  # plain OpenAI has no top-k: usable only when none is asked for
        forms["openai"] = {**base, "extra_body": {}}
    return forms


def target_names(*targets: str | Path) -> tuple[set[str], set[str]]:
    """The ids a server may list for the target named `targets` (as written, or as an absolute
    path), and their last path components: what a server serving a copy of the target from
    another folder lists. The tokenizer probe is what tells such a copy from another model."""
    names, bases = set(), set()
    for target in targets:
        text = str(target).rstrip("/")
        names.add(text)
        if Path(text).expanduser().exists():
            names.add(str(Path(text).expanduser().resolve()))
        bases.add(Path(text).name)
    return names, bases


def _count(usage, key: str, where: str) -> int | None:
    """A token count of an answer's `usage` (None: not reported); anything but a count is malformed."""
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise DraftsmithError(f"{where}: a malformed answer: usage is {excerpt(usage)[:100]}, not an object")
    value = usage.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise DraftsmithError(f"{where}: a malformed answer: usage.{key} is {value!r}, not a token count")
    return value


class ServerClient:
    """One checked server: the model id it serves the target under, and the request form.

    What is checked, and what cannot be: the server's model list must hold the target's name
    or path (or one id with the same last path component), and its prompt-token count for a
    probe, chat template applied, must equal the local tokenizer's: that catches another
    tokenizer or template, not other weights under the same name (a fine-tune of the target
    passes; the OpenAI API exposes nothing of the weights). A server that reports no usage
    is checked by name only.
    """

    def __init__(self, url: str, served_names: tuple[str, ...], tokenizer, untemplated: bool, sampling: ReplyDecoding,
                 limits: Limits, template_kwargs: dict | None = None):
        self.endpoint, self.untemplated, self.sampling = Endpoint(url, limits), untemplated, sampling
        self.template_kwargs = dict(template_kwargs or {})  # enable_thinking, as the recipe decided
        self.tokenizer, self.lock = tokenizer, threading.Lock()
        self.surrogates = 0  # lone surrogates replaced in this server's answers
        self._token_chars = None
        try:
            listed = self.endpoint.call("/models", startup=True)
        except Refused as exc:
            raise DraftsmithError(f"server {self.endpoint.url}: no OpenAI model list ({exc})") from None
        models = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(models, list):
            raise DraftsmithError(f"server {self.endpoint.url}: /v1/models answered {excerpt(listed)[:100]}, "
                                  f"not an OpenAI model list")
        ids = [str(m.get("id")) for m in models if isinstance(m, dict)]
        names, bases = target_names(*served_names)
        exact = [i for i in ids if i.rstrip("/") in names]
        same_base = [i for i in ids if Path(i.rstrip("/")).name in bases]
        if not exact and len(same_base) != 1:
            raise DraftsmithError(f"server {self.endpoint.url} serves {', '.join(ids) or 'no model'}, "
                                  f"not the target {served_names[0]}")
        self.model = (exact or same_base)[0]
        self.form = self._probe()

    def _body(self, prompt, form: dict, seed: int) -> dict:
        key = "prompt" if self.untemplated else "messages"
        extra = dict(form["extra_body"])
        if self.template_kwargs and not self.untemplated:  # vLLM and SGLang hand them to the template (Qwen3's enable_thinking)
            extra["chat_template_kwargs"] = self.template_kwargs
        return {"model": self.model, key: prompt, **{k: form[k] for k in STANDARD_FIELDS}, "seed": seed,
                "extra_body": extra}

    def _path(self) -> str:
        return "/completions" if self.untemplated else "/chat/completions"

    def _probe(self) -> dict:
        """The first request form the server takes; and the tokenizer check: the server must
        count as many prompt tokens for the probe as the target's tokenizer does here."""
        prompt = PROBE if self.untemplated else [{"role": "user", "content": PROBE}]
        refused = []
        for name, form in _forms(self.sampling, 1).items():
            try:
                reply = self.endpoint.call(self._path(), self._body(prompt, form, self.sampling.seed), startup=True)
            except Refused as exc:
                refused.append(f"{name}: {exc}")
                continue
            self._reply_text(reply, "the probe")
            self._check_tokenizer(prompt, reply)
            return _forms(self.sampling, self.sampling.max_new_tokens)[name]
        raise DraftsmithError(f"server {self.endpoint.url} refuses every request form: {'; '.join(refused)}")

    def _check_tokenizer(self, prompt, reply: dict) -> None:
        served = _count(reply.get("usage"), "prompt_tokens", f"server {self.endpoint.url}, the probe")
        if served is None:  # nothing to compare: the model id is all that was checked
            return
        if self.untemplated:
            local = len(self.tokenizer(prompt)["input_ids"])
        else:
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                      **self.template_kwargs)
            local = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if served != local:
            raise DraftsmithError(f"server {self.endpoint.url} ({self.model}) counts {served} prompt tokens for a "
                                  f"probe the target's tokenizer makes {local} of: another tokenizer or chat template")

    def _reply_text(self, reply, request: str) -> str:
        """The text of an answer, whose shape is checked: a malformed one is one line."""
        where = f"server {self.endpoint.url}, {request}"
        try:
            choice = reply["choices"][0]
            text = choice["text"] if self.untemplated else choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise DraftsmithError(f"{where}: an answer without choices: {excerpt(reply)[:200]}") from None
        if text is not None and not isinstance(text, str):
            raise DraftsmithError(f"{where}: a malformed answer: its text is {excerpt(text)[:100]}, not a string")
        text, replaced = replace_surrogates(text or "")  # before any tokenizer (or the UTF-8 file) sees it
        if replaced:
            with self.lock:
                self.surrogates += replaced
        return text

    def token_chars(self) -> int:
        """The most characters one token of the target's tokenizer can decode to (its longest
        vocabulary entry, byte-level or not, and one for a joining space)."""
        if self._token_chars is None:
            with self.lock:
                vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
                self._token_chars = max(map(len, vocab), default=64) + 1
        return self._token_chars

    def _check_length(self, text: str, tokens: int | None, where: str) -> None:
        """An answer no longer than the max_tokens asked for, checked before it is tokenized or
        written: a server that ignores the limit would otherwise hand the tokenizer (or a
        training row) megabytes."""
        asked = self.form["max_tokens"]
        if tokens is not None and tokens > asked:
            raise DraftsmithError(f"{where}: the answer counts {tokens} completion tokens, more than the max_tokens "
                                  f"{asked} asked for: the server does not keep to it")
        if len(text) > asked * self.token_chars():
            raise DraftsmithError(f"{where}: an answer of {len(text)} characters, more than {asked} tokens can hold "
                                  f"(at most {self.token_chars()} characters each): the server does not keep to "
                                  "max_tokens")

    def complete(self, history: list[dict], seed: int, request: str = "a request") -> tuple[str, int]:
        """The reply to `history` and its token count; `request` names it in errors."""
        prompt = "".join(m["content"] for m in history) if self.untemplated else history
        try:
            reply = self.endpoint.call(self._path(), self._body(prompt, self.form, seed))
        except Refused as exc:  # e.g. a prompt longer than the server's context
            raise DraftsmithError(f"server {self.endpoint.url}, {request}: {exc}") from None
        text = self._reply_text(reply, request)
        tokens = _count(reply.get("usage"), "completion_tokens", f"server {self.endpoint.url}, {request}")
        self._check_length(text, tokens, f"server {self.endpoint.url}, {request}")
        if tokens is None:
            with self.lock:  # a Rust tokenizer is not to be used by two threads at once
                tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return text, tokens
