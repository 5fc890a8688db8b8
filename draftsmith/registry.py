"""One registration per method: every table the parts need is derived from `METHODS`.

A method is its files (the trained module in `models/<name>.py`, its training in
`train/<name>.py`, its decode-time proposer in `eval/proposers/<name>.py`, its layouts in
`models/formats/<name>.py`) plus one `MethodSpec` below (docs/design.md, "Adding a method"). The recipe schema, the training loop, the eval command, the export
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
class DecodeOption:
    """A proposer option `draftsmith eval` sets for one run. One name end to end: `name` is the
    proposer's keyword, the flag (`--` + name with dashes), and the report column."""

    name: str
    help: str  # the flag's help, its default said in words
    check: str  # "module:function(value, what) -> value": refuses a bad value in one line naming `what`
    type: type = float
    metavar: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_REQUIRED = object()


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
    # "module": its formats module (models/formats/__init__.py: read, serve, ...; "" none), the
    # one place that knows its layouts; `face` reaches what it offers.
    formats: str = ""
    exports: dict[str, str] = field(default_factory=dict)  # --format -> "module:function(folder, out, dtype)"
    # Decode-time variants of the same checkpoint: spec name -> options for the proposer.
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Folders other tools write that `eval --drafter NAME:DIR` reads, told apart by their
    # config's architectures[0]: architecture -> layout (models/layouts.py routes by it).
    foreign_layouts: dict[str, str] = field(default_factory=dict)
    # The `speculators_model_type` of the folders vLLM's `speculators` library writes for this
    # method (their formats modules read and write them; models/layouts.py routes by it).
    speculators_type: str = ""
    # Options `eval` sets per run for every drafter of this method (variants included).
    decode_options: tuple[DecodeOption, ...] = ()
    # vLLM (`eval --engine vllm`, eval/engine.py): the export formats whose printed `vllm serve` line
    # serves this method's drafter, preferred first; or, for a method vLLM serves without an
    # export, "module:function(path, num_draft, options) -> (speculative config, note)".
    vllm_layouts: tuple[str, ...] = ()
    vllm_config: str = ""
    vllm_variants: tuple[str, ...] = ()  # decode variants vLLM drafts as we do (the others: one line)
    # train.* values as the method's reference sets them, where they differ from the schema's
    # defaults; a recipe or override that sets the key wins.
    train_defaults: dict[str, Any] = field(default_factory=dict)
    # "module:function(plan: TilePlan) -> str": a line `draftsmith plan` prints for this method where the tile
    # leaves room for drafts (how its drafter is sized by the tile rule, a block say; "" none).
    plan_line: str = ""
    # The --format choices whose writer also takes `latency_table=` (`export --latency-table`: a cost table it
    # writes beside the weights); every writer takes (folder, out_dir, dtype).
    latency_exports: tuple[str, ...] = ()
    # Method keys (`method.*`) that shrink its drafter to a run of seconds on the tests' tiny targets
    # (their golden curves and feature-cache runs read them; {}: its defaults already are small).
    test_keys: dict[str, Any] = field(default_factory=dict)

    def load(self, field_name: str) -> Any:
        """What a "module:attribute" field names, imported: its config class, model class,
        training class or proposer loader."""
        ref = getattr(self, field_name)
        if not ref:
            raise DraftsmithError(f"method {self.name!r} has no {field_name}")
        return import_ref(ref, f"method {self.name!r}")

    def face(self, name: str, default: Any = _REQUIRED) -> Any:
        """`name` of this method's formats module (`read`, `serve`, ...); `default` where the
        method has no formats module or the module does not offer `name`."""
        module = import_ref(self.formats, f"method {self.name!r}'s formats") if self.formats else None
        if module is None or not hasattr(module, name):
            if default is _REQUIRED:
                raise DraftsmithError(f"method {self.name!r}: its formats offer no {name!r} "
                                      f"({self.formats or 'no formats module'})")
            return default
        return getattr(module, name)

    def refs(self) -> dict[str, str]:
        """Every "module:attribute" string of this entry, by the field that holds it."""
        named = {"proposer": self.proposer, "config": self.config, "model": self.model, "training": self.training,
                 "vllm_config": self.vllm_config, "plan_line": self.plan_line}
        return {**{k: v for k, v in named.items() if v}, **{f"exports[{fmt}]": ref for fmt, ref in self.exports.items()},
                **{f"decode_options[{o.name}].check": o.check for o in self.decode_options}}


_NATIVE_EXPORT = "draftsmith.models.export:export_native"
# SpecForge (specforge/optimizer.py: AdamW with torch's betas (0.9, 0.999); lr_scheduler.py:
# CosineAnnealingWarmupLR, eta_min 0) for EAGLE-3 and DFlash; DeepSpec the same for DSpark
# (deepspec/utils/optim.py, the same AdamW and CosineAnnealingWarmupLR with eta_min 0).
_SPECFORGE_OPTIMIZER = {"adam_beta2": 0.999, "min_lr_ratio": 0.0}

def method_table(*specs: MethodSpec) -> dict[str, MethodSpec]:
    """name -> spec; two specs of one name are refused (a dict would keep the last silently),
    and so is a variant that shadows a method or another variant's --drafter name."""
    table: dict[str, MethodSpec] = {}
    names: set[str] = set()
    for spec in specs:
        for name in (spec.name, *spec.variants):
            if name in names:
                raise ValueError(f"draftsmith.registry: the name {name!r} is registered twice")
            names.add(name)
        table[spec.name] = spec
    return table


METHODS: dict[str, MethodSpec] = method_table(
    MethodSpec(
        "ngram", "prompt lookup: copies the continuation of the latest matching n-gram (no training)",
        proposer="draftsmith.eval.proposers.ngram:load_proposer", needs_path=False,
        # ngram_earliest: the earliest match, the copy stopped at the context's end (transformers' and
        # vLLM's policy), for engine-to-engine comparisons on equal drafts
        variants={"ngram_earliest": {"latest": False, "extend": False}},
        vllm_config="draftsmith.eval.proposers.ngram:vllm_config", vllm_variants=("ngram_earliest",),
    ),
    MethodSpec(
        "draft_lm", "an external small causal LM with the target's tokenizer, pretrained or distilled",
        proposer="draftsmith.eval.proposers.draft_lm:load_proposer",
        config="draftsmith.models.draft_lm:DraftLMConfig",
        training="draftsmith.train.draft_lm:DraftLMTraining",
        vllm_config="draftsmith.eval.proposers.draft_lm:vllm_config",
        test_keys={"hidden_size": 64},
    ),
    MethodSpec(
        "mtp", "DeepSeek-V3 multi-token-prediction modules trained jointly with the target",
        proposer="draftsmith.eval.proposers.mtp:load_proposer",
        config="draftsmith.models.mtp:MTPConfig", model="draftsmith.models.mtp:MTPDrafter",
        formats="draftsmith.models.formats.mtp", training="draftsmith.train.mtp:MTPTraining",
        # DeepSeek-style targets only: engines run MTP just for architectures that declare it.
        # SGLang's NextN loader reads one module; vLLM's DeepSeekMTP all K.
        exports={"sglang": "draftsmith.models.formats.mtp:write_sglang",
                 "vllm": "draftsmith.models.formats.mtp:write_vllm",
                 # Qwen3 targets: speculators' MTPDraftModel, module 1 (models/formats/mtp.py)
                 "speculators": "draftsmith.models.formats.mtp:write_speculators"},
        speculators_type="mtp",
        vllm_layouts=("vllm",), vllm_variants=("mtp_nextn",),  # vLLM chains module 1 (design.md section 7)
        # Default: one row per draft, module k for draft k; mtp_nextn: module 1 for every draft (what
        # SGLang and vLLM run today); mtp_exact: DeepSeek's depths, recomputed.
        variants={"mtp_nextn": {"modules": 1}, "mtp_exact": {"mode": "exact"}},
    ),
    MethodSpec(
        "eagle3", "EAGLE-3: one decoder layer over three fused target layers, trained with TTT",
        proposer="draftsmith.eval.proposers.eagle3:load_proposer",
        config="draftsmith.models.eagle3:Eagle3Config", model="draftsmith.models.eagle3:Eagle3Drafter",
        formats="draftsmith.models.formats.eagle3",
        training="draftsmith.train.eagle3:Eagle3Training", reads_target_features=True,
        train_defaults=_SPECFORGE_OPTIMIZER,
        exports={"sglang": "draftsmith.models.formats.eagle3:write_sglang",
                 "vllm": "draftsmith.models.formats.eagle3:write_vllm",
                 "speculators": "draftsmith.models.formats.eagle3:write_speculators", "native": _NATIVE_EXPORT},
        variants={"eagle3_tree": {"tree": True},
                  # EAGLE-2 as published: top-k children under sampling too (an ablation)
                  "eagle3_tree_topk": {"tree": True, "sampled_children": False}},
        foreign_layouts={"LlamaForCausalLMEagle3": "sglang/vllm"},  # SpecForge writes it too
        speculators_type="eagle3", vllm_layouts=("vllm", "speculators"),
        test_keys={"draft_vocab_size": 128, "ttt_length": 2},
    ),
    MethodSpec(
        "dflash", "DFlash: a block-diffusion drafter filling a block of masks in one forward",
        proposer="draftsmith.eval.proposers.dflash:load_proposer",
        config="draftsmith.models.dflash:DFlashConfig", model="draftsmith.models.dflash:DFlashDrafter",
        formats="draftsmith.models.formats.dflash",
        training="draftsmith.train.dflash:DFlashTraining", reads_target_features=True,
        train_defaults=_SPECFORGE_OPTIMIZER,
        plan_line="draftsmith.models.dflash_tile:plan_line",
        exports={"zlab": "draftsmith.models.formats.dflash:write_zlab",
                 "speculators": "draftsmith.models.formats.dflash:write_speculators", "native": _NATIVE_EXPORT},
        foreign_layouts={"DFlashDraftModel": "zlab"},  # z-lab and SpecForge
        speculators_type="dflash", vllm_layouts=("zlab", "speculators"),
        test_keys={"block_size": 4, "num_anchors": 8},
    ),
    MethodSpec(
        "dspark", "DSpark: DFlash's backbone plus a light serial refiner and a confidence head",
        proposer="draftsmith.eval.proposers.dspark:load_proposer",
        config="draftsmith.models.dspark:DSparkConfig", model="draftsmith.models.dspark:DSparkDrafter",
        formats="draftsmith.models.formats.dspark",
        training="draftsmith.train.dspark:DSparkTraining", reads_target_features=True,
        train_defaults=_SPECFORGE_OPTIMIZER,
        plan_line="draftsmith.models.dspark:plan_line", latency_exports=("sglang", "vllm", "deepspec"),
        # One Qwen3DSparkModel folder serves DeepSpec, SGLang and vLLM; SpecForge's trainer reads its own.
        exports={"sglang": "draftsmith.models.formats.dspark:write_qwen3_dspark",
                 "vllm": "draftsmith.models.formats.dspark:write_qwen3_dspark",
                 "deepspec": "draftsmith.models.formats.dspark:write_qwen3_dspark",
                 "specforge": "draftsmith.models.formats.dspark:write_specforge",
                 "speculators": "draftsmith.models.formats.dspark:write_speculators", "native": _NATIVE_EXPORT},
        foreign_layouts={"DSparkDraftModel": "specforge", "Qwen3DSparkModel": "deepspec"},
        speculators_type="dspark",  # both block conventions (sample_from_anchor states which)
        vllm_layouts=("vllm", "speculators"),
        decode_options=(DecodeOption(
            "confidence_threshold", metavar="C", check="draftsmith.models.dspark:check_threshold",
            help="dspark: end a draft before the first position whose confidence is below C, in [0, 1] "
                 "(default: the checkpoint's; 0 drafts the full block)"),),
        test_keys={"block_size": 4, "num_anchors": 8, "markov_rank": 16},
    ),
)


def register(spec: MethodSpec) -> None:
    """Add a method at run time (a plugin, or a test's throwaway method); a name already taken
    is refused as in METHODS. Every table is derived from METHODS when it is read, so the
    method is then known to recipes, training, eval, export and the CLI alike."""
    table = method_table(*METHODS.values(), spec)
    METHODS.clear()
    METHODS.update(table)


def unregister(name: str) -> None:
    METHODS.pop(name)


def import_ref(ref: str, what: str) -> Any:
    """Import a registry string, "module:attribute" (or "module"); a module missing from this
    build is one line."""
    module, _, attr = ref.partition(":")
    try:
        imported = importlib.import_module(module)
        return getattr(imported, attr) if attr else imported
    except ModuleNotFoundError as exc:
        raise DraftsmithError(f"{what} is not available in this build ({exc.name} missing)") from None


def method_spec(name: str, need: str = "") -> MethodSpec:
    """The spec of `name`; with `need` ("config", "training", ...), one whose field is set."""
    known = [n for n, s in METHODS.items() if not need or getattr(s, need)]
    if not name:
        raise DraftsmithError(f"method.name: not set; name the drafter ({', '.join(known)})")
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
    return method_spec(name, "config").load("config")


def decode_options() -> list[tuple[str, DecodeOption]]:
    """(method, option) for every per-run proposer option `eval` offers as a flag."""
    return [(spec.name, option) for spec in METHODS.values() for option in spec.decode_options]
