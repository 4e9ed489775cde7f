"""What a name given to leasework may hold (labels, project names, ZIP member names: one rule,
which `leasework.label_problem` in schema.sql states again in SQL), and text made safe to show
whatever an older row holds. Imports nothing of leasework."""

from __future__ import annotations

import re

MAX_LABEL = 200  # characters in a key, tenant or group

# The characters no name may hold, and that every reader shows escaped: C0 controls, DEL, C1
# controls (U+009B is a terminal's CSI), the bidi controls (U+061C, U+200E-U+200F,
# U+202A-U+202E, U+2066-U+2069: `\u202egnp.exe` displays as `exe.png`) and the line and
# paragraph separators (U+2028-U+2029, which end a line in JavaScript and many editors).
# leasework.label_problem in schema.sql holds the same class, but from U+0001: Postgres text
# cannot hold NUL.
UNSAFE_CLASS = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
UNSAFE = frozenset(
    (
        *range(0x00, 0x20),
        *range(0x7F, 0xA0),
        0x061C,
        0x200E,
        0x200F,
        *range(0x2028, 0x202F),
        *range(0x2066, 0x206A),
    )
)
_UNSAFE = re.compile(f"[{UNSAFE_CLASS}]")
# JSON's whitespace between tokens (tab, newline, carriage return) stays; inside a string JSON
# escapes them already.
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in UNSAFE - {0x09, 0x0A, 0x0D}}
_JSON_UNSAFE = re.compile("[" + "".join(re.escape(chr(c)) for c in sorted(_JSON_ESCAPES)) + "]")


_VISIBLE = {c: repr(chr(c))[1:-1] for c in UNSAFE}


def visible(text: str) -> str:
    """`text` with every unsafe character shown as its escape (`\\x1b`, `\\u202e`): one line
    that cannot reorder, hide or forge what is around it."""
    return text.translate(_VISIBLE)


def control_problem(value: str) -> str | None:
    """Why `value` may not be a name (the first unsafe character it holds), or None. Linear in
    its length."""
    found = _UNSAFE.search(value)
    if found is None:
        return None
    return (
        f"contains control characters (U+{ord(found.group()):04X}; no C0/C1 control, DEL, "
        "bidi control or line separator is allowed)"
    )


def label_problem(value: str) -> str | None:
    """Why a label (key, tenant, group) is refused, or None: the words of leasework.label_problem
    in schema.sql, for every text Postgres can hold (tests/security/test_labels.py)."""
    if not 1 <= len(value) <= MAX_LABEL:
        return f"must be 1-{MAX_LABEL} characters long"
    return control_problem(value)


def json_visible(text: str) -> str:
    """JSON text with every unsafe character but the whitespace between tokens written as a
    `\\u` escape: the same JSON value, but a C1 control, a bidi control or a line separator from
    a row reaches no terminal raw. orjson escapes only what JSON requires (below U+0020); between
    tokens JSON has nothing but ASCII punctuation and whitespace, so each one found is inside a
    string, where `\\uXXXX` means that character."""
    if _JSON_UNSAFE.search(text) is None:
        return text
    return text.translate(_JSON_ESCAPES)


def tags_text(tags: object) -> str:
    """A run's tags as one line, `a, b`: what each reader shows. Elements that are not text (a
    NULL in the array: the schema admits `{NULL}`, whoever wrote it) are left out, not fatal."""
    if not isinstance(tags, (list, tuple)):
        return ""
    return ", ".join(t for t in tags if isinstance(t, str))
