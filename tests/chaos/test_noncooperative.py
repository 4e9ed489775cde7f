"""The chaos tier for handlers that never call ctx.check() (README, "Handlers that never call
ctx.check()"): a real supervisor runs handlers blocked in one call that knows nothing of
leasework (a sleep, a socket read from a server that never answers, `subprocess.run`, a C call
holding the GIL, an open ctx.transaction() held past a third of the lease: blockingapp.py), and
each test injects one fault while they block: kill -9 of the children, SIGSTOP past the lease,
black-holed links, a cancel, a timeout, TERM or kill -9 of the supervisor, Postgres paused past
the lease, Postgres crashed right after claims, a claim answered after its lease ran out.

Besides every invariant of the harness (fenced effects, no stale write, terminal states final,
...), the attempt oracle (attempts.py) checks over the handlers' journal and the processes'
liveness that no two attempts of one run were ever alive at once (an attempt is alive until its
handler leaves or its process is gone), every run ends in the status the scenario expects, and a
run whose process died does not stay `running` under its token past its lease. One CHAOS line per
test, as in tests/faults/scenarios.py."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import wait_for
from tests.faults import blockingapp
from tests.faults.attempts import Attempt, AttemptLog
from tests.faults.blockingapp import BLOCKS
from tests.faults.harness import ChaosRun, Fault, worker_pid
from tests.pgcluster import private_cluster
from tests.process.conftest import Supervised

APP = "tests.faults.blockingapp:app"
LEASE = 4.0  # the harness's lease (harness.CONFIG)
# Seconds a stuck attempt blocks (gil: minutes): longer than it takes any fault to end it. A
# `sleep` of subprocess.run whose worker was killed outlives it by as much.
STUCK = 15.0
# Cancel and timeout: a lease long enough that neither the watchdog's lease rule, its hang rule
# nor the dead man's switch can end an attempt first; only the cancel or the timeout (and, for a
# handler holding the GIL, the supervisor's kill after abort_grace) can.
LONG_LEASE: dict[str, Any] = {
    "lease": 20.0,
    "renew_interval": 2.0,
    "watchdog_margin": 3.0,
    "hang_timeout": 30.0,
}
# Postgres crash: a keeper that checks its runs seldom (control_interval as with the default
# lease), so that a claim lost in the crash would be handed out again and started while its first
# handler still blocks, before that handler's keeper sees the run is no longer its own.
CRASH: dict[str, Any] = {
    "lease": 8.0,
    "renew_interval": 2.5,
    "control_interval": 2.0,
    "watchdog_margin": 2.0,
    "hang_timeout": 10.0,
    "processes": 4,
}
NOTIFY_CLAIMS = """
CREATE OR REPLACE FUNCTION public.chaos_notify_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('chaos_claim', NEW.id::text);
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS chaos_notify_claim ON leasework.runs;
CREATE TRIGGER chaos_notify_claim AFTER UPDATE ON leasework.runs FOR EACH ROW
    WHEN (NEW.status = 'running' AND NEW.lease_owner IS DISTINCT FROM OLD.lease_owner)
    EXECUTE FUNCTION public.chaos_notify_claim();
"""


class SilentServer:
    """A TCP server that accepts connections and never sends a byte."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.address = self._sock.getsockname()[:2]
        self._held: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="silent-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *self._held]:
            with contextlib.suppress(OSError):
                s.close()


class NonCoopRun(ChaosRun):
    """A ChaosRun of the blocking app, with the attempt oracle and expected final statuses."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.journal = self.tmp / "attempts.jsonl"
        self.log = AttemptLog(self.journal, self.worker_pids)
        self.silent = SilentServer()
        self.expected: dict[int, str] = {}  # run id -> the status it must end in
        self.first_outcome: dict[int, str] = {}  # run id -> its first attempt's outcome

    def worker_pids(self) -> list[int]:
        return [pid for sup in self.supervisors for pid in sup.children()]

    def start(self, **config: Any) -> Supervised:
        return super().start(app=APP, **config)

    def enqueue_blocking(
        self,
        block: str,
        *,
        steps: int = 1,
        seconds: float = 0.2,
        stuck: int = 0,
        timeout: bool = False,
        expect: str = "succeeded",
        **extra: Any,
    ) -> int:
        """One run whose steps block in `block` for `seconds` each; its first `stuck` attempts
        block for STUCK s (gil: minutes). `timeout`: the kind with a short attempt timeout."""
        payload = {
            "block": block,
            "steps": steps,
            "seconds": seconds,
            "stuck": stuck,
            "stuck_seconds": STUCK,
            "journal": str(self.journal),
            "silent": list(self.silent.address),
            **extra,
        }
        kind = f"{block}_timeout" if timeout else block
        with self.connect() as conn:
            run_id = blockingapp.app.enqueue(conn, kind, payload)
        self.enqueued.append(run_id)
        self.expected[run_id] = expect
        return run_id

    def running_attempt(self, run_id: int, attempt: int = 1) -> Attempt:
        """The attempt, once its handler has started (and while it has not left)."""
        try:
            found: Attempt = wait_for(
                lambda: self.log.running(run_id, attempt), timeout=30, interval=0.01
            )
        except AssertionError:
            row = self.query("SELECT status, history FROM leasework.runs WHERE id = %s", (run_id,))
            seen = self.log.of_run(run_id)
            raise AssertionError(
                f"attempt {attempt} of run {run_id} not seen: {seen} {row}"
            ) from None
        return found

    def holder(self, run_id: int) -> tuple[str, str] | None:
        """(owner token, worker) of the run while it is running."""
        rows = self.query(
            "SELECT lease_owner::text, lease_worker FROM leasework.runs"
            " WHERE id = %s AND status = 'running'",
            (run_id,),
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def hit(self, kind: str, attempt: Attempt) -> Fault:
        fault = Fault(kind, time.time(), attempt.run_id, attempt.owner)
        self.faults.append(fault)
        return fault

    # -- the checks -------------------------------------------------------------------------------

    def check(self, *, control: bool = False) -> list[str]:
        v = super().check(control=control)
        ids = self.enqueued
        # No two attempts of one run alive at once.
        v += self.log.overlaps(ids)
        # Every run in the status its scenario expects.
        for run_id, kind, status, history in self.query(
            "SELECT id, kind, status, history FROM leasework.runs WHERE id = ANY(%s) ORDER BY id",
            (ids,),
        ):
            outcomes = " ".join(str(h.get("outcome")) for h in history)
            print(f"run {run_id} {kind}: {outcomes} -> {status}")  # shown if the test fails
            want = self.expected.get(run_id)
            if want is not None and status != want:
                v.append(f"run {run_id} ended {status}, expected {want}: {history}")
            first = self.first_outcome.get(run_id)
            got = history[0].get("outcome") if history else None
            if first is not None and got != first:
                v.append(f"run {run_id}'s first attempt ended {got}, expected {first}: {history}")
        # A run whose process died moves on (a poll and a claim after its lease, on a busy machine).
        v += self.log.held_by_the_dead(self.query, slack=2 * float(self.cfg["lease"]))
        # No worker crashed on a fault it should wait out (e.g. Postgres restarting).
        v += [
            f"worker {e.get('worker')} crashed: {str(e.get('error')).splitlines()[0]}"
            for sup in self.supervisors
            for e in sup.events("child_crashed")
        ]
        return v

    def close(self) -> None:
        self.stop()
        self.log.close()
        self.silent.close()


@pytest.fixture
def nc(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., NonCoopRun]]:
    """nc(through_pooler=False, **config) -> a NonCoopRun on a fresh private cluster."""
    runs: list[NonCoopRun] = []
    with private_cluster("leasework-noncoop-") as cluster:

        def make(through_pooler: bool = False, **config: Any) -> NonCoopRun:
            seed = random.randrange(1 << 32)
            print(f"chaos seed {seed}")
            run = NonCoopRun(
                cluster,
                tmp_path,
                request.node.name,
                config,
                random.Random(seed),
                pooled=through_pooler,
            )
            runs.append(run)
            return run

        try:
            yield make
        finally:
            for run in runs:
                run.close()


def each_block(run: NonCoopRun, **kwargs: Any) -> dict[str, int]:
    """One run per blocking call, enqueued together."""
    return {block: run.enqueue_blocking(block, **kwargs) for block in BLOCKS}


# -- the faults -----------------------------------------------------------------------------------


def test_kill_9_of_a_child_blocked_in_each_call(nc: Callable[..., NonCoopRun]) -> None:
    """Killed mid-call (the transaction's effect rolls back with its session); the supervisor
    reaps the child and the run is redone at once elsewhere, every step's effect once."""
    run = nc(processes=5)
    run.start()
    runs = each_block(run, steps=2, stuck=1)
    for run_id in runs.values():
        a = run.running_attempt(run_id)
        run.hit("kill9_child", a)
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.pid, signal.SIGKILL)
    run.finish()


def test_sigstop_past_the_lease_with_only_the_dead_mans_switch(
    nc: Callable[..., NonCoopRun],
) -> None:
    """Every blocked child stopped for twice the lease, the watchdog off: nothing in a stopped
    process runs, so the kernel timer (the dead man's switch) must kill each before its lease
    expires; two spare children take the runs over after the lease, never beside a stopped one."""
    run = nc(processes=7, watchdog=False, hang_timeout=0)
    run.start()
    runs = each_block(run, steps=2, stuck=1)
    stopped = [run.running_attempt(run_id) for run_id in runs.values()]
    faults = []
    for a in stopped:
        faults.append(run.hit("sigstop_child", a))
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.pid, signal.SIGSTOP)
    try:
        time.sleep(2 * LEASE)  # the fault's duration
    finally:
        for a in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(a.pid, signal.SIGCONT)
    for fault in faults:
        fault.healed = time.time()
    run.finish()


def test_blackholed_children_blocked_in_each_call(nc: Callable[..., NonCoopRun]) -> None:
    """Every blocked child's traffic black-holed for twice the lease (its renewals hang, they do
    not fail): it must be stopped before its lease expires; the runs move on, and what the cut
    children had sent is delivered after the heal without effect."""
    run = nc(processes=7)
    run.start()
    runs = each_block(run, steps=2, stuck=1)
    cut = [run.running_attempt(run_id) for run_id in runs.values()]
    faults = []
    for a in cut:
        faults.append(run.hit("blackhole_child", a))
        run.proxy.set_mode(a.pid, "blackhole")
    try:
        time.sleep(2 * LEASE)  # the fault's duration
    finally:
        for a, fault in zip(cut, faults, strict=True):
            run.heal_child(fault, a.pid)
    run.finish()


def test_cancel_of_each_blocking_call(nc: Callable[..., NonCoopRun]) -> None:
    """Cancelled while blocked in every attempt: each run ends `cancelled` and never starts again.
    A handler in an interruptible call returns at once (Aborted), its process goes on serving;
    the one holding the GIL is killed by the supervisor after abort_grace."""
    run = nc(processes=5, **LONG_LEASE)
    run.start()
    runs = each_block(run, stuck=10, expect="cancelled")
    each_block(run)  # run after the cancels, untouched by them
    attempts = {block: run.running_attempt(run_id) for block, run_id in runs.items()}
    for a in attempts.values():
        run.faults.append(Fault("cancel", time.time(), a.run_id))
        with run.connect() as conn:
            blockingapp.app.cancel(conn, a.run_id)
    run.finish()
    for block, a in attempts.items():
        (ended,) = [x for x in run.log.of_run(a.run_id) if x.owner == a.owner]
        if block == "gil":
            assert ended.end is None and run.log.gone(a.pid), ended
        else:
            assert ended.how == "Aborted", f"{block}: {ended} (not interrupted)"


def test_timeout_of_each_blocking_call(nc: Callable[..., NonCoopRun]) -> None:
    """Each first attempt blocks past its task's timeout: it ends as a timed-out attempt (the
    GIL-holding one killed by the supervisor after abort_grace) and the retry succeeds."""
    run = nc(processes=5, **LONG_LEASE)
    run.start()
    runs = each_block(run, stuck=1, timeout=True)
    for run_id in runs.values():
        run.first_outcome[run_id] = "timeout"
        run.hit("task_timeout", run.running_attempt(run_id))
    run.finish()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_the_supervisor_signalled_mid_blocking_calls(
    nc: Callable[..., NonCoopRun], sig: signal.Signals
) -> None:
    """TERM while every child blocks: each handler gets graceful_timeout, is then interrupted and
    its run given back; kill -9: the children, orphaned, stop fast (their parent-death signal) and
    give their runs back. The GIL-holding handler can do neither and is killed (watchdog, dead
    man's switch). A new supervisor started at once takes the runs over, never beside an old
    attempt."""
    run = nc(processes=5)
    old = run.start()
    runs = [
        run.enqueue_blocking(block, steps=2, seconds=3.0, stuck=int(block == "gil"))
        for block in BLOCKS
    ]
    for run_id in runs:
        run.running_attempt(run_id)
    run.remember_children()
    kind = {signal.SIGTERM: "sigterm_supervisor", signal.SIGKILL: "kill9_supervisor"}[sig]
    run.faults.append(Fault(kind, time.time()))
    old.signal(sig)
    run.start()
    old.wait_exit(float(run.cfg["graceful_timeout"]) + 15)
    run.finish()


def test_postgres_paused_past_the_lease_under_blocking_calls(
    nc: Callable[..., NonCoopRun],
) -> None:
    """The server stopped (SIGSTOP) for one and a half leases while every child blocks: renewals
    hang rather than fail, and the supervisor's own statements may hang too; every blocked child
    must be dead before its lease expires, and the runs go on after the server resumes."""
    run = nc(processes=5)
    run.start()
    runs = each_block(run, steps=2, stuck=1)
    for run_id in runs.values():
        run.running_attempt(run_id)
    run.pause_postgres(1.5 * LEASE)
    run.finish()


def test_postgres_crash_right_after_claims(nc: Callable[..., NonCoopRun]) -> None:
    """Postgres crashed (immediate stop, WAL replay) right after each claim of a blocking run: a
    claim the crash lost would be handed out again after the restart while its first handler
    still blocks (issue 12's first overlap: claims committed asynchronously)."""
    run = nc(**CRASH)
    run.query(NOTIFY_CLAIMS)
    run.start()
    for block in BLOCKS:
        # The one holding the GIL stays blocked past the restart, and past its lease.
        crash_after_claim(run, block, seconds=3.0, stuck=int(block == "gil"))
    run.finish()


def crash_after_claim(run: NonCoopRun, block: str, **kwargs: Any) -> Fault:
    """Enqueue a run and crash Postgres the moment its claim commits (a NOTIFY from a trigger,
    heard on a connection of the driver's own, not through the proxy)."""
    with psycopg.connect(run.cluster.dsn, autocommit=True) as conn:
        conn.execute("LISTEN chaos_claim")
        run_id = run.enqueue_blocking(block, **kwargs)
        deadline = time.monotonic() + 30
        while (left := deadline - time.monotonic()) > 0:  # other runs' claims go by too
            if any(n.payload == str(run_id) for n in conn.notifies(timeout=left, stop_after=1)):
                break
        else:
            raise AssertionError(f"run {run_id} not claimed")
    return run.crash_postgres()


@pytest.mark.parametrize("path", ["claim", "finish_and_claim"])
def test_a_claim_answered_after_its_lease_ran_out_never_starts(
    nc: Callable[..., NonCoopRun], path: str
) -> None:
    """The answer to a claim is held by the link past the lease; meanwhile another worker takes
    the run (its lease ran out) and starts it. When the late answer arrives, the first worker
    must not start the run beside it (issue 12's second overlap). The claim on its own, or made
    in one statement with the seal of the run before it (one-at-a-time mode's steady state)."""
    run = nc()
    late = run.start(processes=1)
    [pid] = late.children()
    marker = f"late-claim-{uuid.uuid4()}"
    run.proxy.set_mode(pid, "hold", role="control", after=marker.encode())
    if path == "finish_and_claim":  # the held worker runs this one first
        run.enqueue_blocking("sleep", seconds=0.5)
    run_id = run.enqueue_blocking("sleep", seconds=3.0, marker=marker)
    owner, worker = wait_for(lambda: run.holder(run_id), timeout=30)  # its answer held
    assert worker_pid(worker) == pid, "claimed by another worker than the held one"
    fault = Fault("late_claim_reply", time.time(), run_id, owner)
    run.faults.append(fault)
    try:
        run.start(processes=1)  # takes the run once the held claim's lease has run out
        thief = run.running_attempt(run_id, attempt=2)
        assert thief.pid != pid
    finally:
        run.heal_child(fault, pid)

    def answered() -> bool:  # the late answer reached the worker: it started the run or said no
        started = any(a.owner == owner for a in run.log.of_run(run_id))
        return started or any(e.get("run_id") == run_id for e in late.events("claim_not_started"))

    wait_for(answered, timeout=30)
    run.finish()
    late_starts = [a for a in run.log.of_run(run_id) if a.owner == owner]
    assert not late_starts, f"the claim answered late was started: {late_starts}"
