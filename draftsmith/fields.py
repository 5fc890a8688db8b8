"""`option(default, help)`: a dataclass field that carries its meaning.

Recipe sections (draftsmith/recipe.py) and the drafters' config dataclasses (models/)
both declare their fields with it, so `draftsmith recipe show` can print every key's
meaning from one source. It lives apart from the recipe so that models/ need not import
the recipe (models/ depends only on errors, fsutil, registry and this).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str) -> Any:
    """A field with `default` and `metadata["help"]`. A mutable default (list, dict) is
    copied per instance, as `field(default_factory=...)` would."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def help_of(f) -> str:
    """The meaning recorded on a dataclass field ("" when it has none)."""
    return f.metadata.get("help", "")
