"""The offline feature cache: a target's features over a set of training rows, computed
once and read back by any number of training runs that then never load the target.

A cache folder holds

    manifest.json                what the features are: the target (path and fingerprint),
                                 the rows' settings, dtype, seq_len, per method its layer ids
                                 and the like (`methods`), every stored tensor by its
                                 METHOD.KEY name (`tensors`), the shard plan, `complete`
    rows.safetensors             copies of the rows: input_ids, loss_mask, attention_mask [N, T]
    shard-NNNNN.safetensors      the features of one row range, each named METHOD.KEY,
                                 e.g. dflash.hidden [n, T, k*H]

One cache serves every post-hoc method trained on the same rows: the target runs once per
batch, capturing the layers all of them read, and each method's share is stored under its
name (a run reads only its own). Only what the caller's `compute` returns is stored (each
method decides what its loss reads), floating tensors in bfloat16. A shard is written under
a temporary name and renamed, so it
exists under its own name only when whole: an interrupted writer keeps the shards it
finished and restarts at the first missing one; `complete` is set when none is missing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file, ensure_writable_dir, open_safetensors, read_json, write_json
from draftsmith.processes import Processes

FORMAT = "draftsmith-feature-cache/2"
OLD_FORMATS = ("draftsmith-feature-cache/1",)  # one method per cache, tensors named without it
DTYPE = torch.bfloat16
ROW_KEYS = ("input_ids", "loss_mask", "attention_mask")
SHARD_BYTES = 1 << 30  # default shard size: the unit of resumption; writing one holds about twice this
MANIFEST = "manifest.json"
ROWS = "rows.safetensors"


# ---------------------------------------------------------------- the target's identity

def local_model_dir(path: str | Path) -> Path:
    """The folder holding a model's files: `path` as `find_model_dir` gave it (a folder, or a
    hub name it found in no cache, downloaded here)."""
    local = Path(path)
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 - the hub raises many kinds; all mean "not there"
        raise DraftsmithError(f"target {path}: no local folder and cannot fetch it ({type(exc).__name__})") from None


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"target {model_dir} has no safetensors weights (a feature cache reads them)")
    return files


def target_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """Hashes of the config and of the weights, the latter over the first and last row of
    every tensor: any fine-tune or conversion changes them, and it reads kilobytes, not the
    model. Paths move; this is what says two targets are the same."""
    model_dir = local_model_dir(model_dir)
    config = read_json(model_dir / "config.json")
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    weights = hashlib.sha256()
    for file in _weight_files(model_dir):
        with open_safetensors(file) as f:
            for name in sorted(f.keys()):
                part = f.get_slice(name)
                shape = part.get_shape()
                weights.update(f"{name}:{part.get_dtype()}:{shape}".encode())
                if shape:
                    for row in (part[:1], part[-1:]):
                        weights.update(row.contiguous().view(torch.uint8).numpy().tobytes())
    return {"config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
            "weights": weights.hexdigest()[:16]}


class TargetEnds(nn.Module):
    """The target's input embedding and output head alone, with its config: all a drafter
    trained from a feature cache still reads of the target."""

    def __init__(self, config, embed: nn.Module, head: nn.Module):
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.lm_head = head

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def load_target_ends(path: str | Path, dtype: str = "auto", device=None) -> TargetEnds:
    """Read only the embedding and head tensors from the target's safetensors files.

    The modules come from the model class built on the meta device, so their types and
    tensor names are the architecture's own; a tied head shares the embedding's weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = local_model_dir(path)
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {module: name for name, module in skeleton.named_modules(remove_duplicate=False)}
    embed, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    wanted = {f"{names[m]}.{p}": (m, p) for m in (embed, head) for p, _ in m.named_parameters(recurse=False)}
    found = {}
    for file in _weight_files(model_dir):
        with open_safetensors(file) as f:
            found.update({k: f.get_tensor(k) for k in wanted.keys() & set(f.keys())})
    if f"{names[head]}.weight" not in found and getattr(config, "tie_word_embeddings", False):
        found[f"{names[head]}.weight"] = found.get(f"{names[embed]}.weight")
    missing = sorted(k for k in wanted if found.get(k) is None)
    if missing:
        raise DraftsmithError(f"target {path}: {', '.join(missing)} not found in its safetensors files")
    cast = None if dtype == "auto" else getattr(torch, dtype)
    for key, (module, param) in wanted.items():
        tensor = found[key].to(device=device, dtype=cast or found[key].dtype)
        setattr(module, param, nn.Parameter(tensor, requires_grad=False))
    return TargetEnds(config, embed, head).eval()


# ---------------------------------------------------------------- writing

def _sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _store(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.to(DTYPE) if v.is_floating_point() else v).cpu().contiguous() for k, v in features.items()}


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000


def _identity(manifest: dict) -> dict:
    """What a restart must bring to resume a cache: the same features of the same rows of
    the same target, wherever the target and the rows' source now are."""
    same = {k: v for k, v in manifest.items() if k not in ("source", "shards", "complete")}
    same["target"] = (manifest.get("target") or {}).get("fingerprint")
    return same


def check_sizes(batch_size: int, shard_rows: int) -> None:
    """Refuse sizes a cache cannot be written with, before anything is computed or written
    (a negative shard size planned no shards at all, and a cache of none was marked complete)."""
    if batch_size < 1:
        raise DraftsmithError(f"--batch-size: must be at least 1, got {batch_size}")
    if shard_rows < 0:
        raise DraftsmithError(f"--shard-rows: must be 0 (about {_human(SHARD_BYTES)} each) or more, got {shard_rows}")


def _whole(file: Path) -> bool:
    """Whether a file the cache wrote is there and readable (written whole; not cut since)."""
    try:
        with open_safetensors(file):
            return True
    except DraftsmithError:
        return False


def _plan_covers(shards: list, n: int) -> bool:
    """Whether a shard plan covers rows 0..n-1 exactly once, in order (and at least one row)."""
    edge = 0
    for shard in shards:
        start, stop = shard["rows"]
        if start != edge or stop <= start:
            return False
        edge = stop
    return n > 0 and edge == n


def write_feature_cache(out: str | Path, identity: dict, tokens: dict[str, torch.Tensor],
                        compute: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                        batch_size: int = 8, shard_rows: int = 0, processes=None) -> Path:
    """Store `compute(batch of rows)` for every row of `tokens` ({ROW_KEYS: [N, T]}).

    `identity` (JSON) says what the features are and whose; the manifest records it, and a
    restart must bring the same (with the same rows) to resume, else it is refused.
    `shard_rows` 0 sizes shards to about SHARD_BYTES. Prints the disk size before starting.
    `processes` (draftsmith/processes.py: rank, world, barrier) deals the shards round-robin to the
    processes of a launch; the main one writes the rows and the manifest and, once every
    shard is there, marks the cache complete. A shard is the same whoever computes it.
    """
    from tqdm.auto import tqdm

    from draftsmith.logs import show_progress

    check_sizes(batch_size, shard_rows)
    n, seq_len = tokens["input_ids"].shape
    if n == 0:
        raise DraftsmithError(f"{out}: no rows to cache (the dataset gave no training rows)")
    out = ensure_writable_dir(out)
    # One row through `compute` gives the exact per-row size and the tensors' layout.
    probe = _store(compute({k: v[:1] for k, v in tokens.items()}))
    layout = {k: {"shape": list(v.shape[1:]), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in probe.items()}
    row_bytes = sum(v.numel() * v.element_size() for v in probe.values())
    manifest = {"format": FORMAT, **identity, "dtype": str(DTYPE).removeprefix("torch."), "seq_len": seq_len,
                "rows_file": ROWS, "rows_sha256": _sha256(tokens), "num_rows": n, "tensors": layout}
    old = read_json(out / MANIFEST) if (out / MANIFEST).is_file() else None
    if old is not None:
        have, want = _identity(old), _identity(manifest)
        differs = [k for k in want if have.get(k) != want[k]]
        if differs:
            raise DraftsmithError(f"{out} holds a feature cache of other features or rows ({differs[0]} differs); "
                                  "delete it or choose another --out")
        manifest["shards"] = old["shards"]
    processes = processes or Processes()
    if old is None or not _plan_covers(manifest["shards"], n):  # an old plan that misses rows is replanned
        for shard in (old or {}).get("shards", []) if processes.main else []:
            (out / shard["file"]).unlink(missing_ok=True)
        per = shard_rows or max(1, SHARD_BYTES // max(row_bytes, 1))
        manifest["shards"] = [{"file": f"shard-{i // per:05d}.safetensors", "rows": [i, min(i + per, n)]}
                              for i in range(0, n, per)]
    per_position = " + ".join(f"{v.numel() // seq_len} {k} x {v.element_size()} B" for k, v in probe.items())
    if processes.main:
        logging.getLogger(__name__).info("feature cache: %d rows x %d positions x (%s) = %s in %d shard(s) -> %s", n,
                                         seq_len, per_position, _human(n * row_bytes), len(manifest["shards"]), out)
        if not _whole(out / ROWS):  # absent, or damaged since: written anew
            with atomic_file(out / ROWS, "wb") as f:
                f.write(save({k: v.contiguous() for k, v in tokens.items()}))
        write_json(out / MANIFEST, {**manifest, "complete": False})
    mine = [s for i, s in enumerate(manifest["shards"]) if processes.mine(i)]
    todo = [s for s in mine if not _whole(out / s["file"])]
    total = sum(b - a for a, b in (s["rows"] for s in mine))
    done = total - sum(b - a for a, b in (s["rows"] for s in todo))
    with tqdm(total=total, initial=done, desc="cache features", unit="row", dynamic_ncols=True,
              disable=not processes.main or not show_progress()) as bar:
        for shard in todo:
            start, stop = shard["rows"]
            tensors = {k: torch.empty(stop - start, *v.shape[1:], dtype=v.dtype) for k, v in probe.items()}
            for a in range(start, stop, batch_size):
                b = min(a + batch_size, stop)
                batch = {k: v[a:b] for k, v in tokens.items()}
                for key, value in _store(compute(batch)).items():
                    tensors[key][a - start : b - start] = value
                bar.update(b - a)
            with atomic_file(out / shard["file"], "wb") as f:
                f.write(save(tensors))
    processes.barrier()
    if processes.main:
        missing = [s["file"] for s in manifest["shards"] if not (out / s["file"]).is_file()]
        if missing or not manifest["shards"]:  # another process failed, or does not see this folder
            raise DraftsmithError(f"{out}: {len(missing)} shard(s) missing after every process finished "
                                  f"({missing[0]} ...); rerun to resume")
        write_json(out / MANIFEST, {**manifest, "complete": True})
    processes.barrier()
    return out


# ---------------------------------------------------------------- reading

class FeatureCache:
    """A complete cache, opened for reading; `expect` refuses one made for something else."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise DraftsmithError(f"feature cache {self.path}: no {MANIFEST} "
                                  "(write one with draftsmith data cache-hidden)")
        self.manifest = m = read_json(self.path / MANIFEST)
        if m.get("format") in OLD_FORMATS:
            raise DraftsmithError(f"feature cache {self.path} was written by an older draftsmith ({m['format']}): "
                                  "rerun draftsmith data cache-hidden into a new folder")
        if m.get("format") != FORMAT:
            raise DraftsmithError(f"feature cache {self.path}: {MANIFEST} is not a {FORMAT} manifest")
        missing = [s["file"] for s in m["shards"] if not (self.path / s["file"]).is_file()]
        if not m.get("complete") or missing or not _plan_covers(m["shards"], m.get("num_rows", 0)):
            raise DraftsmithError(f"feature cache {self.path} is incomplete ({len(missing)} of {len(m['shards'])} "
                                  "shards missing): rerun draftsmith data cache-hidden with the same arguments")
        remedy = "rerun draftsmith data cache-hidden with the same arguments to write it anew"
        for shard in m["shards"]:  # headers only: a truncated shard is named now, not mid-run
            with open_safetensors(self.path / shard["file"], remedy):
                pass
        with open_safetensors(self.path / m["rows_file"], remedy) as f:
            self.tokens = {k: f.get_tensor(k) for k in f.keys()}

    def expect_target(self, model_dir: str | Path) -> None:
        want = self.manifest["target"]
        have = target_fingerprint(model_dir)
        differs = [k for k in have if have[k] != want["fingerprint"].get(k)]
        if differs:
            raise DraftsmithError(f"feature cache {self.path} was written for another target ({want['path']}): "
                                  f"the {' and '.join(differs)} of {model_dir} differ")

    def expect(self, fields: dict, section: str | tuple = ()) -> None:
        """Each key of `fields` must hold the same value in the manifest (or in a section of it,
        a key or a path of keys)."""
        node = self.manifest
        for part in (section,) if isinstance(section, str) else section or ():
            node = node.get(part, {})
        for key, value in fields.items():
            if node.get(key) != value:
                raise DraftsmithError(f"feature cache {self.path} holds {key}={node.get(key)!r}; "
                                      f"this run needs {key}={value!r}")

    def expect_method(self, identity: dict) -> None:
        """The cache holds features for `identity["method"]`, the same as that identity names."""
        name, held = identity["method"], self.manifest.get("methods", {})
        if name not in held:
            raise DraftsmithError(f"feature cache {self.path} holds features for {', '.join(held) or 'no method'}; "
                                  f"this run needs {name}'s (cache-hidden --recipe for each method)")
        self.expect({k: v for k, v in identity.items() if k != "method"}, section=("methods", name))

    def rows(self, start: int, stop: int, method: str = "") -> "CachedRows":
        """Rows start..stop-1 with `method`'s features under their own names (all with "")."""
        return CachedRows(self, start, stop, f"{method}." if method else "")


class CachedRows(torch.utils.data.Dataset):
    """Rows start..stop-1 of a cache: each a dict of its tokens and its stored features whose
    names start with `prefix` (named without it), read from the shard files on demand
    (memory-mapped, never loaded whole): a run reads its own method's features alone."""

    def __init__(self, feature_cache: FeatureCache, start: int, stop: int, prefix: str = ""):
        self.feature_cache, self.start, self.stop = feature_cache, start, stop
        self.tokens = {k: v[start:stop] for k, v in feature_cache.tokens.items()}
        self.stored = {k.removeprefix(prefix): k for k in feature_cache.manifest["tensors"] if k.startswith(prefix)}
        self.shards = feature_cache.manifest["shards"]
        self.starts = [s["rows"][0] for s in self.shards]
        self.handles = {}  # shard index -> open file, per process

    def __getstate__(self):  # a DataLoader worker opens its own files
        return {**self.__dict__, "handles": {}}

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        row = self.start + i
        s = bisect.bisect_right(self.starts, row) - 1
        if s not in self.handles:
            self.handles[s] = open_safetensors(self.feature_cache.path / self.shards[s]["file"])
        j = row - self.starts[s]
        item = {k: v[i] for k, v in self.tokens.items()}
        item.update({k: self.handles[s].get_slice(stored)[j : j + 1][0] for k, stored in self.stored.items()})
        return item
