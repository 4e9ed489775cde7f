"""Loading named SQL: compacting keeps quoted text and refuses what it could break, and the
worker's hot statements stay within psycopg's parse cache (past 4 KiB psycopg parses a statement
again on every execution, which cost the one-at-a-time loop a third of its client CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leasework.leases import lease
from leasework.queries import compact

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
    "finish_and_claim_queued": lease.FINISH_AND_CLAIM_QUEUED,
    "finish_and_claim_lean": lease.FINISH_AND_CLAIM_LEAN,
}


@pytest.mark.parametrize(
    "name",
    [
        "finish_and_claim_queued",
        "finish_and_claim_lean",
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


def test_the_long_claims_are_sent_raw_with_numbered_parameters() -> None:
    # claim_runs and finish_and_claim are past psycopg's parse cache: they go through a
    # RawCursor, their placeholders numbered once here, so psycopg never parses them.
    for text, names, numbered in [
        (lease.Q["claim_runs"], lease.CLAIM_PARAMS, lease.claim_runs_numbered()),
        (lease.FINISH_AND_CLAIM, lease.FINISH_AND_CLAIM_PARAMS, lease.FINISH_AND_CLAIM_NUMBERED),
    ]:
        assert b"%(" not in numbered
        for i, name in enumerate(names, 1):
            assert (b"%%(%s)s" % name.encode() in text) == (b"$%d" % i in numbered)


def _between(text: bytes, start: bytes, end: bytes) -> bytes:
    i = text.index(start)
    return text[i : text.index(end, i)]


def test_the_quick_claim_is_claim_runs_own_text() -> None:
    # finish_and_claim_queued must claim exactly what claim_runs does when nothing else is due:
    # its claim is claim_runs' untenanted_queued branch, written out a second time (the same
    # range per kind, from LATERAL on), over the kinds polled less the paused ones (claim_runs'
    # `live`, asked per kind rather than once).
    # It claims at the sealed run's priority where claim_runs asks due_priority (the probed
    # form's gate asks for a better one); the form for one kind reads `(kinds)[1]` for `k.kind`.
    # Its range starts after the sealed run (AFTER: dead entries of the runs claimed before it
    # are not walked), which the probed form's gate makes up for (BEFORE).
    whole = lease.Q["claim_runs"]
    branch = _between(whole, b"untenanted_queued AS MATERIALIZED (", b"SKIP LOCKED)")
    branch = branch.replace(DUE, b"= " + SEALED + b" AND " + AFTER + b" ")
    claim = lease.Q["quick_claim"]
    assert claim[claim.index(b"LATERAL") :].startswith(branch[branch.index(b"LATERAL") :])
    # claim_runs asks each kind's due priority once, before the range (the quick claim has the
    # sealed run's instead): never in the range's condition, which a locked row re-checks.
    assert b"(SELECT k.kind,leasework.due_priority(k.kind,NULL) AS due FROM unnest(" + LIVE + (
        b") AS k(kind) OFFSET 0) k,"
    ) in branch
    assert b"due_priority" not in branch[branch.index(b"LATERAL") :]
    assert b"FROM unnest(" + KINDS + b") AS k(kind)," in claim
    one = lease.Q["quick_claim_one"].replace(b"<handed_on>", lease.Q["handed_on"])
    inner = branch[branch.index(b"LATERAL (") + len(b"LATERAL (") :]
    expected = inner.replace(b"k.kind", b"(" + KINDS + b")[1]")
    expected = expected.replace(b"SELECT r.id,r.priority,r.queued_at ", b"SELECT r.id ")
    paused = b" AND NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = (%s)[1])"
    assert one.replace(paused % KINDS, b"").replace(LIMITED_ONE, b"") == expected + b"SKIP LOCKED"
    for form in (lease.FINISH_AND_CLAIM_QUEUED_ONE, lease.FINISH_AND_CLAIM_LEAN_ONE):
        assert one.replace(b"%(limit)s", b"1") in form


DUE = b"= k.due "
SEALED = b"(SELECT s.priority FROM leasework.runs s WHERE s.id = %(id)s::bigint)"
_KEY = b"((SELECT s.queued_at FROM leasework.runs s WHERE s.id = %(id)s::bigint),%(id)s::bigint)"
AFTER, BEFORE = b"(r.queued_at,r.id) > " + _KEY, b"(r.queued_at,r.id) < " + _KEY


def test_the_lean_quick_claim_is_the_probed_one_less_its_probe() -> None:
    probed, lean = lease.FINISH_AND_CLAIM_QUEUED, lease.FINISH_AND_CLAIM_LEAN
    gate = b"CASE WHEN NOT (false) THEN"
    assert lean.count(gate) == 1
    assert probed == lean.replace(
        gate, gate.replace(b"false)", b"false " + lease.Q["due_elsewhere"] + b")")
    )
    assert b"leasework.paused_kinds" in lean and b"<" not in lean.replace(b"<=", b"")
    assert lease.FINISH_AND_CLAIM_LEAN_NUMBERED.count(b"$") == lease.FINISH_AND_CLAIM_LEAN.count(
        b"%("
    )


LIVE, KINDS = b"(SELECT k FROM live)::text[]", b"%(kinds)s::text[]"
# A kind with a cap or a rate is left out of the quick claim (claim_runs alone admits its runs).
LIMITED = (
    b"(l.max_running IS NOT NULL OR l.rate_count IS NOT NULL)"
)
# ... but the sealed run's kind when its place is handed on (lease.sql, handed_on).
HANDED_ON = b" AND NOT " + lease.Q["handed_on"]
LIMITED_ONE = (
    b" AND NOT EXISTS (SELECT 1 FROM leasework.kind_limits l WHERE l.kind = (%(kinds)s::text[])[1]"
    b" AND " + LIMITED + HANDED_ON + b")"
)


def test_the_quick_claim_leaves_paused_kinds_out_one_by_one() -> None:
    quick = lease.FINISH_AND_CLAIM_QUEUED
    assert (
        b"WHERE NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = k.kind)" in quick
    )
    assert LIVE not in quick


def test_the_quick_claims_leave_limited_kinds_out() -> None:
    # claim_runs' `rules` and leasework.admit hold a kind with a cap or a rate to it: the quick
    # claims, which admit nothing, take a run of one only into the place the sealed run leaves
    # (every form, one kind or several; tests/db/lease/test_caps.py has the hand-on's rules).
    several = (
        b"AND NOT EXISTS (SELECT 1 FROM leasework.kind_limits l WHERE l.kind = k.kind AND "
        + LIMITED
        + HANDED_ON
        + b")"
    )
    for form in (lease.FINISH_AND_CLAIM_QUEUED, lease.FINISH_AND_CLAIM_LEAN):
        assert several in form
    for form in (lease.FINISH_AND_CLAIM_QUEUED_ONE, lease.FINISH_AND_CLAIM_LEAN_ONE):
        assert LIMITED_ONE in form
    assert b"max_running IS NOT NULL OR l.rate_count IS NOT NULL AS limited" in (
        lease.Q["claim_runs"]
    )


def _where(text: bytes, start: bytes, end: bytes) -> set[bytes]:
    """The conditions ANDed in the WHERE clause after `start`, up to `end`, as a set."""
    i = text.index(b" WHERE ", text.index(start)) + len(b" WHERE ")
    return {c for c in text[i : text.index(end, i)].split(b" AND ") if c}


def _tenant_picks() -> bytes:
    """leasework.tenant_picks' query as schema.sql writes it, compacted, its `live` as KINDS."""
    text = (Path(__file__).resolve().parents[2] / "schema.sql").read_text(encoding="utf-8")
    start = text.index("CREATE OR REPLACE FUNCTION leasework.tenant_picks(")
    body = text[text.index("RETURN QUERY", start) : text.index("$$;", start)]
    return compact(body).replace("unnest(tenant_picks.live)", "unnest(%(kinds)s::text[])").encode()


def test_the_quick_claims_probe_asks_what_claim_runs_other_branches_take() -> None:
    # `others` must see every run claim_runs' tenanted and expired branches could take (their
    # predicates less the limiter, which it leaves out on purpose): a condition of its own would
    # hide one. The tenanted probe asks, per tenant in the turns, for a run the tenanted branch
    # reads (its conditions less the limiter, over the kinds polled); the expired probe asks for
    # both expired branches at once.
    # The tenants' walk is leasework.tenant_picks (schema.sql): claim_runs with its body.
    whole = lease.Q["claim_runs"].replace(LIVE, KINDS) + _tenant_picks()
    quick = lease.FINISH_AND_CLAIM_QUEUED
    kinds = b"r.kind = ANY(%(kinds)s::text[])"
    _paused, queued, expired = quick.split(b" OR EXISTS (")[:3]
    # The tenanted probe: a tenant in the turns with a run due of a kind polled, as the tenanted
    # branch gates each (tenant, kind) it reads.
    gate = b"leasework.due_priority(k.kind,t.name) IS NOT NULL"
    better = quick.split(b" OR EXISTS (")[1]
    queued = quick.split(b" OR EXISTS (")[2]
    expired = quick.split(b" OR EXISTS (")[3]
    assert gate in queued and b"OR " + gate in whole
    assert b"leasework.due_priority(k.kind,NULL) < " + SEALED in better
    assert b"WHERE t.priority IS NOT NULL" in queued and b"WHERE t.priority IS NOT NULL" in whole
    assert b"unnest(%(kinds)s::text[]) AS k(kind)" in queued
    # The run due before the sealed one at its priority, which the quick claim's range leaves
    # out, on a kind not paused: claim_runs' untenanted branch with BEFORE for AFTER.
    before = quick.split(b" OR EXISTS (")[4]
    assert BEFORE in before and b"r.priority = " + SEALED in before
    assert b"r.tenant IS NULL AND r.status = 'queued' AND r.queued_at <= leasework.now()" in before
    assert b"WHERE NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = k.kind)" in (
        before
    )

    probe = _where(expired, b"FROM leasework.runs r", kinds) | {kinds}
    for start, end in [
        (b"tenanted_expired AS MATERIALIZED (", b" ORDER BY"),
        (b"untenanted_expired AS MATERIALIZED (", b" ORDER BY"),
    ]:
        branch = {
            c.replace(b"%(finishing)s", b"%(id)s")  # finish_and_claim passes the sealed run's id
            for c in _where(whole, start, end)
            if not c.startswith(b"r.tenant IS ")
        }
        assert probe == branch, probe ^ branch
