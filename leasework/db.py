"""Connections and the schema: opening connections and a worker's small pool, installing
`schema.sql` or applying the pending versioned migrations, checking that the schema is current.
Holds no connection at import time."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from .errors import ConfigError, LeaseworkError, SchemaMissing
from .log import event, first_line, redact_dsn

NOTIFY_CHANNEL = "leasework"
_MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


def schema_text() -> str:
    """The schema shipped in the wheel, or the repository's copy in a source checkout."""
    packaged = resources.files("leasework").joinpath("schema.sql")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "schema.sql").read_text(encoding="utf-8")


def connect(
    dsn: str | None,
    *,
    autocommit: bool = True,
    application_name: str = "leasework",
    connect_timeout: int = 10,
    pooler: str = "auto",
    **libpq: Any,
) -> psycopg.Connection[Any]:
    """One connection; raises LeaseworkError with a one-line, password-free message on failure.
    `libpq` adds connection parameters (they override the DSN's). `pooler` (auto, on, off): see
    `adapt`."""
    check_dsn(dsn)
    try:
        conn = psycopg.connect(
            dsn or "",
            autocommit=autocommit,
            application_name=application_name,
            connect_timeout=connect_timeout,
            **libpq,
        )
    except psycopg.ProgrammingError as exc:  # a malformed DSN
        raise malformed(exc) from None
    except psycopg.OperationalError as exc:
        first = _unquote_secrets(first_line(exc))
        if is_refusal(str(exc)):
            raise ConfigError(f"the database refused the connection: {first}") from None
        raise DatabaseUnavailable(f"cannot connect to the database: {first}") from exc
    try:
        adapt(conn, pooler)
    except psycopg.Error as exc:
        conn.close()
        raise DatabaseUnavailable(f"cannot connect to the database: {first_line(exc)}") from exc
    return conn


# -- poolers ------------------------------------------------------------------------------------
# Behind a pooler in transaction mode (PgBouncer's pool_mode = transaction, and the poolers of
# managed services) each transaction may run on a different server session, so nothing may
# outlive a transaction: no protocol-level prepared statement (psycopg prepares a statement run
# often, and lease.py asks for it), no session SET, no LISTEN, no advisory lock held across
# transactions. leasework holds none of these on a pooled connection; it finds out per
# connection.


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """True when `conn` reaches Postgres through a pooler. A pooler hands its client a cancel key
    of its own (BackendKeyData: it must, to route a cancel to whichever server session runs the
    client's query at the time), so the process id the connection was given is not the one of
    the server process that answers. Direct, the two are always equal. One round trip; leaves
    no transaction open."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    if not conn.autocommit:
        conn.rollback()
    return row is None or int(row[0]) != conn.info.backend_pid


def adapt(conn: psycopg.Connection[Any], pooler: str = "auto") -> bool:
    """Turn off prepared statements on `conn` if it goes through a pooler: `on` says it does,
    `off` that it does not, `auto` asks (`behind_pooler`). Returns whether it is pooled
    (`is_pooled` tells later)."""
    pooled = pooler == "on" or (pooler == "auto" and behind_pooler(conn))
    if pooled:
        conn.prepare_threshold = None  # every statement unnamed, even those asked prepare=True
    return pooled


def bound_waits(
    conn: psycopg.Connection[Any],
    lock_timeout: float,
    statement_timeout: float,
    idle_timeout: float = 0,
) -> tuple[str, str] | None:
    """Bound every statement of leasework's own on `conn`: a row or key another session holds is
    given up after `lock_timeout` seconds (an uncommitted enqueue or an operator's SELECT ... FOR
    UPDATE must never stall a worker), a statement after `statement_timeout` (0: none), and with
    `idle_timeout` a transaction left idle that long is ended by the server: a client cut off
    between two statements of one (a network partition, a host gone) leaves its server session
    waiting, with the transaction's row locks held, until the server's TCP keepalive gives up
    (two hours by default), and every claim skips the runs it holds. Returns the session's
    lock_timeout and statement_timeout from before, which a handler's transaction on this
    connection gets back (lease.fence, which bounds its idle time by the run's lease), or None
    behind a pooler, where a session setting would land on whichever server session ran it."""
    if is_pooled(conn):
        return None
    row = conn.execute(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'),"
        " set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false),"
        " set_config('idle_in_transaction_session_timeout', %s, false)",
        (
            f"{max(1, round(lock_timeout * 1000))}ms",
            f"{round(statement_timeout * 1000)}ms",
            f"{round(idle_timeout * 1000)}ms",
        ),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def is_pooled(conn: psycopg.Connection[Any]) -> bool:
    """Whether `adapt` found (or was told) that `conn` goes through a pooler: leasework turns
    prepared statements off on exactly those connections."""
    return conn.prepare_threshold is None


def malformed(exc: BaseException | str) -> ConfigError:
    """libpq's complaint about a DSN, without the parts of it that it quotes (a password, or a
    piece of one, is often what it quotes)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
    reason = re.sub(r'"[^"]*"?|\'[^\']*\'?', '"…"', redact_dsn(text))
    return ConfigError(
        f"the DSN is malformed ({reason}): in a URL, percent-encode @ : / % and spaces in the "
        "password (%40 %3A %2F %25 %20); in key=value form, put the password in single quotes"
    )


def check_dsn(dsn: str | None) -> None:
    """Refuse a DSN libpq cannot parse, or whose host holds an `@` (an unencoded `@` in a URL's
    password: libpq would take the rest of the password for a host name and print it), with a
    message that quotes none of it."""
    if not dsn:
        return
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise malformed(exc) from None
    if any("@" in str(params.get(k) or "") for k in ("host", "hostaddr", "port", "dbname")):
        raise malformed("more than one @ before the host")


_QUOTE = re.compile("['\"]")


def _unquote_secrets(message: str) -> str:
    """A connection error as printable: a quoted name holding an `@` (part of a password) is
    hidden. A walk over the quotes, each gap read once (the regex it replaces,
    `(['"])[^'"]*@[^'"]*\\1`, was quadratic in a run of `@`)."""
    quotes = [m.start() for m in _QUOTE.finditer(message)]
    out: list[str] = []
    pos = k = 0
    while k + 1 < len(quotes):
        i, j = quotes[k], quotes[k + 1]
        if message[i] == message[j] and message.find("@", i + 1, j) != -1:
            out.append(message[pos : i + 1] + "…")
            pos, k = j, k + 2
        else:
            k += 1
    out.append(message[pos:])
    return "".join(out)


# Server answers that no retry can fix: wrong credentials, an unknown role or database, a
# pg_hba.conf that does not admit us. libpq reports them without an SQLSTATE, so by their text.
_REFUSALS = (
    "password authentication failed",
    "authentication failed for user",
    "no pg_hba.conf entry",
    "does not exist",
    "no password supplied",
)


def is_refusal(message: str) -> bool:
    """True when a connection failure is a configuration problem, not an outage."""
    text = message.lower()
    return any(r in text for r in _REFUSALS)


class DatabaseUnavailable(LeaseworkError):
    """The database could not be reached (a transient condition for the supervisor)."""


# For connections that must never hang their owner (the supervisor's own (hostdb.py), a worker's lease
# keeper): while one waits, leases go unrenewed or unwatched. A write left unacknowledged for a
# second, or an answer that keepalives show will never come, fails the statement instead.
HANG_CONNECT_TIMEOUT = 2  # seconds; libpq's minimum
HANG_GUARD: dict[str, Any] = {
    "tcp_user_timeout": 1000,  # milliseconds
    "keepalives": 1,
    "keepalives_idle": 1,
    "keepalives_interval": 1,
    "keepalives_count": 1,
}


def connect_listener(
    dsn: str | None, *, application_name: str, instead: str, **libpq: Any
) -> psycopg.Connection[Any] | None:
    """A direct connection to `dsn` (`listen_dsn`) for LISTEN, which a pooler in transaction
    mode cannot keep, or None when it goes through a pooler too: then it is closed at once and
    `listen_dsn_pooled` logged, saying what is done `instead`. Raises as `connect` does."""
    conn = connect(
        dsn, application_name=application_name, connect_timeout=HANG_CONNECT_TIMEOUT, **libpq
    )
    if is_pooled(conn):
        conn.close()
        event(
            "listen_dsn_pooled", level=30, error=f"listen_dsn goes through a pooler too: {instead}"
        )
        return None
    return conn


# A pool connection idle this long is closed (a burst of handlers' connections does not stay).
POOL_MAX_IDLE = 60.0


def make_pool(
    dsn: str | None, size: int, name: str, *, pooler: str = "auto", min_size: int = 0
) -> ConnectionPool[Any]:
    """A worker's pool for handlers: up to `size` connections, autocommit, opened after fork;
    none held until one is asked for (min_size), each closed after POOL_MAX_IDLE idle."""
    check_dsn(dsn)

    def configure(conn: psycopg.Connection[Any]) -> None:
        adapt(conn, pooler)

    pool: ConnectionPool[Any] = ConnectionPool(
        dsn or "",
        min_size=min_size,
        max_size=size,
        kwargs={"autocommit": True, "application_name": name, "connect_timeout": 10},
        configure=configure,
        open=False,
        name=name,
        timeout=30.0,
        max_idle=POOL_MAX_IDLE,
    )
    pool.open(wait=True, timeout=30.0)
    return pool


async def aadapt(conn: psycopg.AsyncConnection[Any], pooler: str = "auto") -> bool:
    """`adapt` for an async connection (an async worker's handler pool)."""
    pooled = pooler == "on"
    if pooler == "auto":
        cur = await conn.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        if not conn.autocommit:
            await conn.rollback()
        pooled = row is None or int(row[0]) != conn.info.backend_pid
    if pooled:
        conn.prepare_threshold = None
    return pooled


def make_async_pool(
    dsn: str | None, size: int, name: str, *, pooler: str = "auto"
) -> AsyncConnectionPool[Any]:
    """The pool of an async worker's handlers (`make_pool` for psycopg's AsyncConnection): up to
    `size` connections, autocommit, none opened until asked for, each closed after POOL_MAX_IDLE
    idle. Created unopened: open it with `await pool.open()` on the worker's event loop."""
    check_dsn(dsn)

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await aadapt(conn, pooler)

    return AsyncConnectionPool(
        dsn or "",
        min_size=0,
        max_size=size,
        kwargs={"autocommit": True, "application_name": name, "connect_timeout": 10},
        configure=configure,
        open=False,
        name=name,
        timeout=30.0,
        max_idle=POOL_MAX_IDLE,
    )


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@cache
def migrations() -> tuple[Migration, ...]:
    """The versioned migrations shipped in leasework/migrations/ (NNNN_what.sql), in order.
    Numbers start at 1 and leave no gap, so "pending" is simply every number above the
    database's version."""
    found: list[Migration] = []
    for entry in resources.files("leasework").joinpath("migrations").iterdir():
        m = _MIGRATION_FILE.match(entry.name)
        if m is None:
            continue
        found.append(Migration(int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda mig: mig.version)
    numbers = [mig.version for mig in found]
    if numbers != list(range(1, len(found) + 1)):
        raise LeaseworkError(
            f"leasework/migrations/ must be numbered 1, 2, 3, ...; found {numbers}"
        )
    return tuple(found)


SCHEMA_VERSION = migrations()[-1].version


def current_version(conn: psycopg.Connection[Any]) -> int | None:
    """The version recorded in the database, or None when the schema is not installed."""
    row = conn.execute("SELECT to_regclass('leasework.schema_version') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return None
    version = conn.execute("SELECT version FROM leasework.schema_version").fetchone()
    return int(version[0]) if version else None


def pending(conn: psycopg.Connection[Any]) -> list[Migration]:
    """The migrations a database at its current version still needs (all of them if empty)."""
    have = current_version(conn) or 0
    return [m for m in migrations() if m.version > have]


def _record(conn: psycopg.Connection[Any], version: int) -> None:
    conn.execute(
        "INSERT INTO leasework.schema_version (id, version, applied_at) VALUES (true, %s, now())"
        " ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, applied_at = now()",
        (version,),
    )


def apply_migrations(conn: psycopg.Connection[Any], todo: list[Migration]) -> None:
    """Run migrations in order, recording each version (the caller holds the transaction)."""
    for mig in todo:
        try:
            conn.execute(mig.sql.encode())
        except psycopg.Error as exc:
            first = first_line(exc)
            raise LeaseworkError(
                f"migration {mig.version:04d}_{mig.name} failed, nothing was applied: {first}"
            ) from exc
        _record(conn, mig.version)


@dataclass(frozen=True)
class Migrated:
    before: int | None  # None: the schema was not installed
    after: int
    applied: tuple[str, ...]  # "schema.sql" for a fresh install, else the migrations' names


def migrate(conn: psycopg.Connection[Any]) -> Migrated:
    """Bring the schema up to date in one transaction, under an advisory lock so that two hosts
    migrating at once take turns (the second finds nothing left to do). An empty database gets
    schema.sql whole; an installed one gets its pending migrations, in order. A failure rolls
    everything back. A database newer than this leasework is left alone."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('leasework.migrate'))")
        before = current_version(conn)
        if before is None:
            conn.execute(schema_text().encode())
            _record(conn, SCHEMA_VERSION)
            return Migrated(None, SCHEMA_VERSION, ("schema.sql",))
        todo = [m for m in migrations() if m.version > before]
        apply_migrations(conn, todo)
        after = todo[-1].version if todo else before
        return Migrated(before, after, tuple(f"{m.version:04d}_{m.name}" for m in todo))


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Raise SchemaMissing with one clear line unless the schema is present and not behind this
    leasework (a newer schema is accepted: migrations only add, so older code keeps working
    during a rolling upgrade)."""
    have = current_version(conn)
    if have is None:
        raise SchemaMissing("the leasework schema is missing: run `leasework migrate` first")
    if have < SCHEMA_VERSION:
        raise SchemaMissing(
            f"the leasework schema is at version {have}, this leasework needs {SCHEMA_VERSION}: "
            "run `leasework migrate`"
        )
