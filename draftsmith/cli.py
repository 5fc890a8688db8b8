"""The `draftsmith` command.

Bad input ends in one line, `draftsmith: error: ...`, and exit status 2; anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import output_lock
from draftsmith.registry import METHODS, decode_options, export_formats, import_ref, posthoc, proposer_names


def pick(flag, default):
    """A flag given on the command line (not None), else the recipe's (or built-in) value."""
    return default if flag is None else flag


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
        print(measure_command(args.target, args.tile, args.tp, args.out, contexts=args.contexts,
                              max_draft=args.max_draft, reps=args.reps, device=args.device))


def _eval(args) -> None:
    from draftsmith.eval.evaluate import EvalSettings, evaluate, print_summary
    from draftsmith.recipe import DataSection, EvalSection, TargetSection, load_recipe

    # A recipe's `eval` section gives the defaults; flags on the command line win.
    recipe = load_recipe(args.recipe) if args.recipe else None
    defaults = recipe.eval if recipe else EvalSection()
    recipe_data = recipe.data if recipe else DataSection()  # the chat settings the drafters were trained with
    target = recipe.target if recipe else TargetSection()  # the tile the drafters were sized for
    num_draft = pick(args.num_draft, defaults.num_draft)
    settings = EvalSettings(
        dataset=args.dataset, num_prompts=pick(args.num_prompts, defaults.num_prompts),
        max_new_tokens=pick(args.max_new_tokens, defaults.max_new_tokens),
        temperatures=args.temperature or [defaults.temperature], top_k=pick(args.top_k, defaults.top_k),
        top_p=pick(args.top_p, defaults.top_p), seed=pick(args.seed, defaults.seed),
        num_draft=None if num_draft == -1 else num_draft,  # the flag's -1 is the recipe's null: the tile rule
        latency_table=args.latency_table or "", calibration_prompts=args.calibration_prompts,
        tile=pick(args.tile, target.tile),
        prompt_chars=args.prompt_chars, min_prompt_tokens=args.min_prompt_tokens,
        drafters=args.drafter,
        cache=args.cache, compile=args.compile,
        proposer_options=_proposer_options(args),
        chat_template=pick(args.chat_template, recipe_data.chat_template),
        enable_thinking=pick(args.enable_thinking, recipe_data.enable_thinking),
    )
    with output_lock(args.out):  # one writer per --out: a second eval into it is refused in one line
        print_summary(evaluate(args.target, settings, args.out), args.out)


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
    from draftsmith.data.regenerate import regenerate_command
    from draftsmith.models.target import find_model_dir
    from draftsmith.recipe import Recipe, load_recipe

    # A recipe gives the target, the dataset, the servers and the sampling; flags win over it.
    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    data = recipe.data
    target = pick(args.target, recipe.target.path)
    if not target:
        raise DraftsmithError("data regenerate: give --target (or a --recipe with target.path)")
    dataset = pick(args.dataset, data.dataset if data.dataset != "embedded" else None)
    with output_lock(args.out):  # two regenerations would share one partial file (answers doubled)
        out = regenerate_command(str(find_model_dir(target)), dataset, args.out,
                                 max_new_tokens=pick(args.max_new_tokens, data.regen_max_new_tokens),
                                 temperature=pick(args.temperature, data.regen_temperature),
                                 top_p=pick(args.top_p, data.regen_top_p), top_k=pick(args.top_k, data.regen_top_k),
                                 seed=pick(args.seed, recipe.train.seed), batch_size=args.batch_size, limit=args.limit,
                                 servers=pick(args.server, data.regen_servers),
                                 in_flight=pick(args.in_flight, data.regen_in_flight), target_name=target,
                                 dataset_config=pick(args.dataset_config, data.dataset_config),
                                 dataset_split=pick(args.dataset_split, data.dataset_split),
                                 columns=data.columns if args.dataset is None else None,
                                 chat_template=pick(args.chat_template, data.chat_template),
                                 enable_thinking=pick(args.enable_thinking, data.enable_thinking))
    print(f"wrote {out}")


def _prepare(args) -> None:
    from draftsmith.data.prepare import prepare

    with output_lock(args.out):
        out = prepare(args.name, args.out, limit=args.limit, source=args.source)
    print(f"wrote {out}")


def _cache_hidden(args) -> None:
    import json

    from draftsmith.recipe import load_recipe
    from draftsmith.train.posthoc import cache_hidden

    # The flags are overrides by another name (JSON-quoted: YAML would misread some paths).
    flags = {"target.path": args.target, "data.dataset": args.dataset, "method.name": args.method}
    overrides = [*args.overrides, *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)]
    recipe = load_recipe(args.recipe, overrides)
    with output_lock(args.out):  # one writer per cache folder
        out = cache_hidden(recipe, args.out, batch_size=args.batch_size, shard_rows=args.shard_rows)
    print(f"wrote {out}")


def _export(args) -> None:
    from pathlib import Path

    from draftsmith.fsutil import check_replaceable
    from draftsmith.models.export import export_notes, export_run
    from draftsmith.models.run_weights import BEST, MODEL, weights_label
    from draftsmith.models.target import find_model_dir

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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftsmith")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _num_draft(text: str) -> int | str:
    """--num-draft: a whole number, or `auto`."""
    return "auto" if text == "auto" else int(text)


def _int_list(text: str) -> list[int]:
    """`256,1024` -> [256, 1024] (argparse shows a ValueError as its own one line)."""
    return [int(part) for part in text.split(",") if part.strip()]


def _recipe_default(key: str) -> str:
    """An unset flag's default: the --recipe's `key`, else the built-in recipe's value."""
    from draftsmith.recipe import Recipe

    section, name = key.split(".")
    return f"(default: the recipe's {key}, else {getattr(getattr(Recipe(), section), name)!r})"


DESCRIPTION = ("Train speculative-decoding drafters (EAGLE-3, DFlash, DSpark, MTP, a draft LM) for a target model,\n"
               "export them for SGLang and vLLM, and measure them losslessly against plain decoding.\n"
               "Every command takes --recipe FILE (recipes/) for its defaults; flags win over it.")
# One example per command, in the order of the real path; tests/test_cli.py parses each line.
EXAMPLES = """commands, one example each:
  plan               draftsmith plan meta-llama/Llama-3.1-8B-Instruct
  data prepare       draftsmith data prepare sharegpt --out data/sharegpt.jsonl
  data regenerate    draftsmith data regenerate --recipe recipes/llama31_8b/eagle3.yaml --server http://127.0.0.1:8000/v1 --out data/regenerated.jsonl
  data cache-hidden  draftsmith data cache-hidden --recipe recipes/llama31_8b/eagle3.yaml --out cache/llama31_8b
  recipe show        draftsmith recipe show --recipe recipes/llama31_8b/eagle3.yaml train.lr=5e-5
  train              draftsmith train --recipe recipes/llama31_8b/eagle3.yaml --accelerate-config zero2
  export             draftsmith export runs/llama31_8b/eagle3 --format sglang --out exports/eagle3-sglang
  eval               draftsmith eval --target meta-llama/Llama-3.1-8B-Instruct --drafter eagle3:runs/llama31_8b/eagle3 --dataset mt-bench --out reports/eagle3

Without a GPU: scripts/demo.sh runs the whole path on a tiny target on CPU."""
RECIPE_HELP = "a YAML recipe, e.g. recipes/tiny/mtp.yaml (default: none, the built-in recipe)"


def build_parser() -> argparse.ArgumentParser:
    # Subparsers take the parent's class, so every subcommand gets the formatter.
    parser = _Parser(prog="draftsmith", description=DESCRIPTION, epilog=EXAMPLES)
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
    p.add_argument("--tile", type=int, default=128, help="rows of the verify kernel's tile (default 128)")
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
    p.add_argument("--drafter", action="append", required=True, metavar="SPEC",
                   help="[LABEL=]NAME[:PATH], repeatable (LABEL names the report's row; default NAME): " + ", ".join(
                       name + (":RUN" if spec.needs_path else "") for name, (spec, _) in proposer_names().items()))
    p.add_argument("--dataset", default="embedded",
                   help="a benchmark by name (" + ", ".join(_benchmarks()) + "; every user turn), a jsonl of "
                        "turns/conversations/messages/prompt, a dataset folder or hub name, or 'embedded' "
                        "(default: embedded)")
    p.add_argument("--recipe", default=None, help="take the defaults below from this recipe's eval section "
                                                  "(default: none, the built-in eval defaults)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts, or conversations of a conversation dataset (every user turn of each); "
                        "default 8 (eval.num_prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (eval.max_new_tokens)")
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="0 = greedy (checked token for token against plain decoding); repeat for one report each "
                        "(default: eval.temperature, 0)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens only (0: all) "
                   + _recipe_default("eval.top_k"))
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of mass p (1: all) "
                   + _recipe_default("eval.top_p"))
    p.add_argument("--seed", type=int, default=None, help="seed of the sampled decodes " + _recipe_default("eval.seed"))
    p.add_argument("--num-draft", type=_num_draft, default=None, metavar="N|auto",
                   help="drafts per verify (default eval.num_draft; -1: the tile rule's D; auto: per drafter, the D "
                        "that maximises expected tokens/s from its acceptance on a calibration split and the "
                        "verify latency table, capped by the tile rule on GPUs)")
    p.add_argument("--latency-table", default=None, metavar="DIR|FILE",
                   help="--num-draft auto: a `draftsmith plan TARGET --measure` table of this device (default: "
                        "none, eval measures one first)")
    p.add_argument("--calibration-prompts", type=int, default=4,
                   help="--num-draft auto: prompts, disjoint from the evaluated ones, that calibrate each drafter")
    p.add_argument("--prompt-chars", type=int, default=400, help="embedded prompts: characters of held-out source each")
    p.add_argument("--min-prompt-tokens", type=int, default=0,
                   help="long-context eval: only prompts (a conversation's first turn) of at least this many tokens, "
                        "drawn from 8x --num-prompts candidates (0: all)")
    p.add_argument("--tile", type=int, default=None, help="rows of the verify kernel's tile; sizes the tile rule's D "
                   + _recipe_default("target.tile"))
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                   help="the target's KV cache: dynamic (grows) or static (preallocated, fixed addresses)")
    p.add_argument("--compile", action="store_true",
                   help="compile the verify forward (CUDA graphs on CUDA); needs --cache static")
    for _, option in decode_options():  # each method's own per-run options (registry.py)
        p.add_argument(option.flag, type=option.type, default=None, metavar=option.metavar or None, help=option.help)
    _chat_flags(p, "the recipe's data.{}, else ")
    p.add_argument("--out", required=True, help="report folder (written whole or not at all)")
    p.set_defaults(handler=_eval)

    p = sub.add_parser("export", help="write a trained drafter in a serving engine's layout")
    p.add_argument("run_dir", metavar="RUN", help="a training run folder (or its model/ folder)")
    p.add_argument("--format", required=True, choices=export_formats(),
                   help="; ".join(f"{'|'.join(s.exports)} for {s.name}" for s in METHODS.values() if s.exports))
    p.add_argument("--out", required=True, help="the folder to write (whole or not at all)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights and torch_dtype of the export (default: the target's dtype)")
    p.add_argument("--latency-table", default=None, metavar="DIR|FILE",
                   help="a `draftsmith plan TARGET --measure` table of the serving device: the printed EAGLE-3 chain "
                        "length then maximises expected tokens/s with the run's validation acceptance, and a "
                        "DSpark SGLang export gets SGLang's steps-per-second table from it (default: none, the "
                        "references' 3 steps, no cost table)")
    p.set_defaults(handler=_export)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_command", required=True,
                                                                          metavar="STEP")
    p = data.add_parser("regenerate", help="answer a dataset's prompts with the target itself (resumable)")
    p.add_argument("--target", default=None,
                   help="a model folder or a training run folder (default: the recipe's target.path)")
    p.add_argument("--dataset", default=None,
                   help="conversations jsonl, a dataset folder or hub name (default: the recipe's, else "
                        "embedded corpus prompts)")
    p.add_argument("--dataset-config", default=None,
                   help="config of a dataset folder or hub dataset (default: the recipe's data.dataset_config, "
                        "else the dataset's default)")
    p.add_argument("--dataset-split", default=None,
                   help="split of a dataset folder or hub dataset " + _recipe_default("data.dataset_split"))
    p.add_argument("--recipe", default=None,
                   help="take the target, dataset (with data.columns), servers and sampling settings from this "
                        "recipe's target, data and train.seed (default: none)")
    p.add_argument("--server", action="append", default=None, metavar="URL",
                   help="an OpenAI-compatible server serving the target (vLLM, SGLang, TGI, transformers "
                        "serve); repeatable; the target is then not loaded here (default: the recipe's "
                        "data.regen_servers, else none: in-process)")
    p.add_argument("--in-flight", type=int, default=None,
                   help="requests in flight per server " + _recipe_default("data.regen_in_flight"))
    p.add_argument("--out", required=True, help="the jsonl to write (OpenAI messages shape)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="longest answer the target writes " + _recipe_default("data.regen_max_new_tokens"))
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy; above 0: sampled " + _recipe_default("data.regen_temperature"))
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass when sampling; 1: off "
                   + _recipe_default("data.regen_top_p"))
    p.add_argument("--top-k", type=int, default=None, help="likeliest tokens kept when sampling; 0: off "
                   + _recipe_default("data.regen_top_k"))
    p.add_argument("--batch-size", type=int, default=8, help="prompts answered per generate call")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many conversations (default: all of --dataset; without one, 256 excerpts "
                        "of the embedded corpus)")
    p.add_argument("--seed", type=int, default=None, help="seed of sampled answers " + _recipe_default("train.seed"))
    _chat_flags(p, "the recipe's data.{}, else ")
    p.set_defaults(handler=_regenerate)

    p = data.add_parser("prepare", help="write a dataset the references train on as a messages jsonl")
    p.add_argument("name", choices=_prepare_names(), help="sharegpt, ultrachat (200k) or perfectblend (DeepSpec's "
                                                           "DSpark mix)")
    p.add_argument("--out", required=True, help="the jsonl to write (written whole or not at all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many conversations (default: all)")
    p.add_argument("--source", default=None, metavar="DIR",
                   help="a local copy laid out as the hub serves it (default: the Hugging Face cache, else the hub)")
    p.set_defaults(handler=_prepare)

    p = data.add_parser("cache-hidden", help="store the target features a post-hoc method trains on, once "
                                              "(resumable); train with data.feature_cache=OUT")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides")
    p.add_argument("--recipe", default=None, help="the recipe the cache is for (its data, seq_len, seed, method; "
                                                  "default: the built-in defaults)")
    p.add_argument("--target", default=None,
                   help="target.path: a model folder or a training run folder (default: the recipe's)")
    p.add_argument("--dataset", default=None,
                   help="data.dataset: a conversations file or 'embedded' (default: the recipe's)")
    p.add_argument("--method", default=None, choices=posthoc(), help="method.name (default: the recipe's)")
    p.add_argument("--out", required=True, help="the cache folder (a rerun resumes it)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per target forward")
    p.add_argument("--shard-rows", type=int, default=0, help="rows per shard file (default: about 1 GB each)")
    p.set_defaults(handler=_cache_hidden)
    return parser


def _benchmarks() -> list[str]:
    from draftsmith.eval.prompts import BENCHMARKS

    return list(BENCHMARKS)


def _prepare_names() -> list[str]:
    from draftsmith.data.prepare import SOURCES

    return list(SOURCES)


def _chat_flags(p, default: str) -> None:
    """--chat-template and --enable-thinking, the recipe's data keys of those names."""
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_NAME",
                   help="a Jinja chat template file or a built-in (chatml) (default: "
                        + default.format("chat_template") + "the tokenizer's)")
    p.add_argument("--enable-thinking", default=None, action=argparse.BooleanOptionalAction,
                   help="templates with a thinking switch (Qwen3): think before answering (default: "
                        + default.format("enable_thinking") + "off where the template has the switch)")


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
