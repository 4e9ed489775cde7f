"""The user's entry point: `App` holds the registered task kinds (per instance, never a global
registry) and enqueues or cancels runs inside the caller's own transaction."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import psycopg
from psycopg.types.json import Jsonb

from .config import Config
from .errors import ConfigError, LeaseworkError, PayloadError, UnknownKind
from .ingest.embed import Embedder
from .queries import load
from .workers.context import Context

if TYPE_CHECKING:
    from .connectors import CheckConfig, Connector, Extract
    from .filestore import FileStore
    from .stages.schedule import ScheduleSpec
    from .workers.stage import Stage

Q = load("leasework", "runs.sql")
F = TypeVar("F", bound=Callable[[Context, Any], Any])
E = TypeVar("E", bound=Embedder)
Conn = psycopg.Connection[Any]

# A run's attempt is aborted (and retried while attempts remain) after this long unless its task
# says otherwise: a deadlocked handler would otherwise hold its lease for ever, the keeper
# renewing it. `@app.task(timeout=None)` turns it off for a task.
DEFAULT_TIMEOUT = 3600.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,200}$")
_MAX_LABEL = 200


@dataclass(frozen=True)
class Task:
    kind: str
    fn: Callable[[Context, Any], Any]
    max_attempts: int | None = None
    lease: float | None = None
    timeout: float | None = None
    # The stage that claims and executes this kind: "runs" for user tasks, syncs and purges;
    # built-in families with a stage of their own (e.g. "ingest") name it here.
    stage: str = "runs"
    # Short tasks may opt into claiming up to `batch` runs per statement (runs stage, one at a
    # time inline, each under its own lease) and finishing the successes in one statement.
    batch: int = 1


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or not _NAME_RE.match(kind):
        raise ConfigError(
            f"kind {kind!r} is not valid: use 1-200 characters from letters, digits and _ . : / @ + -"
        )
    return kind


def _check_label(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_LABEL:
        raise ConfigError(
            f"{name} must be a non-empty string of at most {_MAX_LABEL} characters, got {value!r}"
        )
    if any(ord(ch) < 32 or ch == "\x7f" for ch in value):
        raise ConfigError(f"{name} {value!r} contains control characters")
    return value


def _check_seconds(name: str, value: object, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(
            f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, got {value!r}"
        )
    return float(value)


def _check_attempts(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ConfigError(f"max_attempts must be an integer from 1 to 1000, got {value!r}")
    return value


def encode_payload(payload: Any, max_bytes: int) -> bytes:
    """JSON via orjson (never pickle), capped at `max_bytes`."""
    try:
        data = orjson.dumps(payload)
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise PayloadError(f"payload is not JSON-serializable: {exc}") from None
    if len(data) > max_bytes:
        raise PayloadError(f"payload is {len(data)} bytes, over the cap of {max_bytes} bytes")
    if b"\\u0000" in data:
        raise PayloadError(
            "payload contains a NUL character (\\u0000), which Postgres jsonb cannot store"
        )
    return data


class App:
    """Registered task kinds plus the configuration they run with."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config()
        self.tasks: dict[str, Task] = {}
        self._embedder: Embedder | None = None
        self._store: FileStore | None = None
        from .stages.ingest import ingest_task

        self.register(ingest_task())  # built in: files are indexed by the `ingest` stage
        self._init_connections()

    # -- registration -------------------------------------------------------------------------

    def task(
        self,
        kind: str,
        *,
        max_attempts: int | None = None,
        lease: float | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        every: float | None = None,
        cron: str | None = None,
        tz: str = "UTC",
        batch: int = 1,
    ) -> Callable[[F], F]:
        """Register `fn(ctx, payload)` as the handler of `kind`. With `every=` seconds or
        `cron=` (in time zone `tz`) it is also a periodic task: the schedule stage enqueues it
        (key `schedule:{kind}`, one active run at a time, no backlog after downtime).

        `timeout=` seconds per attempt (default DEFAULT_TIMEOUT, one hour; None: none): past it
        the handler is interrupted and the attempt fails, retried while attempts remain.

        `batch=N` (short tasks only): a worker claims up to N runs of this kind in one statement,
        runs them one at a time, each under its own lease, and finishes the successes in one
        statement at the end of the batch. A crash re-runs the successes not yet written, and
        runs claimed but not started hold their leases meanwhile (README, "Batches")."""
        check_kind(kind)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 1000:
            raise ConfigError(f"batch must be an integer from 1 to 1000, got {batch!r}")
        _check_attempts(max_attempts)
        _check_seconds("lease", lease, allow_zero=False)
        _check_seconds("timeout", timeout, allow_zero=False)
        spec = None
        if every is not None or cron is not None:
            from .stages.schedule import ScheduleSpec

            spec = ScheduleSpec.make(kind, every=every, cron=cron, tz=tz)

        def register(fn: F) -> F:
            self.register(Task(kind, fn, max_attempts, lease, timeout, batch=batch))
            if spec is not None:
                self.schedules[kind] = spec
            return fn

        return register

    def register(self, task: Task) -> None:
        """Add a task kind (the decorators and built-in job families call this)."""
        if task.kind in self.tasks:
            raise ConfigError(f"kind {task.kind!r} is registered twice")
        self.tasks[task.kind] = task

    def kinds(self, stage: str | None = None) -> list[str]:
        """Registered kinds, or only those executed by `stage`."""
        return sorted(k for k, t in self.tasks.items() if stage is None or t.stage == stage)

    def handler(self, kind: str) -> Callable[[Context, Any], Any]:
        try:
            return self.tasks[kind].fn
        except KeyError:
            raise UnknownKind(self._unknown(kind)) from None

    def _unknown(self, kind: str) -> str:
        known = ", ".join(self.kinds()) or "none registered"
        return f"unknown kind {kind!r}; known kinds: {known}"

    def stages(self, config: Config | None = None) -> list[Stage]:
        """The stages a worker of this app polls, in order."""
        from .stages import default_stages

        return default_stages(self, config or self.config)

    def with_config(self, config: Config) -> App:
        """The same tasks under another configuration (the CLI applies file, env and flags)."""
        other = App(config)
        other.tasks = dict(self.tasks)
        other._embedder = self._embedder
        other._store = self._store
        other.connectors = dict(self.connectors)
        other.schedules = dict(self.schedules)
        for task in other._connection_kinds.tasks():  # bound to `other`: its config, connectors
            other.tasks[task.kind] = task
        return other

    # -- connections (stages/sync.py, stages/schedule.py, connectors/) ------------------------

    def _init_connections(self) -> None:
        from .connectors import builtin_connectors
        from .stages.sync import ConnectionKinds

        self.connectors: dict[str, Connector] = builtin_connectors()
        self.schedules: dict[str, ScheduleSpec] = {}
        self._connection_kinds = ConnectionKinds(self)
        for task in self._connection_kinds.tasks():  # built in: `sync` and `purge`
            self.register(task)

    def connector(
        self, provider: str, *, check_config: CheckConfig | None = None
    ) -> Callable[[Extract], Extract]:
        """Register `extract(ctx, connection)` as the connector of `provider`: it yields
        `Table(name, rows)`; a table it cannot read raises `TableError(retryable=...)`."""
        from .connectors import Connector

        _check_label("provider", provider)

        def register(fn: Extract) -> Extract:
            self.add_connector(Connector(provider, fn, check_config))
            return fn

        return register

    def add_connector(self, connector: Connector) -> None:
        """Register a connector; a provider can be registered once (built-ins may be replaced)."""
        from .connectors import builtin_connectors

        known = self.connectors.get(connector.provider)
        if known is not None and known is not builtin_connectors().get(connector.provider):
            raise ConfigError(f"provider {connector.provider!r} is registered twice")
        self.connectors[connector.provider] = connector

    def connect(
        self,
        conn: Conn,
        *,
        workspace: str,
        provider: str,
        config: dict[str, Any] | None = None,
        every: float | None = None,
        sync: bool = True,
    ) -> int:
        """Make a connection and (unless sync=False) enqueue its first sync, in the caller's
        transaction. With `every` seconds the schedule stage syncs it again every period.
        Returns the connection id."""
        from .stages import sync as syncmod

        return syncmod.connect(
            self,
            conn,
            workspace=workspace,
            provider=provider,
            config=config,
            every=every,
            sync=sync,
        )

    def sync_now(self, conn: Conn, connection_id: int) -> int:
        """Enqueue a sync of an active connection; returns the run id (an already queued or
        running sync's id if there is one)."""
        from .stages import sync as syncmod

        return syncmod.sync_now(self, conn, connection_id)

    def disconnect(self, conn: Conn, connection_id: int) -> str:
        """Stop syncing a connection (it keeps its records)."""
        from .stages import sync as syncmod

        return syncmod.disconnect(self, conn, connection_id)

    def reconnect(self, conn: Conn, connection_id: int) -> str:
        """Make a disconnected connection active again."""
        from .stages import sync as syncmod

        return syncmod.reconnect(self, conn, connection_id)

    def delete_connection(self, conn: Conn, connection_id: int) -> int:
        """Delete a connection: `deleting` now, its records and row removed by a purge run that
        drains behind any running sync. Returns the purge run's id."""
        from .stages import sync as syncmod

        return syncmod.delete_connection(self, conn, connection_id)

    # -- files, uploads and embedding (leasework/files.py, stages/ingest.py, stages/expand.py) --

    def embedder(self, fn: E) -> E:
        """Register the embedding callable (texts -> one vector each) the ingest stage uses
        instead of the `embedder` setting or the built-in feature-hashing embedder."""
        self._embedder = fn
        return fn

    def get_embedder(self) -> Embedder:
        from .ingest.embed import HashingEmbedder, load_embedder

        if self._embedder is not None:
            return self._embedder
        if self.config.embedder:
            return load_embedder(self.config.embedder)
        return HashingEmbedder(self.config.embedding_dim)

    def use_store(self, store: FileStore) -> None:
        """Keep file bytes in `store` (e.g. an object store) instead of the local directory."""
        self._store = store

    def file_store(self) -> FileStore:
        from .filestore import LocalStore

        return self._store if self._store is not None else LocalStore(self.config.file_store)

    def add_file(self, conn: Conn, *, project: str, path: str | os.PathLike[str]) -> int:
        """Copy a document into the file store and enqueue its ingest run (in the caller's
        transaction). Returns the file id."""
        from . import files

        return files.add_file(self, conn, project=project, path=path)[0]

    def add_upload(self, conn: Conn, *, project: str, path: str | os.PathLike[str]) -> int:
        """Copy a ZIP archive into the file store for the expand stage. Returns the upload id."""
        from . import files

        return files.add_upload(self, conn, project=project, path=path)

    def replace_file(self, conn: Conn, file_id: int, path: str | os.PathLike[str]) -> int:
        """New bytes for a file; it is indexed again from the start. Returns the run id."""
        from . import files

        return files.replace_file(self, conn, file_id, path)

    def move_file(self, conn: Conn, file_id: int, project: str) -> None:
        """Move a file and its chunks to another project (scope)."""
        from . import files

        files.move_file(conn, file_id, project)

    # -- enqueue and cancel -----------------------------------------------------------------

    def enqueue(
        self,
        conn: Conn,
        kind: str,
        payload: Any = None,
        *,
        key: str | None = None,
        tenant: str | None = None,
        group: str | None = None,
        exclusive: bool = False,
        priority: int = 0,
        delay: float = 0.0,
        max_attempts: int | None = None,
    ) -> int:
        """Enqueue a run inside the caller's transaction and return its id.

        With a `key`, at most one run per key is active (queued or running): a second enqueue
        returns the existing run's id. An `exclusive` run whose key is busy waits and is
        promoted once the key is idle; a second one returns the waiting run's id.
        """
        if kind not in self.tasks:
            raise UnknownKind(self._unknown(kind))
        task = self.tasks[kind]
        params = {
            "kind": kind,
            "key": _check_label("key", key),
            "tenant": _check_label("tenant", tenant),
            "group": _check_label("group", group),
            "exclusive": bool(exclusive),
            "priority": self._check_priority(priority),
            "payload": Jsonb(payload if payload is not None else {}, dumps=self._dumps),
            "max_attempts": _check_attempts(max_attempts)
            or task.max_attempts
            or self.config.max_attempts,
            "lease": task.lease,
            "timeout": task.timeout,
            "delay": _check_seconds("delay", delay, allow_zero=True) or 0.0,
        }
        self._dumps(payload if payload is not None else {})  # refuse before touching the database
        return self._insert(conn, params)

    def _dumps(self, obj: Any) -> bytes:
        return encode_payload(obj, self.config.payload_max_bytes)

    @staticmethod
    def _check_priority(priority: object) -> int:
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not -(2**31) <= priority < 2**31
        ):
            raise ConfigError(
                f"priority must be a 32-bit integer (lower runs first), got {priority!r}"
            )
        return priority

    def _insert(self, conn: Conn, params: dict[str, Any]) -> int:
        for _ in range(10):
            row = conn.execute(Q["enqueue_run"], params).fetchone()
            if row is not None:
                return int(row[0])
            if params["key"] is None:
                raise LeaseworkError("enqueue inserted nothing")  # cannot happen without a key
            if params["exclusive"]:
                row = conn.execute(Q["enqueue_waiting_run"], params).fetchone()
                if row is not None:
                    return int(row[0])
                statuses = ["waiting"]
            else:
                statuses = ["queued", "running"]
            row = conn.execute(
                Q["find_run_by_key"], {"key": params["key"], "statuses": statuses}
            ).fetchone()
            if row is not None:
                return int(row[0])
            # The run that held the key finished between our two statements: try again.
        raise LeaseworkError(f"could not enqueue for key {params['key']!r}: it kept changing")

    def enqueue_many(
        self,
        conn: Conn,
        kind: str,
        payloads: Iterable[Any],
        *,
        keys: Sequence[str | None] | None = None,
        tenant: str | None = None,
        group: str | None = None,
        priority: int = 0,
        delay: float = 0.0,
        max_attempts: int | None = None,
    ) -> list[int]:
        """Enqueue many runs of one kind in one statement, inside the caller's transaction.

        Without `keys` the rows are streamed with COPY. With `keys` (one per payload, None for
        no key) a payload whose key already has an active run is skipped, as `enqueue` would;
        the ids returned are those of the rows actually inserted, in payload order.
        """
        if kind not in self.tasks:
            raise UnknownKind(self._unknown(kind))
        task = self.tasks[kind]
        encoded = [self._dumps(p if p is not None else {}) for p in payloads]
        if keys is not None:
            if len(keys) != len(encoded):
                raise ConfigError(f"enqueue_many got {len(encoded)} payloads but {len(keys)} keys")
            checked_keys = [_check_label("key", k) for k in keys]
        attempts = _check_attempts(max_attempts) or task.max_attempts or self.config.max_attempts
        common = {
            "kind": kind,
            "tenant": _check_label("tenant", tenant),
            "group": _check_label("group", group),
            "priority": self._check_priority(priority),
            "max_attempts": attempts,
            "lease": task.lease,
            "timeout": task.timeout,
            "delay": _check_seconds("delay", delay, allow_zero=True) or 0.0,
        }
        if not encoded:
            return []
        if common["tenant"] is not None:
            conn.execute(Q["ensure_tenant"], {"tenant": common["tenant"]})
        if keys is None:
            return self._copy_many(conn, common, encoded)
        rows = conn.execute(
            Q["enqueue_many"],
            {**common, "payloads": [p.decode() for p in encoded], "keys": checked_keys},
        ).fetchall()
        conn.execute(Q["notify"], {"kind": kind})
        return [int(r[0]) for r in rows]

    def _copy_many(self, conn: Conn, common: dict[str, Any], encoded: list[bytes]) -> list[int]:
        """COPY the rows in with ids drawn from the sequence first, so they can be returned."""
        ids = [int(r[0]) for r in conn.execute(Q["reserve_ids"], {"n": len(encoded)}).fetchall()]
        due = conn.execute(Q["due_at"], {"delay": common["delay"]}).fetchone()
        assert due is not None
        columns = (
            'id, kind, tenant, "group", priority, payload, max_attempts, lease_seconds, '
            "timeout_seconds, queued_at"
        )
        with conn.cursor().copy(f"COPY leasework.runs ({columns}) FROM STDIN") as copy:
            for run_id, payload in zip(ids, encoded, strict=True):
                copy.write_row(
                    (
                        run_id,
                        common["kind"],
                        common["tenant"],
                        common["group"],
                        common["priority"],
                        payload.decode(),
                        common["max_attempts"],
                        common["lease"],
                        common["timeout"],
                        due[0],
                    )
                )
        conn.execute(Q["notify"], {"kind": common["kind"]})
        return ids

    def cancel(self, conn: Conn, run_id: int) -> str:
        """Cancel a run. Queued or waiting: `cancelled` now. Running: the cancel is requested
        and its worker stops at its next control check; returns `running`. Finished: its final
        status, unchanged."""
        if isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 1:
            raise ConfigError(f"run id must be a positive integer, got {run_id!r}")
        row = conn.execute(Q["cancel_run"], {"id": run_id}).fetchone()
        if row is not None:
            return str(row[0])
        row = conn.execute(Q["run_status"], {"id": run_id}).fetchone()
        if row is None:
            raise ConfigError(f"no run with id {run_id}")
        return str(row[0])

    def get_run(self, conn: Conn, run_id: int) -> dict[str, Any] | None:
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            cur.execute(Q["get_run"], {"id": run_id})
            return cur.fetchone()
