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


COMBINED = {
    "finish_and_claim": lease.FINISH_AND_CLAIM,
    "finish_and_claim_untenanted": lease.FINISH_AND_CLAIM_UNTENANTED,
}


@pytest.mark.parametrize(
    "name",
    [
        "claim_runs",
        "finish_and_claim",
        "finish_and_claim_untenanted",
        "finish_run",
        "finish_runs",
        "expire_and_promote",
    ],
)
def test_hot_statements_fit_psycopgs_parse_cache(name: str) -> None:
    statement = COMBINED.get(name) or lease.Q[name]
    assert len(statement) <= PSYCOPG_PARSE_CACHE_BYTES, (
        f"{name} is {len(statement)} bytes once compacted: psycopg would parse it on every call"
    )


def _between(text: bytes, start: bytes, end: bytes) -> bytes:
    i = text.index(start)
    return text[i : text.index(end, i)]


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (b"untenanted_queued AS MATERIALIZED (", b"),untenanted_expired"),
        (b"untenanted_expired AS MATERIALIZED (", b"),chosen"),
        (b"UPDATE leasework.runs r SET status = 'running'", b"queued_at,started_at"),
    ],
)
def test_the_untenanted_claim_is_claim_runs_own_text(start: bytes, end: bytes) -> None:
    # finish_and_claim_untenanted must claim exactly what claim_runs does when no tenanted run
    # is due: its branches and its UPDATE are claim_runs' own, written out a second time.
    whole, untenanted = lease.Q["claim_runs"], lease.Q["finish_and_claim_untenanted"]
    assert _between(untenanted, start, end) == _between(whole, start, end)
