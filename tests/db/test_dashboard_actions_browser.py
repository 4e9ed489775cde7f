"""The dashboard's actions in a real browser (Debian's headless Chromium through Playwright), no
script on any page: cancel a queued run, retry a failed one, delete a finished one (its confirm
box required first), pause and resume a kind, each checked in the database; a form posted from
another page without the token (or with a forged one) refused with 403 and nothing changed; a
read-only dashboard drawing no form and answering a forged form 405; the dashboard mounted under
a prefix in wsgiref, clicked through. Screenshots are kept as artefacts: under the test's
tmp_path, or under $LEASEWORK_ARTEFACTS when set (never committed)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import App
from leasework.dashboard import wsgi_app
from leasework.workers.worker import Worker

from ..conftest import fast_config
from .dashboard_helpers import Scenario, populate, running_dashboard
from .test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, pytestmark  # noqa: F401 - the skip
from .test_dashboard_wsgi import HOST_PASSWORD, PREFIX, dispatcher, serving

Conn = psycopg.Connection[Any]


@pytest.fixture
def artefacts(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    root = os.environ.get("LEASEWORK_ARTEFACTS")
    where = Path(root) / request.node.name if root else tmp_path / "screenshots"
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def scenario(conn: Conn, make_worker: Callable[..., Worker]) -> tuple[Scenario, int]:
    s = populate(conn, make_worker)
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    return s, app.enqueue(conn, "mail", {"to": "ops"})


def state(conn: Conn) -> tuple[list[Any], list[Any]]:
    runs = conn.execute(
        "SELECT id, status, attempts, max_attempts, cancel_requested_at FROM leasework.runs "
        "ORDER BY id"
    ).fetchall()
    paused = conn.execute("SELECT kind FROM leasework.paused_kinds ORDER BY kind").fetchall()
    return runs, paused


def status_of(conn: Conn, run_id: int) -> str | None:
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


def forged_form(page: Any, action: str, token: str | None) -> None:
    """Another page (about:blank, not the dashboard) with a form aimed at an action."""
    field = f'<input type="hidden" name="csrf" value="{token}">' if token is not None else ""
    page.set_content(
        f'<form method="post" action="{action}">{field}'
        '<input type="hidden" name="kind" value="mail"><button id="go">go</button></form>'
    )
    with page.expect_navigation():
        page.click("#go")


def test_every_action_in_chromium(
    dsn: str,
    conn: Conn,
    scenario: tuple[Scenario, int],
    browser: Any,
    artefacts: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s, queued = scenario
    with running_dashboard(fast_config(dsn), actions=True) as dash:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))

        # cancel a queued run from the runs list
        page.goto(f"{dash.url}runs")
        assert "actions on" in page.locator("header .note").inner_text()
        row = page.locator(f'#runs tbody tr:has(a[href="/runs/{queued}"])')
        with page.expect_navigation():
            row.locator('form[data-action="cancel"] button').click()
        assert page.url == f"{dash.url}runs"
        assert page.locator("#flash").inner_text() == f"run {queued} cancelled"
        assert status_of(conn, queued) == "cancelled"
        page.screenshot(path=str(artefacts / "actions-cancelled.png"), full_page=True)

        # retry the failed run, from the failed runs
        page.goto(f"{dash.url}runs?status=failed")
        row = page.locator(f'#runs tbody tr:has(a[href="/runs/{s.broken}"])')
        with page.expect_navigation():
            row.locator('form[data-action="retry"] button').click()
        assert page.url == f"{dash.url}runs?status=failed"
        assert "retried" in page.locator("#flash").inner_text()
        assert status_of(conn, s.broken) == "queued"

        # delete a finished run, from its page: not without ticking its confirm box
        page.goto(f"{dash.url}runs/{s.report}")
        before = state(conn)
        delete = page.locator('#actions form[data-action="delete"]')
        delete.locator("button").click()  # the browser refuses: the box is required
        assert page.url == f"{dash.url}runs/{s.report}"
        assert state(conn) == before
        page.screenshot(path=str(artefacts / "actions-run-page.png"), full_page=True)
        delete.locator('input[name="confirm"]').check()
        with page.expect_navigation():
            delete.locator("button").click()
        assert page.url == f"{dash.url}runs"
        assert page.locator("#flash").inner_text() == f"run {s.report} deleted"
        assert status_of(conn, s.report) is None

        # pause and resume a kind, from /kinds
        page.locator('header nav a[href="/kinds"]').click()
        page.wait_for_url(f"{dash.url}kinds")
        mail = page.locator('#kinds tbody tr:has(a:text-is("mail"))')
        with page.expect_navigation():
            mail.locator('form[data-action="pause"] button').click()
        assert state(conn)[1] == [("mail",)]
        assert "paused" in page.locator('#kinds tbody tr:has(a:text-is("mail"))').inner_text()
        page.screenshot(path=str(artefacts / "actions-kind-paused.png"), full_page=True)
        # the runs list names it, with its resume
        page.goto(f"{dash.url}runs")
        assert "mail" in page.locator("#paused").inner_text()
        page.goto(f"{dash.url}kinds")
        with page.expect_navigation():
            page.locator(
                '#kinds tbody tr:has(a:text-is("mail")) form[data-action="resume"] button'
            ).click()
        assert page.locator("#flash").inner_text() == "kind mail resumed"
        assert state(conn)[1] == []

        assert not problems, problems

        # a form on another page, without the token or with a forged one: 403, nothing changed
        before = state(conn)
        running = s.indexing
        for token in (None, "forged-token"):
            forged_form(page, f"{dash.url}runs/{running}/cancel", token)
            assert page.locator("h2").first.inner_text() == "403"
            assert "nothing changed" in page.locator("#error-line").inner_text()
        page.screenshot(path=str(artefacts / "actions-forged-refused.png"), full_page=True)
        forged_form(page, f"{dash.url}kinds/pause", None)
        assert page.locator("h2").first.inner_text() == "403"
        assert state(conn) == before

        assert problems and all("403" in p for p in problems), problems  # the refusals only

        # a run offers only what its status allows: the retried run, queued again, no retry
        page.goto(f"{dash.url}runs/{s.broken}")
        assert page.locator('#actions form[data-action="retry"]').count() == 0
        assert page.locator('#actions form[data-action="cancel"]').count() == 1
    shots = sorted(artefacts.glob("*.png"))
    assert len(shots) == 4 and all(p.stat().st_size > 10_000 for p in shots)
    with capsys.disabled():
        print(f"\ndashboard action screenshots: {artefacts}")


def test_a_read_only_dashboard_refuses_actions_in_chromium(
    dsn: str, conn: Conn, scenario: tuple[Scenario, int], browser: Any, artefacts: Path
) -> None:
    s, queued = scenario
    with running_dashboard(fast_config(dsn)) as dash:
        page = browser.new_page()
        for path in ("", "runs", f"runs/{queued}", f"runs/{s.broken}", "kinds"):
            page.goto(f"{dash.url}{path}")
            assert page.locator('form[method="post"]').count() == 0, path
            assert "read-only" in page.locator("header .note").inner_text()
        before = state(conn)
        forged_form(page, f"{dash.url}runs/{queued}/cancel", "whatever")
        assert page.locator("h2").first.inner_text() == "405"
        assert "actions are off" in page.locator("#error-line").inner_text()
        page.screenshot(path=str(artefacts / "read-only-refused.png"), full_page=True)
        assert state(conn) == before


def test_mounted_under_a_prefix_in_chromium(
    dsn: str, conn: Conn, browser: Any, artefacts: Path
) -> None:
    app = App(fast_config(dsn))
    app.task("mail")(lambda ctx, payload: None)
    ids = [app.enqueue(conn, "mail", {"n": i}) for i in range(3)]
    with serving(dispatcher(wsgi_app(app=app, actions=True))) as base:
        context = browser.new_context(extra_http_headers={"X-Host-Login": HOST_PASSWORD})
        page = context.new_page()
        page.goto(f"{base}{PREFIX}/")
        assert page.title() == "overview \u00b7 leasework"
        header_bg = page.eval_on_selector("header", "e => getComputedStyle(e).backgroundColor")
        assert header_bg == "rgb(29, 35, 48)"  # the stylesheet came from under the prefix
        page.locator(f'header nav a[href="{PREFIX}/runs"]').click()
        page.wait_for_url(f"{base}{PREFIX}/runs")
        page.fill('input[name="kind"]', "mail")
        page.locator('form.filters button[type="submit"]').click()
        page.wait_for_url(f"{base}{PREFIX}/runs?**kind=mail**")
        assert page.locator("#runs tbody tr").count() == 3
        row = page.locator(f'#runs tbody tr:has(a[href="{PREFIX}/runs/{ids[0]}"])')
        with page.expect_navigation():
            row.locator('form[data-action="cancel"] button').click()
        assert page.url.startswith(f"{base}{PREFIX}/runs?")
        assert page.locator("#flash").inner_text() == f"run {ids[0]} cancelled"
        assert status_of(conn, ids[0]) == "cancelled"
        page.locator(f'a[href="{PREFIX}/runs/{ids[1]}"]').click()
        page.wait_for_url(f"{base}{PREFIX}/runs/{ids[1]}")
        page.screenshot(path=str(artefacts / "mounted-run-page.png"), full_page=True)
        context.close()
    assert status_of(conn, ids[1]) == "queued"
