"""One registration per method: every table the parts need is derived from `METHODS`.

A method is its files (the trained module in `models/<name>.py`, its training in
`train/<name>.py`, its decode-time proposer in `eval/proposers/<name>.py`) plus one
`MethodSpec` below. The recipe schema, the training loop, the eval command, the export
command and the CLI's choices all read this table, so adding a method means adding its
files and one entry here.

Entries name code as "module:attribute" strings, imported only when used: parsing a
recipe or the command line never imports a drafter it does not use (nor torch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str  # one line, shown by `draftsmith --help` and in the docs
    proposer: str  # "module:function" -> load_proposer(path, target, **options)
    config: str = ""  # "module:Class": the config dataclass of its trained module ("" nothing to train)
    model: str = ""  # "module:Class": the trained nn.Module, saved in the native format ("" none)
    training: str = ""  # "module:Class": its TrainMethod subclass ("" nothing to train)
    reads_target_features: bool = False  # trained post hoc on a frozen target's hidden states
    needs_path: bool = True  # a proposer built from a trained folder (NAME:PATH)
    exports: dict[str, str] = field(default_factory=dict)  # --format -> "module:function(folder, out)"
    # Decode-time variants of the same checkpoint: spec name -> options for the proposer.
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Folders other tools write that `eval --drafter NAME:DIR` reads, told apart by their
    # config's architectures[0]: architecture -> layout (models/layouts.py routes by it).
    foreign_layouts: dict[str, str] = field(default_factory=dict)


_NATIVE_EXPORT = "draftsmith.models.export:export_native"

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec(
        "ngram", "prompt lookup: copies the continuation of the latest matching n-gram (no training)",
        proposer="draftsmith.eval.proposers.ngram:load_proposer", needs_path=False,
    ),
    MethodSpec(
        "draft_lm", "an external small causal LM with the target's tokenizer, pretrained or distilled",
        proposer="draftsmith.eval.proposers.draft_lm:load_proposer",
        config="draftsmith.models.draft_lm:DraftLMConfig",
        training="draftsmith.train.draft_lm:DraftLMTraining",
    ),
    MethodSpec(
        "mtp", "DeepSeek-V3 multi-token-prediction modules trained jointly with the target",
        proposer="draftsmith.eval.proposers.mtp:load_proposer",
        config="draftsmith.models.mtp:MTPConfig", model="draftsmith.models.mtp:MTPDrafter",
        training="draftsmith.train.mtp:MTPTraining",
        # DeepSeek-style targets only: engines run MTP just for architectures that declare it.
        exports={"deepseek": "draftsmith.models.export_mtp:export_deepseek"},
        # Default: the engines' chain (one row per draft); mtp_exact: DeepSeek's depths, recomputed.
        variants={"mtp_exact": {"mode": "exact"}},
    ),
    MethodSpec(
        "eagle3", "EAGLE-3: one decoder layer over three fused target layers, trained with TTT",
        proposer="draftsmith.eval.proposers.eagle3:load_proposer",
        config="draftsmith.models.eagle3:Eagle3Config", model="draftsmith.models.eagle3:Eagle3Drafter",
        training="draftsmith.train.eagle3:Eagle3Training", reads_target_features=True,
        exports={"sglang": "draftsmith.models.export_eagle3:export_sglang",
                 "vllm": "draftsmith.models.export_eagle3:export_vllm", "native": _NATIVE_EXPORT},
        variants={"eagle3_tree": {"tree": True},
                  # EAGLE-2 as published: top-k children under sampling too (an ablation)
                  "eagle3_tree_topk": {"tree": True, "sampled_children": False}},
        foreign_layouts={"LlamaForCausalLMEagle3": "sglang/vllm"},  # SpecForge writes it too
    ),
    MethodSpec(
        "dflash", "DFlash: a block-diffusion drafter filling a block of masks in one forward",
        proposer="draftsmith.eval.proposers.dflash:load_proposer",
        config="draftsmith.models.dflash:DFlashConfig", model="draftsmith.models.dflash:DFlashDrafter",
        training="draftsmith.train.dflash:DFlashTraining", reads_target_features=True,
        exports={"zlab": "draftsmith.models.export_dflash:export_zlab", "native": _NATIVE_EXPORT},
        foreign_layouts={"DFlashDraftModel": "zlab"},  # z-lab and SpecForge
    ),
    MethodSpec(
        "dspark", "DSpark: DFlash's backbone plus a light serial refiner and a confidence head",
        proposer="draftsmith.eval.proposers.dflash:load_dspark_proposer",
        config="draftsmith.models.dspark:DSparkConfig", model="draftsmith.models.dspark:DSparkDrafter",
        training="draftsmith.train.dflash:DFlashTraining", reads_target_features=True,
        exports={"specforge": "draftsmith.models.export_dflash:export_specforge",
                 "deepspec": "draftsmith.models.export_dflash:export_deepspec", "native": _NATIVE_EXPORT},
        foreign_layouts={"DSparkDraftModel": "specforge", "Qwen3DSparkModel": "deepspec"},
    ),
)}


def resolve(ref: str, what: str) -> Any:
    """Import "module:attribute"; a module missing from this build is one line."""
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        raise DraftsmithError(f"{what} is not available in this build ({exc.name} missing)") from None


def method_spec(name: str, need: str = "") -> MethodSpec:
    """The spec of `name`; with `need` ("config", "training", ...), one whose field is set."""
    known = [n for n, s in METHODS.items() if not need or getattr(s, need)]
    if name not in known:
        raise DraftsmithError(f"method.name: unknown method {name!r} (known: {', '.join(known)})")
    return METHODS[name]


def trainable() -> list[str]:
    return [n for n, s in METHODS.items() if s.training]


def posthoc() -> list[str]:
    """Methods trained on a frozen target's features (these can use a feature cache)."""
    return [n for n, s in METHODS.items() if s.reads_target_features]


def proposer_names() -> dict[str, tuple[MethodSpec, dict[str, Any]]]:
    """Every drafter name `eval --drafter` accepts: each method and its decode variants."""
    out = {}
    for spec in METHODS.values():
        out[spec.name] = (spec, {})
        for variant, options in spec.variants.items():
            out[variant] = (spec, options)
    return out


def export_formats() -> list[str]:
    return sorted({fmt for s in METHODS.values() for fmt in s.exports})


def config_class(name: str) -> type:
    return resolve(method_spec(name, "config").config, f"method {name!r}")
