"""`draftsmith data prepare NAME --out FILE`: the conversation datasets the references train
drafters on, as one JSON Lines file of `{"messages": [...]}` (OpenAI roles), the shape
`data regenerate` and training read.

- sharegpt: `Aeala/ShareGPT_Vicuna_unfiltered`, split train (SpecForge's `--dataset sharegpt`,
  EAGLE's ShareGPT); speaker names mapped as SpecForge maps them (data/conversations.py).
- ultrachat: `HuggingFaceH4/ultrachat_200k`, split train_sft (SpecForge's `--dataset ultrachat`).
- perfectblend: `mlabonne/open-perfectblend`, split train: the mix DeepSpec trains DSpark on
  (DeepSpec scripts/data/prepare_data.sh, `dataset_name`; it holds out 5% of it for eval,
  as our post-hoc training holds out its own 5%), also SpecForge's `--dataset perfectblend`.

Each is read through `datasets`: from the Hugging Face cache when it is there (a dataset
downloaded once, or a shared cache on a cluster), else fetched online; offline and not
cached is one line, and nothing is written. `--source DIR` reads a local copy laid out as
the hub serves the dataset instead. The file is written whole or not at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file, check_not_an_input


@dataclass(frozen=True)
class Source:
    hub_id: str
    split: str
    config: str = ""


SOURCES = {
    "sharegpt": Source("Aeala/ShareGPT_Vicuna_unfiltered", "train"),
    "ultrachat": Source("HuggingFaceH4/ultrachat_200k", "train_sft"),
    "perfectblend": Source("mlabonne/open-perfectblend", "train"),
}


def prepare(name: str, out: str | Path, limit: int | None = None, source: str | Path | None = None) -> Path:
    """Write dataset `name` (`SOURCES`) to `out` as messages; `limit`: its first records only."""
    from draftsmith.data.conversations import load_conversations

    if name not in SOURCES:
        raise DraftsmithError(f"data prepare: unknown dataset {name!r} (known: {', '.join(SOURCES)})")
    spec = SOURCES[name]
    if source is not None and not Path(source).is_dir():
        raise DraftsmithError(f"data prepare: --source {source}: no such folder")
    check_not_an_input(out, {"--source": source})  # a device, a link or a folder: before anything is read
    where = str(source) if source is not None else spec.hub_id  # data/corpus.py finds it in the hub cache
    conversations = load_conversations(where, limit=limit, config=spec.config, split=spec.split)
    out = Path(out)
    with atomic_file(out) as handle:
        handle.writelines(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations)
    return out
