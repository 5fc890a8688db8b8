"""The training and validation loaders a method's rows are read through."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

from draftsmith.data.batching import LengthGroupedSampler, real_length, trim_padding
from draftsmith.data.packing import pack_rows
from draftsmith.errors import DraftsmithError
from draftsmith.recipe import Recipe


def make_loaders(method, recipe: Recipe) -> tuple[DataLoader, DataLoader]:
    """The training and validation loaders: each batch cut to its longest row (data/batching.py),
    or its conversations packed into rows with data.packing (data/packing.py);
    training rows shuffled, or grouped by length with data.group_by_length, from train.seed."""
    t = recipe.train
    if isinstance(method.train_data, IterableDataset):  # a stream (data.streaming): rows in corpus order
        order = {}
    elif recipe.data.group_by_length:
        lengths = real_length(method.train_tokens()["attention_mask"]).tolist()
        order = {"sampler": LengthGroupedSampler(lengths, t.batch_size, t.seed)}
    else:  # accelerate swaps in its seedable sampler (DataLoaderConfiguration in make_accelerator)
        order = {"shuffle": True, "generator": torch.Generator().manual_seed(t.seed)}
    if recipe.data.packing and not method.packs:
        raise DraftsmithError(f"data.packing: method {recipe.method.name} does not read packed rows "
                              "(its loss takes no per-conversation positions)")
    collate = pack_rows if recipe.data.packing else trim_padding
    train_loader = DataLoader(method.train_data, batch_size=t.batch_size, drop_last=True, collate_fn=collate,
                              **order)
    validation_loader = DataLoader(method.validation_data, batch_size=t.batch_size, shuffle=False, collate_fn=collate)
    if not isinstance(method.train_data, IterableDataset) and len(train_loader) == 0:
        raise DraftsmithError(f"data.dataset {recipe.data.dataset!r}: fewer training rows than train.batch_size={t.batch_size}")
    return train_loader, validation_loader
