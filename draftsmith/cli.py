"""The `draftsmith` command.

Bad input ends in one line, `draftsmith: error: ...`, and exit status 2; anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.errors import DraftsmithError


def _train(args) -> None:
    from draftsmith.recipe import load_recipe
    from draftsmith.train.loop import train

    train(load_recipe(args.recipe, args.overrides))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe (also: accelerate launch -m draftsmith.train)")
    p.add_argument("recipe", help="a YAML recipe, e.g. recipes/tiny/mtp.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides; they win over the recipe")
    p.set_defaults(run=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except DraftsmithError as exc:
        print(f"draftsmith: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
