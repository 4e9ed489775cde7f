"""The dashboard's bulk actions in a real browser (Debian's headless Chromium through Playwright),
no script on any page: search the runs list (error text, tag), tick runs and cancel them, choose
"all N matching this filter" and retry them, run delayed runs now, delete finished ones; each
through its confirm page, each checked in the database. Screenshots are kept as artefacts, as in
test_dashboard_actions_browser.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from leasework import App

from ..conftest import fast_config
from .dashboard_helpers import running_dashboard
from .test_dashboard_actions_browser import artefacts, browser  # noqa: F401 - fixtures
from .test_dashboard_browser import pytestmark  # noqa: F401 - the skip

Conn = psycopg.Connection[Any]


def statuses(conn: Conn, ids: list[int]) -> list[str]:
    rows = conn.execute(
        "SELECT status FROM leasework.runs WHERE id = ANY(%s) ORDER BY id", (ids,)
    ).fetchall()
    return [str(r[0]) for r in rows]


def test_bulk_actions_in_chromium(
    dsn: str, conn: Conn, browser: Any, artefacts: Path  # noqa: F811 - fixtures
) -> None:
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    failed = app.enqueue_many(conn, "mail", [{"account": i} for i in range(4)])
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now(), "
        "error = 'HTTP 429 Too Many Requests' WHERE id = ANY(%s)",
        (failed[:3],),
    )
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now(), "
        "error = 'KeyError: account' WHERE id = %s",
        (failed[3],),
    )
    queued = app.enqueue_many(conn, "mail", [{}, {}, {}], tags=["eu"])
    delayed = app.enqueue_many(conn, "mail", [{}, {}], delay=3600, tags=["later"])
    with running_dashboard(fast_config(dsn), actions=True, app=app) as dash:
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))

        # tick two of the tagged runs and cancel them, through the confirm page
        page.goto(f"{dash.url}runs")
        page.fill('form.filters input[name="tag"]', "eu")
        with page.expect_navigation():
            page.click('form.filters button[type="submit"]')
        assert page.locator("#runs tbody tr").count() == 3
        for run_id in queued[:2]:
            page.check(f'input[name="id"][value="{run_id}"]')
        page.screenshot(path=str(artefacts / "bulk-ticked.png"), full_page=True)
        with page.expect_navigation():
            page.click('#bulk button[value="cancel"]')
        assert page.locator("#confirm-count").inner_text() == "2"
        assert statuses(conn, queued) == ["queued"] * 3  # nothing yet
        page.screenshot(path=str(artefacts / "bulk-confirm.png"), full_page=True)
        with page.expect_navigation():
            page.click("#confirm-button")
        assert "2 run(s) cancelled" in page.locator("#flash").inner_text()
        assert statuses(conn, queued) == ["cancelled", "cancelled", "queued"]

        # all runs whose error holds "429": retried, the other failed run left
        page.goto(f"{dash.url}runs?status=failed")
        page.fill('form.filters input[name="error"]', "too many requests")
        with page.expect_navigation():
            page.click('form.filters button[type="submit"]')
        assert page.locator("#matching").inner_text() == "3"
        page.check("#scope-filter")
        with page.expect_navigation():
            page.click('#bulk button[value="retry"]')
        assert page.locator("#confirm-count").inner_text() == "3"
        with page.expect_navigation():
            page.click("#confirm-button")
        assert "3 run(s) retried" in page.locator("#flash").inner_text()
        assert statuses(conn, failed) == ["queued", "queued", "queued", "failed"]

        # the delayed runs, made due now
        page.goto(f"{dash.url}runs?tag=later")
        page.check("#scope-filter")
        with page.expect_navigation():
            page.click('#bulk button[value="run-now"]')
        with page.expect_navigation():
            page.click("#confirm-button")
        assert "2 run(s) made due now" in page.locator("#flash").inner_text()
        due = conn.execute(
            "SELECT bool_and(queued_at <= leasework.now()) FROM leasework.runs WHERE id = ANY(%s)",
            (delayed,),
        ).fetchone()
        assert due == (True,)

        # the cancelled runs deleted: all matching status=cancelled
        page.goto(f"{dash.url}runs?status=cancelled")
        page.check("#scope-filter")
        with page.expect_navigation():
            page.click('#bulk button[value="delete"]')
        with page.expect_navigation():
            page.click("#confirm-button")
        assert "2 run(s) deleted" in page.locator("#flash").inner_text()
        assert statuses(conn, queued) == ["queued"]
        page.screenshot(path=str(artefacts / "bulk-done.png"), full_page=True)
        assert not problems, problems
