"""Typed schemas of the files draftsmith reads back, and the one way they are checked.

Every file a command reads that a crash, an edit or another tool may have left (a latency
table, DSpark's calibration, a speculators config.json, a report.json, a bench summary) is
checked at its reader against a `Schema` subclass declared beside that reader, through
`validated`: a value of the wrong type, a non-finite or out-of-range number or a missing key
is one line naming the file and the key (`verify_ms[1][3]`), never a traceback later.

The schemas are pydantic models in strict mode: JSON's `"8"` is no integer, `true` no
number, `8.0` no count, and NaN and Infinity (which Python's json module reads) no number at
all. Keys a schema does not declare are kept: the files carry more than each reader needs.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftsmith.errors import DraftsmithError

# The numbers the files hold, finite by the schemas' config.
Count = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class Schema(BaseModel):
    """A file's fields, checked strictly (see the module doc); subclasses declare them."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", frozen=True)


S = TypeVar("S", bound=Schema)


def validated(schema: type[S], data: Any, source: str) -> S:
    """`data` checked against `schema`, or one DraftsmithError naming `source` and the first
    wrong key. A model validator's own message (a check across keys) is given as it is."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise DraftsmithError(f"{source}: {_first_problem(exc)}") from None


# pydantic's words for a nested schema given no mapping name our class; the file has an object there.
_MAPPING_ERRORS = ("model_type", "model_attributes_type", "dict_type")


def _first_problem(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    key = key_path(error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if not key:
        return message
    if error["type"] == "missing":
        return f"no {key} (a required key)"
    if error["type"] in _MAPPING_ERRORS:
        message = "must be a mapping (a JSON object)"
    message = message.replace("Input should be", "must be", 1)
    return f"{key}: {message}, got {_shown(error['input'])}"


def key_path(loc: tuple) -> str:
    """("verify_ms", 1, 3) -> "verify_ms[1][3]"; ("shape", "layers") -> "shape.layers"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
