"""The `draftsmith` command.

Bad input ends in one line, `draftsmith: error: ...`, and exit status 2; anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from draftsmith.errors import DraftsmithError
from draftsmith.registry import METHODS, export_formats, posthoc, proposer_names


def pick(flag, default):
    """A flag given on the command line (not None), else the recipe's (or built-in) value."""
    return default if flag is None else flag


def _train(args) -> int | None:
    from draftsmith.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # bad keys fail here, once, not in every process
    if args.accelerate_config:
        from draftsmith.train.launch import launch, launch_argv

        argv = launch_argv(args.accelerate_config, args.recipe, args.overrides)
        print("draftsmith: running", shlex.join(argv), file=sys.stderr, flush=True)
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


def _eval(args) -> None:
    from draftsmith.eval.evaluate import EvalSettings, evaluate, print_summary
    from draftsmith.recipe import EvalSection, load_recipe

    # A recipe's `eval` section gives the defaults; flags on the command line win.
    defaults = load_recipe(args.recipe).eval if args.recipe else EvalSection()
    num_draft = pick(args.num_draft, defaults.num_draft)
    settings = EvalSettings(
        dataset=args.dataset, num_prompts=pick(args.num_prompts, defaults.num_prompts),
        max_new_tokens=pick(args.max_new_tokens, defaults.max_new_tokens),
        temperatures=args.temperature or [defaults.temperature], top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        num_draft=None if num_draft == -1 else num_draft, tile=args.tile, prompt_chars=args.prompt_chars,
        drafters=args.drafter,
        cache=args.cache, compile=args.compile,
        proposer_options=_proposer_options(args),
    )
    print_summary(evaluate(args.target, settings, args.out), args.out)


def _proposer_options(args) -> dict[str, dict]:
    """Eval flags that set a method's proposer option for this run."""
    options: dict[str, dict] = {}
    if args.confidence_threshold is not None:
        from draftsmith.models.dspark import check_threshold

        threshold = check_threshold(args.confidence_threshold, "--confidence-threshold")
        options["dspark"] = {"confidence_threshold": threshold}
    return options


def _regenerate(args) -> None:
    from draftsmith.data.regenerate import regenerate_command
    from draftsmith.models.target import resolve_model_dir
    from draftsmith.recipe import Recipe, load_recipe

    # A recipe gives the target, the dataset, the servers and the sampling; flags win over it.
    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    data = recipe.data
    target = pick(args.target, recipe.target.path)
    if not target:
        raise DraftsmithError("data regenerate: give --target (or a --recipe with target.path)")
    dataset = pick(args.dataset, data.dataset if data.dataset != "embedded" else None)
    out = regenerate_command(str(resolve_model_dir(target)), dataset, args.out,
                             max_new_tokens=pick(args.max_new_tokens, data.regen_max_new_tokens),
                             temperature=pick(args.temperature, data.regen_temperature),
                             top_p=pick(args.top_p, data.regen_top_p), top_k=pick(args.top_k, data.regen_top_k),
                             seed=pick(args.seed, recipe.train.seed), batch_size=args.batch_size, limit=args.limit,
                             servers=pick(args.server, data.regen_servers),
                             in_flight=pick(args.in_flight, data.regen_in_flight), target_name=target,
                             dataset_config=pick(args.dataset_config, data.dataset_config),
                             dataset_split=pick(args.dataset_split, data.dataset_split),
                             columns=data.columns if args.dataset is None else None)
    print(f"wrote {out}")


def _cache_hidden(args) -> None:
    import json

    from draftsmith.recipe import load_recipe
    from draftsmith.train.posthoc import cache_hidden

    # The flags are overrides by another name (JSON-quoted: YAML would misread some paths).
    flags = {"target.path": args.target, "data.dataset": args.dataset, "method.name": args.method}
    overrides = [*args.overrides, *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)]
    out = cache_hidden(load_recipe(args.recipe, overrides), args.out, batch_size=args.batch_size,
                       shard_rows=args.shard_rows)
    print(f"wrote {out}")


def _export(args) -> None:
    from pathlib import Path

    from draftsmith.fsutil import check_replaceable
    from draftsmith.models.export import export_run
    from draftsmith.models.target import resolve_model_dir

    out = Path(args.out).resolve()
    if out in (Path(args.run_dir).resolve(), Path(resolve_model_dir(args.run_dir)).resolve()):
        raise DraftsmithError(f"--out {args.out} is the folder being exported; give a new folder")
    check_replaceable(args.out, "config.json", "export")  # an existing folder is replaced whole
    print(f"wrote {export_run(args.run_dir, args.format, args.out)}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends in its default, unless the text already says it in words
    (a None default means "not given", which the words explain better than "None")."""

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


def _recipe_default(key: str) -> str:
    """An unset flag's default: the --recipe's `key`, else the built-in recipe's value."""
    from draftsmith.recipe import Recipe

    section, name = key.split(".")
    return f"(default: the recipe's {key}, else {getattr(getattr(Recipe(), section), name)!r})"


def build_parser() -> argparse.ArgumentParser:
    # Subparsers take the parent's class, so every subcommand gets the formatter.
    parser = _Parser(prog="draftsmith", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe (also: accelerate launch -m draftsmith.train)")
    p.add_argument("recipe", help="a YAML recipe, e.g. recipes/tiny/mtp.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides; they win over the recipe")
    p.add_argument("--accelerate-config", default=None, metavar="NAME|FILE",
                   help="run under `accelerate launch --config_file`: a config of recipes/accelerate/ "
                        "(cpu, ddp, zero2, zero3, fsdp2) or a YAML file (default: this process, no launcher)")
    p.set_defaults(handler=_train)

    recipe = sub.add_parser("recipe", help="inspect recipes").add_subparsers(dest="recipe_command", required=True,
                                                                            metavar="STEP")
    p = recipe.add_parser("show", help="print a recipe as train resolves it: every key's value, default and meaning")
    p.add_argument("recipe", help="a YAML recipe, e.g. recipes/tiny/mtp.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides; they win over the recipe")
    p.set_defaults(handler=_recipe_show)

    p = sub.add_parser("plan", help="size the draft count D from the target's head grouping (tile rule)")
    p.add_argument("target", help="a model folder, a config.json, or a hub name")
    p.add_argument("--tile", type=int, default=128, help="rows of the verify kernel's tile (default 128)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.set_defaults(handler=_plan)

    p = sub.add_parser("eval", help="decode with drafters, check them losslessly, write the report")
    p.add_argument("--target", required=True, help="the target: a model folder or a training run folder")
    p.add_argument("--drafter", action="append", required=True, metavar="SPEC",
                   help="NAME[:PATH], repeatable: " + ", ".join(
                       name + (":RUN" if spec.needs_path else "") for name, (spec, _) in proposer_names().items()))
    p.add_argument("--dataset", default="embedded", help="a jsonl of turns/conversations/messages/prompt, or 'embedded'")
    p.add_argument("--recipe", default=None, help="take the defaults below from this recipe's eval section "
                                                  "(default: none, the built-in eval defaults)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 8 (eval.num_prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (eval.max_new_tokens)")
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="0 = greedy (checked token for token against plain decoding); repeat for one report each "
                        "(default: eval.temperature, 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens only (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of mass p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled decodes")
    p.add_argument("--num-draft", type=int, default=None,
                   help="drafts per verify (default eval.num_draft; -1: the tile rule's D)")
    p.add_argument("--prompt-chars", type=int, default=400, help="embedded prompts: characters of held-out source each")
    p.add_argument("--tile", type=int, default=128, help="rows of the verify kernel's tile; sizes the tile rule's D")
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                   help="the target's KV cache: dynamic (grows) or static (preallocated, fixed addresses)")
    p.add_argument("--compile", action="store_true",
                   help="compile the verify forward (CUDA graphs on CUDA); needs --cache static")
    p.add_argument("--confidence-threshold", type=float, default=None, metavar="C",
                   help="dspark: end a draft before the first position whose confidence is below C, in [0, 1] "
                        "(default: the checkpoint's; 0 drafts the full block)")
    p.add_argument("--out", required=True, help="report folder (written whole or not at all)")
    p.set_defaults(handler=_eval)

    p = sub.add_parser("export", help="write a trained drafter in a serving engine's layout")
    p.add_argument("run_dir", metavar="RUN", help="a training run folder (or its model/ folder)")
    p.add_argument("--format", required=True, choices=export_formats(),
                   help="; ".join(f"{'|'.join(s.exports)} for {s.name}" for s in METHODS.values() if s.exports))
    p.add_argument("--out", required=True, help="the folder to write (whole or not at all)")
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
    p.add_argument("--limit", type=int, default=None, help="at most this many conversations (default: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of sampled answers " + _recipe_default("train.seed"))
    p.set_defaults(handler=_regenerate)

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a `nargs="*"` positional at the first option, so overrides written after
    # an option (train RECIPE --accelerate-config cpu key=value) arrive here: they are kept.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    quiet_libraries()
    try:
        status = args.handler(args)  # a launched child's exit status, or None
    except DraftsmithError as exc:
        print(f"draftsmith: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
