"""Connection syncs and purges: the `sync` and `purge` kinds the `runs` stage executes,
and the API that makes, syncs, disconnects and deletes connections.

A sync calls the provider's connector under the run's context and publishes each table in
bounded, fenced batches; a purge deletes a deleting connection's records in bounded, fenced
batches and then the connection row. Never writes lease columns (the lease module does)."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .. import log
from ..config import RETENTION, SECONDS, Range, doc, section
from ..errors import Aborted, ConfigError, LeaseLost, LeaseworkError, Partial
from ..queries import load
from ..status import tolerant
from ..tasks import MAX_EVERY, RESERVED_KEY_PREFIX, Task, check_seconds
from .connectors import Connection, Connector, Row, Table, TableError

if TYPE_CHECKING:
    from ..workers.context import Context
    from . import Syncs

Q = load("leasework.syncs", "syncs.sql")
Conn = psycopg.Connection[Any]

SYNC_KIND = "sync"
PURGE_KIND = "purge"
# A purge must finish for the connection to go away; it is cheap to retry, so it gets more tries.
PURGE_MAX_ATTEMPTS = 10


def connection_key(connection_id: int) -> str:
    """The run key of a connection's syncs and purges, under the reserved prefix (no application
    enqueue can take it). `leasework:file:{id}` (ingest) never collides."""
    return f"{RESERVED_KEY_PREFIX}connection:{connection_id}"


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


# -- reading connections ----------------------------------------------------------------------


def _row_to_connection(row: Mapping[str, Any]) -> Connection:
    return Connection(
        id=row["id"],
        workspace=row["workspace"],
        provider=row["provider"],
        status=row["status"],
        config=dict(row["config"] or {}),
        sync_interval=row["sync_interval_seconds"],
        next_run_at=row["next_run_at"],
        created_at=row["created_at"],
    )


def get_connection(conn: Conn, connection_id: int, *, lock: bool = False) -> Connection | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(Q["lock_connection" if lock else "get_connection"], {"id": connection_id})
        row = cur.fetchone()
    return None if row is None else _row_to_connection(row)


def list_connections(conn: Conn, limit: int = 1000) -> list[dict[str, Any]]:
    """Connections for `leasework connections list`; a timestamp Python cannot hold (infinity)
    is read as status.tolerant reads it."""
    with tolerant(conn.cursor(row_factory=dict_row)) as cur:
        cur.execute(Q["list_connections"], {"limit": limit})
        return cur.fetchall()


# -- the API (App.connect, sync_now, disconnect, delete_connection delegate here) -------------


def _check_id(connection_id: object) -> int:
    if (
        isinstance(connection_id, bool)
        or not isinstance(connection_id, int)
        or not 1 <= connection_id < 2**63
    ):
        raise ConfigError(
            f"connection id must be a positive 64-bit integer, got {reprlib.repr(connection_id)}"
        )
    return connection_id


def _check_every(every: object) -> float | None:
    return check_seconds("every", every, allow_zero=False, maximum=MAX_EVERY)


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise ConfigError(
            f"{what} must be a non-empty string of at most 200 characters, got {value!r}"
        )
    return value


def connector_for(syncs: Syncs, provider: str) -> Connector:
    try:
        return syncs.connectors[provider]
    except KeyError:
        known = ", ".join(sorted(syncs.connectors)) or "none registered"
        raise ConfigError(f"unknown provider {provider!r}; known providers: {known}") from None


def connect(
    syncs: Syncs,
    conn: Conn,
    *,
    workspace: str,
    provider: str,
    config: Mapping[str, Any] | None = None,
    every: float | None = None,
    sync: bool = True,
) -> int:
    """Make a connection (active) and, unless sync=False, enqueue its first sync in the same
    transaction. With `every`, the schedule stage syncs it every `every` seconds after that."""
    _check_name("workspace", workspace)
    _check_name("provider", provider)
    interval = _check_every(every)
    cfg = dict(config or {})
    connector = connector_for(syncs, provider)
    if connector.check_config is not None:
        connector.check_config(cfg)
    with conn.transaction():
        row = conn.execute(
            Q["insert_connection"],
            {
                "workspace": workspace,
                "provider": provider,
                "config": Jsonb(cfg, dumps=_dumps),
                "every": interval,
            },
        ).fetchone()
        assert row is not None
        connection_id = int(row[0])
        if sync:
            enqueue_sync(syncs, conn, connection_id, workspace, provider)
    return connection_id


def enqueue_sync(
    syncs: Syncs, conn: Conn, connection_id: int, workspace: str, provider: str
) -> int:
    return syncs.enqueue(
        conn,
        SYNC_KIND,
        {"connection_id": connection_id},
        key=connection_key(connection_id),
        tenant=workspace,
        group=provider,
    )


def sync_now(syncs: Syncs, conn: Conn, connection_id: int) -> int:
    """Enqueue a sync now. A connection with a sync already queued or running gets that run's
    id back (the one-active-run-per-key index): racing calls give one run."""
    connection = get_connection(conn, _check_id(connection_id))
    if connection is None:
        raise ConfigError(f"no connection with id {connection_id}")
    if connection.status != "active":
        raise ConfigError(f"connection {connection_id} is {connection.status}, not active")
    return enqueue_sync(syncs, conn, connection.id, connection.workspace, connection.provider)


def disconnect(syncs: Syncs, conn: Conn, connection_id: int) -> str:
    """Stop syncing: `disconnected`, no schedule, a queued sync cancelled. A running sync
    finishes its attempt but is not retried (its requeue ends it `cancelled`)."""
    with conn.transaction():
        connection = get_connection(conn, _check_id(connection_id), lock=True)
        if connection is None:
            raise ConfigError(f"no connection with id {connection_id}")
        if connection.status == "deleting":
            raise ConfigError(f"connection {connection_id} is being deleted")
        conn.execute(Q["set_connection_status"], {"id": connection.id, "status": "disconnected"})
        conn.execute(
            Q["cancel_queued_syncs"],
            {"key": connection_key(connection.id), "why": "connection disconnected"},
        )
    return "disconnected"


def reconnect(syncs: Syncs, conn: Conn, connection_id: int) -> str:
    """Make a disconnected connection active again (its schedule resumes)."""
    with conn.transaction():
        connection = get_connection(conn, _check_id(connection_id), lock=True)
        if connection is None:
            raise ConfigError(f"no connection with id {connection_id}")
        if connection.status == "deleting":
            raise ConfigError(f"connection {connection_id} is being deleted")
        if connection.status != "active":
            conn.execute(Q["set_connection_status"], {"id": connection.id, "status": "active"})
    return "active"


def delete_connection(syncs: Syncs, conn: Conn, connection_id: int) -> int:
    """Mark the connection `deleting` and enqueue its purge; returns the purge run's id.

    The purge is exclusive: while a sync of this connection is running it waits (status
    `waiting`) and the claim's settle step promotes it once nothing else is active for the
    connection, so a delete drains behind an in-flight sync instead of fighting it. A queued
    sync is cancelled. Deleting again returns the pending purge."""
    with conn.transaction():
        connection = get_connection(conn, _check_id(connection_id), lock=True)
        if connection is None:
            raise ConfigError(f"no connection with id {connection_id}")
        key = connection_key(connection.id)
        if connection.status == "deleting":
            row = conn.execute(Q["find_purge"], {"key": key}).fetchone()
            if row is not None:
                return int(row[0])
        else:
            conn.execute(Q["set_connection_status"], {"id": connection.id, "status": "deleting"})
        conn.execute(Q["cancel_queued_syncs"], {"key": key, "why": "connection deleted"})
        return syncs.enqueue(
            conn,
            PURGE_KIND,
            {"connection_id": connection.id},
            key=key,
            tenant=connection.workspace,
            group=connection.provider,
            exclusive=True,
        )


# -- the handlers -----------------------------------------------------------------------------


def _payload_id(payload: Any) -> int:
    value = payload.get("connection_id") if isinstance(payload, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LeaseworkError(f"payload needs an integer connection_id, got {payload!r}")
    return value


def _external_id(row: Row) -> str:
    if not isinstance(row, Mapping):
        raise TableError(f"a row must be a mapping, got {type(row).__name__}", retryable=False)
    value = row.get("id")
    if value is None or isinstance(value, bool) or value == "":
        raise TableError(f"a row has no `id`: {dict(row)!r}"[:300], retryable=False)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


@section("The syncs family", order=50)
@dataclass(frozen=True)
class SyncSettings:
    sync_batch: int = field(
        default=200,
        metadata=doc(
            "records a sync publishes (or a purge deletes) per fenced transaction",
            range=Range(1, 100_000),
        ),
    )
    sync_timeout: float = field(
        default=3600.0,
        metadata=doc(
            "seconds a sync or purge attempt may run before it is aborted and retried",
            range=SECONDS,
        ),
    )
    retention_tombstones: float = field(
        default=30 * 86400.0,
        metadata=doc("seconds a tombstoned record (deleted upstream) is kept", range=RETENTION),
    )



class ConnectionKinds:
    """The `sync` and `purge` handlers of one App (its connectors and config)."""

    def __init__(self, syncs: Syncs) -> None:
        self.syncs = syncs

    def tasks(self) -> list[Task]:
        timeout = self.syncs.settings.sync_timeout
        return [
            Task(SYNC_KIND, self.sync, timeout=timeout, family="syncs"),
            Task(
                PURGE_KIND,
                self.purge,
                max_attempts=PURGE_MAX_ATTEMPTS,
                timeout=timeout,
                family="syncs",
            ),
        ]

    @property
    def batch(self) -> int:
        return self.syncs.settings.sync_batch

    # -- sync -------------------------------------------------------------------------------

    def sync(self, ctx: Context, payload: Any) -> dict[str, Any]:
        connection_id = _payload_id(payload)
        connection = self._active_or_cancel(ctx, connection_id)
        connector = connector_for(self.syncs, connection.provider)
        previous = ctx.result if isinstance(ctx.result, dict) else {}
        result: dict[str, Any] = {
            "connection_id": connection_id,
            "tables": dict(previous.get("tables") or {}),
        }
        ctx.result = result
        failed: list[tuple[str, dict[str, Any]]] = []
        yielded: set[str] = set()
        try:
            for table in connector.extract(ctx, connection):
                ctx.check()
                outcome = self._publish(ctx, connection, table)
                yielded.add(table.name)
                result["tables"][table.name] = outcome
                ctx.result = result
                if outcome["status"] == "failed":
                    failed.append((table.name, outcome))
            if connector.complete:
                for name in self._vanished_tables(ctx, connection.id, yielded):
                    outcome = self._publish(ctx, connection, Table(name, ()))
                    result["tables"][name] = {**outcome, "removed_upstream": True}
                    ctx.result = result
        except (Aborted, LeaseLost):
            raise
        except Exception:
            # The requeue re-checks the world: a connection deleted or disconnected meanwhile
            # ends the run `cancelled` instead of retrying it. Checked here, in the sync's own
            # module, so the lease module stays free of connection logic; a delete racing past
            # this check is caught by the next attempt's check (and delete cancels queued syncs).
            self._active_or_cancel(ctx, connection_id)
            raise
        if failed:
            self._active_or_cancel(ctx, connection_id)
            retryable = any(o["retryable"] for _, o in failed) and not ctx.claim.last_attempt
            names = ", ".join(f"{name}: {o['error']}" for name, o in failed)
            raise Partial(
                result,
                retryable=retryable,
                message=f"{len(failed)} table(s) failed: {names}"[:2000],
            )
        return result

    def _vanished_tables(self, ctx: Context, connection_id: int, yielded: set[str]) -> list[str]:
        """Tables with live records that a complete extraction no longer yields."""
        with ctx.connection() as conn:
            rows = conn.execute(Q["live_tables"], {"connection_id": connection_id}).fetchall()
        return sorted(r[0] for r in rows if r[0] not in yielded)

    def _active_or_cancel(self, ctx: Context, connection_id: int) -> Connection:
        """The connection, if active; otherwise end the run `cancelled` (trip the signal)."""
        if ctx.signal.tripped:
            raise Aborted(ctx.signal.reason or "cancelled")
        with ctx.connection() as conn:
            connection = get_connection(conn, connection_id)
        if connection is not None and connection.status == "active":
            return connection
        why = "gone" if connection is None else connection.status
        if isinstance(ctx.result, dict):
            ctx.result = {**ctx.result, "cancelled": f"connection {connection_id} is {why}"}
        else:
            ctx.result = {"connection_id": connection_id, "cancelled": f"connection is {why}"}
        log.event("sync_cancelled", run_id=ctx.run_id, connection_id=connection_id, why=why)
        ctx.signal.trip("cancelled")
        raise Aborted("cancelled")

    def _publish(self, ctx: Context, connection: Connection, table: Table) -> dict[str, Any]:
        """Upsert one table in bounded, fenced batches, checking control between them; if it was
        read to the end, tombstone the rows of this table this attempt did not see."""
        outcome: dict[str, Any] = {
            "status": "ok",
            "upserted": 0,
            "tombstoned": 0,
            "error": None,
            "retryable": None,
            "attempt": ctx.attempt,
        }
        if not isinstance(table.name, str) or not table.name:
            raise LeaseworkError(f"connector yielded a table without a name: {table!r}"[:300])
        token = ctx.claim.owner
        try:
            if table.error is not None:
                raise table.error
            batch: dict[str, Row] = {}
            for row in table.rows:
                batch[_external_id(row)] = row
                if len(batch) >= self.batch:
                    outcome["upserted"] += self._upsert(ctx, connection.id, table.name, batch)
                    batch = {}
                    ctx.check()
            if batch:
                outcome["upserted"] += self._upsert(ctx, connection.id, table.name, batch)
        except TableError as exc:
            outcome.update(status="failed", error=str(exc), retryable=exc.retryable)
            log.event(
                "sync_table_failed",
                run_id=ctx.run_id,
                table=table.name,
                error=str(exc)[:300],
                retryable=exc.retryable,
            )
            return outcome
        while True:
            ctx.check()
            with ctx.transaction() as tx:
                cur = tx.execute(
                    Q["tombstone_unseen"],
                    {
                        "connection_id": connection.id,
                        "table": table.name,
                        "token": token,
                        "limit": self.batch,
                    },
                )
                done = cur.rowcount
            outcome["tombstoned"] += done
            if done < self.batch:
                break
        return outcome

    def _upsert(self, ctx: Context, connection_id: int, table: str, batch: dict[str, Row]) -> int:
        try:
            rows = orjson.dumps([{"id": k, "data": dict(v)} for k, v in batch.items()])
        except (orjson.JSONEncodeError, TypeError) as exc:
            raise TableError(f"a row is not JSON-serializable: {exc}", retryable=False) from None
        ctx.check()
        with ctx.transaction() as tx:
            tx.execute(
                Q["upsert_records"],
                {
                    "connection_id": connection_id,
                    "table": table,
                    "token": ctx.claim.owner,
                    "rows": rows.decode(),
                },
            )
        return len(batch)

    # -- purge ------------------------------------------------------------------------------

    def purge(self, ctx: Context, payload: Any) -> dict[str, Any]:
        connection_id = _payload_id(payload)
        previous = ctx.result if isinstance(ctx.result, dict) else {}
        result: dict[str, Any] = {
            "connection_id": connection_id,
            "deleted_records": int(previous.get("deleted_records") or 0),
            "connection_deleted": False,
        }
        ctx.result = result
        with ctx.connection() as conn:
            connection = get_connection(conn, connection_id)
        if connection is None:
            result["connection_deleted"] = True  # an earlier attempt finished the job
            return result
        if connection.status != "deleting":
            result["cancelled"] = f"connection {connection_id} is {connection.status}"
            ctx.signal.trip("cancelled")
            raise Aborted("cancelled")
        while True:
            ctx.check()
            with ctx.transaction() as tx:
                done = tx.execute(
                    Q["purge_records"], {"connection_id": connection_id, "limit": self.batch}
                ).rowcount
            result["deleted_records"] += done
            ctx.result = result
            if done < self.batch:
                break
        ctx.check()
        with ctx.transaction() as tx:
            gone = tx.execute(Q["delete_connection_row"], {"id": connection_id}).fetchone()
        result["connection_deleted"] = gone is not None
        log.event(
            "connection_purged",
            run_id=ctx.run_id,
            connection_id=connection_id,
            records=result["deleted_records"],
        )
        return result
