"""Tokenizer and corpus for the pretraining methods (MTP, draft LM).

The embedded default trains a tokenizer on the stdlib corpus's train part; a run against
an existing target uses that target's tokenizer, so drafts and target share ids.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.models.model_dir import find_model_dir
from draftsmith.recipe import Recipe


def load_tokenizer(recipe: Recipe, target_dir: Path | str | None):
    """data.tokenizer's, else the target's (at `target_dir`, its target.path resolved), else one
    trained on the embedded corpus."""
    from draftsmith.data.tokenizer import load_pretrained_tokenizer

    # A hub name (data.tokenizer or the target's) is read from its snapshot in the Hugging Face cache.
    if recipe.data.tokenizer:
        return load_pretrained_tokenizer(find_model_dir(recipe.data.tokenizer), "data.tokenizer")
    if recipe.target.path:
        return load_pretrained_tokenizer(target_dir, "target")
    from draftsmith.data.corpus import load_embedded_corpus
    from draftsmith.data.tokenizer import train_tokenizer

    return train_tokenizer(load_embedded_corpus("train", max_chars=recipe.data.max_chars or None),
                           vocab_size=recipe.data.vocab_size)


def corpus_texts(recipe: Recipe, split: str) -> list[str]:
    from draftsmith.data.corpus import load_embedded_corpus, load_text_dataset

    data = recipe.data
    if data.dataset == "embedded":
        limit = data.max_chars or None
        if split != "train" and limit:
            limit = max(limit // 10, 20_000)
        texts = load_embedded_corpus(split, max_chars=limit)
    else:
        texts = load_text_dataset(data.dataset, split, text_field=data.text_field or None)
    if not texts:
        raise DraftsmithError(f"data.dataset {data.dataset!r}: the {split} split is empty")
    return texts


def packed_corpus(recipe: Recipe, tokenizer, split: str):
    """The packed rows of one split; with data.streaming, the validation rows in a list and
    the training rows as a stream (data/stream.py)."""
    from draftsmith.data.chat import pack_texts

    if recipe.data.streaming:
        from draftsmith.data.stream import streamed_corpus

        return streamed_corpus(recipe.data, tokenizer, recipe.train.seq_len, split)
    rows = pack_texts(corpus_texts(recipe, split), tokenizer, recipe.train.seq_len)
    if len(rows) == 0:
        raise DraftsmithError(
            f"data.dataset {recipe.data.dataset!r}: the {split} split has fewer than train.seq_len="
            f"{recipe.train.seq_len} tokens"
        )
    return rows.with_format("torch")
