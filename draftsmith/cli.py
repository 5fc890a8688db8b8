"""The `draftsmith` command.

Bad input ends in one line, `draftsmith: error: ...`, and exit status 2; anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys

from draftsmith.errors import DraftsmithError
from draftsmith.fields import DEFAULT_TILE, Flags
from draftsmith.fsutil import output_lock
from draftsmith.registry import (
    METHODS,
    decode_options,
    export_formats,
    import_ref,
    posthoc,
    proposer_names,
    trainable,
)


def _train(args) -> int | None:
    from draftsmith.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # bad keys fail here, once, not in every process
    if args.accelerate_config:
        from draftsmith.train.launch import launch, launch_argv

        argv = launch_argv(args.accelerate_config, args.recipe, args.overrides)
        logging.getLogger(__name__).info("draftsmith: running %s", shlex.join(argv))
        return launch(argv)
    from draftsmith.train.loop import train

    train(recipe)
    return None


def _recipe_show(args) -> None:
    from draftsmith.recipe_show import show_command

    print(show_command(args.recipe, args.overrides), end="")


def _plan(args) -> None:
    from draftsmith.models.tile import plan_command

    print(plan_command(args.target, args.tile, args.tp))
    if args.measure:
        from draftsmith.models.latency import measure_command

        if not args.out:
            raise DraftsmithError("plan --measure: give --out DIR (the latency table's folder)")
        print()
        with output_lock(args.out):  # two measurements into one folder: the second is refused, none lost
            print(measure_command(args.target, args.tile, args.tp, args.out, contexts=args.contexts,
                                  max_draft=args.max_draft, reps=args.reps, device=args.device))


def _eval(args) -> None:
    from draftsmith.eval.evaluate import evaluate, print_summary
    from draftsmith.eval.settings import EvalSettings
    from draftsmith.recipe import Recipe, load_recipe

    # A recipe's eval section, target.tile (what the drafters were sized for) and chat settings
    # (what they were trained with) give the defaults; flags given win.
    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    section, own, tile, chat = _eval_flags()
    data = chat.over(args, recipe.data)
    settings = EvalSettings(**vars(section.over(args, recipe.eval)), **own.given(args),
                            tile=tile.over(args, recipe.target).tile, chat_template=data.chat_template,
                            enable_thinking=data.enable_thinking, proposer_options=_proposer_options(args))
    with output_lock(args.out):  # one writer per --out: a second eval into it is refused in one line
        print_summary(evaluate(args.target, settings, args.out), args.out)


def _eval_flags() -> tuple[Flags, Flags, Flags, Flags]:
    """eval's flags: the eval section's (its temperature is --temperature's default), the
    command's own, target.tile and the chat settings."""
    from draftsmith.eval.settings import EvalSettings
    from draftsmith.recipe import EvalSection, TargetSection

    section = tuple(f.name for f in dataclasses.fields(EvalSection) if f.name != "temperature")
    own = tuple(f.name for f in dataclasses.fields(EvalSettings) if f.name not in {*section, "temperature"})
    return (Flags(EvalSection, "eval", section), Flags(EvalSettings, names=own, rename=EVAL_RENAMES),
            Flags(TargetSection, "target", ("tile",)), _chat_flags())


# Repeatable flags are named for one value.
EVAL_RENAMES = {"temperatures": "temperature", "drafters": "drafter", "cache_kind": "cache"}


def _chat_flags() -> Flags:
    from draftsmith.recipe import DataSection

    return Flags(DataSection, "data", ("chat_template", "enable_thinking"))


def _proposer_options(args) -> dict[str, dict]:
    """The registered decode options given on the command line: method -> {option: value},
    each value checked by its method's own check (before any model is loaded)."""
    options: dict[str, dict] = {}
    for method, option in decode_options():
        value = getattr(args, option.name)
        if value is not None:
            options.setdefault(method, {})[option.name] = import_ref(option.check, option.flag)(value, option.flag)
    return options


def _regenerate(args) -> None:
    from draftsmith.data.regenerate import regenerate_command, regeneration
    from draftsmith.models.model_dir import find_model_dir
    from draftsmith.recipe import Recipe, load_recipe

    # A recipe gives the target, the dataset, the servers and the sampling; flags win over it.
    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    data_flags, seed_flag = _regenerate_flags()
    data = data_flags.over(args, recipe.data)
    if hasattr(args, "dataset"):  # another dataset than the recipe's: its data.columns are not this one's
        data = dataclasses.replace(data, columns={})
    target = args.target or recipe.target.path
    if not target:
        raise DraftsmithError("data regenerate: give --target (or a --recipe with target.path)")
    settings = regeneration(data, seed_flag.over(args, recipe.train).seed, batch_size=args.batch_size)
    with output_lock(args.out):  # two regenerations would share one partial file (answers doubled)
        out = regenerate_command(str(find_model_dir(target)), args.out, settings, data, limit=args.limit,
                                 target_name=target)
    print(f"wrote {out}")


def _regenerate_flags() -> tuple[Flags, Flags]:
    """data regenerate's flags: the data section's (its regen_ keys without the prefix) and train.seed."""
    from draftsmith.recipe import DataSection, TrainSection

    regen = tuple(f.name for f in dataclasses.fields(DataSection) if f.name.startswith("regen_"))
    names = ("dataset", "dataset_config", "dataset_split", *regen, "chat_template", "enable_thinking")
    return (Flags(DataSection, "data", names, drop="regen_", rename={"regen_servers": "server"}),
            Flags(TrainSection, "train", ("seed",)))


def _prepare(args) -> None:
    from draftsmith.data.prepare import prepare

    with output_lock(args.out):
        out = prepare(args.name, args.out, limit=args.limit, source=args.source)
    print(f"wrote {out}")


def _cache_hidden(args) -> None:
    import json

    from draftsmith.recipe import load_recipe
    from draftsmith.train.posthoc import cache_hidden

    # --recipe collects a list; a recipe written first without the option arrives as one path.
    recipes = [args.recipe] if isinstance(args.recipe, str) else args.recipe or [None]
    if args.method is not None and len(recipes) > 1:
        raise DraftsmithError("data cache-hidden: --method names the method of one recipe; "
                              "with several --recipe each names its own")
    # The flags are overrides by another name (JSON-quoted: YAML would misread some paths).
    flags = {"target.path": args.target, "data.dataset": args.dataset, "method.name": args.method}
    overrides = [*args.overrides, *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)]
    loaded = [load_recipe(path, overrides) for path in recipes]
    with output_lock(args.out):  # one writer per cache folder
        out = cache_hidden(loaded, args.out, batch_size=args.batch_size, shard_rows=args.shard_rows,
                           engine=args.engine or "")
    print(f"wrote {out}")


def _export(args) -> None:
    from pathlib import Path

    from draftsmith.fsutil import check_replaceable
    from draftsmith.models.export import export_notes, export_run
    from draftsmith.models.model_dir import find_model_dir
    from draftsmith.models.run_weights import BEST, MODEL, weights_label

    out, run = Path(args.out).resolve(), Path(args.run_dir)
    if out in {p.resolve() for p in (run, Path(find_model_dir(run)), run / MODEL, run / BEST)}:  # the run's own
        raise DraftsmithError(f"--out {args.out} is the folder being exported; give a new folder")
    check_replaceable(args.out, "config.json", "export")  # an existing folder is replaced whole
    with output_lock(args.out):
        written = export_run(args.run_dir, args.format, args.out, dtype=args.dtype, latency_table=args.latency_table)
    source = find_model_dir(args.run_dir)
    label = weights_label(source)  # a run stands for its best weights: say which were exported
    print(f"wrote {written}" + (f" from {source} (the run's {label} weights)" if label else ""))
    # a layout's caveat, then how to serve it
    for line in export_notes(args.run_dir, args.format, written, latency_table=args.latency_table):
        print(line)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends in its default, unless the text already says it in words
    (a None default means "not given", which the words explain better than "None").
    Descriptions and epilogs keep their lines (the top-level examples are a table)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.required or not action.option_strings:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _report(args) -> None:
    from draftsmith.eval.combine import combine_reports

    with output_lock(args.out):
        out = combine_reports(args.reports, args.out)
    print(f"wrote {out / 'report.md'}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftsmith")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _int_list(text: str) -> list[int]:
    """`256,1024` -> [256, 1024] (argparse shows a ValueError as its own one line)."""
    return [int(part) for part in text.split(",") if part.strip()]


def _description() -> str:
    """The top-level help's first lines, the methods as the registry holds them."""
    return (f"Train speculative-decoding drafters ({', '.join(trainable())}) for a target model,\n"
            "export them for SGLang and vLLM, and measure them losslessly against plain decoding.\n"
            "Every command takes --recipe FILE (recipes/) for its defaults; flags win over it.")
def _examples() -> str:
    """One example per command, in the order of the real path, for the first post-hoc method the
    registry holds (its Llama-3.1-8B recipe); tests/test_cli.py parses each line."""
    m = posthoc()[0]
    recipe, run, fmt = f"recipes/llama31_8b/{m}.yaml", f"runs/llama31_8b/{m}", next(iter(METHODS[m].exports))
    return f"""commands, one example each:
  plan               draftsmith plan meta-llama/Llama-3.1-8B-Instruct
  data prepare       draftsmith data prepare sharegpt --out data/sharegpt.jsonl
  data regenerate    draftsmith data regenerate --recipe {recipe} --server http://127.0.0.1:8000/v1 --out data/regenerated.jsonl
  data cache-hidden  draftsmith data cache-hidden --recipe {recipe} --out cache/llama31_8b
  recipe show        draftsmith recipe show --recipe {recipe} train.lr=5e-5
  train              draftsmith train --recipe {recipe} --accelerate-config zero2
  export             draftsmith export {run} --format {fmt} --out exports/{m}-{fmt}
  eval               draftsmith eval --target meta-llama/Llama-3.1-8B-Instruct --drafter {m}:{run} --dataset mt-bench --out reports/{m}
  report             draftsmith report reports/{m} reports/{m}-sampled --out reports/all

Without a GPU: scripts/demo.sh runs the whole path on CPU against SmolLM2-135M-Instruct (make demo)."""


RECIPE_HELP = "a YAML recipe, e.g. one of recipes/ (default: none, the built-in recipe)"


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.eval.settings import AUTO, TILE, num_draft_arg

    # Subparsers take the parent's class, so every subcommand gets the formatter.
    parser = _Parser(prog="draftsmith", description=_description(), epilog=_examples())
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe (also: accelerate launch -m draftsmith.train --recipe FILE)")
    p.add_argument("--recipe", default=None, help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides; they win over the recipe")
    p.add_argument("--accelerate-config", default=None, metavar="NAME|FILE",
                   help="run under `accelerate launch --config_file`: a config of recipes/accelerate/ "
                        "(cpu, ddp, zero2, zero3, fsdp2) or a YAML file (default: this process, no launcher)")
    p.set_defaults(handler=_train)

    recipe = sub.add_parser("recipe", help="inspect recipes").add_subparsers(dest="recipe_command", required=True,
                                                                            metavar="STEP")
    p = recipe.add_parser("show", help="print a recipe as train resolves it: every key's value, default and meaning")
    p.add_argument("--recipe", default=None, help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides; they win over the recipe")
    p.set_defaults(handler=_recipe_show)

    p = sub.add_parser("plan", help="size the draft count D from the target's head grouping (tile rule)")
    p.add_argument("target", help="a model folder, a config.json, or a hub name")
    p.add_argument("--tile", type=int, default=DEFAULT_TILE, help=f"rows of the verify kernel's tile (default {DEFAULT_TILE})")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--measure", action="store_true",
                   help="time the target's verify forward for 1 + d query tokens on this device (d = 0 to past the "
                        "tile rule's D) at a few context lengths; writes latency.json and latency.png to --out")
    p.add_argument("--out", default=None, help="--measure: the latency table's folder (default: none, required "
                                               "with --measure)")
    p.add_argument("--contexts", type=_int_list, default=None, metavar="N,N,...",
                   help="--measure: KV-cache lengths (default: 256,1024,4096 where the target's context allows)")
    p.add_argument("--max-draft", type=int, default=None,
                   help="--measure: the largest d timed (default: the tile rule's D + 8)")
    p.add_argument("--reps", type=int, default=5, help="--measure: timed forwards per point, median (default 5)")
    p.add_argument("--device", default=None, help="--measure: cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.set_defaults(handler=_plan)

    p = sub.add_parser("eval", help="decode with drafters, check them losslessly, write the report")
    p.add_argument("--target", required=True, help="the target: a model folder, a training run folder or a hub name")
    p.add_argument("--recipe", default=None, help="take the defaults below from this recipe's eval section, "
                                                  "target.tile and chat settings (default: none, the built-in ones)")
    from draftsmith.eval.engine import ENGINE_LAYOUTS, ENGINES  # light: no torch

    section, own, tile, chat = _eval_flags()
    section.add(p, num_draft=dict(type=num_draft_arg, metavar=f"N|{TILE}|{AUTO}", help=(
        f"{AUTO}: per drafter, the D that maximises expected tokens/s from its acceptance on a calibration split "
        "and the verify latency table, capped by the tile rule on GPUs")))
    own.add(p, drafters=dict(required=True, metavar="[LABEL=]NAME[:PATH]", help="NAME: " + ", ".join(
        name + (":RUN" if spec.needs_path else "") for name, (spec, _) in proposer_names().items())),
        latency_table=dict(metavar="DIR|FILE"),
        engine=dict(choices=list(ENGINES)), engine_layouts=dict(choices=list(ENGINE_LAYOUTS)))
    tile.add(p)
    for _, option in decode_options():  # each method's own per-run options (registry.py)
        p.add_argument(option.flag, type=option.type, default=None, metavar=option.metavar or None, help=option.help)
    chat.add(p, chat_template=dict(metavar="FILE_OR_NAME"))
    p.add_argument("--out", required=True, help="report folder (written whole or not at all)")
    p.set_defaults(handler=_eval)

    p = sub.add_parser("report", help="several eval reports on one page, per setting (drafters of other targets too)")
    p.add_argument("reports", nargs="+", metavar="REPORT_DIR",
                   help="eval output folders; the first one's target, settings and plain decoding head the page")
    p.add_argument("--out", required=True, help="the combined report's folder (written whole or not at all)")
    p.set_defaults(handler=_report)

    p = sub.add_parser("export", help="write a trained drafter in a serving engine's layout")
    p.add_argument("run_dir", metavar="RUN", help="a training run folder (or its model/ folder)")
    p.add_argument("--format", required=True, choices=export_formats(),
                   help="; ".join(f"{'|'.join(s.exports)} for {s.name}" for s in METHODS.values() if s.exports))
    p.add_argument("--out", required=True, help="the folder to write (whole or not at all)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights and torch_dtype of the export (default: the target's dtype)")
    p.add_argument("--latency-table", default=None, metavar="DIR|FILE",
                   help="a `draftsmith plan TARGET --measure` table of the serving device: a printed chain's length "
                        "then maximises expected tokens/s with the run's validation acceptance, and " + "; ".join(
                            f"--format {'|'.join(s.latency_exports)} of {s.name}" for s in METHODS.values()
                            if s.latency_exports) + " write a cost table from it (default: none, the references' "
                        "3 steps, no cost table)")
    p.set_defaults(handler=_export)

    _data_parsers(sub)
    return parser


def _data_parsers(sub) -> None:
    """`draftsmith data STEP`: prepare, regenerate, cache-hidden."""
    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_command", required=True,
                                                                          metavar="STEP")
    p = data.add_parser("regenerate", help="answer a dataset's prompts with the target itself (resumable)")
    p.add_argument("--target", default=None,
                   help="a model folder or a training run folder (default: the recipe's target.path)")
    p.add_argument("--recipe", default=None,
                   help="take the target, dataset (with data.columns), servers and sampling settings from this "
                        "recipe's target, data and train.seed (default: none)")
    data_flags, seed_flag = _regenerate_flags()
    data_flags.add(p, regen_servers=dict(metavar="URL"), chat_template=dict(metavar="FILE_OR_NAME"))
    seed_flag.add(p)
    p.add_argument("--out", required=True, help="the jsonl to write (OpenAI messages shape)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts answered per generate call")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many conversations (default: all of --dataset; without one, 256 excerpts "
                        "of the embedded corpus)")
    p.set_defaults(handler=_regenerate)

    p = data.add_parser("prepare", help="write a dataset the references train on as a messages jsonl")
    p.add_argument("name", choices=_prepare_names(), help="sharegpt, ultrachat (200k) or perfectblend (the mix "
                                                           "DeepSpec trains on)")
    p.add_argument("--out", required=True, help="the jsonl to write (written whole or not at all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many conversations (default: all)")
    p.add_argument("--source", default=None, metavar="DIR",
                   help="a local copy laid out as the hub serves it (default: the Hugging Face cache, else the hub)")
    p.set_defaults(handler=_prepare)

    p = data.add_parser("cache-hidden", help="store the target features a post-hoc method trains on, once "
                                              "(resumable); train with data.feature_cache=OUT")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides")
    p.add_argument("--recipe", action="append", default=None,
                   help="a recipe the cache is for (its data, seq_len, seed, method; default: the built-in defaults); "
                        "repeat it for several methods on the same rows: the target runs once for all")
    p.add_argument("--target", default=None,
                   help="target.path: a model folder or a training run folder (default: the recipe's)")
    p.add_argument("--dataset", default=None,
                   help="data.dataset: a conversations file or 'embedded' (default: the recipe's)")
    p.add_argument("--method", default=None, choices=posthoc(), help="method.name (default: the recipe's)")
    p.add_argument("--out", required=True, help="the cache folder (a rerun resumes it)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="rows per target forward (with --engine: requests in flight)")
    p.add_argument("--shard-rows", type=int, default=0, help="rows per shard file (default: about 1 GB each)")
    p.add_argument("--engine", default=None, metavar="vllm",
                   help="run the target's forward in a vLLM server that draftsmith starts (`make engine`, or "
                        "DRAFTSMITH_ENGINE_PYTHON) and read the layers it captured (default: in this process)")
    p.set_defaults(handler=_cache_hidden)


def _prepare_names() -> list[str]:
    from draftsmith.data.prepare import SOURCES

    return list(SOURCES)


def quiet_libraries() -> None:
    """Keep stderr for our one-line errors and our own progress bars: transformers'
    per-load weight bars and its 5.24 `cache=` rename notice only add noise."""
    import logging

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        logging.getLogger("transformers.utils.generic").setLevel(logging.ERROR)
    except ImportError:
        pass


def check_numbers(args) -> None:
    """The recipe's rule for numbers, for flags: every float finite, a seed in numpy's range
    (argparse's float() takes "nan" and "inf"; NaN would then pass every range check)."""
    from draftsmith.fields import finite, seed

    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float):
                finite(item, flag)
        if name == "seed" and isinstance(value, int):
            seed(value, flag)


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-v/-q on the command and on every subcommand, before or after its name (draftsmith/logs.py)."""
    def add(p, default):
        p.add_argument("-v", "--verbose", action="count", default=default,
                       help="show debug messages too (default: progress and status)")
        p.add_argument("-q", "--quiet", action="count", default=default,
                       help="warnings and errors only, no progress bars; -qq: errors only (default: progress and status)")

    add(parser, 0)
    todo = [parser]
    while todo:
        for action in todo.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    add(sub, argparse.SUPPRESS)  # the command's own count unless given here
                    todo.append(sub)


def check_working_dir() -> None:
    """Refuse to run from a working directory that was deleted: transformers resolves paths
    against it on import (a FileNotFoundError traceback), and a relative path given, or a
    recipe default such as runs/default, would mean nothing. Going elsewhere silently would
    give those paths another meaning, so it is one line instead."""
    import os

    try:
        os.getcwd()
    except FileNotFoundError:
        raise DraftsmithError("the working directory no longer exists (deleted while this shell was in it): "
                              "cd to an existing folder and run again") from None


def main(argv: list[str] | None = None) -> int:
    from draftsmith.logs import setup_logging

    try:
        check_working_dir()
    except DraftsmithError as exc:
        print(f"draftsmith: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    add_verbosity(parser)
    args, extra = parser.parse_known_args(argv)
    # argparse ends a `nargs="*"` positional at the first option, so overrides written after
    # an option (train --recipe R --accelerate-config cpu key=value) arrive here: they are kept.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # The recipe is --recipe in every command. Written first without the option, as `train` and
    # `recipe show` (and `python -m draftsmith.train`) took it before, it is still taken.
    overrides = getattr(args, "overrides", None)
    if overrides and getattr(args, "recipe", "") is None and "=" not in overrides[0]:
        args.recipe = overrides.pop(0)
    setup_logging(args.verbose, args.quiet)  # first: tqdm reads TQDM_DISABLE (-q) when it is imported
    quiet_libraries()
    try:
        check_numbers(args)
        status = args.handler(args)  # a launched child's exit status, or None
    except DraftsmithError as exc:
        print(f"draftsmith: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a full disk where no writer of ours said what it kept
        from draftsmith.fsutil import full_disk_reason, is_disk_full, write_failure

        if not is_disk_full(exc):
            raise
        print(f"draftsmith: error: {write_failure(exc)} ({full_disk_reason(exc)}); the files finished before "
              "are intact (each is written whole or not at all)", file=sys.stderr)
        return 2
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
