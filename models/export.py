"""Conversions between our modules and the layouts other tools load.

One function per format; the drafter modules know nothing about them. EAGLE-3 and
DFlash/DSpark layouts live in `export_eagle3.py` and `export_dflash.py`.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.mtp import MTPConfig, MTPHeads
from draftsmith.models.native import (
    config_from_dict, load_native_weights, load_state_strict, read_native_meta, save_native,
)

MTP_DIR = "mtp"  # the MTP modules sit in this subfolder of the saved target


def mtp_deepseek_names(state: dict) -> dict:
    """Our nested names -> DeepSeek-V3's flat ones: `layers.k.block.self_attn...` becomes
    `layers.k.self_attn...`, beside `layers.k.{enorm,hnorm,eh_proj,shared_head.norm}`.
    `shared_head.head` and `embed_tokens` are the target's and are not repeated."""
    return {name.replace(".block.", "."): t for name, t in state.items()}


def mtp_from_deepseek_names(state: dict) -> dict:
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    out = {}
    for name, t in state.items():
        prefix, k, rest = name.split(".", 2)
        out[name if rest.startswith(own) else f"{prefix}.{k}.block.{rest}"] = t
    return out


def save_mtp(heads: MTPHeads, config: MTPConfig, target_dir: Path) -> Path:
    """Write the MTP modules beside a saved target: TARGET/mtp/{config.json,model.safetensors}."""
    return save_native(target_dir / MTP_DIR, "mtp", config, mtp_deepseek_names(heads.state_dict()),
                       extra={"num_nextn_predict_layers": heads.num_depths,
                              "shared": ["embed_tokens", "shared_head.head"]})


def load_mtp(target_dir: str | Path, target: nn.Module) -> tuple[MTPHeads, MTPConfig]:
    folder = Path(target_dir) / MTP_DIR
    if not folder.is_dir():
        raise DraftsmithError(f"{target_dir} has no MTP modules (expected a {MTP_DIR}/ folder from the mtp recipe)")
    meta = read_native_meta(folder, expect_method="mtp")
    config = config_from_dict(MTPConfig, meta["config"], source=f"{folder}/config.json")
    heads = MTPHeads.for_target(target, config.num_depths)
    load_state_strict(heads, mtp_from_deepseek_names(load_native_weights(folder)), source=str(folder))
    return heads, config
