"""Testing your tasks against a real database with the real engine: `run_task` runs one task
inline under a real claim, lease and `Context` (fenced transaction and checkpoints included) and
says how it ended; `drain` executes the due runs of some kinds in this process until none is
left; `enqueued` reads back what was enqueued. Runs are claimed by lease.claim_runs and run by the
worker's executor, exactly as a worker would; the schedule and maintenance stages never run
here. The pytest plugin (fixtures for a clean schema) is leasework.pytest_plugin."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Unpack

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from .app import App
from .errors import ConfigError, LeaseworkError, UnknownKind
from .leases import lease
from .leases.lease import Claim
from .operations import STATUSES
from .queries import load
from .stages import deps
from .tasks import RunTaskOptions, accept_options, check_label
from .workers.worker import Worker, new_worker_id

Q = load("leasework", "testing.sql")
Conn = psycopg.Connection[Any]

# run_task's run goes before every other due run of its kind, so that the claim takes it.
FIRST = -(2**31)

__all__ = ["Drained", "RunResult", "Runner", "assert_enqueued", "drain", "enqueued", "run_task"]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How one attempt left its run: `status` is the run's status afterwards (`succeeded`,
    `partial`, `failed`, `cancelled`, or `queued` for a retry or a snooze, then `due_at` says
    when), with its `result` and `error` (the failure's type and message, the retry's reason,
    a Fail's `Fail: reason`; a snooze leaves the run's error as it was). `outcome` is how the
    attempt ended, as the run's history records it: `succeeded`, `failed`, `retry`, `snoozed`,
    `partial`, `timeout`, `cancelled`, `released`; `snoozes` how many times the run snoozed."""

    run_id: int
    kind: str
    status: str
    result: Any
    error: str | None
    attempts: int
    payload: Any
    due_at: datetime | None = None
    key: str | None = None
    tenant: str | None = None
    outcome: str | None = None
    snoozes: int = 0

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"

    @property
    def snoozed(self) -> bool:
        """The attempt ended with a Snooze and the run is queued again (not charged)."""
        return self.outcome == "snoozed" and self.status == "queued"


class Drained(list[RunResult]):
    """What `drain` ran, one RunResult per attempt, in order; `by_kind(kind)` selects some."""

    def by_kind(self, kind: str) -> list[RunResult]:
        return [r for r in self if r.kind == kind]

    @property
    def statuses(self) -> list[str]:
        return [r.status for r in self]


def dsn_of(conn_or_dsn: Conn | str) -> str:
    """A DSN for the database `conn_or_dsn` is on (a connection's own, with its password)."""
    if isinstance(conn_or_dsn, str):
        return conn_or_dsn
    if isinstance(conn_or_dsn, psycopg.Connection):
        info = conn_or_dsn.info
        return make_conninfo(info.dsn, password=info.password) if info.password else info.dsn
    raise ConfigError(
        f"expected a psycopg.Connection or a DSN string, got {type(conn_or_dsn).__name__}"
    )


class Runner:
    """A worker of `app` inside this process that polls no stage: `run_task` and `drain` claim
    with lease.claim_runs and run each claim through its executor (keeper, lease, Context,
    outcome). Open it once for several calls (`with Runner(app, conn) as r:`), or use the
    module's functions, which open one per call. `config` overrides settings (lease, ...)."""

    def __init__(self, app: App, conn_or_dsn: Conn | str, **config: Any) -> None:
        if not isinstance(app, App):
            raise ConfigError(f"expected a leasework.App, got {type(app).__name__}")
        self.app = app
        cfg = dataclasses.replace(app.config, dsn=dsn_of(conn_or_dsn), **config)
        self.worker = Worker(
            app.with_config(cfg),
            cfg,
            worker_id=f"testing-{new_worker_id()}",
            stages=[],
            register=False,
        )

    def __enter__(self) -> Runner:
        self.worker.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.close()

    @property
    def _main(self) -> Conn:
        return self.worker.conns.main()

    def _kinds(self, kinds: Iterable[str] | None) -> list[str]:
        served = self.app.kinds(stage="runs") + self.app.kinds(stage="async")
        if kinds is None:
            return served
        if isinstance(kinds, str):
            kinds = [kinds]
        chosen = list(kinds)
        for kind in chosen:
            if kind not in served:
                raise UnknownKind(
                    f"kind {kind!r} is not a task of this app that runs here; its tasks are: "
                    f"{', '.join(served) or 'none registered'}"
                )
        return chosen

    def _execute(self, claim: Claim) -> RunResult:
        handler = self.app.handler(claim.kind)
        if self.app.tasks[claim.kind].stage == "async":  # on the worker's event loop, to its end
            self.worker.aexecutor.run_now(claim, handler)
        else:
            self.worker.executor.run(claim, handler)
        return self.result(claim.id)

    def result(self, run_id: int) -> RunResult:
        """A run as it stands now."""
        row = self._main.execute(Q["run_row"], {"id": run_id}).fetchone()
        if row is None:
            raise LeaseworkError(f"run {run_id} is gone")
        rid, kind, status, payload, result, error, attempts, queued_at, key, tenant = row[:10]
        history, snoozes = row[10], row[11]
        last = history[-1] if isinstance(history, list) and history else None
        outcome = last.get("outcome") if isinstance(last, dict) else None
        return RunResult(
            rid,
            kind,
            status,
            result,
            error,
            attempts,
            payload,
            due_at=queued_at if status == "queued" else None,
            key=key,
            tenant=tenant,
            outcome=outcome if isinstance(outcome, str) else None,
            snoozes=snoozes or 0,
        )

    def run_task(
        self, kind: str, payload: Any = None, **options: Unpack[RunTaskOptions]
    ) -> RunResult:
        """Enqueue a run of `kind` (committed at once), claim it and run its handler here with a
        real Context; return how the attempt ended. `Retry`, `Snooze`, `Fail`, `Partial`,
        `Aborted` and failures come back as outcomes (a retry or a snooze: status `queued`,
        `due_at` set, `outcome` `retry` or `snoozed`), never as exceptions."""
        accept_options("run_task", options, RunTaskOptions)
        (kind,) = self._kinds([kind])
        # Due at once and a new run: the task's unique window and debounce do not apply.
        done = self.app.enqueue_run(
            self._main, kind, payload, priority=FIRST, unique_for=None, debounce=None, **options
        )
        if done.existing:
            key = options.get("key")
            raise LeaseworkError(
                f"key {key!r} already has an active run ({done.run_id}): run_task runs a new one"
            )
        claims = lease.claim_runs(
            self._main, [kind], worker=self.worker.id, lease=self.worker.config.lease
        )
        if not claims or claims[0].id != done.run_id:
            for claim in claims:
                lease.release(self._main, claim, "not the run run_task enqueued")
            raise LeaseworkError(
                f"run {done.run_id} of kind {kind!r} could not be claimed (its kind paused, its "
                "tenant's limiter busy, or another run of the kind claimed first)"
            )
        return self._execute(claims[0])

    def drain(
        self,
        kinds: Iterable[str] | None = None,
        *,
        jump_delays: bool = False,
        max_runs: int = 1000,
    ) -> Drained:
        """Run due runs of `kinds` (default: every task kind of the app), one at a time, until
        none is due; waiting runs whose key went idle are promoted on the way, and runs that
        wait for others decided once these have ended (the `deps` stage's step). With
        `jump_delays`, delayed runs (a `delay`, a retry's backoff) are made due one due time
        after another, as if time had moved on, until none is left. Runs other kinds never.
        Raises LeaseworkError past `max_runs` attempts (a task that re-enqueues itself)."""
        chosen = self._kinds(kinds)
        if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
            raise ConfigError(f"max_runs must be a positive integer, got {max_runs!r}")
        ran = Drained()
        while chosen:
            claims = lease.claim_runs(
                self._main, chosen, worker=self.worker.id, lease=self.worker.config.lease
            )
            if claims:
                if len(ran) >= max_runs:
                    lease.release(self._main, claims[0], "drain stopped at max_runs")
                    raise LeaseworkError(
                        f"drain ran {max_runs} attempts and runs are still due (a task that "
                        "enqueues itself?): pass a larger max_runs="
                    )
                ran.append(self._execute(claims[0]))
                continue
            ended, promoted = lease.expire_and_promote(self._main, 100)
            if ended or promoted:
                continue
            if deps.settle(self._main, deps.LIMIT):  # runs whose parents ended: decided
                continue
            if (
                jump_delays
                and self._main.execute(Q["make_next_due"], {"kinds": chosen}).fetchall()
            ):
                continue
            break
        return ran


def run_task(
    app: App,
    conn_or_dsn: Conn | str,
    kind: str,
    payload: Any = None,
    **options: Unpack[RunTaskOptions],
) -> RunResult:
    """Run one task of `app` inline on the database of `conn_or_dsn` (Runner.run_task)."""
    accept_options("run_task", options, RunTaskOptions)
    with Runner(app, conn_or_dsn) as runner:
        return runner.run_task(kind, payload, **options)


def drain(
    app: App,
    conn_or_dsn: Conn | str,
    kinds: Iterable[str] | None = None,
    *,
    jump_delays: bool = False,
    max_runs: int = 1000,
) -> Drained:
    """Execute due runs of `kinds` in this process until none is left (Runner.drain). Runs
    enqueued on `conn_or_dsn` must be committed (an autocommit connection is simplest)."""
    with Runner(app, conn_or_dsn) as runner:
        return runner.drain(kinds, jump_delays=jump_delays, max_runs=max_runs)


def enqueued(
    conn: Conn,
    kind: str | None = None,
    *,
    payload: Any = None,
    key: str | None = None,
    tenant: str | None = None,
    status: str | None = None,
) -> list[dict[str, Any]]:
    """The runs enqueued (in this connection's view, so its uncommitted ones too), oldest
    first, filtered by kind, exact payload, key, tenant and status; each a dict of id, kind,
    status, payload, key, tenant, group, priority, queued_at."""
    if status is not None and status not in STATUSES:
        raise ConfigError(f"status {status!r} is not a run status: use one of {', '.join(STATUSES)}")
    params = {
        "kind": kind,
        "payload": None if payload is None else Jsonb(payload),
        "key": check_label("key", key),
        "tenant": check_label("tenant", tenant),
        "status": status,
    }
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(Q["enqueued"], params).fetchall()


def assert_enqueued(
    conn: Conn,
    kind: str,
    payload: Any = None,
    *,
    count: int | None = None,
    key: str | None = None,
    tenant: str | None = None,
    status: str | None = None,
) -> list[dict[str, Any]]:
    """Assert that runs of `kind` (with this exact payload, key, tenant, status if given) were
    enqueued: at least one, or exactly `count`. The AssertionError lists what was enqueued."""
    found = enqueued(conn, kind, payload=payload, key=key, tenant=tenant, status=status)
    if (count is None and not found) or (count is not None and len(found) != count):
        seen = _describe(enqueued(conn))
        want = "at least one run" if count is None else f"{count} run(s)"
        what = f"{kind!r}" + ("" if payload is None else f" with payload {payload!r}")
        raise AssertionError(
            f"expected {want} of {what}, found {len(found)}; enqueued: {seen or 'nothing'}"
        )
    return found


def _describe(rows: Sequence[dict[str, Any]], limit: int = 20) -> str:
    parts = [f"#{r['id']} {r['kind']} {r['payload']!r} ({r['status']})" for r in rows[:limit]]
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return ", ".join(parts) + more
