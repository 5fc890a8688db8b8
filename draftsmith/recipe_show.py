"""`draftsmith recipe show --recipe RECIPE [key.sub=value ...]`: the resolved recipe, every key with
its value and meaning.

The text is YAML (comments after `#`), so it can be saved and trained from. A key whose
value differs from its default also names the default: the keys the recipe or the
overrides changed stand out, and the unchanged ones do not repeat their value twice.
The `method` section lists every field of the chosen method's config; a None there is
derived from the target when training starts (each field's help says how).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import yaml

from draftsmith.fields import help_of
from draftsmith.recipe import Recipe, load_recipe

COLUMN = 36  # where the comments start, when the key and value leave room


def _text(value: Any) -> str:
    """One value in YAML's flow style, on one line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False)
    return text.removesuffix("...\n").strip()


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _line(key: str, value: Any, f: dataclasses.Field) -> str:
    head = f"  {key}: {_text(value)}"
    default = _default(f)
    note = help_of(f) + ("" if value == default else f" (default: {_text(default)})")
    return f"{head.ljust(COLUMN)}  # {note}"


def show_recipe(recipe: Recipe) -> str:
    lines = []
    for section in dataclasses.fields(Recipe):
        lines.append(f"{section.name}:")
        if section.name == "method":
            method = recipe.method
            name_field = next(f for f in dataclasses.fields(method) if f.name == "name")
            lines.append(_line("name", method.name, name_field))
            for f in dataclasses.fields(method.spec.load("config")) if method.name else ():
                lines.append(_line(f.name, method.params.get(f.name, _default(f)), f))
            continue
        values = getattr(recipe, section.name)
        for f in dataclasses.fields(values):
            lines.append(_line(f.name, getattr(values, f.name), f))
    return "\n".join(lines) + "\n"


def show_command(path: str, overrides: list[str]) -> str:
    """Defaults < the YAML file < overrides, as `draftsmith train` resolves them."""
    return show_recipe(load_recipe(path, overrides))
