"""The `draftsmith` command.

Bad input ends in one line, `draftsmith: error: ...`, and exit status 2; anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.errors import DraftsmithError
from draftsmith.registry import METHODS, export_formats, posthoc, proposer_names


def _train(args) -> None:
    from draftsmith.recipe import load_recipe
    from draftsmith.train.loop import train

    train(load_recipe(args.recipe, args.overrides))


def _plan(args) -> None:
    from draftsmith.models.tile import plan_command

    print(plan_command(args.target, args.tile, args.tp))


def _eval(args) -> None:
    from draftsmith.eval.evaluate import EvalSettings, evaluate, print_summary
    from draftsmith.recipe import EvalSection, load_recipe

    # A recipe's `eval` section gives the defaults; flags on the command line win.
    defaults = load_recipe(args.recipe).eval if args.recipe else EvalSection()
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    num_draft = pick(args.num_draft, defaults.num_draft)
    settings = EvalSettings(
        dataset=args.dataset, num_prompts=pick(args.num_prompts, defaults.num_prompts),
        max_new_tokens=pick(args.max_new_tokens, defaults.max_new_tokens),
        temperatures=args.temperature or [defaults.temperature], top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        num_draft=None if num_draft < 0 else num_draft, tile=args.tile, prompt_chars=args.prompt_chars,
        drafters=args.drafter,
        cache=args.cache, compile=args.compile,
    )
    print_summary(evaluate(args.target, settings, args.out), args.out)


def _regenerate(args) -> None:
    from draftsmith.data.regenerate import regenerate_command
    from draftsmith.models.target import resolve_model_dir

    out = regenerate_command(str(resolve_model_dir(args.target)), args.dataset, args.out,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             batch_size=args.batch_size, limit=args.limit, seed=args.seed)
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
    from draftsmith.models.export import export_run

    print(f"wrote {export_run(args.run_dir, args.format, args.out)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe (also: accelerate launch -m draftsmith.train)")
    p.add_argument("recipe", help="a YAML recipe, e.g. recipes/tiny/mtp.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides; they win over the recipe")
    p.set_defaults(handler=_train)

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
    p.add_argument("--recipe", default=None, help="take the defaults below from this recipe's eval section")
    p.add_argument("--num-prompts", type=int, default=None, help="default 8 (eval.num_prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (eval.max_new_tokens)")
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="0 = greedy (checked token for token against plain decoding); repeat for one report each")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-draft", type=int, default=None,
                   help="drafts per verify (default eval.num_draft; -1: the tile rule's D)")
    p.add_argument("--prompt-chars", type=int, default=400, help="embedded prompts: characters of held-out source each")
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                   help="the target's KV cache: dynamic (grows) or static (preallocated, fixed addresses)")
    p.add_argument("--compile", action="store_true",
                   help="compile the verify forward (CUDA graphs on CUDA); needs --cache static")
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
    p.add_argument("--target", required=True, help="a model folder or a training run folder")
    p.add_argument("--dataset", default=None, help="conversations jsonl; omitted: embedded corpus prompts")
    p.add_argument("--out", required=True, help="the jsonl to write (OpenAI messages shape)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="at most this many conversations")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_regenerate)

    p = data.add_parser("cache-hidden", help="store the target features a post-hoc method trains on, once "
                                              "(resumable); train with data.feature_cache=OUT")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides")
    p.add_argument("--recipe", default=None, help="the recipe the cache is for (its data, seq_len, seed, method)")
    p.add_argument("--target", default=None, help="target.path: a model folder or a training run folder")
    p.add_argument("--dataset", default=None, help="data.dataset: a conversations file or 'embedded'")
    p.add_argument("--method", default=None, choices=posthoc(), help="method.name")
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
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        args.handler(args)
    except DraftsmithError as exc:
        print(f"draftsmith: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
