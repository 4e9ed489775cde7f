"""Pools on real processes: one supervisor with 2 children for `reports` and 2 for everything
else. While every reports child is held by a report (its handler waits on a file the test
controls), short runs keep flowing through the other pool, and reports never run elsewhere."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from tests.conftest import wait_for

from .conftest import Supervised, enqueue, holder_pid

Conn = psycopg.Connection[Any]
Start = Callable[..., Supervised]
POOLS = [
    {"name": "reports", "processes": 2, "kinds": ["reports"]},
    {"name": "rest", "processes": 2},  # every kind no other pool names
]


def _by_status(conn: Conn, kind: str) -> dict[str, int]:
    rows = conn.execute(
        "SELECT status, count(*) FROM leasework.runs WHERE kind = %s GROUP BY status", (kind,)
    ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def test_short_runs_flow_while_every_reports_child_is_busy(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(pools=POOLS)
    children = sup.wait_children(4, timeout=30)
    # The parent records each child's pool on its workers row.
    pools = wait_for(
        lambda: (
            rows
            if len(
                rows := pconn.execute(
                    "SELECT pid, pool, pool_kinds FROM leasework.workers WHERE stopped_at IS NULL"
                ).fetchall()
            )
            == 4
            else None
        ),
        timeout=30,
    )
    reports_pids = {pid for pid, pool, _ in pools if pool == "reports"}
    assert sorted((pool, kinds) for _, pool, kinds in pools) == [
        ("reports", ["reports"]),
        ("reports", ["reports"]),
        ("rest", None),
        ("rest", None),
    ]
    assert {pid for pid, _, _ in pools} == set(children)

    reports = [enqueue(pconn, "reports") for _ in range(4)]
    # Both reports children take one each; the other two reports wait for them, not for the
    # idle children of the other pool.
    wait_for(lambda: _by_status(pconn, "reports") == {"running": 2, "queued": 2}, timeout=30)
    holders = pconn.execute(
        "SELECT lease_worker FROM leasework.runs WHERE kind = 'reports' AND status = 'running'"
    ).fetchall()
    assert {holder_pid(h[0]) for h in holders} == reports_pids

    shorts = [enqueue(pconn, "short") for _ in range(20)]
    wait_for(lambda: _by_status(pconn, "short") == {"succeeded": 20}, timeout=60)
    # Every short run ran in the other pool while the reports still held both reports children.
    assert _by_status(pconn, "reports") == {"running": 2, "queued": 2}
    ran_on = pconn.execute(
        "SELECT DISTINCT (result ->> 'pid')::int FROM leasework.runs WHERE id = ANY(%s)",
        (shorts,),
    ).fetchall()
    assert {r[0] for r in ran_on}.isdisjoint(reports_pids)

    (app_dir / "release-reports").touch()
    wait_for(lambda: _by_status(pconn, "reports") == {"succeeded": 4}, timeout=60)
    ran_reports = pconn.execute(
        "SELECT DISTINCT (result ->> 'pid')::int FROM leasework.runs WHERE id = ANY(%s)",
        (reports,),
    ).fetchall()
    assert {r[0] for r in ran_reports} <= reports_pids
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(30) == 0


def test_a_reload_resizes_each_pool_and_ttin_is_ignored(
    supervise: Start, pconn: Conn, app_dir: Path
) -> None:
    sup = supervise(pools=POOLS)
    sup.wait_children(4, timeout=30)
    sup.signal(signal.SIGTTIN)  # with pools the file says how many: logged and ignored
    sup.wait_event("resize_ignored")
    sup.write_config({"pools": [{"name": "reports", "processes": 1, "kinds": ["reports"]}]})
    sup.signal(signal.SIGHUP)
    sup.wait_event("config_reloaded")
    sup.wait_children(1, timeout=30)

    def rows() -> list[tuple[Any, ...]] | None:
        got = pconn.execute(
            "SELECT pool FROM leasework.workers WHERE stopped_at IS NULL"
        ).fetchall()
        return got if got == [("reports",)] else None

    wait_for(rows, timeout=30)
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(30) == 0
