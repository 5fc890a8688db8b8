"""Pretraining text streamed from a corpus too large to download or hold (FineWeb-Edu, say).

The corpus is read through `datasets` with `streaming=True` (a local folder, a hub snapshot
in the Hugging Face cache, or a hub name read over the network), tokenized a batch of
documents at a time and packed as `pack_texts` packs a corpus held in memory: documents end
to end, an end-of-text token after each, cut into rows of `train.seq_len`. Only one batch of
documents and the unfinished row are in memory at a time.

The rows form one fixed sequence (the corpus in its file order), numbered from 0. The
first `data.heldout_rows` are the validation rows, never trained on; training reads the
rows after them in order, once: a stream has no length to count epochs in, so a run is
`train.max_steps` long. A resumed run starts at the row after those its steps consumed, so
it trains on exactly the rows an uninterrupted run would. Every `INDEX_EVERY` batches of
documents the stream notes a resume point (the row number, the unfinished row's tokens and
`datasets`' own stream state, which restarts inside a shard); the latest points are saved
with each checkpoint (the loop registers the stream with accelerate), and a resume restores
the last point before its row and tokenizes only from there on. Without a point (a resume
within the first INDEX_EVERY batches) it reads the stream again from its start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import torch
from torch.utils.data import IterableDataset

from draftsmith.errors import DraftsmithError

# Documents tokenized together: the fast tokenizers encode a batch in parallel threads.
DOCS_PER_BATCH = 256
# A resume point every 64 batches (about 16k documents, 16M FineWeb-Edu tokens: seconds to
# re-tokenize); the newest 64 are kept, each holding less than one row of tokens.
INDEX_EVERY = 64
KEEP_POINTS = 64


def packed_rows(encoded_batches: Iterable[list[list[int]]], eos: int, seq_len: int, buffer: list[int] | None = None,
                after_batch: Callable[[list[int], int], None] | None = None) -> Iterator[list[int]]:
    """Rows of `seq_len` tokens cut from documents laid end to end, `eos` after each; the
    tail shorter than a row is dropped. The one packing rule, in memory or streamed.
    `buffer`: the unfinished row to continue; `after_batch(buffer, rows)` is told the
    unfinished row and the rows produced so far once a batch's rows have all been taken."""
    buffer, produced = list(buffer or []), 0
    for batch in encoded_batches:
        for ids in batch:
            buffer.extend(ids)
            buffer.append(eos)
        full = len(buffer) // seq_len * seq_len
        for start in range(0, full, seq_len):
            produced += 1
            yield buffer[start:start + seq_len]
        del buffer[:full]
        if after_batch is not None:
            after_batch(buffer, produced)


def open_text_stream(spec: str, config: str, split: str, text_field: str):
    """The documents of `spec` (a hub name, dataset folder or data file), streamed: a
    `datasets.IterableDataset` and the text column. Checked before any row is read: the
    name (offline and not cached: one line), the config, the split and the column."""
    from draftsmith.data.corpus import load_dataset_spec

    stream = load_dataset_spec(spec, split, name=config or None, streaming=True)
    columns = list(stream.column_names or [])
    column = text_field or "text"
    if column not in columns:
        raise DraftsmithError(f"data.dataset {spec}: no text column {column!r} (columns: {', '.join(columns)}); "
                              "set data.text_field")
    return stream.select_columns([column]), column


class PackedStream(IterableDataset):
    """Rows `start` .. `stop` (None: to the corpus's end) of the packed corpus, as the
    loop's DataLoader reads them: {"input_ids", "attention_mask"} of `seq_len` tokens each,
    from column `column` of `source` (a streamed `datasets.IterableDataset`). An iteration
    reads from the corpus's first document, or, after `resume_at`, from the nearest resume
    point before the resumed row (`state_dict` and `load_state_dict` carry the points)."""

    def __init__(self, source, column: str, tokenizer, seq_len: int, start: int = 0, stop: int | None = None):
        if tokenizer.eos_token_id is None:
            raise DraftsmithError("tokenizer has no end-of-text token to separate documents with")
        self.source, self.column, self.tokenizer, self.seq_len = source, column, tokenizer, seq_len
        self.start, self.stop = start, stop
        self.skip = 0  # rows after `start` already trained on (a resumed run)
        self.points: list[dict] = []  # {"row", "buffer", "state"}: where the stream can restart

    def state_dict(self) -> dict:
        return {"points": self.points[-KEEP_POINTS:]}

    def load_state_dict(self, state: dict) -> None:
        self.points = list(state.get("points", []))

    def resume_at(self, rows: int) -> None:
        """The next iteration starts `rows` rows after `start`."""
        self.skip = rows

    def _encoded(self) -> Iterator[list[list[int]]]:
        for batch in self.source.iter(batch_size=DOCS_PER_BATCH):
            texts = [t for t in batch[self.column] if isinstance(t, str) and t.strip()]
            if texts:
                yield self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        first = self.start + self.skip
        point = max((p for p in self.points if p["row"] <= first), key=lambda p: p["row"], default=None)
        base, buffer, batches = (point["row"], point["buffer"], 0) if point else (0, [], 0)
        if point is not None:
            self.source.load_state_dict(point["state"])

        def note_point(unfinished: list[int], produced: int) -> None:
            nonlocal batches
            batches += 1
            if batches % INDEX_EVERY == 0:  # the source has handed out this batch and not the next
                self.points.append({"row": base + produced, "buffer": list(unfinished),
                                    "state": self.source.state_dict()})
                del self.points[:-KEEP_POINTS]

        rows = packed_rows(self._encoded(), self.tokenizer.eos_token_id, self.seq_len, buffer, note_point)
        for row in islice(rows, first - base, None if self.stop is None else self.stop - base):
            ids = torch.tensor(row, dtype=torch.long)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def streamed_corpus(data, tokenizer, seq_len: int, split: str):
    """data.streaming: the validation rows (the first data.heldout_rows, held in a list) or
    the training stream (every row after them)."""
    stream, column = open_text_stream(data.dataset, data.dataset_config, data.dataset_split, data.text_field)
    held = data.heldout_rows
    if split == "train":
        return PackedStream(stream, column, tokenizer, seq_len, start=held)
    rows = list(PackedStream(stream, column, tokenizer, seq_len, stop=held))
    if len(rows) < held:
        raise DraftsmithError(f"data.dataset {data.dataset}: {len(rows)} rows of train.seq_len={seq_len} tokens, "
                              f"fewer than the data.heldout_rows={held} held out for validation")
    return rows
