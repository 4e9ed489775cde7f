"""The reference generator: every setting as Markdown tables (key, default, range, environment
variable, meaning), and values written as TOML, from the field definitions alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .fields import ENV_PREFIX
from .sections import catalogue, title
from .settings import Config, Pool


def toml_string(text: str) -> str:
    """A TOML basic string: quotes and backslashes escaped, and every character a terminal could
    act on or that would not show as itself (C0 and C1 controls, DEL, bidi controls, line and
    paragraph separators: what `isprintable()` refuses) written as `\\uXXXX`, so the output is
    valid TOML, one line, and inert on a terminal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(f"\\U{ord(ch):08X}")
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Pool):  # a spec string, which `pools` also reads back
        return f'"{value.spec()}"'
    return repr(value)


def reference(sections: Iterable[type] = ()) -> str:
    """The configuration reference as Markdown tables, generated from the field definitions: the
    engine's, then each of `sections`' in their order. `leasework config --reference` prints it
    (with the built-in families' sections and the named app's), and the copy in
    docs/configuration.md is checked against it."""
    out = [_table(dataclasses.fields(Config), "The engine: the worker, its lease, the supervisor")]
    for cls in catalogue(sections):
        out.append(_table(dataclasses.fields(cls), f"{title(cls)} (`{cls.__module__}`)"))
    return "\n".join(out)


def _table(fields: Any, title: str) -> str:
    rows = [f"**{title}**", "", "| key | default | range | environment | meaning |",
            "|---|---|---|---|---|"]  # fmt: skip
    for f in fields:
        if f.metadata.get("internal"):
            continue
        text = f.metadata.get("doc", "").replace("|", "\\|")
        default = f.metadata.get("default") or toml_value(f.default)
        bound = f.metadata.get("range")
        shown = bound.describe().replace("|", "\\|") if bound is not None else ""
        rows.append(
            f"| `{f.name}` | `{default}` | {shown} | `{ENV_PREFIX}{f.name.upper()}` | {text} |"
        )
    return "\n".join(rows) + "\n"
