"""Plain-text corpora: the embedded stdlib corpus and local or hub text datasets.

The embedded corpus is read at run time from the running Python's standard library (its
hand-written `.py` sources and the `pydoc_data.topics` help texts), so nothing of it is
copied into this repository and no download is needed. It is split by module, by a hash of
the module's name, so the parts are disjoint, and identical on every machine with the same
Python version: held-out modules are never seen in training, not even in part.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sysconfig
from pathlib import Path

from draftsmith.errors import DraftsmithError, first_lines

SPLITS = ("train", "validation", "test")
_SPLIT_PERCENT = {"train": range(0, 90), "validation": range(90, 95), "test": range(95, 100)}

# Folders whose sources are test suites or third-party code, not the standard library.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
# Machine-written files (codec tables, token lists, the Sphinx topic dump): text that
# teaches a code model nothing. Sought in the first 1000 characters only.
_GENERATED = re.compile(r"(?i)auto-?generated|automatically generated|do not edit|gencodec\.py")
_MAX_FILE_BYTES = 200_000  # larger files are pure-Python twins of C modules or data tables


def _bucket(name: str) -> int:
    """A percentile in [0, 100) from the module name; stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % 100


def _is_library_file(rel: Path) -> bool:
    if rel.name.startswith("_sysconfigdata"):  # the build's configuration, not code
        return False
    return not any(d in _SKIP_DIRS or d.startswith("config-") for d in rel.parts[:-1])


@functools.lru_cache(maxsize=1)
def _documents() -> tuple[tuple[str, str], ...]:
    """(name, text) for every document of the embedded corpus, sorted by name."""
    import pydoc_data.topics

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = {f"pydoc_data.topics:{topic}": text for topic, text in pydoc_data.topics.topics.items()}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _is_library_file(rel) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a handful of legacy files; not worth guessing encodings
            continue
        if not _GENERATED.search(text[:1000]):
            docs[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = text
    return tuple(sorted((name, text) for name, text in docs.items() if text.strip()))


def embedded_split(split: str) -> list[tuple[str, str]]:
    """(module name, text) of one part, ordered by hash so that any prefix is a fair sample."""
    if split not in _SPLIT_PERCENT:
        raise DraftsmithError(f"embedded corpus: unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    part = _SPLIT_PERCENT[split]
    docs = [(name, text) for name, text in _documents() if _bucket(name) in part]
    return sorted(docs, key=lambda doc: hashlib.sha256(doc[0].encode()).digest())


def _cut_at_line(text: str, max_chars: int) -> str:
    """The longest prefix of whole lines within `max_chars` (a hard cut if the first line is longer)."""
    if len(text) <= max_chars:
        return text
    end = text.rfind("\n", 0, max_chars) + 1
    return text[: end or max_chars]


def load_embedded_corpus(split: str, max_chars: int | None = None) -> list[str]:
    """The texts of one part of the embedded corpus, at most `max_chars` characters in all."""
    texts, used = [], 0
    for _, text in embedded_split(split):
        if max_chars and used + len(text) > max_chars:  # the corpus ends inside this document
            texts.append(_cut_at_line(text, max_chars - used))
            break
        texts.append(text)
        used += len(text)
    return [text for text in texts if text]


def _line_windows(text: str, max_chars: int) -> list[str]:
    windows = []
    while text:
        window = _cut_at_line(text, max_chars)
        windows.append(window)
        text = text[len(window):]
    return [w for w in windows if w.strip()]


def corpus_prompts(count: int, max_chars: int = 512, split: str = "test") -> list[str]:
    """`count` prompts of up to `max_chars` characters cut at line boundaries, spread evenly
    over all the line windows of the split's modules.

    Even spacing makes the prompts a fair sample of the text: taking each module's first
    window would make most of them licence headers, whose continuation is a run of `#`
    lines that says nothing about the code a drafter is meant to predict.
    """
    if count < 1 or max_chars < 1:
        raise DraftsmithError(f"corpus prompts: count ({count}) and max_chars ({max_chars}) must be positive")
    windows = [w for _, text in embedded_split(split) for w in _line_windows(text, max_chars)]
    if len(windows) < count:
        raise DraftsmithError(f"embedded corpus: the {split} split holds {len(windows)} prompts of "
                              f"{max_chars} characters, fewer than the {count} asked for")
    # The middle of each of `count` equal strides, so neither end of the split is favoured.
    return [windows[(2 * i + 1) * len(windows) // (2 * count)] for i in range(count)]


_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text",
             ".md": "text", ".csv": "csv"}
# A local corpus file is one part; named splits carve it in file order, 90/5/5 like the embedded corpus.
_LOCAL_SLICES = {"train": "train[:90%]", "validation": "train[90%:95%]", "test": "train[95%:]"}


def load_dataset_spec(spec: str, split: str = "train", name: str | None = None, streaming: bool = False):
    """A `datasets.Dataset` from a local file (json, jsonl, parquet, csv, text) or a hub name;
    with `streaming`, a `datasets.IterableDataset` read as it is iterated (data/stream.py).

    A local file is read whole as the split "train" (slices such as "train[:95%]" carve it).
    Loading goes through the `datasets` cache, so a second run reuses the Arrow files.
    """
    import datasets

    path = Path(spec).expanduser()
    suffix = path.suffix.lower()
    if (suffix in _BUILDERS or spec.startswith((".", "/", "~"))) and not path.exists():
        raise DraftsmithError(f"dataset {spec}: no such file")
    if path.is_file() and suffix not in _BUILDERS:
        raise DraftsmithError(f"dataset {spec}: unknown file type {suffix!r} (expected one of {', '.join(_BUILDERS)})")
    if path.is_file() and path.stat().st_size == 0:  # datasets would only say "error while generating"
        raise DraftsmithError(f"dataset {spec} is empty")
    if not path.exists():
        from draftsmith.models.hub import dataset_source

        source = dataset_source(spec)  # offline and not in the Hugging Face cache: one line here
    try:
        if path.is_file():
            dataset = datasets.load_dataset(_BUILDERS[suffix], data_files=str(path), split=split, streaming=streaming)
        else:  # a folder of data files, or a hub name (its cached snapshot, else online)
            dataset = datasets.load_dataset(str(path) if path.exists() else source, name, split=split,
                                            streaming=streaming)
    except Exception as exc:  # datasets raises many types (hub, config, schema, Arrow); report the first line
        where = f"config {name!r}, " if name else ""
        raise DraftsmithError(f"dataset {spec} ({where}split {split!r}): {first_lines(exc, 1)}") from None
    if not streaming and len(dataset) == 0:  # a stream has no length until it is read
        raise DraftsmithError(f"dataset {spec} (split {split!r}) is empty")
    return dataset


def load_text_dataset(spec: str, split: str = "train", text_field: str | None = None) -> list[str]:
    """The texts of one split of a plain-text corpus (a .txt file holds one document per line).

    The column is `text_field`, else "text", else the only string column. A local file's
    train, validation and test splits are its first 90%, next 5% and last 5%.
    """
    if Path(spec).expanduser().is_file():
        split = _LOCAL_SLICES.get(split, split)
    dataset = load_dataset_spec(spec, split)
    columns = dataset.column_names
    if not text_field:
        strings = [name for name, feature in dataset.features.items()
                   if getattr(feature, "dtype", None) in ("string", "large_string")]
        text_field = "text" if "text" in columns else (strings[0] if len(strings) == 1 else None)
    if text_field not in columns:
        wanted = f"text column {text_field!r}" if text_field else "text column"
        raise DraftsmithError(f"dataset {spec}: no {wanted} (columns: {', '.join(columns)}); set data.text_field")
    texts = [text for text in dataset[text_field] if isinstance(text, str) and text.strip()]
    if not texts:
        raise DraftsmithError(f"dataset {spec}: column {text_field!r} holds no text")
    return texts
