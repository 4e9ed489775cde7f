"""The dashboard's pictures in the manual (docs/dashboard.md, README.md): the overview, the runs
list and a running run's page, in headless Chromium, on an hour of a plausible queue (four kinds,
a few runs a minute, a backlog, failures, a run a third of the way through its units). Each page is checked
as it is shot; with LEASEWORK_SCREENSHOTS set to a folder (`make screenshots`: docs/images) the
pictures are saved there, 1200 px wide."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import App, Context
from leasework.leases import lease
from leasework.workers import presence

from ..conftest import fast_config
from .dashboard_helpers import running_dashboard
from .test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

Conn = psycopg.Connection[Any]

pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)),
    reason=f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (.ci/run installs it)",
)

SIZE = {"width": 1200, "height": 860}

# The last hour, minute m starting at START + m minutes (the overview's charts are per minute).
START = "date_trunc('minute', leasework.now()) - interval '59 minutes'"
ERROR = "RuntimeError: the CRM answered HTTP 503 (Service Unavailable); retry later"

HOUR = [
    f"""
INSERT INTO leasework.runs (kind, tenant, status, created_at, queued_at, started_at, finished_at,
                            attempts, result)
SELECT kind, 'acct-' || ((m + i) % 5), 'succeeded',
       {START} + make_interval(secs => m * 60 + i * 6),
       {START} + make_interval(secs => m * 60 + i * 6),
       {START} + make_interval(secs => m * 60 + i * 6 + 1 + (m % 4)),
       {START} + make_interval(secs => m * 60 + i * 6 + 4 + (m % 4) + n * 2),
       1, '{{"ok": true}}'
FROM (VALUES ('resize_image', 4), ('send_report', 2), ('sync_crm', 1), ('index_docs', 1)) k(kind, n),
     generate_series(0, 58) m, generate_series(1, 6) i
WHERE i <= n + abs(hashtext(kind || m)) % 3 - 1  -- n - 1 to n + 1 a minute, the same each time
""",
    # three runs of sync_crm failed for good, three attempts each
    f"""
INSERT INTO leasework.runs (kind, tenant, status, created_at, queued_at, started_at, finished_at,
                            attempts, max_attempts, error, history)
SELECT 'sync_crm', 'acct-' || m %% 5, 'failed',
       {START} + make_interval(mins => m - 3),
       {START} + make_interval(mins => m - 3),
       {START} + make_interval(mins => m),
       {START} + make_interval(mins => m, secs => 20),
       3, 3, %(error)s,
       (SELECT jsonb_agg(jsonb_build_object(
                   'attempt', a, 'outcome', 'failed', 'worker', 'host-b:3117',
                   'started_at', {START} + make_interval(mins => m - 3 + a, secs => 1),
                   'ended_at', {START} + make_interval(mins => m - 3 + a, secs => 20),
                   'error', %(error)s::text) ORDER BY a)
        FROM generate_series(1, 3) a)
FROM unnest(ARRAY[21, 42, 53]) m
""",
    # a backlog of images, due over the last ten minutes
    f"""
INSERT INTO leasework.runs (kind, tenant, created_at, queued_at, payload)
SELECT 'resize_image', 'acct-' || i % 5, due, due, jsonb_build_object('image', 'upload-' || i || '.jpg')
FROM generate_series(1, 27) i, LATERAL (SELECT {START} + make_interval(mins => 50, secs => i * 20)) d(due)
""",
]


def showcase(conn: Conn) -> int:
    """An hour of a queue; returns the id of the run being indexed (37 of 120 units done)."""
    succeeded, failed, backlog = HOUR
    conn.execute(succeeded)
    conn.execute(failed, {"error": ERROR})  # its % are doubled: it takes parameters
    conn.execute(backlog)
    app = App()

    @app.task("index_docs")
    def index_docs(ctx: Context, payload: Any) -> None:  # held by hand below, never run here
        raise AssertionError("claimed by hand in this test")

    indexing = app.enqueue(conn, "index_docs", {"project": "handbook", "documents": 120})
    (claim,) = lease.claim_runs(conn, ["index_docs"], worker="host-a:4242", lease=600.0)
    assert claim.id == indexing
    assert lease.checkpoint(conn, claim, 37, 120)
    presence.upsert_worker(conn, "host-a:4242", "host-a", 4242, indexing)
    presence.upsert_worker(conn, "host-a:4243", "host-a", 4243, None)
    presence.upsert_worker(conn, "host-b:3117", "host-b", 3117, None)
    return indexing


def test_the_manuals_screenshots_in_chromium(
    dsn: str, conn: Conn, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    indexing = showcase(conn)
    where = os.environ.get("LEASEWORK_SCREENSHOTS")
    folder = Path(where) if where else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    shots = []

    def shoot(page: Any, name: str) -> None:
        page.wait_for_load_state("load")
        shot = folder / name
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000, f"{shot} is nearly empty"
        shots.append(shot)

    with running_dashboard(fast_config(dsn)) as dash, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=SIZE)
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))

            page.goto(dash.url)
            for what in ("done", "failed", "depth"):
                assert page.locator(f'#charts svg[data-chart="{what}"] polyline').count() >= 1
            assert page.locator("#running progress").first.get_attribute("value") == "37"
            assert "HTTP 503" in page.locator("body").inner_text()
            shoot(page, "dashboard-overview.png")

            page.goto(f"{dash.url}runs?kind=sync_crm")
            assert page.locator("#runs tbody tr").count() > 20
            assert "HTTP 503" in page.locator("#runs").inner_text()
            shoot(page, "dashboard-runs.png")

            page.goto(f"{dash.url}runs/{indexing}")
            assert page.locator("#run h2").inner_text() == f"Run #{indexing}"
            assert page.locator("#run progress").get_attribute("value") == "37"
            shoot(page, "dashboard-run.png")
            assert not problems, problems
        finally:
            browser.close()
    with capsys.disabled():
        print(f"\ndashboard screenshots: {' '.join(map(str, shots))}")
