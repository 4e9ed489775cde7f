"""The chaos harness: a private Postgres cluster with the oracle installed, a real `leasework
supervise` whose children all reach Postgres through the fault proxy, the faults themselves, the
invariants checked over the recorded history, and the one-line summary.

Timings are scaled down through the config file (lease 4 s); waits are conditions with deadlines.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from leasework import db
from tests.conftest import wait_for
from tests.pgbouncer import Bouncer, pgbouncer
from tests.pgcluster import Cluster
from tests.process.conftest import Supervised, alive

from .chaosapp import app as chaos_app
from .proxy import Proxy

Conn = psycopg.Connection[Any]
TERMINAL = ("succeeded", "partial", "failed", "cancelled")
SUMMARY: list[str] = []
ORACLE = (Path(__file__).parent / "oracle.sql").read_text()

CONFIG: dict[str, Any] = {
    "poll_interval": 0.2,
    "lease": 4.0,
    "renew_interval": 1.0,
    "control_interval": 0.25,
    "heartbeat_interval": 1.0,
    "graceful_timeout": 2.0,
    "watchdog_margin": 1.5,
    "hang_timeout": 5.0,
    "restart_backoff": 0.1,
    "restart_backoff_max": 1.0,
    "backoff": [0.2, 0.5, 1.0],
    "processes": 3,
    "pool_size": 3,
}


# A step's fenced transaction picked for a partition has been idle in transaction for less than
# this (seconds): shorter than the rest of its tx_sleep, so it is still open when the link goes.
FRESH_TX = 0.3


@dataclass
class Fault:
    kind: str
    at: float  # wall clock (same machine as the server: comparable with its timestamps)
    run_id: int | None = None  # the run the fault hit, if one
    owner: str | None = None  # that run's lease owner when hit
    healed: float | None = None  # end of a fault with a duration
    # The server session (backend pid, xact_start) caught inside a transaction, if one.
    session: tuple[int, Any] | None = None


@dataclass
class ChaosRun:
    cluster: Cluster
    tmp: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    rand: random.Random = field(default_factory=random.Random)
    # Children (and their supervisor) reach Postgres through a PgBouncer in transaction mode,
    # behind the fault proxy: child -> proxy -> pgbouncer -> Postgres.
    pooled: bool = False
    # The app the supervisors run (MODULE:ATTR): chaosapp's sync handlers, or chaosapp_async's.
    app: str = "tests.faults.chaosapp:app"

    def __post_init__(self) -> None:
        self.cfg = {**CONFIG, **self.config}
        self.bouncer: Bouncer | None = None
        upstream = self.cluster.port
        if self.pooled:
            self._bouncer_cm = pgbouncer(self.cluster.dsn)
            self.bouncer = self._bouncer_cm.__enter__()
            upstream = self.bouncer.port
        self.proxy = Proxy(upstream)
        self.supervisors: list[Supervised] = []
        self.spawned: set[int] = set()
        self.faults: list[Fault] = []
        self.enqueued: list[int] = []
        self.started = time.time()
        with self.connect() as conn:
            db.migrate(conn)
            conn.execute(ORACLE)

    # -- plumbing ------------------------------------------------------------------------------

    def connect(self, timeout: int = 5) -> Conn:
        return psycopg.connect(self.cluster.dsn, autocommit=True, connect_timeout=timeout)

    def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """A fresh direct connection per call: the driver must survive the faults it injects."""

        def attempt() -> tuple[list[tuple[Any, ...]]] | None:
            try:
                with self.connect(timeout=3) as conn:
                    cur = conn.execute(sql, params)
                    return (cur.fetchall() if cur.description else [],)
            except psycopg.OperationalError:
                return None

        result: tuple[list[tuple[Any, ...]]] = wait_for(attempt, timeout=30, interval=0.1)
        return result[0]

    def start(
        self,
        *,
        dsn: str | None = None,
        wrap: Sequence[str] = (),
        tmp: Path | None = None,
        app: str | None = None,
        **config: Any,
    ) -> Supervised:
        """A supervisor whose children reach Postgres through the proxy, unless `dsn` is given
        (`wrap`: a command prefix, e.g. `ip netns exec NS`; `tmp`: its own config and log dir;
        `app`: MODULE:ATTR of the app it runs)."""
        sup = Supervised(
            tmp or self.tmp,
            dsn or self.proxy.dsn(),
            {**self.cfg, **config},
            app=app or self.app,
            wrap=wrap,
        )
        self.supervisors.append(sup)
        sup.wait_children(int(config.get("processes", self.cfg["processes"])), timeout=20)
        return sup

    @property
    def sup(self) -> Supervised:
        return self.supervisors[-1]

    def enqueue(
        self,
        n: int,
        *,
        kind: str = "steps",
        steps: int = 3,
        sleep: tuple[float, float] = (0.05, 0.2),
        die: str | None = None,
        tx_sleep: float = 0.0,
    ) -> list[int]:
        """Enqueue `n` runs of `steps` steps, each waiting `sleep` (a random value in the range)
        and then sleeping `tx_sleep` s inside its fenced transaction."""
        ids = []
        with self.connect() as conn:
            for _ in range(n):
                payload: dict[str, Any] = {
                    "steps": steps,
                    "sleep": round(self.rand.uniform(*sleep), 3),
                }
                if die:
                    payload["die"] = die
                if tx_sleep:
                    payload["tx_sleep"] = tx_sleep
                ids.append(chaos_app.enqueue(conn, kind, payload))
        self.enqueued.extend(ids)
        return ids

    def ensure_work(self, live: int = 6) -> None:
        """Enqueue more runs if fewer than `live` are queued or running (a schedule's fault on a
        busy child needs one)."""
        rows = self.query(
            "SELECT count(*) FROM leasework.runs WHERE status IN ('queued', 'running')"
        )
        if rows[0][0] < live:
            self.enqueue(live, steps=4)

    def running(self) -> list[tuple[int, str, str]]:
        """(run id, owner, worker) of every running run."""
        rows = self.query(
            "SELECT id, lease_owner::text, lease_worker FROM leasework.runs"
            " WHERE status = 'running' AND lease_expires_at > now()"
        )
        return [(r[0], r[1], r[2]) for r in rows]

    def busy_child(self, timeout: float = 20) -> tuple[int, int, str]:
        """(pid, run id, owner) of a child of the current supervisor holding a live lease."""

        def find() -> tuple[int, int, str] | None:
            kids = set(self.sup.children())
            held = [(worker_pid(w), r, o) for r, o, w in self.running()]
            held = [h for h in held if h[0] in kids]
            return self.rand.choice(held) if held else None

        found: tuple[int, int, str] = wait_for(find, timeout=timeout, interval=0.05)
        return found

    def remember_children(self) -> None:
        for sup in self.supervisors:
            self.spawned.update(e["pid"] for e in sup.events("child_spawned"))

    # -- faults --------------------------------------------------------------------------------

    def sleep(self, seconds: float) -> None:
        """A random moment between faults (part of the schedule, not a wait for a condition)."""
        time.sleep(seconds)

    def kill_child(self, pid: int | None = None, sig: int = signal.SIGKILL) -> Fault:
        """kill -9 a child: the one given, else a busy one."""
        run_id: int | None = None
        owner: str | None = None
        if pid is None:
            pid, run_id, owner = self.busy_child()
        fault = Fault("kill9_child", time.time(), run_id, owner)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        self.faults.append(fault)
        return fault

    def sigstop_child(self, seconds: float) -> Fault:
        # A child killed a moment ago may still be listed, its run not yet released by its
        # parent: when the one picked is gone, pick another busy child (within busy_child's
        # own deadline).
        deadline = time.monotonic() + 20
        while True:
            pid, run_id, owner = self.busy_child()
            try:
                os.kill(pid, signal.SIGSTOP)
                break
            except ProcessLookupError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # polling interval while the parent reaps the dead child
        fault = Fault("sigstop_child", time.time(), run_id, owner)
        try:
            time.sleep(seconds)  # the fault's duration, not a wait for a condition
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        fault.healed = time.time()
        self.faults.append(fault)
        return fault

    def partition_child(self, *, in_transaction: Sequence[int] = ()) -> tuple[Fault, int]:
        """Black-hole a busy child's traffic until `heal_child`. in_transaction: run ids (whose
        steps hold their fenced transaction open a while: payload tx_sleep); black-hole the
        child of one of them whose job is inside that transaction now, its session idle in it
        for less than FRESH_TX s, and record that session in `fault.session`."""
        if not in_transaction:
            pid, run_id, owner = self.busy_child()
            self.proxy.set_mode(pid, "blackhole")
            fault = Fault("blackhole_child", time.time(), run_id, owner)
            self.faults.append(fault)
            return fault, pid

        def in_tx() -> tuple[Any, ...] | None:
            rows = self.query(
                "SELECT r.lease_worker, r.id, r.lease_owner::text, a.pid, a.xact_start"
                "  FROM leasework.runs r"
                "  JOIN pg_stat_activity a ON a.application_name IN ("
                "       'leasework:' || r.lease_worker, 'leasework:' || r.lease_worker || ':control')"
                " WHERE r.id = ANY(%s) AND r.status = 'running' AND r.lease_expires_at > now()"
                "   AND a.state = 'idle in transaction'"
                "   AND a.state_change > clock_timestamp() - make_interval(secs => %s)",
                (list(in_transaction), FRESH_TX),
            )
            kids = set(self.sup.children())
            rows = [r for r in rows if worker_pid(r[0]) in kids]
            return self.rand.choice(rows) if rows else None

        worker, run_id, owner, backend, xact_start = wait_for(in_tx, timeout=20, interval=0.01)
        pid = worker_pid(worker)
        self.proxy.set_mode(pid, "blackhole")
        fault = Fault("blackhole_child", time.time(), run_id, owner, session=(backend, xact_start))
        self.faults.append(fault)
        return fault, pid

    def session_state(self, fault: Fault) -> str | None:
        """The state of the server session a fault caught inside a transaction, if it is still
        in that same transaction (pg_stat_activity), else None."""
        assert fault.session is not None
        backend, xact_start = fault.session
        rows = self.query(
            "SELECT state FROM pg_stat_activity WHERE pid = %s AND xact_start = %s",
            (backend, xact_start),
        )
        return str(rows[0][0]) if rows else None

    def heal_child(self, fault: Fault, pid: int) -> None:
        self.proxy.heal(pid)
        fault.healed = time.time()

    def blackhole_child(self, seconds: float) -> tuple[Fault, int]:
        fault, pid = self.partition_child()
        try:
            time.sleep(seconds)  # the fault's duration
        finally:
            self.heal_child(fault, pid)
        return fault, pid

    def delay_child(self, seconds: float, delay: float = 0.05) -> Fault:
        pid, run_id, owner = self.busy_child()
        fault = Fault("delay_child", time.time(), run_id, owner)
        self.proxy.set_mode(pid, "delay", delay)
        try:
            time.sleep(seconds)
        finally:
            self.proxy.heal(pid)
        fault.healed = time.time()
        self.faults.append(fault)
        return fault

    def terminate_backend(self, which: str = "any") -> Fault:
        """pg_terminate_backend of a worker session: `control` (renewal, control and LISTEN),
        `pool` (the job's connections) or any."""
        like = {"control": "leasework:%:control", "pool": "leasework:%"}.get(which, "leasework:%")
        rows = self.query(
            "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s"
            " AND application_name <> 'leasework:supervisor'",
            (like,),
        )
        if which == "pool":
            rows = [r for r in rows if not r[1].endswith(":control")]
        fault = Fault(f"terminate_{which}", time.time())
        if rows:
            pid = self.rand.choice(rows)[0]
            self.query("SELECT pg_terminate_backend(%s)", (pid,))
        self.faults.append(fault)
        return fault

    def crash_postgres(self, down: float = 0.3) -> Fault:
        fault = Fault("pg_crash_restart", time.time())
        self.cluster.crash()
        time.sleep(down)  # the fault's duration: workers meet a dead server for a moment
        self.cluster.start()
        fault.healed = time.time()
        self.faults.append(fault)
        return fault

    def pause_postgres(self, seconds: float) -> Fault:
        fault = Fault("pg_pause", time.time())
        self.cluster.pause()
        try:
            time.sleep(seconds)
        finally:
            self.cluster.resume()
        fault.healed = time.time()
        self.faults.append(fault)
        return fault

    def cancel(self, run_id: int | None = None) -> Fault:
        if run_id is None:
            live = self.query(
                "SELECT id FROM leasework.runs WHERE status IN ('queued', 'running')"
                " AND kind = 'steps' ORDER BY random() LIMIT 1"
            )
            run_id = live[0][0] if live else None
        fault = Fault("cancel", time.time(), run_id)
        if run_id is not None:
            with self.connect() as conn:
                chaos_app.cancel(conn, run_id)
        self.faults.append(fault)
        return fault

    def supervisor_signal(self, sig: int) -> Fault:
        kind = {signal.SIGTERM: "sigterm_supervisor", signal.SIGKILL: "kill9_supervisor"}[sig]
        fault = Fault(kind, time.time())
        self.remember_children()
        kids = self.sup.children()
        self.sup.signal(sig)
        if sig == signal.SIGTERM:
            self.sup.wait_exit(float(self.cfg["graceful_timeout"]) + 10)
        wait_for(lambda: not [p for p in kids if alive(p)], timeout=15)
        self.faults.append(fault)
        return fault

    # -- the end -------------------------------------------------------------------------------

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait until every enqueued run is terminal: within max_attempts x (lease + backoff cap)
        after the last fault, plus slack for the steps themselves."""
        cfg = self.cfg
        bound = 5 * (cfg["lease"] + max(cfg["backoff"])) + 30 if timeout is None else timeout

        def done() -> bool:
            rows = self.query(
                "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status <> ALL(%s)",
                (self.enqueued, list(TERMINAL)),
            )
            return rows[0][0] == 0

        wait_for(done, timeout=bound, interval=0.2)

    def stop(self) -> None:
        self.remember_children()
        for sup in self.supervisors:
            sup.stop()
        self.proxy.close()
        if self.bouncer is not None:
            self._bouncer_cm.__exit__(None, None, None)
            self.bouncer = None

    def check(self, *, control: bool = False) -> list[str]:
        """Every invariant over the history. Returns the violations (must be empty)."""
        v: list[str] = []
        ids = self.enqueued
        terminal = list(TERMINAL)
        q = self.query
        # No run lost: every enqueued run is there and terminal (quiesce waited for it).
        rows = q("SELECT id, status FROM leasework.runs WHERE id = ANY(%s)", (ids,))
        if len(rows) != len(ids):
            v.append(f"lost runs: {sorted(set(ids) - {r[0] for r in rows})}")
        v += [f"run {r[0]} not terminal: {r[1]}" for r in rows if r[1] not in TERMINAL]
        # Zero stale writes: the oracle refused none (a refusal means an unfenced write).
        for sup in self.supervisors:
            v += [f"oracle refused a stale write: {e}" for e in sup.events("oracle_rejected")]
        # Effects per step <= 1, and a succeeded run has every step exactly once.
        v += [
            f"run {r[0]} step {r[1]} committed {r[2]} times"
            for r in q(
                "SELECT run_id, step, count(*) FROM public.chaos_effects"
                " GROUP BY 1, 2 HAVING count(*) > 1"
            )
        ]
        v += [
            f"succeeded run {r[0]} has {r[1]} of {r[2]} effects"
            for r in q(
                "SELECT r.id, (SELECT count(*) FROM public.chaos_effects e WHERE e.run_id = r.id),"
                " (r.payload->>'steps')::int FROM leasework.runs r"
                " WHERE r.payload ? 'steps' AND r.status = 'succeeded' AND r.id = ANY(%s)",
                (ids,),
            )
            if r[1] != r[2]
        ]
        # Every committed effect was written by the run's owner at the time (history check,
        # independent of the trigger): an owner that held the run as `running`.
        v += [
            f"effect of run {r[0]} step {r[1]} by {r[2]}, never its owner"
            for r in q(
                "SELECT e.run_id, e.step, e.owner FROM public.chaos_effects e"
                " WHERE NOT EXISTS (SELECT 1 FROM public.chaos_transitions t"
                " WHERE t.run_id = e.run_id AND t.new_owner = e.owner AND t.new_status = 'running')"
            )
        ]
        # Terminal states are final.
        v += [
            f"run {r[0]} left terminal {r[1]} for {r[2]}"
            for r in q(
                "SELECT run_id, old_status, new_status FROM public.chaos_transitions"
                " WHERE old_status = ANY(%s) AND new_status IS DISTINCT FROM old_status",
                (terminal,),
            )
        ]
        # Attempts never exceed the maximum.
        v += [
            f"run {r[0]} attempt {r[1]} > max {r[2]}"
            for r in q(
                "SELECT run_id, new_attempts, max_attempts FROM public.chaos_transitions"
                " WHERE new_attempts > max_attempts"
            )
        ]
        # A run whose cancel was requested is never claimed (started) again.
        v += [
            f"run {r[0]} claimed after its cancel was requested"
            for r in q(
                "SELECT run_id FROM public.chaos_transitions WHERE cancel_requested"
                " AND new_status = 'running' AND new_owner IS DISTINCT FROM old_owner"
            )
        ]
        # No running row with a long-expired lease.
        v += [
            f"run {r[0]} running with a lease expired {r[1]}"
            for r in q(
                "SELECT id, now() - lease_expires_at FROM leasework.runs WHERE status = 'running'"
                " AND lease_expires_at < now() - make_interval(secs => %s)",
                (2 * self.cfg["lease"],),
            )
        ]
        # No worker session idle in a transaction (a stale fenced transaction holding a run).
        v += [
            f"worker session {r[0]} idle in transaction for {r[1]}"
            for r in q(
                "SELECT application_name, now() - state_change FROM pg_stat_activity"
                " WHERE application_name LIKE 'leasework:%%' AND state LIKE 'idle in transaction%%'"
                " AND state_change < now() - interval '5 seconds'"
            )
        ]
        if control:
            v += [
                f"fault-free run {r[0]} executed {r[1]} times (attempts {r[2]})"
                for r in q(
                    "SELECT r.id, (SELECT count(*) FROM public.chaos_exec x WHERE x.run_id = r.id),"
                    " r.attempts FROM leasework.runs r WHERE r.id = ANY(%s)",
                    (ids,),
                )
                if r[1] != 1 or r[2] != 1
            ]
        return v

    def check_orphans(self) -> list[str]:
        """After stop(): every child any supervisor ever spawned is gone."""
        self.remember_children()

        def gone() -> bool:
            return not [p for p in self.spawned if alive(p)]

        with contextlib.suppress(AssertionError):
            wait_for(gone, timeout=10)
        return [f"orphan child {p} still alive" for p in self.spawned if alive(p)]

    def recovery_times(self) -> list[float]:
        """Per fault: how long until work moved again. A fault that hit a run: until another
        owner held it or it ended. A fault of the whole database or a link: from the heal until
        the next effect committed anywhere."""
        out = []
        for f in self.faults:
            if f.kind == "cancel":
                continue
            if f.run_id is not None and f.owner is not None:
                rows = self.query(
                    "SELECT extract(epoch FROM min(at)) FROM public.chaos_transitions"
                    " WHERE run_id = %s AND at > to_timestamp(%s) AND ("
                    " (new_status = 'running' AND new_owner IS DISTINCT FROM %s::uuid)"
                    " OR new_status = ANY(%s))",
                    (f.run_id, f.at, f.owner, list(TERMINAL)),
                )
                start = f.at
            else:
                start = f.healed or f.at
                rows = self.query(
                    "SELECT extract(epoch FROM min(at)) FROM public.chaos_effects"
                    " WHERE at > to_timestamp(%s)",
                    (start,),
                )
            if rows and rows[0][0] is not None:
                out.append(max(0.0, float(rows[0][0]) - start))
        return out

    def summary(self, violations: list[str]) -> str:
        counts = collections.Counter(f.kind for f in self.faults)
        faults = ",".join(f"{k}={n}" for k, n in sorted(counts.items())) or "none"
        worst = max(self.recovery_times(), default=0.0)
        via = " via=pgbouncer" if self.pooled else ""
        line = (
            f"CHAOS {self.name}{via}: runs={len(self.enqueued)} faults[{faults}]"
            f" violations={len(violations)} worst_recovery={worst:.2f}s"
            f" elapsed={time.time() - self.started:.1f}s"
        )
        print(line)
        SUMMARY.append(line)  # repeated at the end of the pytest run (conftest.py)
        return line

    def finish(self, *, control: bool = False, quiesce: bool = True) -> str:
        """Quiesce, check every invariant, stop, check for orphans, print the summary line;
        raise with the violations if there are any."""
        violations: list[str] = []
        try:
            if quiesce:
                try:
                    self.quiesce()
                except AssertionError:
                    violations.append("runs not terminal within max_attempts x (lease + backoff)")
            violations += self.check(control=control)
        finally:
            self.stop()
        violations += self.check_orphans()
        line = self.summary(violations)
        assert not violations, line + "\n" + "\n".join(violations[:30])
        return line


def worker_pid(worker_id: str) -> int:
    """Worker ids are host-pid-suffix."""
    return int(worker_id.rsplit("-", 2)[1])


def within(seconds: float, predicate: Callable[[], Any]) -> Any:
    return wait_for(predicate, timeout=seconds, interval=0.05)
