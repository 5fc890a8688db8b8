"""The tile rule (docs/design.md section 3) and the planner built on it, in one place for
every part that sizes a draft.

Verify attention kernels (FlashAttention-3/4, FlashInfer, FlashMLA) pack the `G` query
heads that share a KV head together with the `1 + D` query tokens into the rows of one
tile. While `G * (1 + D) <= T` the verify pass walks the KV cache once, as plain decoding
does; one row more and a second tile walks it again. So the draft budget is

    D = max(0, T // G - 1)

and for a draft tree the node count, root included, takes the place of `1 + D`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fields import DEFAULT_TILE
from draftsmith.fsutil import read_json
from draftsmith.registry import METHODS, import_ref

# GPT-2 style configs (GPT-BigCode/StarCoder, old Falcon) spell the head count `n_head`,
# MPT and DBRX `n_heads`.
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")


@dataclass(frozen=True)
class TilePlan:
    """Figures named as in docs/design.md section 3; H and KV are whole-model counts."""

    H: int  # query heads
    KV: int  # KV heads (1 for multi-latent attention)
    G: int  # query heads per KV head on one tensor-parallel rank
    tile: int  # rows per tile, T
    tp: int  # tensor-parallel degree
    D: int  # drafts that fit one tile with the root token
    mla: bool  # multi-latent attention: all heads share one latent KV


def has_heads(config: dict) -> bool:
    return any(config.get(key) for key in _HEAD_KEYS)


def plan_tile(config, tile: int = DEFAULT_TILE, tp: int = 1) -> TilePlan:
    """Size the draft for `config` (a dict or a transformers config) on a verify kernel
    with `tile` rows at tensor parallel `tp`."""
    config = as_dict(config)
    if tile < 1 or tp < 1:
        raise DraftsmithError(f"tile ({tile}) and tp ({tp}) must be positive")
    key = next((key for key in _HEAD_KEYS if config.get(key)), None)
    if key is None:
        raise DraftsmithError("config has no num_attention_heads")
    heads = _head_count(config[key], key)
    mla = config.get("kv_lora_rank") is not None
    kv = 1 if mla else _head_count(kv_heads(config, heads), "num_key_value_heads")  # MLA: one latent KV
    if heads % kv:
        raise DraftsmithError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if heads % tp:
        raise DraftsmithError(f"num_attention_heads {heads} does not split over tp {tp}")
    # KV heads are split across ranks, or replicated when there are fewer than ranks.
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise DraftsmithError(f"num_key_value_heads {kv} does not split over tp {tp}")
    group = (heads // tp) // max(1, kv // tp)
    return TilePlan(H=heads, KV=kv, G=group, tile=tile, tp=tp, D=max(0, tile // group - 1), mla=mla)


def _head_count(value, key: str) -> int:
    """A head count as a config must give it: a positive whole number (JSON "8", 8.0 or [8]
    would otherwise fail as a TypeError, and -8 would print G = -8)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DraftsmithError(f"config {key} must be a positive whole number, got {value!r}")
    return value


def as_dict(config) -> dict:
    """A config's fields as a dict, whether given a dict or a transformers config."""
    if isinstance(config, dict):
        return config
    return config.to_dict() if hasattr(config, "to_dict") else vars(config)


def kv_heads(config: dict, heads: int) -> int:
    """KV heads as each family spells them. Falcon follows its attention code: `num_kv_heads`
    (`n_head_kv` in the original configs) counts only under `new_decoder_architecture` or
    without `multi_query`; `multi_query` alone (Falcon-7B, GPT-BigCode) is one KV head.
    MPT and DBRX keep `kv_n_heads` under `attn_config`; ChatGLM `multi_query_group_num`."""
    if config.get("num_key_value_heads") is not None:
        return config["num_key_value_heads"]
    falcon = next((config[k] for k in ("num_kv_heads", "n_head_kv") if config.get(k) is not None), None)
    if falcon is not None and (config.get("new_decoder_architecture") or not config.get("multi_query")):
        return falcon
    if config.get("multi_query_attention") and config.get("multi_query_group_num"):
        return config["multi_query_group_num"]
    if config.get("multi_query"):
        return 1
    attn = config.get("attn_config")
    if isinstance(attn, dict) and attn.get("kv_n_heads") is not None:
        return attn["kv_n_heads"]
    return heads  # plain multi-head attention


# ---------------------------------------------------------------- the planner

# Row counts of the verify tiles in use: FlashMLA 64; FA3 (head_dim 128/256), FA4 and
# FlashInfer 128; FA3 at head_dim <= 96 192; 256 on the widest configurations.
COMMON_TILES = (64, 128, 192, 256)

def read_target_config(source: str | Path) -> dict:
    """The attention fields of a target: `source` is a model folder, a config.json, or a hub
    name (its config.json from the Hugging Face cache, or downloaded alone when online), or
    a GGUF file (that of the folder it converts into, models/gguf.py)."""
    from draftsmith.models.gguf import gguf_folder

    path = gguf_folder(source) or Path(source)
    if path.is_dir():
        config = read_json(path / "config.json")
    elif path.is_file():
        config = read_json(path)
    else:
        config = _cached_hub_config(str(source))
    if not isinstance(config, dict):
        raise DraftsmithError(f"{source}: config is not a JSON object")
    # Multimodal configs (Llava, Gemma 3, Llama 4, ...) keep the language model's
    # attention fields under `text_config`.
    if not has_heads(config) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    if not has_heads(config):
        raise DraftsmithError(
            f"{source}: config has no num_attention_heads (nor text_config.num_attention_heads)"
        )
    return config


def _cached_hub_config(name: str) -> dict:
    """A hub model's config.json: from the Hugging Face cache, else (unless HF_HUB_OFFLINE)
    that one file downloaded into it; never the weights."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from transformers import AutoConfig

    from draftsmith.models.hub import cached_snapshot, looks_like_repo_id

    snapshot = cached_snapshot(name) if looks_like_repo_id(name) else None
    if snapshot is not None and (snapshot / "config.json").is_file():
        return read_json(snapshot / "config.json")
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as exc:
        # Models with remote code (Kimi-K2, ...) have a model_type transformers does not
        # know, but their cached config.json has every field the plan needs.
        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return read_json(cached)
        reason = first_lines(exc, 1)
    try:  # not cached: the config alone from the hub (refused at once when offline)
        return read_json(hf_hub_download(name, "config.json"))
    # huggingface_hub's offline, missing-repository, gated and network errors all mean "not found".
    except Exception as exc:
        raise DraftsmithError(
            f"{name}: not a model folder or config.json, not in the local Hugging Face cache ({reason}), "
            f"and not downloadable ({first_lines(exc, 1)})"
        ) from None


def tree_budget(plan: TilePlan) -> int:
    """Tree nodes, root included, that fit one tile (the root always exists)."""
    return max(1, plan.tile // plan.G)


def rows_used(plan: TilePlan, num_draft: int) -> int:
    return plan.G * (1 + num_draft)


def tiles_launched(plan: TilePlan, num_draft: int) -> int:
    return math.ceil(rows_used(plan, num_draft) / plan.tile)


def fitting_tile(group: int) -> int:
    """The smallest common tile with room for one draft (2G rows), else 2G itself."""
    return next((t for t in COMMON_TILES if t >= 2 * group), 2 * group)


def format_plan(plan: TilePlan) -> str:
    kv_kind = " (multi-latent attention: one latent KV for all heads)" if plan.mla else ""
    lines = [f"heads  H = {plan.H} query, KV = {plan.KV}{kv_kind}"]
    if plan.tp > 1:
        kv_per_rank = max(1, plan.KV // plan.tp)
        lines.append(f"tp     {plan.tp}: {plan.H // plan.tp} query and {kv_per_rank} KV heads per rank")
    lines += [f"G      {plan.G}", f"tile   T = {plan.tile} rows"]
    if plan.D == 0:
        lines.append(
            f"D      0, no room for drafts: the root token alone fills G = {plan.G} rows and "
            f"the tile has {plan.tile}; a tile of {fitting_tile(plan.G)} rows would fit one draft."
        )
    else:
        nodes = tree_budget(plan)
        lines.append(f"D      {plan.D} drafts in a chain, or a tree of {nodes} nodes with the root")
        lines += method_lines(plan)
    lines += [
        "",
        "G is the group size (query heads per KV head) that the verify kernel packs, with the "
        "query tokens, into the rows of one tile.",
        "",
        "| drafts | rows G*(1+d) | tiles |",
        "|---:|---:|---:|",
    ]
    around = range(max(0, plan.D - 2), plan.D + 3)
    for d in sorted({*around, 2 * plan.D + 1}):
        label = f"{d} = D" if d == plan.D else str(d)
        lines.append(f"| {label} | {rows_used(plan, d)} | {tiles_launched(plan, d)} |")
    return "\n".join(lines)


def method_lines(plan: TilePlan) -> list[str]:
    """The lines of the methods that size their drafter by the plan (the registry's `plan_line`)."""
    return [import_ref(spec.plan_line, f"method {spec.name!r}'s plan_line")(plan)
            for spec in METHODS.values() if spec.plan_line]


def plan_command(target_path: str, tile: int, tp: int) -> str:
    """What `draftsmith plan` prints for one target."""
    config = read_target_config(target_path)
    try:
        plan = plan_tile(config, tile=tile, tp=tp)
    except DraftsmithError as exc:
        raise DraftsmithError(f"{target_path}: {exc}") from None
    return f"target {target_path}\n{format_plan(plan)}"
