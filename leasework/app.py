"""The user's entry point: `App` is the registry of task kinds (per instance, never a global
registry) and the facade that enqueues or cancels runs inside the caller's own transaction. Job
families (connection syncs, documents, or the user's own) plug in with `app.use(...)`."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from . import operations
from .config import Config
from .errors import ConfigError, LeaseworkError, NotFound, UnknownKind
from .queries import load
from .stages.maintenance import MaintenanceStage, Pruner
from .stages.runs import RunsSettings, RunsStage
from .stages.schedule import ScheduleSettings, ScheduleStage
from .tasks import (
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT,
    TASK_LEASE_RANGE,
    Enqueued,
    ScheduleSpec,
    Task,
    check_attempts,
    check_bool,
    check_kind,
    check_label,
    check_priority,
    check_seconds,
    encode_payload,
)
from .workers.context import Context
from .workers.stage import Stage

Q = load("leasework", "runs.sql")
F = TypeVar("F", bound=Callable[[Context, Any], Any])
Fam = TypeVar("Fam", bound="Family")
T = TypeVar("T")
Conn = psycopg.Connection[Any]

__all__ = ["DEFAULT_TIMEOUT", "App", "Enqueued", "Family", "Task"]


class Family:
    """A job family plugged into an app with `app.use(family)`: its kinds, its stages, what the
    schedule stage enqueues for it and what the maintenance stage prunes for it. Subclass it and
    override what the family has (each default adds nothing). The built-in ones are
    leasework.syncs.Syncs and leasework.documents.Documents; ARCHITECTURE.md has a small one."""

    name: str = "family"
    _app: App | None = None  # set by App.use

    @property
    def app(self) -> App:
        """The app this family was installed on."""
        if self._app is None:
            cls = type(self).__name__
            raise LeaseworkError(f"the {cls} family is not in use: app.use({cls}()) first")
        return self._app

    @property
    def config(self) -> Config:
        return self.app.config

    def enqueue(self, conn: Conn, kind: str, payload: Any = None, **options: Any) -> int:
        return self.app.enqueue(conn, kind, payload, **options)

    def install(self, app: App) -> None:
        """Register the family's kinds on `app` (Task(..., family=self.name))."""

    def stages(self, config: Config) -> list[Stage]:
        """Its stages, polled after the runs stage and before maintenance, in this order."""
        return []

    def enqueue_due(self, conn: Conn, limit: int) -> int:
        """Enqueue its due scheduled work (bounded) in the schedule stage's transaction; return
        how many items were due."""
        return 0

    def pruners(self) -> list[Pruner]:
        """Its maintenance: bounded deletions run by the maintenance stage."""
        return []


class App:
    """Registered task kinds and families, plus the configuration they run with."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config()
        self.tasks: dict[str, Task] = {}
        self.schedules: dict[str, ScheduleSpec] = {}
        self.families: dict[str, Family] = {}

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
        check_attempts(max_attempts)
        check_seconds(
            "lease", lease, allow_zero=False, minimum=TASK_LEASE_RANGE[0], maximum=TASK_LEASE_RANGE[1]
        )
        check_seconds("timeout", timeout, allow_zero=False, maximum=MAX_TIMEOUT)
        spec = None
        if every is not None or cron is not None:
            spec = ScheduleSpec.make(kind, every=every, cron=cron, tz=tz)

        def register(fn: F) -> F:
            self.register(Task(kind, fn, max_attempts, lease, timeout, batch=batch))
            if spec is not None:
                self.schedules[kind] = spec
            return fn

        return register

    def register(self, task: Task) -> None:
        """Add a task kind (the decorators and the families call this)."""
        if task.kind in self.tasks:
            raise ConfigError(f"kind {task.kind!r} is registered twice")
        self.tasks[task.kind] = task

    def use(self, family: Fam) -> Fam:
        """Plug a job family in (its kinds, stages, schedule and maintenance); returns it, for
        its own API: `syncs = app.use(Syncs())`."""
        if family.name in self.families:
            raise ConfigError(f"family {family.name!r} is used twice")
        family._app = self
        family.install(self)
        self.families[family.name] = family
        return family

    def family(self, cls: type[T]) -> T | None:
        """The family of type `cls` this app uses, if it does: `app.family(Syncs)`."""
        for family in self.families.values():
            if isinstance(family, cls):
                return family
        return None

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

    def with_config(self, config: Config) -> App:
        """The same tasks and families under another configuration (the CLI applies file, env
        and flags). Each family is installed afresh (a shallow copy: its connectors, embedder
        and store are shared), so its kinds run with `config`."""
        other = App(config)
        other.tasks = {k: t for k, t in self.tasks.items() if t.family is None}
        other.schedules = dict(self.schedules)
        for family in self.families.values():
            other.use(copy.copy(family))
        return other

    def stages(self, config: Config | None = None) -> list[Stage]:
        """The stages a worker of this app polls, in order: schedule, runs, each family's,
        maintenance."""
        config = config or self.config
        families = list(self.families.values())
        stages: list[Stage] = [
            ScheduleStage(
                self,
                limit=config.section(ScheduleSettings).schedule_limit,
                due=[f.enqueue_due for f in families],
            ),
            RunsStage(
                self,
                limit=config.section(RunsSettings).runs_limit,
                settle_limit=config.section(RunsSettings).settle_limit,
            ),
        ]
        for family in families:
            stages.extend(family.stages(config))
        pruners = [p for family in families for p in family.pruners()]
        stages.append(MaintenanceStage(config, extra=pruners))
        return stages

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
        `enqueue_run` takes the same arguments and also says which of the two happened.
        """
        return self.enqueue_run(
            conn,
            kind,
            payload,
            key=key,
            tenant=tenant,
            group=group,
            exclusive=exclusive,
            priority=priority,
            delay=delay,
            max_attempts=max_attempts,
        ).run_id

    def enqueue_run(
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
    ) -> Enqueued:
        """`enqueue`, returning Enqueued(run_id, existing): `existing` is True when the key
        already had an active (or, for an exclusive run, a waiting) run, whose id it is."""
        if kind not in self.tasks:
            raise UnknownKind(self._unknown(kind))
        task = self.tasks[kind]
        params = {
            "kind": kind,
            "key": check_label("key", key),
            "tenant": check_label("tenant", tenant),
            "group": check_label("group", group),
            "exclusive": check_bool("exclusive", exclusive),
            "priority": check_priority(priority),
            "payload": Jsonb(payload if payload is not None else {}, dumps=self._dumps),
            "max_attempts": check_attempts(max_attempts)
            or task.max_attempts
            or self.config.max_attempts,
            "lease": task.lease,
            "timeout": task.timeout,
            "delay": check_seconds("delay", delay, allow_zero=True) or 0.0,
        }
        self._dumps(payload if payload is not None else {})  # refuse before touching the database
        return self._insert(conn, params)

    def _dumps(self, obj: Any) -> bytes:
        return encode_payload(obj, self.config.payload_max_bytes)

    def _insert(self, conn: Conn, params: dict[str, Any]) -> Enqueued:
        """One call of leasework.enqueue (schema.sql), which also resolves a busy key."""
        row = conn.execute(Q["enqueue_run"], params).fetchone()
        if row is None or row[0] is None:
            raise LeaseworkError("enqueue inserted nothing")  # leasework.enqueue always returns
        return Enqueued(int(row[0]), existing=bool(row[1]))

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
            if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
                raise ConfigError(
                    f"keys must be a list of strings (or None), one per payload, got "
                    f"{type(keys).__name__}"
                )
            if len(keys) != len(encoded):
                raise ConfigError(f"enqueue_many got {len(encoded)} payloads but {len(keys)} keys")
            checked_keys = [check_label("key", k) for k in keys]
        attempts = check_attempts(max_attempts) or task.max_attempts or self.config.max_attempts
        common = {
            "kind": kind,
            "tenant": check_label("tenant", tenant),
            "group": check_label("group", group),
            "priority": check_priority(priority),
            "max_attempts": attempts,
            "lease": task.lease,
            "timeout": task.timeout,
            "delay": check_seconds("delay", delay, allow_zero=True) or 0.0,
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
        if isinstance(run_id, bool) or not isinstance(run_id, int) or not 1 <= run_id < 2**63:
            raise ConfigError(f"run id must be a positive 64-bit integer, got {run_id!r}")
        row = conn.execute(Q["cancel_run"], {"id": run_id}).fetchone()
        if row is None or row[0] is None:
            raise NotFound(f"no run with id {run_id}")
        return str(row[0])

    def get_run(self, conn: Conn, run_id: int) -> dict[str, Any] | None:
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            cur.execute(Q["get_run"], {"id": run_id})
            return cur.fetchone()

    # -- operators: thin wrappers over leasework.operations -------------------------------------

    def list_runs(
        self,
        conn: Conn,
        filters: operations.Filters | None = None,
        *,
        limit: int = 50,
        before: int | None = None,
    ) -> operations.Page:
        """Runs newest first, filtered and keyset-paged (operations.list_runs)."""
        return operations.list_runs(conn, filters, limit=limit, before=before)

    def retry(
        self,
        conn: Conn,
        ids: Iterable[int] | None = None,
        *,
        filters: operations.Filters | None = None,
        attempts: int | None = None,
        dry_run: bool = False,
    ) -> operations.Acted:
        """Failed, cancelled or partial runs back to `queued` with a fresh attempt budget: the
        kind's max_attempts (task, else config) unless `attempts` says (operations.retry)."""
        budgets = {k: t.max_attempts for k, t in self.tasks.items() if t.max_attempts}
        return operations.retry(
            conn,
            ids,
            filters=filters,
            attempts=attempts,
            budgets=budgets,
            default_attempts=self.config.max_attempts,
            dry_run=dry_run,
        )

    def delete(
        self,
        conn: Conn,
        ids: Iterable[int] | None = None,
        *,
        filters: operations.Filters | None = None,
        dry_run: bool = False,
    ) -> operations.Acted:
        """Delete finished runs (operations.delete)."""
        return operations.delete(conn, ids, filters=filters, dry_run=dry_run)

    def pause(self, conn: Conn, *kinds: str) -> list[str]:
        """Pause kinds: claimed by no worker until resumed (operations.pause)."""
        return operations.pause(conn, kinds, known=self.tasks)

    def resume(self, conn: Conn, *kinds: str) -> list[str]:
        """Resume paused kinds (operations.resume)."""
        return operations.resume(conn, kinds)
