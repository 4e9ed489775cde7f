"""Loading named SQL: compacting keeps quoted text and refuses what it could break, and the
worker's hot statements stay within psycopg's parse cache (past 4 KiB psycopg parses a statement
again on every execution, which cost the one-at-a-time loop a third of its client CPU)."""

from __future__ import annotations

import pytest

from leasework.queries import compact
from leasework.workers import lease

# psycopg caches the parsing of a statement of at most this many bytes (MAX_CACHED_STATEMENT_LENGTH
# in its private module psycopg/_queries.py, 4096 in psycopg 3.3; read there, not
# imported: tests use psycopg's public API only).
PSYCOPG_PARSE_CACHE_BYTES = 4096


def test_compact_collapses_whitespace_and_drops_comment_lines() -> None:
    text = "-- a comment\nSELECT a,\n       b\n  FROM t\n -- another\n WHERE ( x = 1 )"
    assert compact(text) == "SELECT a,b FROM t WHERE (x = 1)"


def test_compact_keeps_quoted_text_as_is() -> None:
    text = "SELECT 'two  spaces, -- not a comment',  \"odd  name\" FROM t WHERE s = 'it''s  ok'"
    assert compact(text) == (
        "SELECT 'two  spaces, -- not a comment',\"odd  name\" FROM t WHERE s = 'it''s  ok'"
    )


@pytest.mark.parametrize(
    "text", ["SELECT 1 -- trailing comment\nFROM t", "SELECT /* c */ 1", "SELECT $$x$$"]
)
def test_compact_refuses_what_it_could_break(text: str) -> None:
    with pytest.raises(ValueError, match="outside a quoted string"):
        compact(text)


@pytest.mark.parametrize(
    "name", ["claim_runs", "finish_and_claim", "finish_run", "finish_runs", "expire_and_promote"]
)
def test_hot_statements_fit_psycopgs_parse_cache(name: str) -> None:
    statement = lease.FINISH_AND_CLAIM if name == "finish_and_claim" else lease.Q[name]
    assert len(statement) <= PSYCOPG_PARSE_CACHE_BYTES, (
        f"{name} is {len(statement)} bytes once compacted: psycopg would parse it on every call"
    )
