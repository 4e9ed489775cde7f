"""Handlers that never call ctx.check(), under a real supervisor: one blocking call longer than
the lease keeps its lease and runs once; a cancel or a timeout interrupts a handler blocked in a
sleep, and kills one stuck in a C call that holds the GIL (the parent writes the outcome); an
open ctx.transaction() does not hold up renewal. The committed lease of a running run is sampled
throughout and must never be in the past."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from leasework import App
from tests.conftest import get_run, wait_for

from .conftest import alive, holder_pid

HANDLERS = textwrap.dedent(
    """

    def _started(ctx):
        (HERE / f"started-{ctx.run_id}-{ctx.attempt}-{os.getpid()}").touch()


    @app.task("sleepy", timeout=None)
    def sleepy(ctx, payload):
        _started(ctx)
        time.sleep(payload["seconds"])  # one blocking call, never ctx.check()
        return {"attempt": ctx.attempt, "pid": os.getpid()}


    @app.task("sleepy_timeout", timeout=2, max_attempts=2)
    def sleepy_timeout(ctx, payload):
        _started(ctx)
        time.sleep(600)


    @app.task("gil")
    def gil(ctx, payload):
        _started(ctx)
        sum(range(10**10))  # minutes inside one C call holding the GIL, deaf to signals
        return {"done": True}


    @app.task("busy_then_gil")
    def busy_then_gil(ctx, payload):
        if payload.get("stick"):
            _started(ctx)
            sum(range(10**10))
        return None


    @app.task("gil_timeout", timeout=2, max_attempts=1)
    def gil_timeout(ctx, payload):
        _started(ctx)
        sum(range(10**10))


    @app.task("tx_held", timeout=None)
    def tx_held(ctx, payload):
        _started(ctx)
        with ctx.transaction() as conn:
            conn.execute(
                "INSERT INTO public.supervisor_test_effects (run_id, attempt, pid) VALUES (%s, %s, %s)",
                (ctx.run_id, ctx.attempt, os.getpid()),
            )
            # Open far past the lease, never idle for long (a transaction idle for a whole
            # lease is ended by the server: fence_run).
            for _ in range(payload["seconds"]):
                time.sleep(1)
                conn.execute("SELECT 1")
        return {"attempt": ctx.attempt}
    """
)

# The reproduction: a 6 s lease renewed every 2 s, control every second.
SHORT_LEASE: dict[str, Any] = {
    "lease": 6.0,
    "renew_interval": 2.0,
    "control_interval": 1.0,
    "watchdog_margin": 1.0,
    "hang_timeout": 6.0,
    "abort_grace": 3.0,
    "backoff": [0.1],
}


# The default lease: neither the lease rule nor hang_timeout fires within a test; only a cancel
# or a timeout (after abort_grace) can end a handler stuck holding the GIL. Such a handler can
# never return, so abort_grace is only waited out here: 1 s.
LONG_LEASE: dict[str, Any] = {
    "lease": 120.0,
    "renew_interval": None,
    "control_interval": 1.0,
    "watchdog_margin": None,
    "hang_timeout": 120.0,
    "abort_grace": 1.0,
}


def add_handlers(app_dir: Path) -> None:
    with (app_dir / "lwtestapp.py").open("a", encoding="utf-8") as f:
        f.write(HANDLERS)


def enqueue(conn: psycopg.Connection[Any], kind: str, payload: dict[str, Any], **task: Any) -> int:
    app = App()
    app.task(kind, **task)(lambda ctx, p: None)
    return app.enqueue(conn, kind, payload)


def starts(app_dir: Path, run_id: int) -> list[str]:
    return sorted(p.name for p in app_dir.glob(f"started-{run_id}-*"))


class LeaseSampler:
    """Reads the run's committed lease while it runs: it must never be in the past, and no two
    attempts may ever have started while another process was still running one."""

    def __init__(self, conn: psycopg.Connection[Any], run_id: int) -> None:
        self.conn, self.run_id, self.samples, self.lapsed = conn, run_id, 0, []

    def sample(self, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """One sample; the run once `done` holds for it, else None."""
        row = self.conn.execute(
            "SELECT status, lease_expires_at < leasework.now() AS lapsed, attempts"
            " FROM leasework.runs WHERE id = %s",
            (self.run_id,),
        ).fetchone()
        assert row is not None
        if row[0] == "running":
            self.samples += 1
            if row[1]:
                self.lapsed.append(row[2])
        run = get_run(self.conn, self.run_id)
        return run if done(run) else None

    def until(self, done: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        result: dict[str, Any] = wait_for(lambda: self.sample(done), timeout=timeout, interval=0.1)
        return result


def ended(run: dict[str, Any]) -> bool:
    return run["status"] not in ("queued", "running")


def test_blocked_past_the_lease_in_a_sleep_or_an_open_transaction_each_runs_once(
    supervise: Any, pconn: Any, app_dir: Path
) -> None:
    """Side by side, on two children (a third one idle, free to take either run whose lease
    lapsed): a handler blocked in one sleep for two and a half leases, and one holding its
    ctx.transaction() open for ten seconds, a statement every second. Neither committed lease
    ever lapses; each run succeeds on its first attempt, started once; the transaction's effect
    is written once. (Two scenarios that only wait, run at once rather than one after the
    other.)"""
    add_handlers(app_dir)
    sup = supervise(processes=3, **SHORT_LEASE)
    sup.wait_children(3)
    sleepy = enqueue(pconn, "sleepy", {"seconds": 15}, timeout=None)
    tx_held = enqueue(pconn, "tx_held", {"seconds": 10}, timeout=None)
    samplers = [LeaseSampler(pconn, sleepy), LeaseSampler(pconn, tx_held)]
    done = wait_for(
        lambda: (runs := [s.sample(ended) for s in samplers]) and all(runs) and runs,
        timeout=60,
        interval=0.1,
    )
    slept, held = done

    # The sleep, blocked for two leases and more.
    assert slept["status"] == "succeeded", slept
    assert slept["attempts"] == 1 and slept["result"]["attempt"] == 1
    assert [h["outcome"] for h in slept["history"]] == ["succeeded"]
    assert len(starts(app_dir, sleepy)) == 1, "run twice"
    assert samplers[0].samples > 50 and samplers[0].lapsed == [], "the committed lease lapsed"

    # The open transaction.
    assert held["status"] == "succeeded" and held["attempts"] == 1, held["error"]
    assert samplers[1].lapsed == [], "the committed lease lapsed while the transaction was open"
    effects = pconn.execute(
        "SELECT attempt FROM public.supervisor_test_effects WHERE run_id = %s", (tx_held,)
    ).fetchall()
    assert effects == [(1,)]
    assert not sup.events("child_killed_by_watchdog")


def test_a_cancel_interrupts_a_handler_blocked_in_a_sleep(
    supervise: Any, pconn: Any, app_dir: Path
) -> None:
    add_handlers(app_dir)
    sup = supervise(processes=1, **SHORT_LEASE)
    sup.wait_children(1)
    run_id = enqueue(pconn, "sleepy", {"seconds": 600}, timeout=None)
    run = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "running" and r)
    pid = holder_pid(run["lease_worker"])
    App().cancel(pconn, run_id)
    done = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "cancelled" and r, 10)
    assert done["history"][-1]["outcome"] == "cancelled"
    # Interrupted, not killed: the same child goes on serving.
    assert alive(pid) and not sup.events("child_killed_by_watchdog")
    again = enqueue(pconn, "sleepy", {"seconds": 0}, timeout=None)
    served = wait_for(lambda: (r := get_run(pconn, again))["status"] == "succeeded" and r, 10)
    assert served["result"]["pid"] == pid


def test_a_cancel_kills_a_handler_stuck_in_a_c_call_holding_the_gil(
    supervise: Any, pconn: Any, app_dir: Path
) -> None:
    add_handlers(app_dir)
    sup = supervise(processes=1, **LONG_LEASE)
    sup.wait_children(1)
    run_id = enqueue(pconn, "gil", {})
    run = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "running" and r)
    wait_for(lambda: starts(app_dir, run_id))
    pid = holder_pid(run["lease_worker"])
    App().cancel(pconn, run_id)
    done = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "cancelled" and r, 20)
    assert "abort_grace" in done["error"]
    killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == pid)
    assert (killed["reason"], killed["why"], killed["run_id"]) == ("abort", "cancelled", run_id)
    wait_for(lambda: not alive(pid), timeout=5)


def test_a_busy_childs_new_run_is_known_to_its_parent_before_its_handler_sticks(
    supervise: Any, pconn: Any, app_dir: Path
) -> None:
    """A child draining quick runs writes no pipe line per run (its beats wait for the gap); the
    run it claims next and whose handler then holds the GIL for ever reaches the parent through
    the child's board all the same, so a cancel of that run still kills the child for it."""
    add_handlers(app_dir)
    sup = supervise(processes=1, **LONG_LEASE)
    sup.wait_children(1)
    app = App()
    app.task("busy_then_gil")(lambda ctx, p: None)
    with pconn.transaction():  # all queued at once: the child claims them back to back
        for _ in range(400):
            app.enqueue(pconn, "busy_then_gil", {})
        run_id = app.enqueue(pconn, "busy_then_gil", {"stick": True})
    wait_for(lambda: starts(app_dir, run_id), timeout=30)
    pid = holder_pid(get_run(pconn, run_id)["lease_worker"])
    App().cancel(pconn, run_id)
    done = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "cancelled" and r, 20)
    assert "abort_grace" in done["error"]
    killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == pid)
    assert (killed["reason"], killed["why"], killed["run_id"]) == ("abort", "cancelled", run_id)
    left = pconn.execute(
        "SELECT count(*) FROM leasework.runs WHERE kind = 'busy_then_gil' AND status <> 'succeeded'"
    ).fetchone()
    assert left is not None and left[0] == 1  # the quick ones all ran; only the stuck one did not


def test_a_timeout_kills_a_handler_stuck_in_a_c_call_holding_the_gil(
    supervise: Any, pconn: Any, app_dir: Path
) -> None:
    add_handlers(app_dir)
    sup = supervise(processes=1, **LONG_LEASE)
    sup.wait_children(1)
    run_id = enqueue(pconn, "gil_timeout", {}, timeout=2, max_attempts=1)
    done = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "failed" and r, 30)
    assert done["history"][-1]["outcome"] == "timeout" and "abort_grace" in done["error"]
    killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["run_id"] == run_id)
    assert (killed["reason"], killed["why"]) == ("abort", "timeout")


def test_a_timeout_ends_each_blocked_attempt(supervise: Any, pconn: Any, app_dir: Path) -> None:
    add_handlers(app_dir)
    sup = supervise(processes=1, **SHORT_LEASE)
    sup.wait_children(1)
    run_id = enqueue(pconn, "sleepy_timeout", {}, timeout=2, max_attempts=2)
    done = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "failed" and r, 40)
    history = done["history"]
    assert [h["outcome"] for h in history] == ["timeout", "timeout"], history
    assert len(starts(app_dir, run_id)) == 2
    assert not sup.events("child_killed_by_watchdog"), "interrupted, not killed"
