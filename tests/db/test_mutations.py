"""The suite must be able to fail: load a query from its .sql file, break one rule on purpose (a
renewal without its owner predicate, a claim that ignores cancel requests, one branch of the claim
without its attempts check or out of the order rule, a fence whose idle timeout is off, an ingest
re-check that looks at the scope only), or replace a function of schema.sql with a broken one
and put the real one back after (the label rule without DEL, the claim's tenants' walk), and show
that the invariant checks that pass on the real code fail on the mutant, by their assertions.
(Bugs planted in Python code: tests/mutants.py.)

The claim states each rule twice, in its tenanted and its untenanted branch (lease.sql,
claim_runs), so a mutation can break one branch alone (`branch`: the CTE to mutate in); the
checks run once per branch (checks.TENANTS) and each branch's mutant is caught by its own run."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from leasework.documents import ingest
from leasework.leases import lease
from leasework.queries import compact, parse

from ..conftest import truncate_all
from .checks import (
    TENANTS,
    admit_holds_each_group_to_its_rate,
    cancel_beats_reclaim,
    capped_kind_takes_only_its_places,
    claim_order_is_priority_then_queued_at,
    claim_takes_only_its_kinds,
    debounce_merge_keeps_a_racing_merge,
    delayed_run_is_claimed_only_when_due,
    expire_worker_leases_expires_only_the_dead_workers_leases,
    idle_fenced_transaction_is_ended,
    last_attempt_is_never_reclaimed,
    paused_kind_is_never_claimed,
    promotion_skips_an_open_enqueue_of_its_tenants_key,
    rated_kind_claims_only_its_rate,
    snooze_charges_no_attempt,
    spent_group_budget_is_passed,
    sql_labels_refuse_every_unsafe_character,
    stale_owner_writes_nothing,
    unique_window_holds_finished_runs,
    waiting_run_waits_for_its_key,
    waiting_run_waits_only_for_its_tenants_key,
)
from .ingest_helpers import Env, replaced_mid_run_is_never_ready_with_stale_chunks

Conn = psycopg.Connection[Any]
Check = Callable[[Conn], None]

# Where each query lives: the package and .sql file it is loaded from, and the module's
# {name: statement} that the code runs it from (what a mutation replaces).
SOURCES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "lease": ("leasework.leases", "lease.sql", lease.Q),
    "ingest": ("leasework.documents", "ingest.sql", ingest.Q),
}


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: in query `query` of `source`, `remove` becomes `replace`; with
    `branch`, only inside that CTE of the query (where `remove` must occur exactly once)."""

    query: str
    remove: str
    replace: str = ""
    branch: str | None = None
    source: str = "lease"


def original(source: str, name: str) -> str:
    package, filename, _ = SOURCES[source]
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return parse(text)[name]


def cte_span(body: str, name: str) -> tuple[int, int]:
    """Where CTE `name` of query text `body` starts and ends ((-1, -1): no such CTE)."""
    cte = re.compile(r"\b(\w+) AS (?:MATERIALIZED )?\(")
    starts = {m.group(1): m.start() for m in cte.finditer(body)}
    if name not in starts:
        return -1, -1
    start = starts[name]
    return start, min((s for s in starts.values() if s > start), default=len(body))


def mutate(mutation: Mutation) -> Any:
    """The mutated query, in the form its module's Q holds (compacted bytes, as queries.load)."""
    body = original(mutation.source, mutation.query)
    stale = f"the mutation {mutation} no longer applies: update this test"
    if mutation.branch is None:
        assert mutation.remove in body, stale
        mutant = body.replace(mutation.remove, mutation.replace)
    else:
        start, end = cte_span(body, mutation.branch)
        assert start >= 0, stale
        part = body[start:end]
        assert part.count(mutation.remove) == 1, stale
        mutant = body[:start] + part.replace(mutation.remove, mutation.replace) + body[end:]
    assert mutant != body
    current = SOURCES[mutation.source][2][mutation.query]
    text = compact(mutant)
    return text.encode() if isinstance(current, bytes) else text


def applied(m: pytest.MonkeyPatch, mutations: Mutation | tuple[Mutation, ...]) -> None:
    for mutation in mutations if isinstance(mutations, tuple) else (mutations,):
        m.setitem(SOURCES[mutation.source][2], mutation.query, mutate(mutation))


def fails_with(
    monkeypatch: pytest.MonkeyPatch,
    conn: Conn,
    mutation: Mutation | tuple[Mutation, ...],
    check: Check,
    on_mutant: Check | None = None,
) -> AssertionError:
    """`check` passes on the real queries, fails (AssertionError, not any other error) on the
    mutant, and passes again once the real queries are back. `on_mutant`: the same check as run
    on the mutant, where it differs (a shorter window that the mutant can only wait out)."""
    check(conn)
    truncate_all(conn)
    with monkeypatch.context() as m:
        applied(m, mutation)
        with pytest.raises(AssertionError) as caught:
            (on_mutant or check)(conn)
    truncate_all(conn)
    check(conn)
    return caught.value


@dataclass(frozen=True)
class FunctionMutation:
    """One deliberate bug in a function of schema.sql (`function`, as regprocedure text): in its
    definition as the database holds it, `remove` becomes `replace`."""

    function: str
    remove: str
    replace: str = ""


@contextmanager
def function_mutated(conn: Conn, mutation: FunctionMutation) -> Iterator[None]:
    """The mutant of the function in place (committed: a check's statements each run at their
    own database time, as a worker's do), the real definition back after, whatever happened."""
    row = conn.execute(
        "SELECT pg_get_functiondef(%s::regprocedure)", (mutation.function,)
    ).fetchone()
    assert row is not None
    definition: str = row[0]
    assert mutation.remove in definition, f"the mutation {mutation} no longer applies"
    assert conn.autocommit
    conn.execute(definition.replace(mutation.remove, mutation.replace))
    try:
        yield
    finally:
        conn.execute(definition)


def function_fails_with(conn: Conn, mutation: FunctionMutation, check: Check) -> AssertionError:
    """`check` passes on the real function, fails (AssertionError) with the mutant in place,
    and passes again once the real definition is back."""
    check(conn)
    truncate_all(conn)
    with function_mutated(conn, mutation), pytest.raises(AssertionError) as caught:
        check(conn)
    truncate_all(conn)
    check(conn)
    return caught.value


# The tenants' walk of the claim (claim_runs' tenanted_queued calls it; migration 0036).
TENANT_PICKS = "leasework.tenant_picks(text[],integer)"


# -- owner predicates, cancel ---------------------------------------------------------------------

RENEW_WITHOUT_OWNER = Mutation("renew_lease", " AND lease_owner = %(owner)s")
CLAIM_IGNORES_CANCEL = Mutation("claim_runs", "AND r.cancel_requested_at IS NULL ")
BATCH_FINISH_WITHOUT_OWNER = Mutation(
    "finish_runs",
    "AND r.lease_owner = (%(owners)s::uuid[])[array_position(%(ids)s::bigint[], r.id)]",
)
STEP_WITHOUT_OWNER = Mutation("store_step", " AND lease_owner = %(owner)s")


def test_renewal_without_owner_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    fails_with(monkeypatch, conn, RENEW_WITHOUT_OWNER, stale_owner_writes_nothing)


def test_claim_ignoring_cancel_requests_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    err = fails_with(monkeypatch, conn, CLAIM_IGNORES_CANCEL, cancel_beats_reclaim)
    assert "cancel request" in str(err)


def test_batch_finish_without_owner_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    fails_with(monkeypatch, conn, BATCH_FINISH_WITHOUT_OWNER, stale_owner_writes_nothing)


def test_durable_step_without_owner_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    err = fails_with(monkeypatch, conn, STEP_WITHOUT_OWNER, stale_owner_writes_nothing)
    assert "stored a durable step" in str(err)


# -- one branch of the claim at a time ------------------------------------------------------------

# (the predicate removed, in which of the branch's two CTEs, the check that must catch it, and
# what its assertion says)
CLAIM_PREDICATES = [
    pytest.param(
        ("expired", "AND r.attempts < r.max_attempts", "AND true"),
        last_attempt_is_never_reclaimed,
        "past max_attempts",
        id="expired-without-attempts-left",
    ),
    pytest.param(
        ("expired", "AND r.cancel_requested_at IS NULL", "AND true"),
        cancel_beats_reclaim,
        "cancel request",
        id="expired-ignoring-cancel",
    ),
    pytest.param(
        ("expired", "AND r.lease_expires_at < leasework.now()", "AND true"),
        stale_owner_writes_nothing,
        "live lease was claimed",
        id="expired-ignoring-the-lease",
    ),
    pytest.param(
        ("expired", "AND r.kind = ANY((SELECT k FROM live)::text[])", "AND true"),
        claim_takes_only_its_kinds,
        "expired run of another kind",
        id="expired-ignoring-kinds",
    ),
    pytest.param(
        ("expired", "ANY((SELECT k FROM live)::text[])", "ANY(%(kinds)s)"),
        paused_kind_is_never_claimed,
        "expired run of a paused kind",
        id="expired-ignoring-pause",
    ),
    pytest.param(
        ("queued", "(SELECT k FROM live)::text[]", "%(kinds)s::text[]"),
        paused_kind_is_never_claimed,
        "queued run of a paused kind",
        id="queued-ignoring-pause",
    ),
    pytest.param(
        ("queued", "AND r.queued_at <= leasework.now()", "AND true"),
        delayed_run_is_claimed_only_when_due,
        "before it was due",
        id="queued-ignoring-due-time",
    ),
    pytest.param(
        ("queued", "AND r.kind = k.kind", "AND true"),
        claim_takes_only_its_kinds,
        "queued run of another kind",
        id="queued-ignoring-kinds",
    ),
]
BRANCHES = [
    pytest.param("untenanted", None, id="untenanted"),
    pytest.param("tenanted", "ws-1", id="tenanted"),
]


@pytest.mark.parametrize(("branch", "tenant"), BRANCHES)
@pytest.mark.parametrize(("where", "check", "says"), CLAIM_PREDICATES)
def test_claim_branch_without_its_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch,
    conn: Conn,
    branch: str,
    tenant: str | None,
    where: tuple[str, str, str],
    check: Callable[..., None],
    says: str,
) -> None:
    """E.g. the tenanted expired branch without `r.attempts < r.max_attempts`: a tenanted run on
    its last attempt was reclaimed past max_attempts while every untenanted check passed."""
    cte, remove, replace = where
    mutation = Mutation("claim_runs", remove, replace, branch=f"{branch}_{cte}")
    # The tenants' walk is a function of its own (TENANT_PICKS): what it holds is mutated there.
    start, end = cte_span(original("lease", "claim_runs"), mutation.branch or "")
    if remove not in original("lease", "claim_runs")[start:end]:
        walk = FunctionMutation(TENANT_PICKS, remove, replace)
        err = function_fails_with(conn, walk, partial(check, tenant=tenant))
        assert says in str(err), err
        truncate_all(conn)
        with function_mutated(conn, walk):
            check(conn, tenant=None)  # the other branch's run of the same check passes on it
        return
    err = fails_with(monkeypatch, conn, mutation, partial(check, tenant=tenant))
    assert says in str(err), err
    # The mutant broke that branch only: the other branch's run of the same check passes on it.
    other = "ws-1" if tenant is None else None
    truncate_all(conn)
    with monkeypatch.context() as m:
        applied(m, mutation)
        check(conn, tenant=other)


# -- the claim's order ----------------------------------------------------------------------------

# Priority, then turns, then queued_at (docs/state-machine.md). Each ORDER BY of the tenanted
# branch with queued_at put before priority (or priority dropped): the claim still takes one
# run per pick, the wrong one. (`h.id\n`: the walk's pick across kinds, not the due-time probe
# above it, which orders by the same columns on one line. `f.id\n`: the pick among a tenant's
# first runs of a kind, which the walk reads in order.)
CLAIM_ORDER = [
    pytest.param(
        FunctionMutation(
            TENANT_PICKS,
            "ORDER BY f.priority, f.queued_at, f.id\n",
            "ORDER BY f.queued_at, f.priority, f.id\n",
        ),
        "ws-1",
        "by priority, then queued_at",
        id="tenant-within-a-kind-by-queued-at",
    ),
    pytest.param(
        FunctionMutation(
            TENANT_PICKS,
            "ORDER BY h.priority, h.queued_at, h.id\n",
            "ORDER BY h.queued_at, h.priority, h.id\n",
        ),
        "ws-1",
        "by priority, then queued_at",
        id="tenant-across-kinds-by-queued-at",
    ),
    pytest.param(
        FunctionMutation(
            TENANT_PICKS,
            "ORDER BY t.priority, t.turn, t.name",
            "ORDER BY t.turn, t.priority, t.name",
        ),
        "ws-1",
        "priority comes before turns",
        id="tenants-walked-by-turn-first",
    ),
    pytest.param(
        FunctionMutation(
            TENANT_PICKS,
            "ORDER BY t.priority, t.turn, t.name",
            "ORDER BY t.turn, t.name",
        ),
        "ws-1",
        "priority comes before turns",
        id="tenants-walked-without-priority",
    ),
    pytest.param(
        Mutation(
            "claim_runs",
            "ORDER BY c.tenant, c.priority, c.queued_at, c.id",
            "ORDER BY c.tenant, c.queued_at, c.priority, c.id",
            branch="tenanted",
        ),
        "ws-1",
        "expired run was claimed before",
        id="tenant-expired-before-queued-by-queued-at",
    ),
    pytest.param(
        Mutation(
            "claim_runs",
            "ORDER BY priority, turn NULLS FIRST, queued_at, id",
            "ORDER BY queued_at, priority, turn NULLS FIRST, id",
            branch="chosen",
        ),
        None,
        "by priority, then queued_at",
        id="chosen-by-queued-at",
    ),
]


@pytest.mark.parametrize(("mutation", "tenant", "says"), CLAIM_ORDER)
def test_claim_order_mutations_are_caught(
    monkeypatch: pytest.MonkeyPatch,
    conn: Conn,
    mutation: Mutation | FunctionMutation,
    tenant: str | None,
    says: str,
) -> None:
    check = partial(claim_order_is_priority_then_queued_at, tenant=tenant)
    if isinstance(mutation, FunctionMutation):
        err = function_fails_with(conn, mutation, check)
    else:
        err = fails_with(monkeypatch, conn, mutation, check)
    assert says in str(err), err


# -- settle, expire_worker_leases ------------------------------------------------------------------

SETTLE_MUTATIONS = [
    pytest.param(
        Mutation("expire_and_promote", "a.status IN ('queued', 'running')", "false", branch="promotable"),
        waiting_run_waits_for_its_key,
        "promoted a waiting run while its key was active",
        id="promotes-while-its-key-is-active",
    ),
    pytest.param(
        Mutation(
            "expire_and_promote",
            "a.status IN ('queued', 'running')",
            "a.status = 'running'",
            branch="promotable",
        ),
        waiting_run_waits_for_its_key,
        "promoted a waiting run while its key was active",
        id="promotes-while-its-key-is-queued",
    ),
    pytest.param(
        Mutation(
            "expire_and_promote",
            "a.tenant IS NOT DISTINCT FROM w.tenant",
            "a.tenant = w.tenant",
            branch="promotable",
        ),
        waiting_run_waits_for_its_key,
        "promoted a waiting run while its key was active",
        id="promotes-an-untenanted-run-while-its-key-is-active",
    ),
    pytest.param(
        Mutation(
            "expire_and_promote",
            "AND a.tenant IS NOT DISTINCT FROM w.tenant",
            "",
            branch="promotable",
        ),
        waiting_run_waits_only_for_its_tenants_key,
        "only other tenants' runs of its key were active",
        id="waits-for-other-tenants-keys",
    ),
    pytest.param(
        Mutation(
            "expire_and_promote",
            "leasework.key_lock(w.tenant, w.key)",
            "leasework.key_lock(NULL, w.key)",
            branch="promotable",
        ),
        promotion_skips_an_open_enqueue_of_its_tenants_key,
        "waited on an open enqueue of its tenant's key",
        id="tries-the-lock-of-the-key-alone",
    ),
    pytest.param(
        Mutation(
            "expire_and_promote",
            "AND (r.cancel_requested_at IS NOT NULL OR r.attempts >= r.max_attempts)",
            "",
        ),
        last_attempt_is_never_reclaimed,
        "attempts left was settled",
        id="ends-runs-with-attempts-left",
    ),
    pytest.param(
        Mutation(
            "expire_worker_leases", "lease_expires_at = leasework.now() - interval '1 millisecond',"
        ),
        expire_worker_leases_expires_only_the_dead_workers_leases,
        "lease is not expired",
        id="expire-worker-leases-leaves-the-lease",
    ),
    pytest.param(
        Mutation("expire_worker_leases", "'crashed', %(reason)s", "'expired', %(reason)s"),
        expire_worker_leases_expires_only_the_dead_workers_leases,
        "crash is not recorded",
        id="expire-worker-leases-records-no-crash",
    ),
    pytest.param(
        Mutation("expire_worker_leases", "lease_worker = %(worker)s AND ", ""),
        expire_worker_leases_expires_only_the_dead_workers_leases,
        "",
        id="expire-worker-leases-of-every-worker",
    ),
]


@pytest.mark.parametrize(("mutation", "check", "says"), SETTLE_MUTATIONS)
def test_settle_and_expire_mutations_are_caught(
    monkeypatch: pytest.MonkeyPatch,
    conn: Conn,
    dsn: str,
    mutation: Mutation,
    check: Callable[..., None],
    says: str,
) -> None:
    if "dsn" in inspect.signature(check).parameters:  # it opens a second session
        check = partial(check, dsn=dsn)
    err = fails_with(monkeypatch, conn, mutation, check)
    assert says in str(err), err


# -- a handler's Snooze and Fail -------------------------------------------------------------------

SNOOZE_CHARGES_AN_ATTEMPT = Mutation(
    "snooze_run", "THEN attempts - 1 ELSE attempts END", "THEN attempts ELSE attempts END"
)
SNOOZE_WITHOUT_OWNER = Mutation("snooze_run", " AND lease_owner = %(owner)s")
FAIL_WITHOUT_OWNER = Mutation("fail_run", " AND lease_owner = %(owner)s")


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_snooze_that_charges_an_attempt_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn, tenant: str | None
) -> None:
    check = partial(snooze_charges_no_attempt, tenant=tenant)
    err = fails_with(monkeypatch, conn, SNOOZE_CHARGES_AN_ATTEMPT, check)
    assert "charged an attempt" in str(err), err


@pytest.mark.parametrize(
    "mutation",
    [
        pytest.param(SNOOZE_WITHOUT_OWNER, id="snooze"),
        pytest.param(FAIL_WITHOUT_OWNER, id="fail"),
    ],
)
def test_a_snooze_or_fail_without_owner_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn, mutation: Mutation
) -> None:
    fails_with(monkeypatch, conn, mutation, stale_owner_writes_nothing)


# -- the fence's idle timeout ----------------------------------------------------------------------

FENCE_WITHOUT_IDLE_TIMEOUT = Mutation("fence_run", "%(idle_ms)s, true", "'0', true")


def test_fence_without_its_idle_timeout_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn, dsn: str
) -> None:
    """With the timeout off, a cut-off worker's idle fenced transaction holds its run until
    the session dies some other way (TCP keepalive: hours). The real queries keep the check's
    own deadline; the mutant, which can only wait its window out, gets 4 s: four times the
    lease here (the real fence frees the run about one lease in)."""
    check = partial(idle_fenced_transaction_is_ended, dsn=dsn)
    on_mutant = partial(idle_fenced_transaction_is_ended, dsn=dsn, deadline=4.0)
    err = fails_with(monkeypatch, conn, FENCE_WITHOUT_IDLE_TIMEOUT, check, on_mutant)
    assert "still held by an idle fenced transaction" in str(err)


# -- ingest's re-check before `ready` --------------------------------------------------------------

# The re-check compares the file's (project, sha256), read under a row lock, with what the run
# indexed; mark_ready repeats both. Reduced to the scope: the content is read as the content the
# run started on (indexing_sha256), and mark_ready no longer tests it.
RECHECK_READS_STARTED_CONTENT = Mutation(
    "lock_file", "SELECT project, sha256", "SELECT project, indexing_sha256", source="ingest"
)
READY_WITHOUT_CONTENT = Mutation("mark_ready", " AND sha256 = %(sha256)s", source="ingest")


@pytest.mark.parametrize(
    ("mutation", "says"),
    [
        pytest.param(
            (RECHECK_READS_STARTED_CONTENT, READY_WITHOUT_CONTENT),
            "not the new content's",
            id="recheck-of-scope-only",
        ),
        pytest.param(RECHECK_READS_STARTED_CONTENT, "never indexed", id="recheck-misses-content"),
    ],
)
def test_ingest_recheck_of_scope_only_is_caught(
    monkeypatch: pytest.MonkeyPatch,
    conn: Conn,
    tmp_path: Path,
    make_worker: Callable[..., Any],
    mutation: Mutation | tuple[Mutation, ...],
    says: str,
) -> None:
    runs = iter(range(3))

    def check(c: Conn) -> None:
        env = Env(tmp_path / f"run{next(runs)}", make_worker, ingest_chunk_chars=64)
        env.tmp.mkdir()
        replaced_mid_run_is_never_ready_with_stale_chunks(c, env)

    err = fails_with(monkeypatch, conn, mutation, check)
    assert says in str(err), err


# -- functions of schema.sql -----------------------------------------------------------------------


# Issue 34's mutant: the label rule without DEL (the SQL label tests tried only \x07).
LABELS_TAKE_DEL = FunctionMutation("leasework.label_problem(text)", r"\x7f-\x9f", r"\x80-\x9f")


def test_label_problem_accepting_del_is_caught(conn: Conn) -> None:
    err = function_fails_with(conn, LABELS_TAKE_DEL, sql_labels_refuse_every_unsafe_character)
    assert "(U+007F)" in str(err), err


# Unique windows and debounce (leasework.enqueue, migration 0022): a window that counts only its
# run while active (the rule as most queues had it: finished runs forgotten at once), one that a
# failed run still holds, and a merge written over a racing one (the check of what it read gone).
ENQUEUE = (
    "leasework.enqueue(text, jsonb, text, text, text, boolean, double precision, double precision,"
    " double precision, double precision, double precision, double precision, double precision,"
    " double precision, bigint, integer, bigint[], text, text[])"
)
WINDOW_MUTATIONS = [
    pytest.param(
        FunctionMutation(
            ENQUEUE,
            "IF held.unique_at > leasework.now() - make_interval(secs => enqueue.unique_for)",
            "IF held.status IN ('queued', 'running')",
        ),
        unique_window_holds_finished_runs,
        "a run that succeeded inside its window did not hold it",
        id="window-of-active-runs-only",
    ),
    pytest.param(
        FunctionMutation(ENQUEUE, "AND held.status NOT IN ('failed', 'cancelled')", ""),
        unique_window_holds_finished_runs,
        "a run that failed held its window",
        id="window-held-by-a-failed-run",
    ),
    pytest.param(
        FunctionMutation(
            ENQUEUE, "OR enqueue.merge_seen IS DISTINCT FROM pending.debounce_count", "OR false"
        ),
        debounce_merge_keeps_a_racing_merge,
        "a racing merge's payload was lost",
        id="merge-written-over-a-racing-merge",
    ),
]


@pytest.mark.parametrize(("mutation", "check", "says"), WINDOW_MUTATIONS)
def test_window_and_debounce_mutations_are_caught(
    conn: Conn, mutation: FunctionMutation, check: Check, says: str
) -> None:
    err = function_fails_with(conn, mutation, check)
    assert says in str(err), err


# Flow control (migration 0023): leasework.admit with its cap off by one, and the rate's window
# read as empty (every claim let through, as if no window were kept). The checks run on both
# branches of the claim (runs with and without a tenant).
CAP_OFF_BY_ONE = FunctionMutation(
    "leasework.admit(bigint[],text[],text[],integer,bigint,text)",
    "CONTINUE WHEN room[j] < 1;",
    "CONTINUE WHEN room[j] < 0;",
)
RATE_WINDOW_IGNORED = FunctionMutation(
    "leasework.rate_used(bigint[],double precision,timestamp with time zone)",
    "RETURN w[44] - w[(d + 23)::integer];",
    "RETURN 0;",
)


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_cap_off_by_one_is_caught(conn: Conn, tenant: str | None) -> None:
    err = function_fails_with(
        conn, CAP_OFF_BY_ONE, partial(capped_kind_takes_only_its_places, tenant=tenant)
    )
    assert "runs of a kind capped at 2 were claimed" in str(err), err


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_rate_window_ignored_is_caught(conn: Conn, tenant: str | None) -> None:
    err = function_fails_with(
        conn, RATE_WINDOW_IGNORED, partial(rated_kind_claims_only_its_rate, tenant=tenant)
    )
    assert "claims of a kind rated 2 per 10 s within its period" in str(err), err


# Rates per group (migration 0038): leasework.admit that never reads a group's window, and the
# tenants' look-up group by group that does not skip a group whose budget is spent (its pick is
# then refused by admit, and the claim takes nothing while another group has room).
GROUP_MUTATIONS = [
    pytest.param(
        FunctionMutation(
            "leasework.admit(bigint[],text[],text[],integer,bigint,text)",
            "CONTINUE WHEN leasework.rate_used(gw, r.seconds, at) >= r.count;",
        ),
        admit_holds_each_group_to_its_rate,
        "two runs of one group",
        id="admit-ignores-the-groups-window",
    ),
    pytest.param(
        FunctionMutation(
            "leasework.tenant_group_pick(text,text,integer,boolean)",
            "OR leasework.tenant_rate_open(tenant_group_pick.kind, tenant_group_pick.tenant, g))",
            "OR true)",
        ),
        spent_group_budget_is_passed,
        "not the run of the group with a budget left",
        id="group-pick-takes-a-spent-group",
    ),
]


@pytest.mark.parametrize(("mutation", "check", "says"), GROUP_MUTATIONS)
def test_group_rate_mutations_are_caught(
    conn: Conn, mutation: FunctionMutation, check: Check, says: str
) -> None:
    err = function_fails_with(conn, mutation, check)
    assert says in str(err), err


# The payload check (migration 0029): leasework.enqueue that never reads what the kind's workers
# declared, and leasework.payload_problem that forgets the required keys.
SHAPED = {
    "takes": "keywords",
    "required": ["week"],
    "allowed": ["week", "fmt"],
    "describe": "keyword arguments: a JSON object with week, fmt (optional)",
}


def sql_enqueue_refuses_what_the_handler_cannot_take(conn: Conn) -> None:
    conn.execute(
        "INSERT INTO leasework.kinds (kind, accepts) VALUES ('shaped', %s)"
        " ON CONFLICT (kind) DO UPDATE SET accepts = EXCLUDED.accepts",
        (Jsonb(SHAPED),),
    )
    for payload in ("[1]", "{}", '{"week": 1, "fromat": 2}'):
        try:
            with conn.transaction():
                conn.execute("SELECT leasework.enqueue('shaped', %s::jsonb)", (payload,))
        except psycopg.errors.InvalidParameterValue:
            continue
        raise AssertionError(f"payload {payload} was enqueued for a handler that cannot take it")


PAYLOAD_MUTATIONS = [
    pytest.param(
        FunctionMutation(
            ENQUEUE, "IF declared IS NOT NULL AND declared->>'takes' <> 'any' THEN", "IF false THEN"
        ),
        "payload [1] was enqueued",
        id="declaration-never-read",
    ),
    pytest.param(
        FunctionMutation(
            "leasework.payload_problem(text,jsonb,jsonb)", "WHERE NOT payload ? r.key", "WHERE false"
        ),
        "payload {} was enqueued",
        id="required-keys-forgotten",
    ),
]


@pytest.mark.parametrize(("mutation", "says"), PAYLOAD_MUTATIONS)
def test_payload_check_mutations_are_caught(
    conn: Conn, mutation: FunctionMutation, says: str
) -> None:
    err = function_fails_with(conn, mutation, sql_enqueue_refuses_what_the_handler_cannot_take)
    assert says in str(err), err
