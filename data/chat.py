"""Conversations to training rows: chat templates, loss masks, padding and packing.

A drafter learns the target's replies, so the loss covers the assistant tokens only, plus
the token that ends each reply (predicting where a reply stops is part of drafting it).
Templates with `{% generation %}` blocks hand transformers the assistant spans directly.
For any other template the whole conversation is rendered once and each assistant reply is
located in that text, in order, as the reply's text followed by the template's end-of-turn
marker (what a one-turn probe conversation shows it to be). That is how SpecForge's own
templates find assistant spans (header ... end of turn in the full rendering), and unlike
comparing the rendering with and without each turn it holds for templates that are not
prefix-preserving: Qwen3's drops earlier turns' reasoning and its empty `<think>` block, so
turn 1 renders differently once turn 2 follows. One rendering per conversation also keeps
one row per conversation, where a row per turn would repeat the whole context each time.
What is learned is what the template writes for each turn in the full conversation: for
earlier Qwen3 turns, the history as the served model reads it in later turns.
Either way the character spans become token masks through the tokenizer's offsets, so a
token that straddles a span edge is kept in the loss rather than dropped.

`untemplated=True` renders a conversation as its contents concatenated, without any template:
for a target pretrained on plain text, such as the embedded default's, whose replies are
continuations of the prompt text.

Template keyword arguments (`template_kwargs`) reach every rendering: `enable_thinking`,
which Qwen3-style templates read, is decided once by `thinking_kwargs` and passed through
training rows, regeneration (in process and through servers) and eval prompts alike.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from draftsmith.errors import DraftsmithError

_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


def resolve_template(tokenizer, chat_template: str | None) -> str:
    """The template given, else the tokenizer's own; neither is bad input."""
    template = chat_template or tokenizer.chat_template
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DraftsmithError(f"tokenizer {name} has no chat template; give one (chat_template) or use plain text")
    return template


def builtin_templates() -> dict[str, str]:
    """Templates `data.chat_template` may name instead of a file."""
    from draftsmith.data.tokenizer import CHATML_TEMPLATE

    # ChatML with `{% generation %}` blocks: for a tokenizer that has none of its own.
    return {"chatml": CHATML_TEMPLATE}


def load_chat_template(spec: str | None) -> str | None:
    """`data.chat_template`: empty (None: the tokenizer's own), a built-in's name, or a Jinja
    file. The text is compiled here, so a template that does not parse is one line before
    anything is rendered or written."""
    if not spec:
        return None
    builtins = builtin_templates()
    if spec in builtins:
        return builtins[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DraftsmithError(f"chat template {spec}: no such file, nor a built-in ({', '.join(builtins)})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DraftsmithError(f"chat template {spec}: cannot read it ({exc})") from None
    check_template(text, spec)
    return text


def check_template(text: str, where: str) -> None:
    """Compile a template as transformers does (its Jinja settings and `generation` tag)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise DraftsmithError(f"chat template {where}: line {exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise DraftsmithError(f"chat template {where}: {exc}") from None


def reads_thinking_switch(template: str) -> bool:
    """Whether a template branches on `enable_thinking` (Qwen3 and its kin)."""
    return "enable_thinking" in template


def thinking_kwargs(template: str | None, enable_thinking: bool | None) -> dict:
    """The template arguments that decide thinking. None (unset): off where the template has
    the switch, as DeepSpec, SpecForge and z-lab train and measure Qwen3 drafters (the
    served model answers without reasoning unless asked); nothing for a template without it.
    Set explicitly for a template without the switch, it would silently do nothing: refused."""
    if template is None or not reads_thinking_switch(template):
        if enable_thinking is not None:
            raise DraftsmithError(f"data.enable_thinking={str(enable_thinking).lower()}: the chat template has no "
                                  "enable_thinking switch (leave it unset)")
        return {}
    return {"enable_thinking": bool(enable_thinking)}


def chat_format(tokenizer, chat_template: str | None = "", enable_thinking: bool | None = None,
                untemplated: bool = False) -> tuple[str | None, dict]:
    """(template text, template kwargs) from the recipe's `data.chat_template` (a file or a
    built-in's name; empty: the tokenizer's) and `data.enable_thinking`. Plain text: (None, {})."""
    template = load_chat_template(chat_template)
    if untemplated:
        return None, thinking_kwargs(None, enable_thinking)
    template = resolve_template(tokenizer, template)
    return template, thinking_kwargs(template, enable_thinking)


def render_text(tokenizer, messages, template: str | None, add_generation_prompt: bool = False,
                template_kwargs: dict | None = None) -> str:
    """The conversation as the target reads it; `template` None means plain text."""
    if template is None:  # plain text
        return "".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))


_END_OF_TURN: dict[tuple, str] = {}
_PROBE_USER, _PROBE_REPLY = "\u2063probe question 7f3a\u2063", "\u2063probe reply 9c1e\u2063"


def end_of_turn_text(tokenizer, template: str, template_kwargs: dict | None = None) -> str:
    """What the template writes right after a reply's text (ChatML's `<|im_end|>`, Llama 3's
    `<|eot_id|>`), read off a one-turn probe; the layout after it ("\\n") is not the reply's."""
    # Asked once per conversation; the answer depends only on the template, its arguments and
    # the special tokens it may write.
    key = (template, tuple(sorted((template_kwargs or {}).items())), tokenizer.bos_token, tokenizer.eos_token)
    if key not in _END_OF_TURN:
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        text = render_text(tokenizer, probe, template, template_kwargs=template_kwargs)
        at = text.rfind(_PROBE_REPLY)
        if at < 0:
            raise DraftsmithError("chat template does not write an assistant reply's text; cannot find replies "
                                  "to learn")
        _END_OF_TURN[key] = text[at + len(_PROBE_REPLY):].strip()
    return _END_OF_TURN[key]


def _reply_candidates(content: str) -> list[str]:
    """How a template may write a reply, most faithful first: as given, trimmed (Llama 3's
    template trims; Qwen3's strips leading newlines), or, for a reply that reasons first,
    only its answer (Qwen3 drops earlier turns' reasoning)."""
    answer = content.split("</think>")[-1] if "</think>" in content else content
    forms = [content, content.lstrip("\n"), content.strip(), answer.lstrip("\n"), answer.strip()]
    return list(dict.fromkeys(forms))  # in order, without repeats


def _locate_reply(text: str, content: str, end: str, cursor: int) -> tuple[int, int] | None:
    """The span of one reply at or after `cursor`: its text followed by the end-of-turn marker.
    Requiring the marker keeps a short reply from matching inside the headers between turns."""
    for candidate in _reply_candidates(content):
        at = text.find(candidate + end, cursor)
        if at < 0:
            continue
        start = at
        think = text.rfind("<think>", cursor, at)
        if "</think>" in content and think >= 0 and text[think:at].rstrip().endswith("</think>"):
            start = think  # the reasoning the template kept (reformatted) is the reply's too
        return start, at + len(candidate) + len(end)
    return None


def assistant_spans(tokenizer, messages, template: str | None,
                    template_kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant reply in it (its
    end-of-turn marker included), found in one rendering of the whole conversation."""
    text = render_text(tokenizer, messages, template, template_kwargs=template_kwargs)
    if template is None:
        starts = np.cumsum([0] + [len(m["content"]) for m in messages])
        return text, [(int(starts[i]), int(starts[i + 1])) for i, m in enumerate(messages)
                      if m["role"] == "assistant" and i > 0]
    end = end_of_turn_text(tokenizer, template, template_kwargs)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            # Step past the message, so that a reply is never matched inside the question before it.
            content = message["content"].strip()
            at = text.find(content, cursor) if content else -1
            if at >= 0:
                cursor = at + len(content)
                cursor += len(end) if end and text.startswith(end, cursor) else 0
            continue
        found = _locate_reply(text, message["content"], end, cursor)
        if found is None:
            raise DraftsmithError(f"assistant turn {i}: its text is not in the conversation as the chat template "
                                  "renders it; use a template with {% generation %} blocks")
        if i > 0:  # a reply to nothing: no prompt to learn it from
            spans.append(found)
        cursor = found[1]
    return text, spans


def _mask_from_spans(offsets, spans) -> list[int]:
    return [int(any(start < end_ and end > start_ for start_, end_ in spans)) for start, end in offsets]


def render_conversation(tokenizer, messages, max_len: int | None = None, chat_template: str | None = None,
                        untemplated: bool = False, template_kwargs: dict | None = None) -> dict[str, list[int]]:
    """`input_ids` and `loss_mask` (1 on assistant tokens and their end-of-turn token), cut at `max_len`.
    `chat_template` is template text (None: the tokenizer's own)."""
    template = None if untemplated else resolve_template(tokenizer, chat_template)
    if template is not None and _GENERATION_BLOCK.search(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, return_dict=True,
                                            return_assistant_tokens_mask=True, **(template_kwargs or {}))
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text, spans = assistant_spans(tokenizer, messages, template, template_kwargs)
        # A template writes its own BOS; plain text gets the tokenizer's (Llama's <s>, none for ours).
        enc = tokenizer(text, add_special_tokens=untemplated, return_offsets_mapping=True)
        ids, mask = list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return {"input_ids": ids, "loss_mask": mask}


def end_of_turn_ids(tokenizer, chat_template: str | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The special tokens a template puts at the end of a reply (ChatML's <|im_end|>)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    row = render_conversation(tokenizer, messages, chat_template=chat_template, template_kwargs=template_kwargs)
    special = set(tokenizer.all_special_ids)
    return sorted({i for i, m in zip(row["input_ids"], row["loss_mask"]) if m and i in special})


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DraftsmithError("tokenizer has neither a pad nor an end-of-text token to pad rows with")
    return pad


def _rows(rendered: list[dict], max_len: int, pad: int, pack: bool) -> dict[str, list]:
    """Fixed-length rows: one conversation per row (padded), or conversations end to end (packed)."""
    if pack:  # the tail row is padded, not dropped: supervised data is scarce
        ids = [i for r in rendered for i in r["input_ids"]]
        mask = [m for r in rendered for m in r["loss_mask"]]
        pieces = [(ids[s:s + max_len], mask[s:s + max_len]) for s in range(0, len(ids), max_len)]
    else:
        pieces = [(r["input_ids"][:max_len], r["loss_mask"][:max_len]) for r in rendered]
    rows = {"input_ids": [], "loss_mask": [], "attention_mask": []}
    for ids, mask in pieces:
        fill = max_len - len(ids)
        rows["input_ids"].append(ids + [pad] * fill)
        rows["loss_mask"].append(mask + [0] * fill)
        rows["attention_mask"].append([1] * len(ids) + [0] * fill)
    return rows


def tokenize_conversations(conversations, tokenizer, max_len: int, pack: bool = False,
                           chat_template: str | None = None, untemplated: bool = False, num_proc: int | None = None,
                           template_kwargs: dict | None = None):
    """Training rows (`input_ids`, `loss_mask`, `attention_mask`, each `max_len` long).

    `conversations`: a `datasets.Dataset` with a `messages` column, a JSON Lines file of
    OpenAI `messages` records (such as `regenerate` writes), or a list of message lists.
    A file-backed dataset is tokenized through `datasets.map`, so a second run with the
    same data, tokenizer and settings reads the cached rows. Rows with no assistant token
    (a user-only conversation, or one whose reply lies past `max_len`) are left out.
    """
    import datasets

    from draftsmith.data.corpus import load_dataset_spec

    where = "conversations"
    if isinstance(conversations, (str, Path)):
        where, conversations = str(conversations), load_dataset_spec(str(conversations))
    elif not isinstance(conversations, datasets.Dataset):
        conversations = datasets.Dataset.from_dict({"messages": list(conversations)})
    if "messages" not in conversations.column_names:
        raise DraftsmithError(f"{where}: no messages column (columns: {', '.join(conversations.column_names)})")
    if not untemplated:
        resolve_template(tokenizer, chat_template)  # fail before the map, not inside a worker
    pad = _pad_id(tokenizer)

    def to_rows(batch):
        rendered = [render_conversation(tokenizer, messages, chat_template=chat_template, untemplated=untemplated,
                                        template_kwargs=template_kwargs) for messages in batch["messages"]]
        return _rows(rendered, max_len, pad, pack)

    rows = conversations.map(to_rows, batched=True, remove_columns=conversations.column_names,
                             num_proc=num_proc, desc="tokenize conversations")
    rows = rows.filter(lambda mask: any(mask), input_columns="loss_mask", num_proc=num_proc)
    if len(rows) == 0:
        raise DraftsmithError(f"no assistant tokens in {len(conversations)} conversations within {max_len} tokens: "
                              "the data has no assistant turns (regenerate it with the target first)")
    return rows


def pack_texts(texts, tokenizer, seq_len: int):
    """Plain documents, end to end with an end-of-text token after each, cut into `seq_len` rows.

    The tail shorter than a row is dropped (pretraining text is plentiful). Columns
    `input_ids`, `attention_mask` and `loss_mask` (all ones), like conversation rows.
    """
    import datasets

    eos = tokenizer.eos_token_id
    if eos is None:
        raise DraftsmithError("tokenizer has no end-of-text token to separate documents with")
    from draftsmith.data.stream import packed_rows  # the one packing rule, streamed corpora's too

    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    rows = np.array(list(packed_rows([encoded], eos, seq_len)), dtype=np.int64).reshape(-1, seq_len)
    ones = np.ones_like(rows)
    return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": ones, "loss_mask": ones})
