"""Sections: the settings a stage or a family declares beside it, a frozen dataclass marked with
`@section(...)`. Nothing is registered here: the family (`Family.config_sections`) or the app
(`App.section`) that reads a section names it, and the loader is handed the sections it knows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from .fields import SECTION_MARK
from .settings import FIELDS, S, section_fields


def section(title: str, order: int = 100) -> Callable[[type[S]], type[S]]:
    """Declare a frozen dataclass the settings of a stage or a family: its fields become keys of
    the config file, the environment and the reference (under `title`; `order` places the
    section there) wherever the section is known, that is for an app whose family or own
    declaration names it. A `check(self)` method, if any, refuses impossible combinations."""

    def mark(cls: type[S]) -> type[S]:
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{cls.__qualname__}: a settings section is a frozen dataclass")
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in FIELDS:
                raise TypeError(f"{cls.__qualname__}: setting {f.name!r} is already the engine's")
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__qualname__}: setting {f.name!r} needs a default")
        setattr(cls, SECTION_MARK, (title, order))
        return cls

    return mark


def title(cls: type) -> str:
    """The section's heading in the reference."""
    return str(getattr(cls, SECTION_MARK)[0])


def catalogue(sections: Iterable[type]) -> tuple[type, ...]:
    """`sections` in the reference's order (by `order`, then title), each once, refusing a class
    that is no section and two sections that claim one key."""
    found: dict[type, None] = {}
    owner: dict[str, type] = {}
    for cls in sections:
        if SECTION_MARK not in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} is not a settings section (declare it with @section)"
            )
        if cls in found:
            continue
        for f in dataclasses.fields(cls):
            taken = owner.get(f.name)
            if taken is not None:
                raise TypeError(
                    f"{cls.__qualname__}: setting {f.name!r} is already {taken.__qualname__}'s"
                )
            owner[f.name] = cls
        found[cls] = None

    def place(cls: type) -> tuple[int, str]:
        heading, order = getattr(cls, SECTION_MARK)
        return order, heading

    return tuple(sorted(found, key=place))


def all_keys(sections: Iterable[type] = ()) -> list[str]:
    """Every key: the engine's, then those of `sections` in their order."""
    return [*FIELDS, *section_fields(catalogue(sections))]


def field_of(name: str, sections: Iterable[type] = ()) -> dataclasses.Field[Any]:
    """The field that declares key `name`, the engine's or one of `sections`' (KeyError)."""
    return FIELDS[name] if name in FIELDS else section_fields(sections)[name]


def forget(cls: type) -> None:
    """Kept for code written when sections were registered globally: nothing is registered now,
    so there is nothing to forget."""
