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

# The verify kernel's tile rows where a recipe or a command names none: FlashAttention-3's
# 128-row query tile (docs/design.md section 3); recipe.py's target.tile and every part that
# sizes a draft default to it. Here, not in the recipe or models/tile.py, because both the
# recipe and models/ read it and models/ never imports the recipe (design.md section 5).
DEFAULT_TILE = 128

# numpy's legacy seeding (which accelerate's set_seed calls) takes 0 .. 2**32 - 1 only.
SEED_RANGE = (0, 2**32 - 1)


def option(default: Any, help: str, *, choices: tuple | dict = (), low: float | None = None,
           high: float | None = None, above: float | None = None) -> Any:
    """A field with `default` and `metadata["help"]`. A mutable default (list, dict) is
    copied per instance, as `field(default_factory=...)` would.

    The values it takes beyond its type are declared here, once: `choices` (a dict maps each
    to its meaning), `low` and `high` (inclusive bounds) and `above` (an exclusive one). The
    recipe's check (`check_declared`), a flag (its argparse choices, its value checked), its
    help and `recipe show` (`help_of`) all read them."""
    metadata = {"help": help, "choices": choices, "low": low, "high": high, "above": above}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def help_of(f) -> str:
    """The meaning recorded on a dataclass field ("" when it has none), with the values it
    takes where it declares them."""
    text, rule = f.metadata.get("help", ""), rule_of(f)
    return f"{text}; {rule}" if text and rule else text


def rule_of(f) -> str:
    """The values a field declares, in words: "one of a, b", "at least 1", "0 to 1", "above 0"."""
    meta = f.metadata
    choices = meta.get("choices") or ()
    if choices:
        meanings = choices if isinstance(choices, dict) else {}
        return "one of " + ", ".join(f"{c} ({meanings[c]})" if meanings.get(c) else str(c) for c in choices)
    low, high, above = meta.get("low"), meta.get("high"), meta.get("above")
    words = [f"{low} to {high}" if low is not None and high is not None
             else f"at least {low}" if low is not None else f"at most {high}" if high is not None else "",
             f"above {above}" if above is not None else ""]
    return ", ".join(w for w in words if w)


def check_declared(f, value: Any, key: str) -> None:
    """`value` of field `f` against what the field declares, in one line naming `key`; None
    (a value derived later) and a value of another type (a union's other member) pass."""
    meta = f.metadata
    choices = meta.get("choices") or ()
    if choices and value is not None and value not in choices:
        raise DraftsmithError(f"{key}: expected one of {', '.join(map(str, choices))}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, above = meta.get("low"), meta.get("high"), meta.get("above")
    if low is not None and high is not None and not low <= value <= high:
        raise DraftsmithError(f"{key}: must be between {low} and {high}, got {value}")
    if low is not None and value < low:
        raise DraftsmithError(f"{key}: must be at least {low}, got {value}")
    if high is not None and value > high:
        raise DraftsmithError(f"{key}: must be at most {high}, got {value}")
    if above is not None and not value > above:
        raise DraftsmithError(f"{key}: must be above {above}, got {value}")


def check_section(section, prefix: str) -> None:
    """Every field of the dataclass instance `section` against its declaration (`check_declared`)."""
    for f in dataclasses.fields(section):
        check_declared(f, getattr(section, f.name), f"{prefix}.{f.name}")


class MethodConfig:
    """The base of every method's config dataclass (models/<method>.py): what the recipe and
    the training loop call on it, with its default."""

    @classmethod
    def check_params(cls, params: dict, seq_len: int | None = None, target_config=None) -> None:
        """The recipe's method keys (`params`: those it set) against each other, the rows
        (`seq_len`) and, where given, the target's config, refused in one line naming the key.
        The default checks nothing beyond the fields' types and declarations."""


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
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
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
        """The fields whose flags `args` holds (a recipe section's: those given), each checked
        against its field's declaration as the recipe's value is (`check_declared`)."""
        given = {f: getattr(args, self.dest(f.name)) for f in self.fields() if hasattr(args, self.dest(f.name))}
        for f, value in given.items():
            for item in value if isinstance(value, list) else [value]:
                check_declared(f, item, "--" + self.dest(f.name).replace("_", "-"))
        return {f.name: value for f, value in given.items()}

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
