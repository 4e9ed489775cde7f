"""Conversion: one raw value (a TOML value, an environment string, a flag) as its setting's type,
within the range its field declares; a refusal is one line naming the key and where it came
from."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigError
from .fields import Range, env_number, short
from .pools import parse_pools
from .sections import field_of


def coerce(name: str, value: Any, where: str, sections: Iterable[type] = ()) -> Any:
    """One raw value (TOML value, env string or flag) as the field's type, within its range:
    key `name` of the engine or of one of `sections`."""
    out = convert(name, value, where, sections)
    check_range(name, out, where, sections)
    return out


def type_name(kind: Any) -> str:
    """A field's type as written in its class: a section declared without `from __future__
    import annotations` holds the types themselves (`int`, `float | None`), not their text."""
    if isinstance(kind, str):
        return kind
    return kind.__name__ if isinstance(kind, type) else str(kind)


def convert(name: str, value: Any, where: str, sections: Iterable[type] = ()) -> Any:
    """Convert one raw value (TOML value or env string) to the field's type, or refuse it."""
    kind = type_name(field_of(name, sections).type)
    from_env = isinstance(value, str) and where.startswith("env")
    try:
        if kind in ("str | None", "str"):
            if not isinstance(value, str):
                raise TypeError
            return value
        if kind == "bool":
            if from_env and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if from_env and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind in ("float", "float | None"):
            if isinstance(value, bool):
                raise TypeError
            number = env_number(value) if from_env else value
            if not isinstance(number, int | float) or not math.isfinite(number):
                raise TypeError
            return float(number)
        if kind in ("int", "int | None"):
            if isinstance(value, bool):
                raise TypeError
            number = env_number(value, integer=True) if from_env else value
            if not isinstance(number, int):
                raise TypeError
            return number
        if kind == "tuple[Pool, ...]":
            return parse_pools(value, where)
        if kind == "tuple[float, ...]":
            items = value.split(",") if from_env else value
            if not isinstance(items, list | tuple) or not items:
                raise TypeError
            out = tuple(env_number(x) if from_env else x for x in items)
            if any(isinstance(x, bool) or not isinstance(x, int | float) for x in out):
                raise TypeError
            return tuple(float(x) for x in out)
    except (TypeError, ValueError, OverflowError):
        pass
    expected = {
        "float": "a number",
        "float | None": "a number",
        "int": "an integer",
        "int | None": "an integer",
        "tuple[float, ...]": "a non-empty list of numbers",
        "bool": "true or false",
    }.get(str(kind), "a string")
    written = {  # how the environment writes them
        "float": "in ASCII digits (like 2.5)",
        "float | None": "in ASCII digits (like 2.5)",
        "int": "in ASCII digits (like 8)",
        "int | None": "in ASCII digits (like 8)",
        "tuple[float, ...]": "in ASCII digits (like 5,30,120)",
    }.get(str(kind))
    if from_env and written:
        expected += f" {written}"
    raise ConfigError(f"{where}: {name} must be {expected}, got {short(value)}")


def check_range(
    name: str, value: Any, where: str = "config", sections: Iterable[type] = ()
) -> None:
    """The one check of every numeric setting against the Range attached to its field (the
    engine's, or one of `sections`'): one line naming the key, where it came from and what would
    be valid."""
    bound: Range | None = field_of(name, sections).metadata.get("range")
    if bound is None or value is None:
        return
    items = value if isinstance(value, tuple) else (value,)
    ok = all(bound.holds(x) for x in items)
    if bound.items is not None and not bound.items[0] <= len(items) <= bound.items[1]:
        ok = False
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise ConfigError(f"{where}: {name} must be {bound.describe()}, got {short(shown)}")
