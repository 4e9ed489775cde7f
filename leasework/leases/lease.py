"""The lease: claim, renew, control, finish, requeue, release, checkpoint and the fence.

The only module that writes lease columns. Every statement after the claim is scoped by the
claim's owner token, so a stale worker's write matches nothing; a lost lease is a normal return
value (False / None), never an exception. The one-at-a-time hot statement goes through libpq
(wire.py). Never runs job code.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import zlib
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

import psycopg

from ..encoding import check_json
from ..errors import PayloadError, ResultError
from ..queries import load
from . import wire

Q = load("leasework.leases", "lease.sql")
# finish_and_claim embeds finish_run and claim_runs as they are (lease.sql), with the parameters
# that never vary there written in: a success (no error) and one run claimed, the claim skipping
# the run it seals. Four parameters fewer to adapt on every job of one-at-a-time mode.
FINISH_AND_CLAIM = (
    Q["finish_and_claim"]
    .replace(b"<finish_run>", Q["finish_run"])
    .replace(b"<claim_runs>", Q["claim_runs"])
    .replace(b"%(status)s::text", b"'succeeded'::text")
    .replace(b"%(error)s::text", b"NULL::text")
    .replace(b"%(limit)s", b"1")
    .replace(b"%(finishing)s::bigint", b"%(id)s::bigint")
)

# finish_and_claim_queued (lease.sql): one run claimed, as above. Probed: it also asks whether
# claim_runs could take a run it cannot (due_elsewhere). Lean: only whether a kind is paused.
# A capped kind's place handed on from the sealed run to the claimed one (lease.sql, handed_on).
_QUICK_CLAIM = Q["quick_claim"].replace(b"<handed_on>", Q["handed_on"])
_QUICK_CLAIM_ONE = Q["quick_claim_one"].replace(b"<handed_on>", Q["handed_on"])
_QUEUED = Q["finish_and_claim_queued"].replace(b"<quick_claim>", _QUICK_CLAIM)
_QUEUED = _QUEUED.replace(b"%(limit)s", b"1")
FINISH_AND_CLAIM_QUEUED = _QUEUED.replace(b"<due_elsewhere>", Q["due_elsewhere"])
FINISH_AND_CLAIM_LEAN = _QUEUED.replace(b" <due_elsewhere>", b"")
# The same for a worker polling one kind (quick_claim_one: no unnest and LATERAL).
_QUEUED_ONE = Q["finish_and_claim_queued"].replace(b"<quick_claim>", _QUICK_CLAIM_ONE)
_QUEUED_ONE = _QUEUED_ONE.replace(b"%(limit)s", b"1")
FINISH_AND_CLAIM_QUEUED_ONE = _QUEUED_ONE.replace(b"<due_elsewhere>", Q["due_elsewhere"])
FINISH_AND_CLAIM_LEAN_ONE = _QUEUED_ONE.replace(b" <due_elsewhere>", b"")
# How long a Chain sends the lean form after a probed one found nothing else due: how late a
# worker kept busy by untenanted queued runs may see a tenanted run due or an expired lease.
PROBE_EVERY = 0.25
# The same with their parameters numbered ($1 for `id`, ...), for the protocol-level prepared
# statements a Chain keeps on a direct connection (Chain.quick_rows).
QUICK_PARAMS = ("id", "owner", "result", "kinds", "worker", "lease")
QUICK_NAME = b"leasework_finish_and_claim_queued"
LEAN_NAME = b"leasework_finish_and_claim_lean"
QUICK_ONE_NAME = b"leasework_finish_and_claim_queued_one"
LEAN_ONE_NAME = b"leasework_finish_and_claim_lean_one"
# claim_runs and finish_and_claim go through a psycopg RawCursor with their parameters numbered:
# psycopg parses a statement's %(name)s placeholders on every execution past 4 KiB (its parse
# cache), and the claim with its per-kind ranges and turns is longer than that; a raw query is
# sent as it is. CLAIM_PARAMS and FINISH_AND_CLAIM_PARAMS are their parameters, in order.
CLAIM_PARAMS = ("kinds", "worker", "lease", "limit", "finishing")
FINISH_AND_CLAIM_PARAMS = ("id", "owner", "result", "kinds", "worker", "lease")
FINISH_AND_CLAIM_NUMBERED = wire.numbered(FINISH_AND_CLAIM, FINISH_AND_CLAIM_PARAMS)
_claims_numbered: dict[bytes, bytes] = {}
_claims_named: dict[bytes, bytes] = {}


def claim_runs_numbered() -> bytes:
    """claim_runs as it stands in Q (a test may have replaced it), with numbered parameters."""
    text = Q["claim_runs"]
    numbered = _claims_numbered.get(text)
    if numbered is None:
        numbered = _claims_numbered[text] = wire.numbered(text, CLAIM_PARAMS)
    return numbered


def claim_runs_name(numbered: bytes) -> bytes:
    """The name a Chain prepares `numbered` (claim_runs_numbered) under: one per text, so that a
    claim replaced in Q (a test's) is never sent under the name of another."""
    name = _claims_named.get(numbered)
    if name is None:
        name = _claims_named[numbered] = b"leasework_claim_runs_%08x" % zlib.crc32(numbered)
    return name
FINISH_AND_CLAIM_LEAN_NUMBERED = wire.numbered(FINISH_AND_CLAIM_LEAN, QUICK_PARAMS)


def _rated(quick_claim: bytes, probed: bool) -> bytes:
    """finish_and_claim_rated (lease.sql) for `quick_claim` (quick_claim or quick_claim_one),
    probed or lean: its WITH, then finish_and_claim_queued's UPDATE with rated_claim for its
    claim. The quick claim also gives the kind of the run it takes."""
    claim = quick_claim.replace(b"<handed_on>", Q["handed_on_rated"]).replace(b"%(limit)s", b"1")
    for first, with_kind in (
        (b"SELECT c.id FROM unnest", b"SELECT c.id,k.kind FROM unnest"),
        (b"SELECT r.id FROM leasework.runs r", b"SELECT r.id,r.kind FROM leasework.runs r"),
    ):
        if claim.startswith(first):
            claim = with_kind + claim[len(first) :]
    assert b".kind FROM" in claim[:40], "the quick claim no longer starts as _rated expects"
    prefix = Q["finish_and_claim_rated"].replace(b"<quick_claim>", claim)
    prefix = prefix.replace(b" <due_elsewhere>", b" " + Q["due_elsewhere"] if probed else b"")
    gated = b"CASE WHEN NOT (false <due_elsewhere>) THEN (<quick_claim>) END"
    body = Q["finish_and_claim_queued"]
    assert gated in body
    return prefix + b" " + body.replace(gated, Q["rated_claim"])


FINISH_AND_CLAIM_RATED = _rated(Q["quick_claim"], probed=True)
FINISH_AND_CLAIM_RATED_LEAN = _rated(Q["quick_claim"], probed=False)
FINISH_AND_CLAIM_RATED_ONE = _rated(Q["quick_claim_one"], probed=True)
FINISH_AND_CLAIM_RATED_LEAN_ONE = _rated(Q["quick_claim_one"], probed=False)


def _form(text: bytes, name: bytes) -> tuple[bytes, bytes, bytes]:
    return text, name, wire.numbered(text, QUICK_PARAMS)


# Each form's text for the cursor, and its name and numbered text for libpq, by (`probed`, one
# kind polled, a kind polled has a rate).
_QUICK_FORMS = {
    (True, False, True): _form(FINISH_AND_CLAIM_RATED, b"leasework_finish_and_claim_rated"),
    (False, False, True): _form(FINISH_AND_CLAIM_RATED_LEAN, b"leasework_finish_and_claim_rated_lean"),
    (True, True, True): _form(FINISH_AND_CLAIM_RATED_ONE, b"leasework_finish_and_claim_rated_one"),
    (False, True, True): _form(
        FINISH_AND_CLAIM_RATED_LEAN_ONE, b"leasework_finish_and_claim_rated_lean_one"
    ),
    (True, False, False): _form(FINISH_AND_CLAIM_QUEUED, QUICK_NAME),
    (False, False, False): _form(FINISH_AND_CLAIM_LEAN, LEAN_NAME),
    (True, True, False): _form(FINISH_AND_CLAIM_QUEUED_ONE, QUICK_ONE_NAME),
    (False, True, False): _form(FINISH_AND_CLAIM_LEAN_ONE, LEAN_ONE_NAME),
}

Conn = psycopg.Connection[Any]
# Chain.quick_rows' parameters (QUICK_PARAMS): text, but the owner in binary.
_PARAM_FORMATS = [wire.TEXT, wire.BINARY, wire.TEXT, wire.TEXT, wire.TEXT, wire.TEXT]
# Chain.claim_rows' parameters (CLAIM_PARAMS): all text.
_CLAIM_FORMATS = [wire.TEXT] * len(CLAIM_PARAMS)
AConn = psycopg.AsyncConnection[Any]
ControlState = Literal["ok", "lost", "cancelled"]
TERMINAL = ("succeeded", "partial", "failed", "cancelled")


@dataclass(frozen=True)
class Claim:
    """One claimed run: what a worker reads of it, as the claim statement returned it. Only the
    columns the worker uses: each returned column costs the server a type look-up per statement
    (its row description, its send function), and one at a time that is per job (bench/README.md,
    issue 19, fifth pass); the rest of the run is read with `get_run`."""

    id: int
    kind: str
    key: str | None
    tenant: str | None
    payload: Any
    result: Any
    attempts: int
    max_attempts: int
    owner: uuid.UUID
    lease_seconds: float
    timeout_seconds: float | None
    processed_units: int
    total_units: int | None
    # When the claim statement was sent, on this process's monotonic clock: the lease counts from
    # no later than that, so a reply that arrives late (a slow network, a stalled process) is not
    # taken for a fresh lease (Keeper.hold). Not a column.
    sent: float = field(default=0.0, compare=False, repr=False)

    @property
    def last_attempt(self) -> bool:
        return self.attempts >= self.max_attempts


class Owned(Protocol):
    """What an owner-scoped statement needs of a run: its id and the claim's owner token."""

    @property
    def id(self) -> int: ...

    @property
    def owner(self) -> uuid.UUID: ...


@dataclass(frozen=True)
class RunRef:
    """A run known by id and owner only (the supervisor's view of a child's claim)."""

    id: int
    owner: uuid.UUID


class Tended(NamedTuple):
    """One run's state after the keeper's tick (tend_leases)."""

    ours: bool
    renewed: bool
    cancel_requested: bool


def _params(claim: Owned, **extra: Any) -> dict[str, Any]:
    return {"id": claim.id, "owner": claim.owner, **extra}


class JsonText(str):
    """A result already encoded by encode_result: passed through as is."""

    __slots__ = ()


# The most any result may take, whatever the configuration (result_max_bytes, checked where the
# executor encodes a handler's result, is at most this).
RESULT_CEILING = 64 << 20


def encode_result(value: Any, max_bytes: int = RESULT_CEILING) -> JsonText | None:
    """A result as JSON text for a jsonb parameter, encoded and checked as payloads are (orjson,
    never pickle; nan and infinity refused, integers past 64 bits refused, at most `max_bytes`).
    None stays None (keep the result gathered so far). Raises ResultError."""
    if value is None or isinstance(value, JsonText):
        return value
    try:
        data = check_json("result", value, max_bytes)
    except PayloadError as exc:
        raise ResultError(str(exc)) from None
    return JsonText(data.decode())


def claim_runs(
    conn: Conn,
    kinds: Sequence[str],
    *,
    worker: str,
    lease: float,
    limit: int = 1,
    chain: Chain | None = None,
) -> list[Claim]:
    """Claim up to `limit` due runs of `kinds` (queued, or running with an expired lease).

    One autocommit statement, one round trip (`conn` must be idle, in autocommit mode). The rate
    limiter's re-check under the tenant locks, with a fresh snapshot, happens inside that same
    statement (leasework.limiter_conflict), so two conflicting runs are never both `running` with
    live leases, not even for a moment: the seed's "two workers cannot both pass the check" holds
    in the database, not only in the handlers.

    With a `chain` (a worker's, kept from claim to claim) on a direct connection outside a
    transaction, the statement goes through libpq as the chain's own prepared statement
    (Chain.claim_rows): the same text and parameters, sent without psycopg's cursor.
    """
    if not kinds:
        return []
    sent = time.monotonic()
    if chain is not None and wire.direct_and_idle(conn):
        return _claims_in_order(chain.claim_rows(conn, kinds, worker, lease, limit), lease, sent)
    params = (list(kinds), worker, lease, limit, None)  # CLAIM_PARAMS
    # A connection outside autocommit still gets the claim committed on its own.
    own_tx = conn.transaction() if not conn.autocommit else nullcontext()
    with own_tx, psycopg.RawCursor(conn) as cur:
        cur.execute(claim_runs_numbered(), params, prepare=True)
        rows = cur.fetchall()
        if not rows:
            return []
        if not _claim_columns_checked:  # cur.description builds 15 objects: once per process
            _check_claim_columns([d.name for d in cur.description or ()])
    return _claims_in_order(rows, lease, sent)


def _claims_in_order(rows: list[Any], lease: float, sent: float) -> list[Claim]:
    """claim_runs' rows as Claims, a batch run in (priority, queued_at, id) order. Plain
    tuples, in Claim's field order (the claim's RETURNING list): the claim is the hot path of
    one-at-a-time mode, and a dict per row cost more than building the Claim itself."""
    if len(rows) > 1:
        rows.sort(key=lambda r: (r[_CLAIMED], r[_CLAIMED + 1], r[0]))
    return [_claim(r[:_CLAIMED], lease, sent) for r in rows]


class Chain:
    """What a caller of finish_and_claim keeps from one job to the next (one per worker, one
    connection at a time; not thread-safe).

    Which statement to send. The whole finish_and_claim for `recheck` seconds after the quick
    one claimed nothing and claim_runs, sent then, claimed a run only the whole statement takes
    (a tenanted run due, a lease expired; one the quick statement takes too is a miss, forgiven
    once per `recheck`: Chain.missed); otherwise
    finish_and_claim_queued (one update for the seal and the claim), probed: it claims nothing
    if anything else is due. After a probed one claimed a run, its lean form (only a pause is asked: the probe was 8 % of a job's server work) for
    `probe_every` seconds. So a plain queue pays the probe once per `probe_every`, a queue with
    tenants or a crashed worker's runs a statement that claims nothing at most once per
    `recheck`, and a worker kept busy by untenanted runs takes a tenanted run due or an expired
    lease at most `probe_every` late (an idle worker, and one whose untenanted runs ran out,
    claims with claim_runs, so at once). A pause holds from its commit in every form.

    And one cursor, kept open: a new cursor brings a new psycopg Transformer, which looks up
    the dumper of each parameter and the loader of each of the 14 result columns again on
    every statement; a kept one finds them in its own cache.

    On a direct connection the quick statement goes through libpq itself (`quick_rows`, with
    wire.Prepared): a protocol-level prepared statement of the Chain's own per form, its
    parameters sent as the text they already are and its rows returned in binary (no timestamp
    to format on the server or to parse here), the claimed row alone loaded by a kept
    Transformer, with the connection's loaders. psycopg's cursor did the same work with a third
    of a job's client time around it (its execution generators, the parameter mapping, the
    prepared-statement bookkeeping; bench/README.md, issue 19, third pass). Behind a pooler (no
    prepared statement outlives a transaction there) or inside the caller's transaction, the
    kept cursor runs it instead."""

    __slots__ = (
        "_cursor",
        "_encoding",
        "_fixed",
        "_fixed_values",
        "_forgive_after",
        "_kinds",
        "_kinds_text",
        "_one",
        "_raw_cursor",
        "_wire",
        "lean_until",
        "probe_every",
        "rated",
        "recheck",
        "whole_until",
    )

    def __init__(self, recheck: float = 1.0, probe_every: float = PROBE_EVERY) -> None:
        self.recheck = recheck
        self.probe_every = probe_every
        self.whole_until = float("-inf")  # monotonic time until which the whole claim is sent
        self.lean_until = float("-inf")  # ... and the lean form of the quick one
        self._forgive_after = float("-inf")  # monotonic time from which a miss is forgiven
        self._cursor: psycopg.Cursor[Any] | None = None
        self._raw_cursor: psycopg.RawCursor[Any] | None = None
        self._kinds: list[str] | None = None
        self._one = False  # one kind polled: the quick statement's _one form
        # A kind polled had a rate when claim_runs last took a run the quick statement left:
        # finish_and_claim_rated is the quick statement (it records a rated kind's claims).
        self.rated = False
        self._kinds_text = ""
        self._wire = wire.Prepared()  # the quick statement's forms, prepared on one connection
        self._encoding = "utf-8"  # the client encoding the parameters below are sent in
        # The parameters that stay the same from job to job (kinds, worker, lease), and the bytes
        # quick_rows sends for them, made again when they change or the connection does.
        self._fixed: tuple[str, str, float] | None = None
        self._fixed_values: tuple[bytes, bytes, bytes] = (b"", b"", b"")

    def quick(self, now: float) -> bool:
        """Whether to send finish_and_claim_queued at monotonic time `now`."""
        return now >= self.whole_until

    def probed(self, now: float) -> bool:
        """Whether finish_and_claim_queued sent at `now` asks whether anything else is due."""
        return now >= self.lean_until

    def claimed_nothing(self, now: float) -> None:
        """finish_and_claim_queued claimed nothing: something only the whole claim takes may be
        due (a pause, a tenanted run, an expired lease), or nothing at all."""
        self.whole_until = now + self.recheck
        self.lean_until = float("-inf")

    def ran_dry(self) -> None:
        """Nor did claim_runs claim anything: the quick statement again from the next job."""
        self.whole_until = float("-inf")

    def missed(self, now: float) -> None:
        """claim_runs, sent because the quick statement claimed nothing, took a run the quick
        statement takes too (no tenant, a first attempt): most likely the quick statement's
        snapshot saw a rival's claim in flight as queued, which says nothing of the queue.
        The quick statement again from the next job rather than the whole one for `recheck`;
        once per `recheck`, so a queue that does hold what only the whole statement takes (a
        paused kind polled, a tenant's turn, an expired lease at another priority) costs at most
        one statement more per `recheck` than it did."""
        if now >= self._forgive_after:
            self.whole_until = float("-inf")
            self._forgive_after = now + self.recheck

    def saw_nothing_else(self, now: float) -> None:
        """A probed finish_and_claim_queued claimed a run: nothing else was due."""
        self.lean_until = now + self.probe_every

    def kinds(self, kinds: Sequence[str]) -> str:
        """`kinds` as the text of a text[] value, made again only when the kinds change: psycopg's
        list dumper looks through a list's elements to choose the array's type on every call."""
        listed = kinds if isinstance(kinds, list) else list(kinds)
        if listed != self._kinds:
            self._kinds, self._kinds_text = listed, wire.array_text(listed)
            self._one = len(listed) == 1
        return self._kinds_text

    def cursor(self, conn: Conn) -> psycopg.Cursor[Any]:
        """A cursor of `conn`: the one kept, unless the connection changed or it was closed."""
        cur = self._cursor
        if cur is None or cur.closed or cur.connection is not conn:
            cur = self._cursor = conn.cursor()
        return cur

    def raw_cursor(self, conn: Conn) -> psycopg.RawCursor[Any]:
        """A raw cursor of `conn` (for finish_and_claim): the one kept, as `cursor`."""
        cur = self._raw_cursor
        if cur is None or cur.closed or cur.connection is not conn:
            cur = self._raw_cursor = psycopg.RawCursor(conn)
        return cur

    def quick_rows(
        self, conn: Conn, params: dict[str, Any], *, probed: bool = True
    ) -> tuple[bool, tuple[Any, ...] | None]:
        """Send finish_and_claim_queued (its probed or its lean form) for `params` (id, owner,
        result as JsonText or None, kinds as text, worker, lease). Returns (sealed, the claimed
        run's columns or None). Raises psycopg.Error as the cursor would."""
        text, name, numbered = _QUICK_FORMS[probed, self._one, self.rated]
        if not wire.direct_and_idle(conn):
            # Behind a pooler (no prepared statement outlives a transaction there) or inside the
            # caller's transaction (which psycopg's cursor keeps track of): the cursor.
            cur = self.cursor(conn)
            cur.execute(text, params, prepare=True)
            rows = cur.fetchall()
            if rows and not _combined_columns_checked[True]:
                _check_combined_columns([d.name for d in cur.description or ()], quick=True)
            return _quick_outcome(rows)
        fixed = self._fixed_bytes(conn, params["kinds"], params["worker"], params["lease"])
        result, owner = params["result"], params["owner"]
        values: list[Any] = [
            b"%d" % params["id"],
            # The owner in binary (16 bytes): formatting a UUID as text costs more.
            (owner if isinstance(owner, uuid.UUID) else uuid.UUID(owner)).bytes,
            None if result is None else result.encode(self._encoding),
            *fixed,
        ]
        prepared = self._wire
        res = prepared.execute(conn, name, numbered, values, _PARAM_FORMATS)
        if not _combined_columns_checked[True]:
            _check_combined_columns(wire.column_names(res), quick=True)
        # Column 0 is `sealed`, a binary boolean (one byte, 1 for true): read as it is; only
        # the claimed run's row is loaded, the sealed one never read.
        sealed, claimed = False, None
        for i in range(res.ntuples):
            if res.get_value(i, 0) == b"\x01":
                sealed = True
            else:
                claimed = prepared.load_row(res, i)[1:]
        return sealed, claimed


    def claim_rows(
        self, conn: Conn, kinds: Sequence[str], worker: str, lease: float, limit: int
    ) -> list[tuple[Any, ...]]:
        """Send claim_runs (as claim_runs_numbered gives it) for `kinds`, `worker`, `lease` and
        `limit`, nothing being sealed with it, through libpq as quick_rows sends its statement:
        its own prepared statement, the parameters that stay the same from claim to claim kept as
        bytes, the rows returned in binary. A woken idle worker's claim (pickup latency:
        bench/README.md, issue 30, fourth pass): psycopg's cursor spent about as long adapting the
        parameters and preparing its own bookkeeping before the send as the raw loop's whole
        wake-up took. The caller checked `wire.direct_and_idle(conn)`. Raises psycopg.Error as
        the cursor would."""
        numbered = claim_runs_numbered()
        fixed = self._fixed_bytes(conn, self.kinds(kinds), worker, lease)
        values = [*fixed, b"%d" % limit, None]  # CLAIM_PARAMS; nothing sealed
        res = self._wire.execute(conn, claim_runs_name(numbered), numbered, values, _CLAIM_FORMATS)
        if not _claim_columns_checked:
            _check_claim_columns(wire.column_names(res))
        return self._wire.load_rows(res)

    def _fixed_bytes(
        self, conn: Conn, kinds: str, worker: str, lease: float
    ) -> tuple[bytes, bytes, bytes]:
        """The parameters that stay the same from statement to statement (`kinds` as the text of
        a text[], the worker, the lease) as the bytes libpq sends, made again only when they or
        the connection change."""
        fixed = (kinds, worker, lease)
        if self._wire.pgconn is not conn.pgconn or fixed != self._fixed:
            self._encoding = conn.info.encoding  # the text below goes in the client's encoding
            self._fixed = fixed
            self._fixed_values = (
                kinds.encode(self._encoding),
                worker.encode(self._encoding),
                repr(float(lease)).encode(),
            )
        return self._fixed_values


def _quick_outcome(rows: Sequence[tuple[Any, ...]]) -> tuple[bool, tuple[Any, ...] | None]:
    """Chain.quick_rows' answer from the cursor's rows."""
    sealed, claimed = False, None
    for row in rows:
        if row[0]:
            sealed = True
        else:
            claimed = row[1:]
    return sealed, claimed


def finish_and_claim(
    conn: Conn,
    claim: Claim,
    kinds: Sequence[str],
    *,
    worker: str,
    lease: float,
    result: Any = None,
    chain: Chain | None = None,
) -> tuple[bool, Claim | None]:
    """Seal `claim` as succeeded and claim the next due run of `kinds`, in one statement and one
    synchronous commit (lease.sql, finish_and_claim). Returns (sealed, next claim or None);
    sealed False: the run was no longer ours and nothing was written for it. A run with a
    tenant too: the claim's limiter still counts it as holding its lease, so when the statement
    claims nothing, claim_runs claims again once the seal has committed (the next run of that
    tenant may have conflicted with it).

    With a `chain` (the caller's, kept from job to job), the statement runs on its kept cursor,
    and while the chain has seen nothing else due lately it is finish_and_claim_queued; if that
    claims nothing (something else due, or nothing queued without a tenant), it still seals, and
    the claim is made here with claim_runs (one statement more, at most once per `chain.recheck`
    while the queue stays so)."""
    params = {
        "id": claim.id,
        "owner": claim.owner,
        "result": encode_result(result),
        "kinds": list(kinds) if chain is None else chain.kinds(kinds),
        "worker": worker,
        "lease": lease,
    }
    own_tx = conn.transaction() if not conn.autocommit else nullcontext()
    sent = time.monotonic()
    if chain is None or not chain.quick(sent):
        raw = psycopg.RawCursor(conn) if chain is None else nullcontext(chain.raw_cursor(conn))
        with own_tx, raw as cur:
            cur.execute(
                FINISH_AND_CLAIM_NUMBERED,
                [params[name] for name in FINISH_AND_CLAIM_PARAMS],
                prepare=True,
            )
            row = cur.fetchone()
            assert row is not None  # one row always
            if row[1] is not None and not _combined_columns_checked[False]:
                _check_combined_columns([d.name for d in cur.description or ()], quick=False)
        if row[1] is not None:
            return bool(row[0]), _claim(row[1 : 1 + _CLAIMED], lease, sent)
        if claim.tenant is None:
            return bool(row[0]), None
        # The sealed run's tenant: the limiter above saw it still running.
        claims = claim_runs(conn, kinds, worker=worker, lease=lease, chain=chain)
        return bool(row[0]), claims[0] if claims else None
    probed = chain.probed(sent)
    with own_tx:
        sealed, row = chain.quick_rows(conn, params, probed=probed)
    if row is not None:
        if probed:
            chain.saw_nothing_else(sent)
        return sealed, _claim(row, lease, sent)
    # Nothing claimed: a kind polled is paused, something only claim_runs takes was due (the
    # probed form), or no queued run without a tenant was (either form). claim_runs claims now
    # (the worker would otherwise rest with a run due), and the whole statement is sent for
    # `chain.recheck` if it took one only the whole claim takes (a miss is forgiven once per
    # `chain.recheck`: Chain.missed). If it took
    # none the queue ran dry, and the next run enqueued is the quick statement's again (the whole
    # one reads the head of every index, which under a snapshot held elsewhere holds the dead
    # entries of every run claimed since: a worker that drains its queue at every wake-up would
    # send nothing else).
    chain.claimed_nothing(sent)
    claims = claim_runs(conn, kinds, worker=worker, lease=lease, chain=chain)
    if not claims:
        chain.ran_dry()
    else:
        # A kind with a rate is claimed by the quick statement only in its rated form: whether
        # one is polled, asked when claim_runs took a run (so at most twice per chain.recheck).
        row = conn.execute(Q["rated_among"], {"kinds": params["kinds"]}).fetchone()
        rated = bool(row and row[0])
        if rated and not chain.rated:
            # The quick statement left the rated kind out (its plain form claims no rated run):
            # its rated form claims it from the next job, not the whole statement for
            # `chain.recheck` (2 s in a worker: every job of a worker's first 2 s went through
            # claim_runs and leasework.admit, a third to a half of a short drain's jobs).
            chain.ran_dry()
        elif claims[0].tenant is None and claims[0].attempts == 1:
            chain.missed(sent)
        chain.rated = rated
    return sealed, claims[0] if claims else None


def _claim(row: tuple[Any, ...], lease: float, sent: float) -> Claim:
    """The Claim of one returned row (Claim's fields in order, `sent` aside). Built by filling
    the instance's attributes at once: a frozen dataclass's __init__ sets each of its 14 fields
    through object.__setattr__, three times the cost, once per claimed run."""
    claim = _new(Claim)
    fields = claim.__dict__
    fields.update(zip(CLAIM_FIELDS, row, strict=True))
    fields["sent"] = sent
    if fields["lease_seconds"] is None:  # the kind's lease is the worker's
        fields["lease_seconds"] = lease
    return claim


_new = object.__new__

# The claim's RETURNING columns, in order: Claim's fields, `owner` being the lease_owner column.
CLAIM_COLUMNS = tuple(
    "lease_owner" if f.name == "owner" else f.name
    for f in dataclasses.fields(Claim)
    if f.name != "sent"
)
# Claim's fields in the same order (CLAIM_COLUMNS with `owner` for lease_owner), for _claim.
CLAIM_FIELDS = tuple(f.name for f in dataclasses.fields(Claim) if f.name != "sent")
# claim_runs returns these after Claim's columns: the order in which a batch's runs are run
# (priority, then queued_at, then id), which an UPDATE's RETURNING does not keep.
ORDER_COLUMNS = ("priority", "queued_at")
_CLAIMED = len(CLAIM_COLUMNS)
_claim_columns_checked = False


def _check_claim_columns(columns: Sequence[str]) -> None:
    """Once per process: the claim statement returns exactly Claim's fields, in order, and then
    ORDER_COLUMNS."""
    global _claim_columns_checked
    names = tuple(columns)
    if names != (*CLAIM_COLUMNS, *ORDER_COLUMNS):
        raise RuntimeError(
            f"claim_runs returns {names}, expected Claim's {CLAIM_COLUMNS} + {ORDER_COLUMNS}"
        )
    _claim_columns_checked = True


# Per statement (finish_and_claim, finish_and_claim_queued): its columns checked already.
_combined_columns_checked = [False, False]


def _check_combined_columns(columns: Sequence[str], quick: bool) -> None:
    """Once per process and statement: finish_and_claim returns `finished`, then claim_runs'
    columns (Claim's fields in order, then ORDER_COLUMNS); finish_and_claim_queued `sealed`, then
    Claim's fields."""
    names = tuple(columns)
    expected = ("sealed", *CLAIM_COLUMNS) if quick else ("finished", *CLAIM_COLUMNS, *ORDER_COLUMNS)
    if names != expected:
        raise RuntimeError(f"finish_and_claim returns {names}, expected {expected}")
    _combined_columns_checked[quick] = True


def expire_and_promote(conn: Conn, limit: int, busy: list[int] | None = None) -> tuple[int, int]:
    """End expired runs that must not be reclaimed and promote waiting runs whose key is idle.
    A waiting run whose key an open transaction is enqueueing is skipped, not waited on; the pids
    of the sessions holding such keys are appended to `busy`.

    Returns (ended, promoted)."""
    row = conn.execute(Q["expire_and_promote"], {"limit": limit}, prepare=True).fetchone()
    assert row is not None
    if busy is not None and row[3]:
        busy.extend(row[3])
    return int(row[0]), int(row[1])


def next_due(conn: Conn, kinds: Sequence[str]) -> float | None:
    """Seconds until a run of `kinds` may next be claimed or settled by the table as it is (a
    delayed or retried run, a lease running out); None: nothing until a NOTIFY (lease.sql)."""
    row = conn.execute(Q["next_due"], {"kinds": list(kinds)}, prepare=True).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def renew(conn: Conn, claim: Claim) -> datetime | None:
    """Extend the lease by its length from database now. None: the run is no longer ours."""
    row = conn.execute(
        Q["renew_lease"], _params(claim, lease=claim.lease_seconds), prepare=True
    ).fetchone()
    return None if row is None else row[0]


def tend(conn: Conn, runs: Sequence[tuple[Claim, bool]]) -> dict[int, Tended]:
    """The lease keeper's tick: renew the runs flagged True, read every run's state (one
    statement). A run missing from `ours` was lost; one not renewed though flagged had its row
    locked (by the worker's own open transaction) and is tried again next tick."""
    if not runs:
        return {}
    params = {
        "ids": [c.id for c, _ in runs],
        "owners": [c.owner for c, _ in runs],
        "leases": [c.lease_seconds for c, _ in runs],
        "renew": [due for _, due in runs],
    }
    rows = conn.execute(Q["tend_leases"], params, prepare=True).fetchall()
    return {int(r[0]): Tended(*r[1:]) for r in rows}


def control(conn: Conn, claim: Owned) -> ControlState:
    """The control query: lost (another owner, or the lease ran out), cancel requested, or carry
    on."""
    row = conn.execute(Q["control_run"], _params(claim), prepare=True).fetchone()
    if row is None:
        return "lost"
    return "cancelled" if row[0] else "ok"


def finish(
    conn: Conn,
    claim: Owned,
    status: Literal["succeeded", "partial", "failed", "cancelled"],
    *,
    result: Any = None,
    error: str | None = None,
) -> bool:
    """Seal the run. False: it was no longer ours and nothing was written."""
    row = conn.execute(
        Q["finish_run"],
        _params(claim, status=status, result=encode_result(result), error=error),
        prepare=True,
    ).fetchone()
    return row is not None


def finish_many(conn: Conn, done: Sequence[tuple[Claim, Any]]) -> set[int]:
    """Seal a batch's successes, each with its result, in one statement. Returns the ids that
    were still ours; a run missing from it was no longer ours and nothing was written for it."""
    if not done:
        return set()
    # The arrays go as the text of their values, made here with str.join: psycopg's list dumper
    # adapts and quotes a list element by element in Python (a tenth of a batch's client time).
    params = {
        "ids": "{" + ",".join([str(c.id) for c, _ in done]) + "}",
        # UUIDs as their 32 hex digits (which uuid input takes): cheaper than their str().
        "owners": "{" + ",".join([c.owner.hex for c, _ in done]) + "}",
        # NULL when no run returned a result (a batch of no-op handlers): nothing to look up.
        "results": (
            wire.array_text([encode_result(r) for _, r in done])
            if any(r is not None for _, r in done)
            else None
        ),
    }
    rows = conn.execute(Q["finish_runs"], params, prepare=True).fetchall()
    return {r[0] for r in rows}


def requeue(
    conn: Conn,
    claim: Owned,
    *,
    delay: float,
    error: str | None,
    outcome: str = "failed",
    result: Any = None,
) -> str | None:
    """Retry in place after `delay` seconds. Returns the run's new status: `queued`, or
    `cancelled` (cancel requested meanwhile) or `failed` (no attempts left); None if lost."""
    done = requeue_due(conn, claim, delay=delay, error=error, outcome=outcome, result=result)
    return None if done is None else done[0]


def requeue_due(
    conn: Conn,
    claim: Owned,
    *,
    delay: float,
    error: str | None,
    outcome: str = "failed",
    result: Any = None,
) -> tuple[str, datetime] | None:
    """`requeue`, returning the new status and when the run is due again; None if lost."""
    row = conn.execute(
        Q["requeue_run"],
        _params(
            claim,
            delay=max(0.0, delay),
            error=error,
            outcome=outcome,
            result=encode_result(result),
        ),
        prepare=True,
    ).fetchone()
    return None if row is None else (str(row[0]), row[1])


class Snoozed(NamedTuple):
    """What snooze_run did: the run's new status (`queued`, or `failed`: its snoozes used up,
    or `cancelled`: a cancel was requested meanwhile), when it is due, and its snoozes so far."""

    status: str
    due_at: datetime
    snoozes: int


def snooze(
    conn: Conn,
    claim: Owned,
    *,
    after: float,
    max_snoozes: int,
    reason: str | None = None,
    result: Any = None,
) -> Snoozed | None:
    """Requeue the run due `after` seconds from now without charging the attempt, unless it has
    snoozed `max_snoozes` times already (then it ends `failed`) or a cancel was requested (then
    `cancelled`). None: it was no longer ours and nothing was written."""
    row = conn.execute(
        Q["snooze_run"],
        _params(
            claim,
            after=max(0.0, after),
            max_snoozes=max_snoozes,
            reason=reason,
            too_often=f"snoozed too often: more than max_snoozes = {max_snoozes} snoozes",
            result=encode_result(result),
        ),
        prepare=True,
    ).fetchone()
    return None if row is None else Snoozed(str(row[0]), row[1], int(row[2]))


def fail(conn: Conn, claim: Owned, *, error: str, result: Any = None) -> str | None:
    """End the run `failed` now, whatever attempts are left (a handler's Fail), or `cancelled`
    if a cancel was requested meanwhile. Returns the new status; None if it was no longer ours
    and nothing was written."""
    row = conn.execute(
        Q["fail_run"], _params(claim, error=error, result=encode_result(result)), prepare=True
    ).fetchone()
    return None if row is None else str(row[0])


def release(conn: Conn, claim: Owned, reason: str = "shutdown") -> str | None:
    """Give the run back without charging the attempt. Returns the new status or None if lost."""
    row = conn.execute(Q["release_run"], _params(claim, reason=reason), prepare=True).fetchone()
    return None if row is None else str(row[0])


def checkpoint(conn: Conn, claim: Claim, processed: int, total: int | None = None) -> bool:
    """Record progress and renew. False: the run is no longer ours."""
    row = conn.execute(
        Q["checkpoint_run"],
        _params(claim, processed=processed, total=total, lease=claim.lease_seconds),
        prepare=True,
    ).fetchone()
    return row is not None


def fence(conn: Conn, claim: Claim, waits: tuple[str, str] | None = None) -> bool:
    """Inside an open transaction: lock the run against reclaim if it is still ours with a live
    lease. False: it is not, and the caller must write nothing. The transaction may then sit
    idle for at most the lease before the server ends it (see fence_run). `waits`: the
    connection's lock_timeout and statement_timeout from before leasework bounded them
    (Connections.handler_waits), given back to the handler for the transaction."""
    row = conn.execute(Q["fence_run"], _fence_params(claim, waits), prepare=True).fetchone()
    return row is not None


def _fence_params(claim: Claim, waits: tuple[str, str] | None) -> dict[str, Any]:
    lock, statement = waits or (None, None)
    idle_ms = str(max(1, round(claim.lease_seconds * 1000)))
    return _params(claim, idle_ms=idle_ms, lock_timeout=lock, statement_timeout=statement)


# -- the same two for async handlers (workers/acontext.py), on a psycopg AsyncConnection ---------


async def acheckpoint(conn: AConn, claim: Claim, processed: int, total: int | None = None) -> bool:
    """`checkpoint` on an async connection."""
    cur = await conn.execute(
        Q["checkpoint_run"],
        _params(claim, processed=processed, total=total, lease=claim.lease_seconds),
        prepare=True,
    )
    return await cur.fetchone() is not None


async def afence(conn: AConn, claim: Claim) -> bool:
    """`fence` on an async connection, inside its open transaction."""
    cur = await conn.execute(Q["fence_run"], _fence_params(claim, None), prepare=True)
    return await cur.fetchone() is not None


# -- durable steps (ctx.step): read once per attempt, each written once under the fence -----------


def load_steps(conn: Conn, claim: Owned) -> dict[str, str]:
    """The run's stored steps: name -> its value as JSON text."""
    rows = conn.execute(Q["load_steps"], {"id": claim.id}, prepare=True).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def store_step(conn: Conn, claim: Owned, name: str, value: JsonText) -> bool:
    """Store a step's value if the run is still ours with a live lease. False: it is not, and
    nothing was written."""
    params = _params(claim, name=name, value=value)
    return conn.execute(Q["store_step"], params, prepare=True).fetchone() is not None


async def aload_steps(conn: AConn, claim: Owned) -> dict[str, str]:
    """`load_steps` on an async connection."""
    cur = await conn.execute(Q["load_steps"], {"id": claim.id}, prepare=True)
    return {str(r[0]): str(r[1]) for r in await cur.fetchall()}


async def astore_step(conn: AConn, claim: Owned, name: str, value: JsonText) -> bool:
    """`store_step` on an async connection."""
    params = _params(claim, name=name, value=value)
    cur = await conn.execute(Q["store_step"], params, prepare=True)
    return await cur.fetchone() is not None


def expire_worker_leases(conn: Conn, worker: str, reason: str) -> list[int]:
    """Expire every lease held by a worker known to be dead (the supervisor reaped it)."""
    rows = conn.execute(Q["expire_worker_leases"], {"worker": worker, "reason": reason}).fetchall()
    return [r[0] for r in rows]


def db_now(conn: Conn) -> datetime:
    row = conn.execute(Q["db_now"]).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]
