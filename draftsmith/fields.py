"""`option(default, help)`: a dataclass field that carries its meaning; and the one rule
for the numbers a user gives (`finite`, `seed`), applied by the recipe's type check and by
the command line's flag check alike.

Recipe sections (draftsmith/recipe.py) and the drafters' config dataclasses (models/)
both declare their fields with it, so `draftsmith recipe show` can print every key's
meaning from one source. It lives apart from the recipe so that models/ need not import
the recipe (models/ depends only on errors, fsutil, registry and this).
"""

from __future__ import annotations

import math
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
