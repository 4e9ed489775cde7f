"""The supervisor on real processes and real Postgres: kill -9 a child or the supervisor, pause a
child past its lease, graceful TERM, a crash-looping job, TTIN/TTOU/HUP, recycling, boot errors.

Timings are short through the config file (lease 6 s); nothing sleeps out a lease: tests wait on
conditions with deadlines, or move the lease columns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.conftest import expire_lease, get_run, wait_for

from .conftest import Supervised, alive, enqueue, holder_pid

Conn = psycopg.Connection[Any]
Start = Callable[..., Supervised]


def _running(conn: Conn, run_id: int, attempt: int) -> dict[str, Any] | None:
    run = get_run(conn, run_id)
    if run["status"] == "running" and run["attempts"] == attempt and run["lease_worker"]:
        return run
    return None


def _started(conn: Conn, run_id: int) -> dict[str, Any] | None:
    """The run's first attempt, its handler past its first checkpoint."""
    run = _running(conn, run_id, 1)
    return run if run is not None and run["processed_units"] else None


def _wait_status(conn: Conn, run_id: int, status: str) -> None:
    wait_for(lambda: get_run(conn, run_id)["status"] == status)


def _effects(conn: Conn, run_id: int) -> list[tuple[int, int]]:
    rows = conn.execute(
        "SELECT attempt, pid FROM public.supervisor_test_effects WHERE run_id = %s ORDER BY attempt",
        (run_id,),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def _hold(conn: Conn, app_dir: Path) -> int:
    """Enqueue a `hold` run and its marker file in one transaction: workers wake on the commit's
    NOTIFY at once, and must not find the run before its marker exists."""
    with conn.transaction():
        run_id = enqueue(conn, "hold", {"hold": True})
        (app_dir / f"hold-{run_id}").touch()
    return run_id


def test_kill_9_of_a_child_mid_job_is_recovered_within_a_poll(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(processes=2)
    first = sup.wait_children(2)
    run_id = _hold(pconn, app_dir)
    run = wait_for(lambda: _running(pconn, run_id, 1))
    victim = holder_pid(run["lease_worker"])
    assert victim in first
    # The parent writes a workers row per child.
    rows = wait_for(
        lambda: (
            pconn.execute("SELECT pid FROM leasework.workers WHERE stopped_at IS NULL").fetchall()
            if len(pconn.execute("SELECT 1 FROM leasework.workers").fetchall()) >= 2
            else None
        )
    )
    assert {r[0] for r in rows} == set(first)

    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    again = wait_for(lambda: _running(pconn, run_id, 2), timeout=5)
    recovered = time.monotonic() - killed_at
    assert holder_pid(again["lease_worker"]) != victim
    # Reclaimed within about one poll interval (0.2 s here), not the 6 s lease.
    assert recovered < 2.0, f"recovery took {recovered:.2f} s"
    print(f"recovered {recovered:.3f} s after kill -9")

    (app_dir / f"hold-{run_id}").unlink()
    done = wait_for(
        lambda: get_run(pconn, run_id)["status"] == "succeeded" and get_run(pconn, run_id)
    )
    assert done["attempts"] == 2
    outcomes = [h["outcome"] for h in done["history"]]
    assert outcomes[0] == "crashed" and outcomes[-1] == "succeeded"
    assert _effects(pconn, run_id) == [(2, holder_pid(again["lease_worker"]))]  # exactly once

    # The parent restarted the dead child, and marked its row stopped.
    wait_for(lambda: len(sup.children()) == 2 and victim not in sup.children())
    row = wait_for(
        lambda: pconn.execute(
            "SELECT stopped_at FROM leasework.workers WHERE pid = %s AND stopped_at IS NOT NULL",
            (victim,),
        ).fetchone()
    )
    assert row is not None
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0


def test_sigstop_past_the_lease_then_sigcont_writes_nothing(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    # Watchdog and dead man's switch off: only the fence stands between the resumed child and
    # a stale write (with the switch on, a stop outlasting the lease on a busy machine kills it).
    # idle_poll_max 1 s: the lease is moved behind the idle child's back (nothing NOTIFYs that),
    # so it must not sleep until the lease it last read runs out.
    sup = supervise(processes=2, watchdog=False, deadman=False, idle_poll_max=1.0)
    sup.wait_children(2)
    run_id = _hold(pconn, app_dir)
    # Inside the handler (its first checkpoint written), not between the claim and the handler's
    # start: a child stopped there finds its lease lost when it resumes and never starts the
    # handler (claim_not_started), so no fence is ever asked (seen in CI).
    run = wait_for(lambda: _started(pconn, run_id))
    paused = holder_pid(run["lease_worker"])
    os.kill(paused, signal.SIGSTOP)
    try:
        # As if it had been paused for the whole lease: move the lease, do not wait for it.
        expire_lease(pconn, run_id)
        again = wait_for(lambda: _running(pconn, run_id, 2), timeout=5)
        assert holder_pid(again["lease_worker"]) != paused
        (app_dir / f"hold-{run_id}").unlink()  # the new holder finishes
        wait_for(lambda: get_run(pconn, run_id)["status"] == "succeeded")
    finally:
        os.kill(paused, signal.SIGCONT)
    sup.wait_event("lease_lost", lambda e: e.get("run_id") == run_id)

    def refused() -> bool:
        # The handler's marker, or the fence's own line: the resumed child's keeper, finding the
        # lease gone as it resumes, may interrupt the handler (Aborted) inside its `except
        # LeaseLost` before the marker is written (seen in CI, the log then holding the refusal).
        # The new holder never loses the run, so a refusal of this run's fence is the stale one.
        return bool(list(app_dir.glob(f"fence-refused-{run_id}-{paused}"))) or any(
            e.get("run_id") == run_id and e.get("why") == "fence matched no row"
            for e in sup.events("lease_lost")
        )

    try:
        wait_for(refused, timeout=60)
    except AssertionError:
        raise AssertionError(
            f"the resumed child's fence never refused; log:\n{sup.log_path.read_text()}"
        ) from None
    done = get_run(pconn, run_id)
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert done["result"]["attempt"] == 2
    assert [a for a, _ in _effects(pconn, run_id)] == [2]  # the stale worker's write never landed
    assert alive(paused)  # the watchdog is off: the resumed child lives on
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0


def test_watchdog_kills_a_child_that_stopped_renewing(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(processes=2)
    sup.wait_children(2)
    run_id = _hold(pconn, app_dir)
    run = wait_for(lambda: _running(pconn, run_id, 1))
    # A checkpoint means the handler called ctx.check(), whose beat told the parent which run
    # it holds; stopped before that, the child would look idle and die as hung instead.
    wait_for(lambda: get_run(pconn, run_id)["processed_units"] >= 10)
    paused = holder_pid(run["lease_worker"])
    os.kill(paused, signal.SIGSTOP)
    # lease 6 s, margin 2 s: killed ~4 s after its last renewal (QUIT, then KILL 2 s later).
    killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == paused, timeout=10)
    assert killed["reason"] == "lease"
    wait_for(lambda: not alive(paused), timeout=5)
    again = wait_for(lambda: _running(pconn, run_id, 2), timeout=5)
    assert holder_pid(again["lease_worker"]) != paused
    (app_dir / f"hold-{run_id}").unlink()
    wait_for(lambda: get_run(pconn, run_id)["status"] == "succeeded")
    assert [a for a, _ in _effects(pconn, run_id)] == [2]
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0


def test_term_is_graceful_and_releases_an_unfinished_run(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(processes=2, graceful_timeout=2.0)
    kids = sup.wait_children(2)
    run_id = _hold(pconn, app_dir)
    wait_for(lambda: _running(pconn, run_id, 1))
    t0 = time.monotonic()
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(2.0 + 6) == 0
    took = time.monotonic() - t0
    assert 1.5 < took < 2.0 + 5, f"stopped after {took:.2f} s"
    run = get_run(pconn, run_id)
    assert run["status"] == "queued" and run["attempts"] == 0  # released, attempt not charged
    assert run["history"][-1]["outcome"] == "released"
    assert not [p for p in kids if alive(p)]
    rows = pconn.execute("SELECT count(*) FROM leasework.workers WHERE stopped_at IS NULL")
    assert rows.fetchone() == (0,)


def test_status_after_a_clean_term_shows_no_gone_worker(supervise: Start, pconn: Conn) -> None:
    """A child stopped by a clean TERM leaves no row (as a standalone worker on a clean exit),
    rather than a stopped row that `status` counts as `gone` until maintenance prunes it; a
    recycled child's row goes the same way."""
    from leasework import status

    runs = [enqueue(pconn, "hold") for _ in range(3)]
    sup = supervise(processes=2, max_jobs_per_child=1, runs_limit=1)
    for run_id in runs:
        _wait_status(pconn, run_id, "succeeded")
    kids = sup.wait_children(2)
    wait_for(
        lambda: sorted(
            r[0] for r in pconn.execute("SELECT pid FROM leasework.workers").fetchall()
        )
        == sorted(kids),
        timeout=30,  # a busy machine: the children recycle and register in turn
    )  # the recycled children's rows are gone already; the live ones are written
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0
    assert pconn.execute("SELECT id, pid, stopped_at FROM leasework.workers").fetchall() == []
    snap = status.collect(pconn, heartbeat_interval=15.0)
    assert "workers: 0 alive, 0 gone" in status.render(snap), status.render(snap)


def test_kill_9_of_the_supervisor_takes_its_children_down(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(processes=2)
    kids = sup.wait_children(2)
    run_id = _hold(pconn, app_dir)
    wait_for(lambda: _running(pconn, run_id, 1))
    t0 = time.monotonic()
    sup.signal(signal.SIGKILL)
    wait_for(lambda: not [p for p in kids if alive(p)], timeout=4)
    print(f"children gone {time.monotonic() - t0:.3f} s after kill -9 of the supervisor")
    # The orphaned holder gave its run back on the way out (parent-death signal = fast stop).
    run = wait_for(lambda: get_run(pconn, run_id)["status"] == "queued" and get_run(pconn, run_id))
    assert run["attempts"] == 0

    second = supervise(processes=2)
    again = wait_for(lambda: _running(pconn, run_id, 1), timeout=10)
    assert holder_pid(again["lease_worker"]) in second.wait_children(2)
    (app_dir / f"hold-{run_id}").unlink()
    wait_for(lambda: get_run(pconn, run_id)["status"] == "succeeded")
    second.signal(signal.SIGTERM)
    assert second.wait_exit(10) == 0


def test_a_crash_looping_job_backs_off_while_other_jobs_flow(supervise: Start, pconn: Conn) -> None:
    poison = enqueue(pconn, "crash")
    others = [enqueue(pconn, "hold") for _ in range(4)]
    sup = supervise(processes=2)
    wait_for(lambda: get_run(pconn, poison)["status"] == "failed", timeout=15)
    for run_id in others:
        _wait_status(pconn, run_id, "succeeded")
    run = get_run(pconn, poison)
    assert run["attempts"] == 3
    assert [h["outcome"] for h in run["history"]].count("crashed") >= 2
    delays = [e["delay"] for e in sup.events("restart_delayed")]
    assert len(delays) >= 3
    assert all(0 < d <= 1.0 for d in delays)  # restart_backoff_max
    sup.wait_children(2)  # the supervisor kept its children
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0


def test_ttin_ttou_and_hup(supervise: Start, pconn: Conn) -> None:
    sup = supervise(processes=1)
    (first,) = sup.wait_children(1)
    sup.signal(signal.SIGTTIN)
    two = sup.wait_children(2)
    assert first in two
    sup.signal(signal.SIGTTOU)
    sup.wait_children(1)
    sup.wait_event("processes_changed", lambda e: e["why"] == "SIGTTOU")

    # HUP: reload the file (3 processes now) and replace the old children one at a time.
    before = set(sup.children())
    sup.write_config({"processes": 3, "max_jobs_per_child": 5})
    sup.signal(signal.SIGHUP)
    sup.wait_event("config_reloaded")
    after = wait_for(lambda: (k := sup.children()) and len(k) == 3 and not (set(k) & before) and k)
    assert len(after) == 3
    # A broken file is refused and the running config kept.
    sup.config_path.write_text("processes = 'many'\n")
    sup.signal(signal.SIGHUP)
    sup.wait_event("reload_failed")
    assert len(sup.wait_children(3)) == 3
    sup.signal(signal.SIGINT)
    assert sup.wait_exit(10) == 0


def test_a_reload_to_a_database_the_children_could_not_boot_on_is_refused(
    supervise: Start, pconn: Conn, dsn: str
) -> None:
    sup = supervise(dsn_flag=False, processes=1)
    (first,) = sup.wait_children(1)
    params = conninfo_to_dict(dsn)
    params["dbname"] = f"leasework_no_such_db_{os.getpid()}"
    sup.write_config({"processes": 2, "dsn": make_conninfo(**params)})

    sup.signal(signal.SIGHUP)

    refused = sup.wait_event("reload_failed")
    assert "does not exist" in refused["error"]
    assert not sup.events("config_reloaded")
    assert sup.children() == [first]  # the running config and its child kept
    run_id = enqueue(pconn, "hold")
    _wait_status(pconn, run_id, "succeeded")

    # The same file with the right database is taken.
    sup.write_config({"processes": 2, "dsn": dsn})
    sup.signal(signal.SIGHUP)
    sup.wait_event("config_reloaded")
    assert len(sup.wait_children(2)) == 2
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0


def test_max_jobs_per_child_recycles_children(supervise: Start, pconn: Conn) -> None:
    runs = [enqueue(pconn, "hold") for _ in range(6)]
    sup = supervise(processes=1, max_jobs_per_child=2, runs_limit=1)
    for run_id in runs:
        _wait_status(pconn, run_id, "succeeded")
    recycled = sup.events("child_recycled")
    assert len(recycled) >= 2
    assert not sup.events("restart_delayed")  # a recycle is not a crash
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0


def _run_cli(tmp: Path, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "leasework", "supervise", *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_boot_errors_exit_2_with_one_line(app_dir: Path, server_dsn: str, dsn: str) -> None:
    bad_config = app_dir / "bad.toml"
    bad_config.write_text("processes = 0\n")
    cases = [
        ("--app", "lwtestapp:app", "--dsn", dsn, "--config", str(bad_config)),
        ("--app", "no_such_module:app", "--dsn", dsn),
    ]
    # A database without the leasework schema.
    name = f"leasework_empty_{os.getpid()}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = name
    cases.append(("--app", "lwtestapp:app", "--dsn", make_conninfo("", **params)))
    try:
        for args in cases:
            out = _run_cli(app_dir, *args)
            assert out.returncode == 2, (args, out.stderr)
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("leasework: "), out.stderr
        assert "migrate" in lines[0]
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))


def test_an_unreachable_database_at_boot_is_retried(app_dir: Path) -> None:
    (app_dir / "down.toml").write_text("restart_backoff = 0.1\nrestart_backoff_max = 0.5\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = app_dir / "down.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "leasework",
                "supervise",
                "--app",
                "lwtestapp:app",
                "--config",
                "down.toml",
                "--dsn",
                "postgresql://postgres@127.0.0.1:1/postgres",
            ],
            cwd=app_dir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: log.read_text().count('"db_unavailable"') >= 2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_busy_childs_runs_do_not_each_write_its_workers_row(
    supervise: Start, pconn: Conn
) -> None:
    """A host finishing many runs a second writes its workers rows a few times a second, not once
    per run (the row shows the current run for `status`; the watchdog reads the beats): the
    writes to leasework.workers while 400 short runs drain are bounded by the drain's seconds,
    not by its runs."""
    pconn.execute("CREATE TABLE public.workers_writes (at timestamptz DEFAULT clock_timestamp())")
    pconn.execute(
        "CREATE FUNCTION public.count_workers_write() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN INSERT INTO public.workers_writes DEFAULT VALUES; RETURN NULL; END $$"
    )
    pconn.execute(
        "CREATE TRIGGER count_writes AFTER INSERT OR UPDATE ON leasework.workers"
        " FOR EACH ROW EXECUTE FUNCTION public.count_workers_write()"
    )
    try:
        sup = supervise(processes=1, heartbeat_interval=60.0)
        sup.wait_children(1)
        runs = 400
        with pconn.transaction():
            ids = [enqueue(pconn, "short") for _ in range(runs)]

        def drained() -> float | None:
            row = pconn.execute(
                "SELECT extract(epoch FROM max(finished_at) - min(started_at))"
                "  FROM leasework.runs WHERE id = ANY(%s) HAVING bool_and(status = 'succeeded')",
                (ids,),
            ).fetchone()
            return None if row is None else float(row[0])

        seconds = wait_for(drained, timeout=120)
        row = pconn.execute(
            "SELECT count(*) FROM public.workers_writes"
            " WHERE at BETWEEN (SELECT min(started_at) FROM leasework.runs WHERE id = ANY(%s))"
            "              AND (SELECT max(finished_at) FROM leasework.runs WHERE id = ANY(%s))",
            (ids, ids),
        ).fetchone()
        assert row is not None
        writes = int(row[0])
    finally:
        pconn.execute("DROP TRIGGER count_writes ON leasework.workers")
        pconn.execute("DROP FUNCTION public.count_workers_write()")
        pconn.execute("DROP TABLE public.workers_writes")
    # At most one write a second (supervisor.parent.ROWS_CHANGE_GAP) for the changed runs, and
    # slack for the edges; one per run would be 400.
    assert writes <= seconds + 3, (writes, seconds)
    print(f"{runs} runs in {seconds:.2f} s: {writes} workers-row writes")


def test_the_workers_row_follows_a_childs_run_from_claim_to_finish(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    """The supervisor writes a child's workers row when its current run changes, not only on the
    heartbeat: with a 60 s heartbeat (so a periodic write cannot explain either change within
    these deadlines) the row shows the run while its handler is still blocked, and clears once
    it finished, the child alive and idle."""
    sup = supervise(processes=1, heartbeat_interval=60.0)
    (child,) = sup.wait_children(1)

    def current_run() -> tuple[int | None] | None:
        row = pconn.execute(
            "SELECT current_run FROM leasework.workers WHERE pid = %s AND stopped_at IS NULL",
            (child,),
        ).fetchone()
        return None if row is None else (row[0],)

    assert wait_for(current_run, timeout=30) == (None,)  # booted, idle
    run_id = _hold(pconn, app_dir)
    claimed_at = time.monotonic()
    wait_for(lambda: current_run() == (run_id,), timeout=30)
    shown = time.monotonic() - claimed_at
    # still running: the handler waits for its marker, which only this test removes
    run = get_run(pconn, run_id)
    assert run["status"] == "running" and holder_pid(run["lease_worker"]) == child
    assert (app_dir / f"hold-{run_id}").exists()

    (app_dir / f"hold-{run_id}").unlink()
    _wait_status(pconn, run_id, "succeeded")
    finished_at = time.monotonic()
    wait_for(lambda: current_run() == (None,), timeout=30)
    cleared = time.monotonic() - finished_at
    assert sup.children() == [child]  # cleared by the finish, not by the child going away
    print(f"workers row: run shown {shown:.2f} s after enqueue, cleared {cleared:.2f} s after finish")


def test_a_capped_kinds_place_frees_at_once_when_its_child_is_killed(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    # max_running=1 set at run time on `hold`: two runs queued, one runs. Its child killed, the
    # supervisor's fast release ends the dead child's lease (not the 6 s lease), so the place is
    # free within a poll and the other child takes a run of the kind; never two at once.
    from leasework import operations

    operations.set_limits(pconn, "hold", known=["hold"], max_running=1)
    sup = supervise(processes=2)
    sup.wait_children(2)
    first, second = _hold(pconn, app_dir), _hold(pconn, app_dir)
    run = wait_for(lambda: _running(pconn, first, 1))
    victim = holder_pid(run["lease_worker"])
    live = (
        "SELECT count(*) FROM leasework.runs WHERE kind = 'hold' AND status = 'running'"
        " AND lease_expires_at >= leasework.now()"
    )
    assert [h["reason"] for h in operations.held_back(pconn, second)] == ["capped"]
    assert pconn.execute(live).fetchone() == (1,)

    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    def taken() -> dict[str, Any] | None:
        assert pconn.execute(live).fetchone()[0] <= 1, "two runs of a kind capped at 1"  # type: ignore[index]
        rows = pconn.execute(
            "SELECT id, attempts, lease_worker FROM leasework.runs WHERE kind = 'hold'"
            " AND status = 'running' AND lease_expires_at >= leasework.now()"
        ).fetchall()
        mine = [r for r in rows if holder_pid(r[2]) != victim]
        return {"id": mine[0][0], "attempts": mine[0][1]} if mine else None

    again = wait_for(taken, timeout=5)
    recovered = time.monotonic() - killed_at
    assert recovered < 2.0, f"the place freed after {recovered:.2f} s"
    assert again == {"id": first, "attempts": 2}  # the reclaim comes first (older), alone
    assert get_run(pconn, second)["status"] == "queued"
    for run_id in (first, second):
        (app_dir / f"hold-{run_id}").unlink()
    wait_for(lambda: get_run(pconn, second)["status"] == "succeeded", timeout=15)
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0
