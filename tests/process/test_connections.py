"""What a host costs Postgres in connections (docs/operations.md, "Sizing"), counted in pg_stat_activity on
a real supervisor: an idle child holds one (its main connection, lent to a handler's
`ctx.transaction()` too), a child that has renewed a lease its keeper's too; the supervisor one. And the same supervisor
through a PgBouncer in transaction mode: its children detect it, run and finish every run, and
leave no LISTEN behind."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import get_run, wait_for
from tests.pgbouncer import Bouncer, pgbouncer

from .conftest import Supervised, enqueue, holder_pid

Conn = psycopg.Connection[Any]
Start = Callable[..., Supervised]


def sessions(conn: Conn) -> dict[str, int]:
    """Sessions on the test database by role (application_name): control (a child's main
    connection), keeper, pool, supervisor."""
    rows = conn.execute(
        "SELECT application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'leasework:%%'"
    ).fetchall()
    out: collections.Counter[str] = collections.Counter()
    for (name,) in rows:
        if name == "leasework:supervisor":
            out["supervisor"] += 1
        else:
            out[name.rsplit(":", 1)[-1] if name.count(":") == 2 else "pool"] += 1
    return dict(out)


def test_an_idle_child_holds_one_connection_and_one_running_a_handler_two(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(processes=3)
    sup.wait_children(3)
    # Idle: every stage has stepped, on the main connection; no keeper has had a lease to
    # renew yet (it connects for its first), no handler has asked for a pool connection.
    idle = {"control": 3, "supervisor": 1}
    last: list[dict[str, int]] = []

    def settled() -> bool:
        last[:] = [sessions(pconn)]
        return last[0] == idle

    try:
        wait_for(settled, timeout=20)
    except AssertionError:
        raise AssertionError(f"idle sessions {last[0]}, expected {idle}") from None
    # One run held in a handler: then it writes through ctx.transaction(), a pool connection.
    run_id = enqueue(pconn, "hold", {"hold": True})
    (app_dir / f"hold-{run_id}").touch()
    wait_for(lambda: get_run(pconn, run_id)["status"] == "running", timeout=20)
    # Its keeper connects for its first renewal (a third of the lease in).
    wait_for(lambda: sessions(pconn).get("keeper") == 1, timeout=60)  # generous: a busy CI
    (app_dir / f"hold-{run_id}").unlink()
    wait_for(lambda: get_run(pconn, run_id)["status"] == "succeeded", timeout=20)
    # The child that ran it added its keeper's connection; its handler's ctx.transaction() ran
    # on the main connection, lent while the handler ran: no pool connection.
    seen = sessions(pconn)
    assert seen == {"control": 3, "keeper": 1, "supervisor": 1}, seen


@pytest.fixture
def bouncer(server_dsn: str) -> Iterator[Bouncer]:
    with pgbouncer(server_dsn, pool_size=10) as b:
        yield b


def test_a_supervisor_through_pgbouncer_runs_every_run(
    app_dir: Path, dsn: str, pconn: Conn, bouncer: Bouncer
) -> None:
    sup = Supervised(app_dir, bouncer.dsn(dsn), {"processes": 2})
    try:
        kids = sup.wait_children(2, timeout=20)
        ids = [enqueue(pconn, "hold", {"hold": False}) for _ in range(30)]
        wait_for(
            lambda: pconn.execute(
                "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status = 'succeeded'",
                (ids,),
            ).fetchone()
            == (30,),
            timeout=60,
        )
        effects = pconn.execute(
            "SELECT count(*), count(DISTINCT run_id) FROM public.supervisor_test_effects"
        ).fetchone()
        assert effects == (30, 30)
        workers = {holder_pid(get_run(pconn, i)["history"][-1]["worker"]) for i in ids}
        assert workers <= set(kids)
        # The parent wrote its children's rows through the pooler too.
        wait_for(
            lambda: {
                r[0]
                for r in pconn.execute(
                    "SELECT pid FROM leasework.workers WHERE stopped_at IS NULL"
                ).fetchall()
            }
            == set(kids),
            timeout=10,
        )
        assert not [e for e in sup.events() if e.get("event") in ("stage_failed", "child_crashed")]
        listening = pconn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query ILIKE 'LISTEN %%'"
        ).fetchone()
        assert listening == (0,)
    finally:
        sup.stop()


def test_one_direct_listen_per_host_wakes_children_behind_pgbouncer(
    app_dir: Path, dsn: str, pconn: Conn, bouncer: Bouncer
) -> None:
    """With listen_dsn the parent LISTENs on one direct connection and relays each NOTIFY to its
    children: an idle child picks up a new run long before its next poll (a minute away)."""
    sup = Supervised(
        app_dir,
        bouncer.dsn(dsn),
        {"processes": 3, "listen_dsn": dsn, "poll_interval": 60.0, "hang_timeout": 150.0},
    )
    try:
        sup.wait_children(3, timeout=20)
        listeners = wait_for(lambda: _listening(pconn), timeout=20)
        assert listeners == ["leasework:supervisor:listen"]
        first = enqueue(pconn, "hold", {"hold": False})
        wait_for(lambda: get_run(pconn, first)["status"] == "succeeded", timeout=30)
        # Every child is idle now, each in a wait a minute long: only a wake-up can start it.
        second = enqueue(pconn, "hold", {"hold": False})
        wait_for(lambda: get_run(pconn, second)["status"] == "succeeded", timeout=30)
        assert _listening(pconn) == ["leasework:supervisor:listen"]
    finally:
        sup.stop()


def _listening(conn: Conn) -> list[str]:
    rows = conn.execute(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND query ILIKE 'LISTEN %%'"
    ).fetchall()
    return sorted(r[0] for r in rows)
