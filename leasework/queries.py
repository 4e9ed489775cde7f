"""Named SQL queries loaded once from the `.sql` files beside the modules that run them.

A file holds blocks that start with `-- name: some_query`; the Python function that runs a query
carries the same name, so one grep finds both. Never builds SQL from values.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Split a `.sql` text into {name: statement}; comment lines inside a block are kept."""
    queries: dict[str, str] = {}
    matches = list(_NAME.finditer(text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[m.end() : end].strip().rstrip(";").strip()
        if m.group(1) in queries:
            raise ValueError(f"duplicate query name {m.group(1)!r}")
        queries[m.group(1)] = body
    return queries


_COMMENT_LINE = re.compile(r"^\s*--.*\n?", re.MULTILINE)


def strip_comments(statement: str) -> str:
    """The statement without its whole-line comments (the `.sql` file keeps them for readers)."""
    return _COMMENT_LINE.sub("", statement).strip()


# A quoted literal or identifier (kept as is), or a run of whitespace, or what compact refuses.
_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|\s+|--|/\*|\$")


def compact(statement: str) -> str:
    """The statement with its whole-line comments removed and every run of whitespace outside
    quotes made one space, or none after `(` and `,` and before `)` and `,`. Quotes are standard
    SQL ('' inside '...'; leasework's .sql files use no E'' strings). Refuses (ValueError) what
    it could break: a comment after code on a line, a /* comment */, dollar quoting."""

    def one(m: re.Match[str]) -> str:
        token = m.group()
        if token in ("--", "/*", "$"):
            raise ValueError(f"compact: {token!r} outside a quoted string in {statement[:60]!r}")
        if token[0] in "'\"":
            return token
        before, after = m.string[m.start() - 1 : m.start()], m.string[m.end() : m.end() + 1]
        return "" if before in ("(", ",") or after in (")", ",") else " "

    return _TOKEN.sub(one, strip_comments(statement)).strip()


@cache
def load(package: str, filename: str) -> dict[str, bytes]:
    """{name: statement} for a `.sql` file of a package. Statements are bytes, which psycopg
    accepts as a query and caches the parsing of (a `sql.SQL` object is re-parsed per call), and
    compacted (no comments, single spaces): psycopg caches the parsing of statements up to 4 KiB
    only, and the claim as written (comments, indentation) is longer; past that, every claim
    would be parsed again on the client."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return {name: compact(body).encode() for name, body in parse(text).items()}
