"""The fault scenarios, one fault at a time, on a real supervisor with three children and a
private Postgres: each injects its fault while runs of several fenced steps are in flight, then
checks every invariant over the recorded history (harness.ChaosRun.check) and prints one summary
line. Each takes the `chaos` fixture (or a partial of it: another app, a pooler); the tests that
call them are tests/process/test_faults.py (the fast ones, in `make test`) and, in `make chaos`,
tests/chaos/test_sync_faults.py, test_async_faults.py and test_pooler_faults.py."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from tests.conftest import wait_for

from .chaosapp import app as chaos_app
from .harness import ChaosRun, worker_pid

Chaos = Callable[..., ChaosRun]

# Where kill_9_at_a_critical_point kills the child (chaosapp's `die`).
POINTS = ["after_claim", "before_checkpoint", "after_step"]


def _progress(run: ChaosRun, effects: int) -> None:
    """Wait until at least `effects` effects have committed (work is in flight)."""
    wait_for(
        lambda: run.query("SELECT count(*) FROM public.chaos_effects")[0][0] >= effects,
        timeout=30,
        interval=0.05,
    )


def fault_free_control_run_executes_each_run_exactly_once(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    run.enqueue(24, steps=3)
    run.finish(control=True)


def kill_9_of_random_children_at_random_moments(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    run.enqueue(30, steps=4)
    for _ in range(5):
        time.sleep(run.rand.uniform(0.0, 0.6))  # a random moment, not a wait for a condition
        # Work left for the kill to land on: the async app's children, four runs each at once,
        # could drain the thirty before the fifth kill, which then found no child busy.
        (left,) = run.query(
            "SELECT count(*) FROM leasework.runs WHERE status IN ('queued', 'running')"
        )[0]
        if left < 8:
            run.enqueue(10, steps=4)
        run.kill_child()
    run.finish()


def kill_9_at_a_critical_point(chaos: Chaos, point: str) -> None:
    run = chaos()
    run.start()
    victims = run.enqueue(3, steps=3, die=point)
    run.enqueue(6, steps=3)
    run.finish()
    rows = run.query(
        "SELECT id, status, attempts FROM leasework.runs WHERE id = ANY(%s)", (victims,)
    )
    assert all(r[1] == "succeeded" and r[2] >= 2 for r in rows), rows


def kill_9_right_after_the_finish_commits(chaos: Chaos) -> None:
    """The supervisor's fast release of the dead child's leases must not touch a finished run."""
    run = chaos()
    sup = run.start()
    ids = run.enqueue(12, steps=2)
    killed = 0
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    while killed < 3 and time.monotonic() < deadline:
        rows = run.query(
            "SELECT t.run_id, r.lease_worker FROM public.chaos_transitions t"
            " JOIN leasework.runs r ON r.id = t.run_id"
            " WHERE t.new_status = 'succeeded' AND t.run_id <> ALL(%s)",
            (list(seen),),
        )
        for run_id, worker in rows:
            seen.add(run_id)
            pid = worker_pid(worker)
            if pid in sup.children():
                run.kill_child(pid)
                killed += 1
        time.sleep(0.02)  # polling interval of this loop
    assert killed, "no finish observed"
    run.finish()
    assert run.query(
        "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status = 'succeeded'", (ids,)
    ) == [(len(ids),)]


def sigstop_past_the_lease_then_sigcont(chaos: Chaos) -> None:
    """Watchdog and dead man's switch off, so the paused child really wakes up after its run was
    taken: everything it then tries is refused (renewal, fence, finish), and it commits
    nothing."""
    run = chaos(watchdog=False, hang_timeout=0, deadman=False)
    run.start()
    run.enqueue(12, steps=6, sleep=(0.2, 0.3))
    _progress(run, 3)
    fault = run.sigstop_child(1.5 * run.cfg["lease"])
    run.finish()
    # The paused owner's run was taken over by another owner.
    owners = run.query(
        "SELECT DISTINCT new_owner FROM public.chaos_transitions"
        " WHERE run_id = %s AND new_status = 'running'",
        (fault.run_id,),
    )
    assert len(owners) >= 2, owners


def blackholed_child_is_stopped_before_its_lease_expires(chaos: Chaos) -> None:
    """A partition: renewals hang instead of failing. The supervisor's watchdog must stop the
    job (QUIT trips its abort signal) before the lease expires in database time."""
    run = chaos()
    sup = run.start()
    run.enqueue(12, steps=6, sleep=(0.2, 0.3))
    _progress(run, 3)
    fault, pid = run.blackhole_child(2 * run.cfg["lease"])
    killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == pid, timeout=5)
    # The lease as the database last extended it for that owner.
    expiry = run.query(
        "SELECT extract(epoch FROM max(new_expires)) FROM public.chaos_transitions"
        " WHERE run_id = %s AND new_owner = %s::uuid",
        (fault.run_id, fault.owner),
    )[0][0]
    assert killed["ts"] < float(expiry), (killed, expiry)
    print(f"watchdog stopped the job {float(expiry) - killed['ts']:.2f} s before its lease expired")
    run.finish()


def a_partition_inside_a_fenced_transaction_does_not_hold_the_run(chaos: Chaos) -> None:
    """The partitioned child had a fenced transaction open: its server session keeps the run's
    row lock until the server notices, and a reclaim skips locked rows. The run must still move
    to another worker within the lease (plus the watchdog), not when the partition heals: the
    fence's idle_in_transaction_session_timeout ends the session."""
    run = chaos()
    sup = run.start()
    run.enqueue(9, steps=4, sleep=(0.05, 0.1))
    long_tx = run.enqueue(3, steps=4, sleep=(0.05, 0.1), tx_sleep=1.0)
    fault, pid = run.partition_child(in_transaction=long_tx)
    lease = float(run.cfg["lease"])
    try:
        # The link went down inside the step's transaction: the session sits idle in it, with
        # the run's row locked, and nothing more of the child's reaches the server.
        state = run.session_state(fault)
        assert state == "idle in transaction", (
            f"run {fault.run_id}'s session is {state!r} once the partition started"
        )
        moved = wait_for(
            lambda: run.query(
                "SELECT extract(epoch FROM min(at)) FROM public.chaos_transitions"
                " WHERE run_id = %s AND new_status = 'running'"
                " AND new_owner IS DISTINCT FROM %s::uuid AND at > to_timestamp(%s)",
                (fault.run_id, fault.owner, fault.at),
            )[0][0],
            timeout=4 * lease,
        )
        took = float(moved) - fault.at
        print(f"run {fault.run_id} moved {took:.2f} s into the partition")
        assert took < 2 * lease, f"run {fault.run_id} held {took:.2f} s by a partitioned child"
        sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == pid, timeout=1)
    finally:
        run.heal_child(fault, pid)
    run.finish()


def pg_terminate_backend_of_worker_sessions(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    run.enqueue(30, steps=4)
    _progress(run, 2)
    for which in ["control", "pool", "any", "control", "pool", "any", "control", "any"]:
        time.sleep(run.rand.uniform(0.1, 0.5))  # a random moment
        run.terminate_backend(which)
    run.finish()


def postgres_crash_and_restart_mid_run(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    run.enqueue(40, steps=4)
    for i in range(3):
        _progress(run, 10 * (i + 1))
        run.crash_postgres()
    run.finish()


def postgres_paused_past_the_lease(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    run.enqueue(20, steps=4)
    _progress(run, 5)
    run.pause_postgres(1.5 * run.cfg["lease"])
    run.finish()


def supervisor_sigterm_and_kill_9_mid_job(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    run.enqueue(30, steps=5, sleep=(0.2, 0.4))
    _progress(run, 5)
    run.supervisor_signal(signal.SIGTERM)
    run.start()
    _progress(run, 15)
    run.supervisor_signal(signal.SIGKILL)
    run.start()
    run.finish()


def poison_job_ends_failed_while_others_flow(chaos: Chaos) -> None:
    run = chaos()
    run.start()
    (poison,) = run.enqueue(1, kind="poison")
    run.enqueue(12, steps=3)
    run.finish()
    status, attempts, max_attempts = run.query(
        "SELECT status, attempts, max_attempts FROM leasework.runs WHERE id = %s", (poison,)
    )[0]
    assert (status, attempts) == ("failed", max_attempts)
    assert run.query("SELECT count(*) FROM public.chaos_exec WHERE run_id = %s", (poison,)) == [
        (max_attempts,)
    ]


def cancels_race_reclaims_and_retries(chaos: Chaos) -> None:
    """Cancels land on queued runs, running runs, runs whose holder was just killed (lease being
    reclaimed) and runs waiting out a retry backoff: none of them ever starts again."""
    run = chaos()
    run.start()
    run.enqueue(30, steps=4, sleep=(0.1, 0.3))
    _progress(run, 2)
    for _ in range(4):
        fault = run.kill_child()
        run.cancel(fault.run_id)  # racing the reclaim of the killed holder's run
        run.cancel()  # a random live run
        time.sleep(run.rand.uniform(0.05, 0.3))  # a random moment
    run.finish()
    cancelled = run.query("SELECT count(*) FROM leasework.runs WHERE status = 'cancelled'")
    assert cancelled[0][0] >= 1


# -- workflows (docs/workflows.md) ----------------------------------------------------------


def _enqueue_workflow(run: ChaosRun) -> tuple[list[int], int]:
    """A graph of chaos runs in one transaction: four roots, three children after each, a join
    after every child; and a batch of six members with a callback. Returns (every dependent run,
    the batch's callback)."""
    from .chaosapp import app as chaos_app

    def payload() -> dict[str, object]:
        return {"steps": 2, "sleep": round(run.rand.uniform(0.05, 0.2), 3)}

    with run.connect() as conn:
        wf = chaos_app.workflow()
        children = []
        for r in range(4):
            root = wf.add("steps", payload(), name=f"root{r}")
            children.append(wf.group([("steps", payload()) for _ in range(3)], after=root))
        wf.add("steps", {"steps": 1}, name="join", after=children)
        ids = wf.enqueue(conn)
        batch = chaos_app.batch("steps", {"steps": 1})
        members = [batch.add(conn, "steps", payload()) for _ in range(6)]
        callback = batch.close(conn)
    run.enqueued.extend([*ids.values(), *members, callback])
    dependent = [i for name, i in ids.items() if not name.startswith("root")]
    return [*dependent, callback], callback


def _check_workflow(run: ChaosRun, dependent: list[int], callback: int) -> None:
    """Each dependent run left `blocked` exactly once, never started before every parent's end
    was recorded, and ended succeeded (nothing failed for good); the callback too."""
    q = run.query
    left = dict(
        q(
            "SELECT run_id, count(*) FROM public.chaos_transitions"
            " WHERE old_status = 'blocked' AND new_status <> 'blocked' AND run_id = ANY(%s)"
            " GROUP BY 1",
            (dependent,),
        )
    )
    assert all(left.get(i) == 1 for i in dependent), {i: left.get(i) for i in dependent}
    early = q(
        "SELECT d.child, d.parent FROM leasework.run_deps d"
        " WHERE d.child = ANY(%s) AND"
        " (SELECT min(seq) FROM public.chaos_transitions t"
        "   WHERE t.run_id = d.child AND t.new_status = 'running')"
        " < (SELECT min(seq) FROM public.chaos_transitions t"
        "   WHERE t.run_id = d.parent AND t.new_status = ANY(%s))",
        (dependent, ["succeeded", "partial", "failed", "cancelled"]),
    )
    assert not early, f"started before a parent ended: {early}"
    statuses = dict(q("SELECT id, status FROM leasework.runs WHERE id = ANY(%s)", (dependent,)))
    assert set(statuses.values()) == {"succeeded"}, statuses
    assert q(
        "SELECT count(*) FROM public.chaos_transitions WHERE run_id = %s AND new_status = 'queued'",
        (callback,),
    ) == [(1,)]


def kill_9_during_a_workflow(chaos: Chaos, kills: int = 4) -> None:
    """kill -9 of busy children at random moments while a graph and a batch run (a kill may land
    right after a parent's seal, or inside the deps stage's step): no dependent run starts
    twice from `blocked` or before its parents ended, no callback fires twice or is lost."""
    run = chaos()
    run.start()
    dependent, callback = _enqueue_workflow(run)
    for _ in range(kills):
        time.sleep(run.rand.uniform(0.0, 0.8))  # a random moment, not a wait for a condition
        run.ensure_work()  # the graph may have drained: work for the kill to land on
        run.kill_child()
    run.finish()
    _check_workflow(run, dependent, callback)


def sigstop_during_a_batch_join(chaos: Chaos) -> None:
    """A child stopped (SIGSTOP, past the lease) while the batch's members end and join: its run
    is taken over, the deps stage's rows it held are decided by another child, the callback
    fires once."""
    run = chaos()
    run.start()
    dependent, callback = _enqueue_workflow(run)
    _progress(run, 4)
    run.sigstop_child(1.5 * run.cfg["lease"])
    run.finish()
    _check_workflow(run, dependent, callback)


def kill_9_right_after_a_parents_seal(chaos: Chaos, kills: int = 3) -> None:
    """The worker that just sealed a run something waits for is killed (kill -9) as soon as the
    seal is seen committed, before or while any deps step decides its children: the end it
    recorded is decided by another worker, once."""
    run = chaos()
    sup = run.start()
    dependent, callback = _enqueue_workflow(run)
    parents = [
        r[0]
        for r in run.query(
            "SELECT DISTINCT parent FROM leasework.run_deps WHERE child = ANY(%s)", (dependent,)
        )
    ]
    killed = 0
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    while killed < kills and time.monotonic() < deadline:
        rows = run.query(
            "SELECT t.run_id, r.lease_worker FROM public.chaos_transitions t"
            " JOIN leasework.runs r ON r.id = t.run_id"
            " WHERE t.new_status = 'succeeded' AND t.run_id = ANY(%s) AND t.run_id <> ALL(%s)",
            (parents, list(seen)),
        )
        for run_id, worker in rows:
            seen.add(run_id)
            pid = worker_pid(worker)
            if killed < kills and pid in sup.children():
                run.kill_child(pid)
                killed += 1
        time.sleep(0.02)  # polling interval of this loop
    assert killed, "no parent's seal observed"
    run.finish()
    _check_workflow(run, dependent, callback)


# -- durable steps (ctx.step): chaosapp's `durable` -----------------------------------------------


def _enqueue_durable(run: ChaosRun, n: int, steps: int, sleep: tuple[float, float]) -> list[int]:
    with run.connect() as conn:
        ids = [
            chaos_app.enqueue(
                conn, "durable", {"durable": steps, "sleep": round(run.rand.uniform(*sleep), 3)}
            )
            for _ in range(n)
        ]
    run.enqueued.extend(ids)
    return ids


def durable_step_violations(run: ChaosRun, ids: list[int]) -> list[str]:
    """Every step's value stored once, by the attempt whose call returned it, never called again
    by a later attempt; a succeeded run returned exactly the stored values; the effect of a step
    inside a fenced transaction committed once, and only with the step's record."""
    q = run.query
    v: list[str] = []
    v += [
        f"run {r[0]} step {r[1]}: stored {r[2]!r} is no call of the attempt that stored it"
        for r in q(
            "SELECT s.run_id, s.name, s.value #>> '{}' FROM leasework.run_steps s"
            " WHERE s.run_id = ANY(%s) AND NOT EXISTS (SELECT 1 FROM public.chaos_step_calls c"
            "  WHERE c.run_id = s.run_id AND c.name = s.name AND c.token = s.value #>> '{}'"
            "    AND c.attempt = s.attempt)",
            (ids,),
        )
    ]
    v += [
        f"run {r[0]} step {r[1]} called again by attempt {r[2]} after attempt {r[3]} stored it"
        for r in q(
            "SELECT c.run_id, c.name, c.attempt, s.attempt FROM public.chaos_step_calls c"
            " JOIN leasework.run_steps s ON s.run_id = c.run_id AND s.name = c.name"
            " WHERE c.run_id = ANY(%s) AND c.attempt > s.attempt",
            (ids,),
        )
    ]
    v += [
        f"succeeded run {r[0]} returned {r[1]} but stored {r[2]}"
        for r in q(
            "SELECT r.id, r.result -> 'values',"
            " (SELECT jsonb_agg(s.value ORDER BY substr(s.name, 2)::int)"
            "    FROM leasework.run_steps s WHERE s.run_id = r.id)"
            " FROM leasework.runs r WHERE r.id = ANY(%s) AND r.status = 'succeeded'",
            (ids,),
        )
        if r[1] != r[2] or len(r[1]) != 6
    ]
    v += [
        f"run {r[0]} step {r[1]}: {r[2]} effects with {'a' if r[3] else 'no'} stored record"
        for r in q(
            "SELECT s.run_id, s.i, (SELECT count(*) FROM public.chaos_effects e"
            "        WHERE e.run_id = s.run_id AND e.step = s.i),"
            "       EXISTS (SELECT 1 FROM leasework.run_steps t"
            "        WHERE t.run_id = s.run_id AND t.name = 's' || s.i)"
            "  FROM (SELECT id AS run_id, i FROM leasework.runs, generate_series(1, 5, 2) AS i"
            "         WHERE id = ANY(%s)) s",
            (ids,),
        )
        if r[2] != (1 if r[3] else 0)
    ]
    v += [
        f"run {r[0]}: a step was written twice ({r[1]})"
        for r in q(
            "SELECT id, error FROM leasework.runs WHERE id = ANY(%s)"
            " AND (history::text LIKE '%%run_steps_pkey%%' OR error LIKE '%%run_steps_pkey%%')",
            (ids,),
        )
    ]
    return v


def _steps_stored(run: ChaosRun, n: int) -> None:
    wait_for(
        lambda: run.query("SELECT count(*) FROM leasework.run_steps")[0][0] >= n,
        timeout=30,
        interval=0.05,
    )


def kill_9_during_durable_steps(chaos: Chaos) -> None:
    """kill -9 of busy children while their runs are inside a step's call or storing it."""
    run = chaos()
    run.start()
    ids = _enqueue_durable(run, 12, 6, (0.15, 0.3))
    _steps_stored(run, 4)
    for _ in range(3):
        time.sleep(run.rand.uniform(0.0, 0.5))  # a random moment, not a wait for a condition
        run.kill_child()
    run.quiesce()
    violations = durable_step_violations(run, ids)
    run.finish()
    assert not violations, "\n".join(violations[:30])
    _all_durable_steps_stored(run, ids)


def sigstop_past_the_lease_during_durable_steps(chaos: Chaos) -> None:
    """kill -9, then a child paused past its lease in a step (watchdog and dead man's switch off,
    so it wakes up after its run was taken and tries to store its step: refused)."""
    run = chaos(watchdog=False, hang_timeout=0, deadman=False)
    run.start()
    ids = _enqueue_durable(run, 12, 6, (0.2, 0.35))
    _steps_stored(run, 4)
    for _ in range(2):
        time.sleep(run.rand.uniform(0.0, 0.5))
        run.kill_child()
    fault = run.sigstop_child(1.5 * run.cfg["lease"])
    run.quiesce()
    violations = durable_step_violations(run, ids)
    run.finish()
    assert not violations, "\n".join(violations[:30])
    _all_durable_steps_stored(run, ids)
    owners = run.query(
        "SELECT DISTINCT new_owner FROM public.chaos_transitions"
        " WHERE run_id = %s AND new_status = 'running'",
        (fault.run_id,),
    )
    assert len(owners) >= 2, owners


def _all_durable_steps_stored(run: ChaosRun, ids: list[int]) -> None:
    rows = run.query(
        "SELECT r.status, count(s.*) FROM leasework.runs r"
        " LEFT JOIN leasework.run_steps s ON s.run_id = r.id WHERE r.id = ANY(%s) GROUP BY r.id",
        (ids,),
    )
    assert {(r[0], r[1]) for r in rows} == {("succeeded", 6)}, rows
