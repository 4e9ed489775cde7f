"""What a setting is made of: its line in the reference (`doc`), the values it accepts (`Range`),
and the small text helpers every part of the configuration shares. Imports nothing of the
configuration."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "LEASEWORK_"


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: from `lo` to `hi`, both included (`lo` excluded when
    `above`); for a list, each item, and `items` is how many there may be. Attached to the field
    (metadata "range") and checked by one validator, `check_range`; shown in the reference."""

    lo: float
    hi: float
    above: bool = False
    items: tuple[int, int] | None = None

    def holds(self, value: float) -> bool:
        # nan fails both comparisons; an int too large for a float compares exactly
        return (self.lo < value if self.above else self.lo <= value) and value <= self.hi

    def describe(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        text = f"> {lo} and <= {hi}" if self.above else f"{lo} to {hi}"
        if self.items is not None:
            text = f"{self.items[0]}-{self.items[1]} items, each {text}"
        return text


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def doc(text: str, default: str | None = None, *, range: Range | None = None) -> dict[str, Any]:
    """A field's line in the reference; `default` describes a default derived from others;
    `range` the values it accepts."""
    meta: dict[str, Any] = {"doc": text}
    if default is not None:
        meta["default"] = default
    if range is not None:
        meta["range"] = range
    return meta


DAY = 86400.0
SECONDS = Range(0, 30 * DAY, above=True)  # a positive duration of at most 30 days
RETENTION = Range(1, 10 * 365 * DAY)


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(key: str, keys: Iterable[str]) -> str:
    """`; did you mean `lease`?` for a misspelt key among `keys`, else where the keys are
    listed."""
    close = difflib.get_close_matches(key.lower(), list(keys), n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    return " (`leasework config --reference` lists every key)"


# A number in the environment: ASCII digits only. int() and float() also read other scripts'
# digits (`١٢` is 12) and underscores (`1_0` is 10), which nobody types on purpose.
_ENV_INTEGER = re.compile(r"[+-]?[0-9]+")
_ENV_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def env_number(text: str, integer: bool = False) -> int | float:
    """An integer (or a number) written in the environment or a spec, or ValueError."""
    text = text.strip()
    if not (_ENV_INTEGER if integer else _ENV_FLOAT).fullmatch(text):
        raise ValueError(f"not an ASCII number: {text!r}")
    return int(text) if integer else float(text)


# The mark `@section(title, order)` leaves on a settings class: (title, order in the reference).
SECTION_MARK = "__leasework_section__"


def is_section(cls: object) -> bool:
    """Whether `cls` was declared a settings section with `@section(...)`."""
    return isinstance(cls, type) and SECTION_MARK in cls.__dict__
