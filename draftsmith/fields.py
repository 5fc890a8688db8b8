"""`option(default, help)`: a dataclass field that carries its meaning; and the one rule
for the numbers a user gives (`finite`, `seed`), applied by the recipe's type check and by
the command line's flag check alike.

Recipe sections (draftsmith/recipe.py) and the drafters' config dataclasses (models/)
both declare their fields with it, so `draftsmith recipe show` can print every key's
meaning from one source, and `Flags` derives a command's flags from the same fields. It
lives apart from the recipe so that models/ need not import the recipe (models/ depends
only on errors, fsutil, registry and this).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any

from draftsmith.errors import DraftsmithError

# numpy's legacy seeding (which accelerate's set_seed calls) takes 0 .. 2**32 - 1 only.
SEED_RANGE = (0, 2**32 - 1)


def option(default: Any, help: str) -> Any:
    """A field with `default` and `metadata["help"]`. A mutable default (list, dict) is
    copied per instance, as `field(default_factory=...)` would."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def help_of(f) -> str:
    """The meaning recorded on a dataclass field ("" when it has none)."""
    return f.metadata.get("help", "")


def finite(value: float, key: str) -> float:
    """`value` if it is a finite number; NaN or infinity would pass every range check
    (comparisons with NaN are all false) and silently mean something else downstream."""
    if not math.isfinite(value):
        raise DraftsmithError(f"{key}: must be a finite number, got {value}")
    return value


def seed(value: int, key: str) -> int:
    low, high = SEED_RANGE
    if not low <= value <= high:
        raise DraftsmithError(f"{key}: must be between {low} and 2**32 - 1, got {value}")
    return value


def positive(values: dict, keys: tuple[str, ...], prefix: str = "method", low: int = 1) -> None:
    """Each of `keys` that `values` holds (None: derived later) is at least `low`: a size or a
    count of a config, checked where it is declared, in one line naming the recipe key (a
    negative width would otherwise reach torch as "negative dimension")."""
    for key in keys:
        value = values.get(key)
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)) and value < low:
            raise DraftsmithError(f"{prefix}.{key}: must be at least {low}, got {value}")


def divides(values: dict, whole: str, part: str, why: str, prefix: str = "method") -> None:
    """`values[part]` divides `values[whole]` where both are known; `why` says what needs it."""
    a, b = values.get(whole), values.get(part)
    if isinstance(a, int) and isinstance(b, int) and b > 0 and a % b:
        raise DraftsmithError(f"{prefix}.{part}={b} does not divide {prefix}.{whole}={a} ({why})")


@dataclasses.dataclass(frozen=True)
class Flags:
    """Command-line flags derived from a dataclass's `option` fields, as litgpt and TRL derive
    theirs: `--name` per field, typed from its annotation (bool: --name/--no-name, list:
    repeatable, X | None: X), with the field's help and default.

    `names` picks the fields (empty: every option field); a flag is the field's name without
    `drop` at its front, or `rename[field]`. With `recipe` (a section's key, "data") the fields
    are that recipe section's: an unset flag leaves the recipe's value (argparse sets nothing)
    and the help says so, with the built-in default."""

    cls: type
    recipe: str = ""
    names: tuple[str, ...] = ()
    drop: str = ""
    rename: dict[str, str] = dataclasses.field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        chosen = [f for f in dataclasses.fields(self.cls) if help_of(f)]
        return [f for f in chosen if f.name in self.names] if self.names else chosen

    def dest(self, name: str) -> str:
        """The flag's argparse attribute (argparse's own: the flag's words joined by `_`)."""
        return self.rename.get(name, name.removeprefix(self.drop))

    def add(self, parser: argparse.ArgumentParser, **custom: dict) -> None:
        """Add the flags; `custom[field]`: argparse arguments that differ from the derived ones
        (a parse function, a metavar, choices, required), its `help` added to the field's."""
        hints = typing.get_type_hints(self.cls)
        unknown = set(custom) - {f.name for f in self.fields()}
        if unknown:  # a renamed field would otherwise drop its custom arguments silently
            raise TypeError(f"Flags.add: no field(s) {', '.join(sorted(unknown))} in {self.cls.__name__}")
        for f in self.fields():
            kwargs = _argparse_kind(hints[f.name])
            extra = dict(custom.get(f.name, {}))
            text = help_of(f) + (f"; {extra.pop('help')}" if "help" in extra else "")
            text += "; repeatable" if kwargs.get("action") == "append" else ""
            if self.recipe:
                kwargs["default"] = argparse.SUPPRESS
                text += f" (default: the recipe's {self.recipe}.{f.name}, else {_shown(_default(f))})"
            else:
                kwargs["default"] = _default(f)
            parser.add_argument("--" + self.dest(f.name).replace("_", "-"), dest=self.dest(f.name),
                                help=text.replace("%", "%%"), **{**kwargs, **extra})

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields whose flags `args` holds (a recipe section's: those given)."""
        return {f.name: getattr(args, self.dest(f.name)) for f in self.fields() if hasattr(args, self.dest(f.name))}

    def over(self, args: argparse.Namespace, section):
        """`section` with the values of the flags given."""
        return dataclasses.replace(section, **self.given(args))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _shown(value: Any) -> str:
    """A default as a recipe spells it (None: null)."""
    return "null" if value is None else repr(value)


def _argparse_kind(tp) -> dict:
    """argparse's `type`/`action` for a field annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: X (None is the unset default)
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(tp) is list:
        return {"action": "append", "type": typing.get_args(tp)[0]}
    if tp in (int, float, str):
        return {"type": tp}
    raise TypeError(f"no command-line flag for a field of type {tp}")
