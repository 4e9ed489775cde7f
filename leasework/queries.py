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


@cache
def load(package: str, filename: str) -> dict[str, bytes]:
    """{name: statement} for a `.sql` file of a package. Statements are bytes, which psycopg
    accepts as a query and caches the parsing of (a `sql.SQL` object is re-parsed per call), and
    without their comment lines: psycopg only caches statements up to 4 KiB, and the claim's
    comments alone would push it past that, costing a re-parse on every claim."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return {name: strip_comments(body).encode() for name, body in parse(text).items()}
