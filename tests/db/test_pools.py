"""Pools (config `pools`): a worker of a pool claims only its pool's kinds on every claim path
(the claim on its own, the claim riding on a success's seal, a batch's claim, a reclaim of an
expired lease), the pool without kinds takes every kind no other pool names, and the workers
row, `status` and the dashboard show the pool."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from leasework import App, Context, status
from leasework.config import Config, Pool
from leasework.leases import lease
from leasework.workers.worker import Worker

from ..conftest import expire_lease, fast_config, get_run
from .dashboard_helpers import request, running_dashboard

Conn = psycopg.Connection[Any]
POOLS = (Pool("reports", 1, ("reports",)), Pool("rest", 2, None))


def make_app() -> App:
    app = App()

    @app.task("reports")
    def reports(ctx: Context, payload: Any) -> dict[str, Any]:
        return {"ran": "reports"}

    @app.task("short")
    def short(ctx: Context, payload: Any) -> dict[str, Any]:
        return {"ran": "short"}

    @app.task("tiny", batch=5)
    def tiny(ctx: Context, payload: Any) -> dict[str, Any]:
        return {"ran": "tiny"}

    return app


@pytest.fixture
def pooled(dsn: str) -> Iterator[Any]:
    made: list[Worker] = []

    def factory(pool: str | None, **overrides: Any) -> Worker:
        cfg = fast_config(dsn, pools=POOLS, **overrides)
        worker = Worker(make_app().with_config(cfg), cfg, keeper_thread=False, pool=pool)
        worker.open()
        worker.running = True
        made.append(worker)
        return worker

    yield factory
    for w in made:
        w.close()


def statuses(conn: Conn) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for kind, st in conn.execute("SELECT kind, status FROM leasework.runs ORDER BY id").fetchall():
        out.setdefault(kind, []).append(st)
    return out


def enqueue_mix(conn: Conn) -> None:
    """Short runs interleaved with reports, all due, in id order: a claim that ignored the pool
    would take a short run first."""
    app = make_app()
    for i in range(3):
        app.enqueue(conn, "short", {"i": i})
        app.enqueue(conn, "reports", {"i": i})
        app.enqueue(conn, "tiny", {"i": i})


def test_a_reports_worker_runs_only_reports_through_finish_and_claim(
    conn: Conn, pooled: Any
) -> None:
    enqueue_mix(conn)
    # runs_limit 10: after the first report succeeds, the next claim rides on its seal
    # (finish_and_claim), and must stay within the pool's kinds too.
    worker = pooled("reports", runs_limit=10)
    assert worker.poll() == 3
    assert statuses(conn) == {
        "short": ["queued"] * 3,
        "reports": ["succeeded"] * 3,
        "tiny": ["queued"] * 3,
    }


def test_the_rest_pool_runs_every_kind_but_reports_batches_included(
    conn: Conn, pooled: Any
) -> None:
    enqueue_mix(conn)
    worker = pooled("rest", runs_limit=10)
    while worker.poll():
        pass
    assert statuses(conn) == {
        "short": ["succeeded"] * 3,
        "reports": ["queued"] * 3,
        "tiny": ["succeeded"] * 3,
    }


def test_a_batch_claim_stays_within_the_pool(conn: Conn, dsn: str, pooled: Any) -> None:
    """A pool naming the batch kind only: its batch claim takes the batch kind's runs and
    nothing else, however the others are ordered."""
    cfg_pools = (Pool("tiny", 1, ("tiny",)), Pool("rest", 1, None))
    cfg = fast_config(dsn, pools=cfg_pools, runs_limit=1)
    worker = Worker(make_app().with_config(cfg), cfg, keeper_thread=False, pool="tiny")
    with worker:
        worker.running = True
        enqueue_mix(conn)
        assert worker.poll() == 3  # one claim, one batch of the three tiny runs
    assert statuses(conn)["tiny"] == ["succeeded"] * 3
    assert statuses(conn)["short"] == ["queued"] * 3


def test_an_expired_lease_is_reclaimed_only_by_its_pool(conn: Conn, pooled: Any) -> None:
    make_app().enqueue(conn, "reports", {})
    (held,) = lease.claim_runs(conn, ["reports"], worker="gone", lease=30.0)
    expire_lease(conn, held.id)
    rest = pooled("rest")
    rest.poll()
    assert get_run(conn, held.id)["lease_owner"] == held.owner  # not the rest pool's to take
    reports = pooled("reports")
    assert reports.poll() == 1
    assert get_run(conn, held.id)["status"] == "succeeded"


def test_notify_wakes_only_a_pool_that_claims_the_kind(dsn: str) -> None:
    cfg = fast_config(dsn, pools=POOLS)
    app = make_app().with_config(cfg)
    reports = Worker(app, cfg, keeper_thread=False, pool="reports")
    rest = Worker(app, cfg, keeper_thread=False, pool="rest")
    assert reports.stage_for("reports") == "runs" and reports.stage_for("short") is None
    assert rest.stage_for("short") == "runs" and rest.stage_for("reports") is None
    # leasework's own wake-ups (a parent ended: docs/workflows.md) wake every pool's workers
    assert reports.stage_for("leasework:deps") == rest.stage_for("leasework:deps") == "deps"


def test_an_unknown_pool_is_refused(dsn: str) -> None:
    cfg = fast_config(dsn, pools=POOLS)
    with pytest.raises(Exception, match="unknown pool 'reprots'; pools: reports, rest"):
        Worker(make_app().with_config(cfg), cfg, pool="reprots")


def test_rows_status_and_dashboard_show_the_pools(conn: Conn, dsn: str, pooled: Any) -> None:
    make_app().enqueue(conn, "reports", {})
    pooled("reports").heartbeat(force=True)
    pooled("rest").heartbeat(force=True)
    pooled("rest").heartbeat(force=True)
    rows = conn.execute(
        "SELECT pool, pool_kinds FROM leasework.workers ORDER BY pool, id"
    ).fetchall()
    assert rows == [("reports", ["reports"]), ("rest", None), ("rest", None)]

    snap = status.collect(conn)
    assert [(p["pool"], p["kinds"], p["workers"], p["busy"]) for p in snap["pools"]] == [
        ("reports", ["reports"], 1, 0),
        ("rest", None, 2, 0),
    ]
    text = status.render(snap)
    assert "pool reports" in text and "claims reports" in text
    assert "pool rest" in text and "claims every other kind" in text

    with running_dashboard(fast_config(dsn)) as dash:
        page = request(dash.url).text
    assert 'id="pools"' in page and "every other kind" in page
    assert "<td>reports</td>" in page


def test_unserved_counts_only_workers_whose_pool_claims_the_kind() -> None:
    """An idle reports worker is no evidence about short runs: busy rest workers mean a backlog,
    and a kind no live pool claims is reported even while every worker is busy."""

    def w(pool: str | None, kinds: list[str] | None, run: int | None) -> dict[str, Any]:
        return {"alive": True, "host": "h", "pool": pool, "pool_kinds": kinds, "current_run": run}

    workers = [w("reports", ["reports"], None), w("rest", None, 7), w("rest", None, 8)]
    queued = [{"kind": "short", "due": 5, "oldest_due": 300.0}]
    assert status.unserved(workers, queued, set(), 15.0) == []
    only_reports = [w("reports", ["reports"], 1)]
    (warning,) = status.unserved(only_reports, queued, set(), 15.0)
    assert warning["kind"] == "short" and warning["alive"] == 0


def run_cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "leasework", "--dsn", dsn, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pool", "r:2:reprots"], "pool 'r' names kind 'reprots', which the app does not"),
        (["--pool", "r:2:"], "pool 'r' names no kind"),
        (["--pool", "reports:2"], "must look like NAME:PROCESSES:KIND,KIND (or NAME:PROCESSES:*"),
        (["--pool", "r:0:reports"], "processes must be 1 to 1024, got 0"),
        (["--pool", "a:1:reports", "--pool", "b:1:reports"], "both claim kind 'reports'"),
        (["--processes", "3", "--pool", "r:1:reports"], "--processes and pools both"),
    ],
)
def test_supervise_refuses_bad_pools_before_starting(
    conn: Conn, dsn: str, flags: list[str], message: str
) -> None:
    done = run_cli(dsn, "supervise", "--app", "tests.db.test_pools:cli_app", *flags)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert conn.execute("SELECT count(*) FROM leasework.workers").fetchone() == (0,)


cli_app = make_app()


def test_a_config_file_with_pools(tmp_path: Any) -> None:
    from leasework import config

    path = tmp_path / "leasework.toml"
    path.write_text(
        'processes = 3\n[[pools]]\nname = "reports"\nprocesses = 2\nkinds = ["reports"]\n'
        '[[pools]]\nname = "rest"\nprocesses = 6\nkinds = ["*"]\n'
    )
    cfg: Config = config.load(path, env={})
    assert cfg.pools == (Pool("reports", 2, ("reports",)), Pool("rest", 6, None))
    assert cfg.children == 8
    assert cfg.pool_serves("rest", "short") and not cfg.pool_serves("rest", "reports")
    assert cfg.pool_serves("reports", "reports") and not cfg.pool_serves("reports", "short")
    assert cfg.pool_serves(None, "reports")
