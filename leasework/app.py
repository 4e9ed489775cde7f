"""The user's entry point: `App` is the registry of task kinds (per instance, never a global
registry) and the facade that enqueues or cancels runs inside the caller's own transaction. Job
families (connection syncs, documents, or the user's own) plug in with `app.use(...)`."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack

import psycopg

from . import operations
from .client import Client, KindDefaults
from .config import FIELDS, Config, catalogue, did_you_mean, section_fields, short
from .errors import ConfigError, LeaseworkError, UnknownKind
from .handles import TaskHandle, accepts, check_handler, is_async, prepare_handler
from .queries import load
from .stages.async_runs import AsyncRunsStage
from .stages.deps import DepsStage
from .stages.maintenance import MaintenanceSettings, MaintenanceStage, Pruner
from .stages.runs import RunsSettings, RunsStage
from .stages.schedule import ScheduleSettings, ScheduleStage
from .tasks import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT,
    TASK_LEASE_RANGE,
    Accepts,
    Enqueued,
    EnqueueOptions,
    Merge,
    ScheduleSpec,
    Task,
    check_attempts,
    check_kind,
    check_seconds,
    check_windows,
)
from .workers.stage import Stage
from .workflows import Batch, Workflow, batch_options

Q = load("leasework", "runs.sql")
P = ParamSpec("P")
R = TypeVar("R")
Fam = TypeVar("Fam", bound="Family")
T = TypeVar("T")
Conn = psycopg.Connection[Any]

__all__ = ["DEFAULT_TIMEOUT", "App", "Client", "Enqueued", "Family", "Task", "TaskHandle"]


# The sections of the engine's own stages, which every app polls.
STAGE_SECTIONS: tuple[type, ...] = (RunsSettings, ScheduleSettings, MaintenanceSettings)


class Family:
    """A job family plugged into an app with `app.use(family)`: its kinds, its stages, what the
    schedule stage enqueues for it and what the maintenance stage prunes for it. Subclass it and
    override what the family has (each default adds nothing). The built-in ones are
    leasework.syncs.Syncs and leasework.documents.Documents; ARCHITECTURE.md has a small one."""

    name: str = "family"
    # The config sections it reads (frozen dataclasses marked `@section`): their keys are known
    # wherever an app that uses the family reads its config.
    config_sections: tuple[type, ...] = ()
    _app: App | None = None  # set by App.use

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "schedules" in vars(cls):
            warnings.warn(
                f"{cls.__qualname__} overrides Family.schedules(), deprecated: override "
                "has_schedules() instead",
                DeprecationWarning,
                stacklevel=2,
            )

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

    def enqueue(
        self, conn: Conn, kind: str, payload: Any = None, **options: Unpack[EnqueueOptions]
    ) -> int:
        """`app.enqueue` for the family's own runs: a key may be under "leasework:" (reserved
        for the families: syncs key `leasework:connection:{id}`, documents `leasework:file:{id}`),
        which no application enqueue can take (Client.enqueue_reserved)."""
        return self.app.enqueue_reserved(conn, kind, payload, **options)

    def install(self, app: App) -> None:
        """Register the family's kinds on `app` (Task(..., family=self.name))."""

    def stages(self, config: Config) -> list[Stage]:
        """Its stages, polled after the runs stage and before maintenance, in this order."""
        return []

    def enqueue_due(self, conn: Conn, limit: int) -> int:
        """Enqueue its due scheduled work (bounded) in the schedule stage's transaction; return
        how many items were due."""
        return 0

    def has_schedules(self) -> bool:
        """Whether it has scheduled work: it overrides `enqueue_due`."""
        if type(self).schedules is not Family.schedules:  # a family written before the rename
            return bool(self.schedules())
        return type(self).enqueue_due is not Family.enqueue_due

    def schedules(self) -> bool:
        """Deprecated: `has_schedules()` (a family that overrides this is still asked it)."""
        warnings.warn(
            "Family.schedules() is deprecated: use (or override) Family.has_schedules()",
            DeprecationWarning,
            stacklevel=2,
        )
        return type(self).enqueue_due is not Family.enqueue_due

    def next_due(self, conn: Conn) -> float | None:
        """Seconds until its scheduled work is next due (in the schedule stage's transaction,
        when none was due), None: none. An idle worker sleeps until then, at most idle_poll_max
        (workers/idle.py). The default: 0, unknown (the schedule stage is asked every
        poll_interval) for a family that schedules, since an override of `enqueue_due` alone
        cannot say."""
        return 0.0

    def pruners(self) -> list[Pruner]:
        """Its maintenance: bounded deletions run by the maintenance stage."""
        return []

    def check_start(self, config: Config) -> None:
        """Raise ConfigError (one line) for what would fail each poll of its stages once workers
        run: a setting naming code that cannot be loaded. Called by `leasework worker` and
        `supervise` before any poll or fork (exit 2), not by every command that loads the app."""


class App(Client):
    """Registered task kinds and families, plus the configuration they run with. Enqueue and
    cancel are the Client's (leasework/client.py), refusing a kind not registered here and
    giving each run its task's max_attempts, lease and timeout."""

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.tasks: dict[str, Task] = {}
        self.schedules: dict[str, ScheduleSpec] = {}
        self.families: dict[str, Family] = {}
        self._sections: list[type] = []  # declared with App.section

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
        concurrency: int | None = None,
        unique_for: float | None = None,
        debounce: float | None = None,
        debounce_max: float | None = None,
        debounce_merge: Merge | None = None,
        max_running: int | None = None,
        group_limit: int | None = None,
        rate: str | None = None,
        rate_per: str | None = None,
    ) -> Callable[[Callable[Concatenate[Any, P], R]], TaskHandle[P, R]]:
        """Register `fn(ctx, payload)` as the handler of `kind`; returns a TaskHandle (the
        handler, callable as written, with a typed `.enqueue(conn, ...)`). A handler whose
        parameters after ctx are keyword-only, `fn(ctx, *, week: int)`, is called with the
        payload's keys as arguments. Generator functions are refused. With `every=` seconds or
        `cron=` (in time zone `tz`) it is also a periodic task: the schedule stage enqueues it
        (key `schedule:{kind}`, one active run at a time, no backlog after downtime).

        `timeout=` seconds per attempt (default DEFAULT_TIMEOUT, one hour; None: none): past it
        the handler is interrupted and the attempt fails, retried while attempts remain.

        `batch=N` (short tasks only): a worker claims up to N runs of this kind in one statement,
        runs them one at a time, each under its own lease, and finishes the successes in one
        statement at the end of the batch. A crash re-runs the successes not yet written, and
        runs claimed but not started hold their leases meanwhile (docs/workflows.md, "Batches").

        An `async def` handler gets an AsyncContext and runs on the worker's event loop, up to
        `concurrency=` runs of its kind at once per worker process (default 10), each under its
        own lease; a cancel, timeout or lost lease cancels its task (docs/async.md).

        `unique_for=` seconds: one run per key within that window, finished runs counted (an
        enqueue of a key whose run was enqueued less than that ago, and did not fail or get
        cancelled, returns that run). `debounce=` seconds: an enqueue of a key whose run is still
        pending replaces its payload (or merges old and new with `debounce_merge(old, new)`) and
        makes it due that long from now, at most `debounce_max=` seconds after its first
        enqueue. Defaults for the kind's enqueues, which must then give a key; an enqueue may
        give its own (docs/flow-control.md).
        Flow control across every host (docs/flow-control.md), admitted inside the claim:
        `max_running=N` runs of the kind holding a live lease at most; `group_limit=N` runs of a
        tenant's group at once at most (default 1: a group is one at a time); `rate="100/10s"`
        claims at most per period, in any span of it (a sliding window), per kind or, with
        `rate_per="tenant"`, per tenant, or with `rate_per="group"`, per tenant's group (a
        tenant's runs without a group share the tenant's). Declared by each worker as it starts;
        `leasework limits set` changes them at run time."""
        if callable(kind):  # `@app.task` without its parentheses
            raise ConfigError(
                f"@app.task needs the kind: write @app.task({getattr(kind, '__name__', 'kind')!r})"
                " above the handler"
            )
        check_kind(kind)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 1000:
            raise ConfigError(f"batch must be an integer from 1 to 1000, got {batch!r}")
        check_attempts(max_attempts)
        check_seconds(
            "lease",
            lease,
            allow_zero=False,
            minimum=TASK_LEASE_RANGE[0],
            maximum=TASK_LEASE_RANGE[1],
        )
        check_seconds("timeout", timeout, allow_zero=False, maximum=MAX_TIMEOUT)
        if concurrency is not None and (
            isinstance(concurrency, bool)
            or not isinstance(concurrency, int)
            or not 1 <= concurrency <= 1000
        ):
            raise ConfigError(f"concurrency must be an integer from 1 to 1000, got {concurrency!r}")
        windows = check_windows(
            {
                "unique_for": unique_for,
                "debounce": debounce,
                "debounce_max": debounce_max,
                "debounce_merge": debounce_merge,
            },
            task=kind,
        )
        limits = operations.declared_limits(max_running, group_limit, rate, rate_per)
        spec = None
        if every is not None or cron is not None:
            spec = ScheduleSpec.make(kind, every=every, cron=cron, tz=tz)

        def register(fn: Callable[Concatenate[Any, P], R]) -> TaskHandle[P, R]:
            run = prepare_handler(kind, fn)
            if is_async(fn):
                if batch != 1:
                    raise ConfigError(
                        f"task {kind!r}: batch= is for plain functions; an async def handler "
                        "runs several at once with concurrency= instead"
                    )
                task = Task(
                    kind,
                    run,
                    max_attempts,
                    lease,
                    timeout,
                    stage=AsyncRunsStage.name,
                    concurrency=concurrency or DEFAULT_CONCURRENCY,
                    windows=windows,
                    limits=limits,
                    accepts=accepts(fn),
                )
            else:
                if concurrency is not None:
                    raise ConfigError(
                        f"task {kind!r}: concurrency= is for async def handlers; a plain "
                        "function runs one at a time per process (add processes, or batch=)"
                    )
                task = Task(
                    kind, run, max_attempts, lease, timeout, batch=batch, windows=windows,
                    limits=limits, accepts=accepts(fn),
                )
            self.register(task)
            if spec is not None:
                self.schedules[kind] = spec
            return TaskHandle(self, kind, fn)

        return register

    def register(self, task: Task) -> None:
        """Add a task kind (the decorators and the families call this)."""
        if task.kind in self.tasks:
            raise ConfigError(f"kind {task.kind!r} is registered twice")
        check_handler(task.kind, task.fn)
        self.tasks[task.kind] = task

    def section(self, cls: type[T]) -> type[T]:
        """Declare a config section this app reads beyond its families' (a frozen dataclass
        marked `@section`), so that its keys are known where the app's config is read; returns
        it. The engine's stages' and each used family's (`Family.config_sections`) need none."""
        catalogue([cls])  # refuses what is no section
        if cls not in self._sections:
            self._sections.append(cls)
        return cls

    def sections(self) -> tuple[type, ...]:
        """The config sections this app reads, in the reference's order: its stages' (runs,
        schedule, maintenance), its families' and its own declarations (App.section)."""
        families = [c for f in self.families.values() for c in f.config_sections]
        return catalogue([*STAGE_SECTIONS, *families, *self._sections])

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

    def handler(self, kind: str) -> Callable[[Any, Any], Any]:
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
        other._sections = list(self._sections)
        for family in self.families.values():
            other.use(copy.copy(family))
        return other

    def check_start(self) -> None:
        """Each family's start-up check (Family.check_start) under this app's configuration."""
        for family in self.families.values():
            family.check_start(self.config)

    def stages(self, config: Config | None = None) -> list[Stage]:
        """The stages a worker of this app polls, in order: schedule, runs, async (when a task
        is `async def`), each family's, deps (runs waiting for others), maintenance."""
        config = config or self.config
        unknown = config.unknown(self.sections())
        if unknown:  # a key of a section neither the config nor this app knows: a misspelling
            keys = [*FIELDS, *section_fields((*config.sections, *self.sections()))]
            raise ConfigError(
                f"unknown setting {short(unknown[0])}{did_you_mean(unknown[0], keys)}"
            )
        families = list(self.families.values())
        stages: list[Stage] = [
            ScheduleStage(
                self,
                limit=config.section(ScheduleSettings).schedule_limit,
                due=[f.enqueue_due for f in families if f.has_schedules()],
                next_due=[f.next_due for f in families if f.has_schedules()],
            ),
            RunsStage(
                self,
                limit=config.section(RunsSettings).runs_limit,
                settle_limit=config.section(RunsSettings).settle_limit,
            ),
        ]
        if self.kinds(stage=AsyncRunsStage.name):
            stages.append(AsyncRunsStage(self, config))
        for family in families:
            stages.extend(family.stages(config))
        stages.append(DepsStage())
        pruners = [p for family in families for p in family.pruners()]
        stages.append(
            MaintenanceStage(
                config,
                extra=pruners,
                kinds=self.kinds(),
                accepts={k: t.accepts.declared() for k, t in self.tasks.items()},
            )
        )
        return stages

    # -- enqueue and cancel: the Client's, for the kinds registered here ---------------------

    def defaults(self, kind: str) -> KindDefaults:
        """The registered task's settings; UnknownKind for a kind not registered here (a
        process that enqueues kinds it has no handler for uses a Client)."""
        task = self._task(kind)
        w = task.windows
        return KindDefaults(
            task.max_attempts,
            task.lease,
            task.timeout,
            w.unique_for,
            w.debounce,
            w.debounce_max,
            w.debounce_merge,
        )

    def accepts(self, kind: str) -> Accepts:
        """The payloads the registered task's handler can be called with (tasks.Accepts): an
        enqueue refuses any other, before anything is written."""
        return self._task(kind).accepts

    def _defaults_source(self, kind: str) -> object:
        """The registered Task (frozen): `defaults(kind)` is made from it alone."""
        return self.tasks.get(kind)

    def _task(self, kind: str) -> Task:
        task = self.tasks.get(kind) if isinstance(kind, str) else None
        if task is None:
            raise UnknownKind(self._unknown(kind))
        return task

    # -- workflows (docs/workflows.md) --------------------------------------------------------

    def workflow(self) -> Workflow:
        """A graph of runs to enqueue in one transaction (chains, groups, joins, named nodes):
        `wf.add(...)`, `wf.group(...)`, `wf.chain(...)`, then `wf.enqueue(conn)` -> {name: id}."""
        return Workflow(self)

    def batch(self, kind: str, payload: Any = None, **options: Unpack[EnqueueOptions]) -> Batch:
        """A batch whose callback is a run of `kind` (enqueued by `close`, or by `open` in a
        handler): `batch.add(conn, kind, payload)` for each member."""
        self.defaults(kind)
        return Batch(self, kind, payload, batch_options(options))

    def batch_of(self, batch_id: int) -> Batch:
        """The batch whose callback is run `batch_id`, to add members to while it is open."""
        if isinstance(batch_id, bool) or not isinstance(batch_id, int) or batch_id < 1:
            raise ConfigError(f"batch id must be a positive integer (its callback's run id), got {batch_id!r}")
        return Batch(self, "", None, {}, id=batch_id)

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
        clear_steps: bool = False,
    ) -> operations.Acted:
        """Failed, cancelled or partial runs back to `queued` with a fresh attempt budget: the
        kind's max_attempts (task, else config) unless `attempts` says (operations.retry); their
        durable steps kept unless `clear_steps`."""
        budgets = {k: t.max_attempts for k, t in self.tasks.items() if t.max_attempts}
        return operations.retry(
            conn,
            ids,
            filters=filters,
            attempts=attempts,
            budgets=budgets,
            default_attempts=self.config.max_attempts,
            dry_run=dry_run,
            clear_steps=clear_steps,
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
        """Resume paused kinds; one not paused is left as it is (operations.resume)."""
        return operations.resume(conn, kinds, known=self.tasks)
