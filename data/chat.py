"""Conversations to training rows: chat templates, loss masks, padding and packing.

A drafter learns the target's replies, so the loss covers the assistant tokens only, plus
the token that ends each reply (predicting where a reply stops is part of drafting it).
Templates with `{% generation %}` blocks hand transformers the assistant spans directly.
For any other template the spans are found by rendering: the text an assistant turn adds
to the conversation before it (rendered with the generation prompt) is the reply.
Either way the character spans become token masks through the tokenizer's offsets, so a
token that straddles a span edge is kept in the loss rather than dropped.

`plain=True` renders a conversation as its contents concatenated, without any template:
for a target pretrained on plain text, such as the embedded default's, whose replies are
continuations of the prompt text.
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


def render_text(tokenizer, messages, template: str | None, add_generation_prompt: bool = False) -> str:
    """The conversation as the target reads it; `template` None means plain text."""
    if template is None:  # plain text
        return "".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages, template: str | None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant reply in it."""
    text = render_text(tokenizer, messages, template)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:  # a reply to nothing: no prompt to learn it from
            continue
        before = render_text(tokenizer, messages[:i], template, add_generation_prompt=True)
        upto = render_text(tokenizer, messages[: i + 1], template)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DraftsmithError(f"chat template renders the conversation before assistant turn {i} differently "
                                  "once the turn is added; use a template with {% generation %} blocks")
        reply = upto[len(before):]
        if template is not None:  # the layout after the end-of-turn token (ChatML's "\n") is not the reply's
            reply = reply.rstrip()
        spans.append((len(before), len(before) + len(reply)))
    return text, spans


def _mask_from_spans(offsets, spans) -> list[int]:
    return [int(any(start < end_ and end > start_ for start_, end_ in spans)) for start, end in offsets]


def render_conversation(tokenizer, messages, max_len: int | None = None, chat_template: str | None = None,
                        plain: bool = False) -> dict[str, list[int]]:
    """`input_ids` and `loss_mask` (1 on assistant tokens and their end-of-turn token), cut at `max_len`."""
    template = None if plain else resolve_template(tokenizer, chat_template)
    if template is not None and _GENERATION_BLOCK.search(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text, spans = assistant_spans(tokenizer, messages, template)
        # A template writes its own BOS; plain text gets the tokenizer's (Llama's <s>, none for ours).
        enc = tokenizer(text, add_special_tokens=plain, return_offsets_mapping=True)
        ids, mask = list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return {"input_ids": ids, "loss_mask": mask}


def end_of_turn_ids(tokenizer, chat_template: str | None = None) -> list[int]:
    """The special tokens a template puts at the end of a reply (ChatML's <|im_end|>)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    row = render_conversation(tokenizer, messages, chat_template=chat_template)
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
                           chat_template: str | None = None, plain: bool = False, num_proc: int | None = None):
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
    if not plain:
        resolve_template(tokenizer, chat_template)  # fail before the map, not inside a worker
    pad = _pad_id(tokenizer)

    def to_rows(batch):
        rendered = [render_conversation(tokenizer, messages, chat_template=chat_template, plain=plain)
                    for messages in batch["messages"]]
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
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for ids in encoded for t in (*ids, eos)), dtype=np.int64)
    rows = stream[: len(stream) // seq_len * seq_len].reshape(-1, seq_len)
    ones = np.ones_like(rows)
    return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": ones, "loss_mask": ones})
