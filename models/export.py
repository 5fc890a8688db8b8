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


# `draftsmith export RUN --format F`: which formats each method's runs can be written in.
FORMATS = {
    "eagle3": ("sglang", "vllm", "native"),
    "dflash": ("zlab", "native"),
    "dspark": ("dspark", "native"),
}


def export_run(run: str | Path, fmt: str, out_dir: str | Path) -> Path:
    """Write the drafter of a training run (or a native drafter folder) in format `fmt`."""
    import shutil

    from draftsmith.fsutil import atomic_dir
    from draftsmith.models.target import resolve_model_dir

    folder = Path(resolve_model_dir(run))
    if _is_hf_model(folder):
        raise DraftsmithError(f"{run} is a Hugging Face model folder (the target with its MTP modules, or a "
                              f"draft model): serving engines load {folder} as it is")
    method = read_native_meta(folder)["method"]
    if method not in FORMATS:
        raise DraftsmithError(f"{run}: no export for method {method!r}")
    if fmt not in FORMATS[method]:
        raise DraftsmithError(f"{run} holds a {method} drafter: --format must be one of {', '.join(FORMATS[method])}")
    if fmt == "native":
        with atomic_dir(out_dir) as tmp:
            for name in ("config.json", "model.safetensors"):
                shutil.copy2(folder / name, tmp / name)
        return Path(out_dir)
    if method == "eagle3":
        from draftsmith.models.export_eagle3 import export_eagle3

        return export_eagle3(folder, out_dir, fmt)
    from draftsmith.models.export_dflash import export_dflash_zlab, export_dspark, load_native_drafter

    drafter = load_native_drafter(folder, method)
    return export_dspark(drafter, out_dir) if method == "dspark" else export_dflash_zlab(drafter, out_dir)


def _is_hf_model(folder: Path) -> bool:
    try:
        import json

        return "architectures" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
