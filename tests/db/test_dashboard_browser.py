"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright. Loads the
overview, checks a progress bar and the stylesheet under the page's CSP, watches the page refresh
itself, follows a run link to the run's page, and saves screenshots for a person to look at."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework.leases import lease
from leasework.workers.worker import Worker

from ..conftest import fast_config
from .dashboard_helpers import populate, running_dashboard

CHROMIUM = os.environ.get("LEASEWORK_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)),
    reason=f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (.ci/run installs it)",
)


def test_dashboard_in_chromium(
    dsn: str,
    conn: psycopg.Connection[Any],
    make_worker: Callable[..., Worker],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    scenario = populate(conn, make_worker)
    with running_dashboard(fast_config(dsn)) as dash, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))

            page.goto(dash.url)
            assert page.title() == "overview \u00b7 leasework"
            bar = page.locator("#running progress").first
            assert bar.is_visible()
            assert (bar.get_attribute("value"), bar.get_attribute("max")) == ("4", "10")
            assert "4 / 10 (40%)" in page.locator("#running").inner_text()
            # the stylesheet loaded under the page's CSP (the header is dark, the cards are boxes)
            header_bg = page.eval_on_selector("header", "e => getComputedStyle(e).backgroundColor")
            assert header_bg == "rgb(29, 35, 48)"
            # hostile data is shown as text, never run
            assert '<script>alert("key")</script>' in page.locator("#recent").inner_text()
            overview_shot = tmp_path / "dashboard-overview.png"
            page.screenshot(path=str(overview_shot), full_page=True)

            # the page refreshes itself: progress moved on in the database shows up by itself
            assert lease.checkpoint(conn, scenario.indexing_claim, 7, 10)
            page.wait_for_selector('#running progress[value="7"]', timeout=15_000)

            # follow the running run's link to its page
            link = page.locator(f'#running a[href="/runs/{scenario.indexing}"]')
            assert link.inner_text() == f"#{scenario.indexing}"
            link.click()
            page.wait_for_url(f"{dash.url}runs/{scenario.indexing}")
            assert page.locator("#run h2").inner_text() == f"Run #{scenario.indexing}"
            assert page.locator("#run progress").get_attribute("value") == "7"
            assert "w-indexer" in page.locator("#run").inner_text()
            run_shot = tmp_path / "dashboard-run-running.png"
            page.screenshot(path=str(run_shot), full_page=True)

            # a finished run: attempt history and per-table results
            page.goto(dash.url)
            page.locator(f'#recent a[href="/runs/{scenario.report}"]').click()
            page.wait_for_url(f"{dash.url}runs/{scenario.report}")
            tables = page.locator("#tables").inner_text()
            assert "users" in tables and "orders" in tables and "HTTP 503 <b>" in tables
            assert "succeeded" in page.locator("#history").inner_text()
            report_shot = tmp_path / "dashboard-run-finished.png"
            page.screenshot(path=str(report_shot), full_page=True)

            assert not problems, problems
        finally:
            browser.close()
    for shot in (overview_shot, run_shot, report_shot):
        assert shot.stat().st_size > 10_000
    with capsys.disabled():
        print(f"\ndashboard screenshots: {overview_shot} {run_shot} {report_shot}")


def test_runs_page_filters_and_pages_in_chromium(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/runs in a real browser: the filter form (a plain GET form, no script) narrows the list,
    the pager walks older runs, and the schedules and connections pages are one click away."""
    from leasework import App
    from leasework.dashboard import web as server

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    app.task("report")(lambda ctx, payload: None)
    mails = [
        app.enqueue(conn, "mail", {"i": i}, tenant="acme") for i in range(server.RUNS_PAGE + 5)
    ]
    report = app.enqueue(conn, "report", key="weekly")
    with running_dashboard(fast_config(dsn)) as dash, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.goto(dash.url)
            page.locator('header nav a[href="/runs"]').click()
            page.wait_for_url(f"{dash.url}runs")
            first = page.locator("#runs tbody tr")
            assert first.count() == server.RUNS_PAGE
            assert first.first.locator("a.run-link").inner_text() == f"#{report}"
            # the pager: the rest, older
            page.locator("#next-page").click()
            page.wait_for_selector("#runs tbody tr")
            older = [
                t.removeprefix("#") for t in page.locator("#runs a.run-link").all_inner_texts()
            ]
            assert [int(t) for t in older] == sorted(mails, reverse=True)[server.RUNS_PAGE - 1 :]
            # the filter form
            page.goto(f"{dash.url}runs")
            page.fill('input[name="kind"]', "report")
            page.select_option('select[name="status"]', "queued")
            page.locator('form.filters button[type="submit"]').click()
            page.wait_for_url("**/runs?status=queued&kind=report**")
            rows = page.locator("#runs tbody tr")
            assert rows.count() == 1 and "weekly" in rows.first.inner_text()
            shot = tmp_path / "dashboard-runs-filtered.png"
            page.screenshot(path=str(shot), full_page=True)
            page.fill('input[name="kind"]', "nothing-like-it")
            page.locator('form.filters button[type="submit"]').click()
            page.wait_for_selector("text=no runs match")
            page.locator('header nav a[href="/schedules"]').click()
            page.wait_for_selector("#schedules")
            page.locator('header nav a[href="/connections"]').click()
            page.wait_for_selector("#connections")
            assert not problems, problems
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    with capsys.disabled():
        print(f"\ndashboard screenshot: {shot}")
