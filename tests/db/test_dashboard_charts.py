"""The overview's charts (dashboard_chart): completions, failed attempts and queue depth per
minute by kind over the last hour, from the runs' timestamps and histories; kinds not drawn are
`other`; the SVG on the page, and in a real browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework.dashboard import pages
from leasework.dashboard.web import DashboardApp, chart

from ..conftest import fast_config
from .dashboard_helpers import running_dashboard
from .test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

Conn = psycopg.Connection[Any]

# Minute m of the chart starts at START + m minutes; START is 59 minutes before the current one.
START = "date_trunc('minute', leasework.now()) - interval '59 minutes'"


def at(minute: float) -> str:
    return f"({START} + make_interval(secs => {minute * 60}))"


def entry(outcome: str, minute: float) -> str:
    return (
        "jsonb_build_object('attempt', 1, 'outcome', '" + outcome + "', 'ended_at', "
        + at(minute) + ")"
    )  # fmt: skip


def insert(conn: Conn) -> None:
    """In the caller's transaction (one leasework.now() for the inserts and the chart)."""
    conn.execute(
        f"""
        INSERT INTO leasework.runs (kind, status, queued_at, started_at, finished_at, attempts)
        SELECT 'mail', 'succeeded', {at(48)}, {at(49)}, {at(49.5)}, 1 FROM generate_series(1, 3);
        INSERT INTO leasework.runs (kind, status, queued_at, started_at, finished_at, attempts)
        VALUES ('mail', 'succeeded', {at(58)}, {at(58.5)}, {at(59)}, 1);
        -- two failed attempts (minutes 40 and 45), the run failed for good; one retried (released
        -- and snoozed entries are no failure)
        INSERT INTO leasework.runs (kind, status, queued_at, started_at, finished_at, attempts,
                                    history)
        VALUES ('mail', 'failed', {at(44)}, {at(44.5)}, {at(45.2)}, 2,
                jsonb_build_array({entry('failed', 40.1)}, {entry('failed', 45.2)})),
               ('mail', 'succeeded', {at(30)}, {at(31)}, {at(32)}, 2,
                jsonb_build_array({entry('released', 20)}, {entry('snoozed', 21)},
                                  {entry('timeout', 22.5)}));
        -- waiting: queued at minute 29 (due at the samples of minutes 28..59), and a run queued at
        -- 39.2 that started at 44 (the samples of minutes 39..42); a delayed run is not due
        INSERT INTO leasework.runs (kind, queued_at) VALUES ('mail', {at(29)}),
                                                           ('mail', leasework.now() + interval '1 hour');
        INSERT INTO leasework.runs (kind, status, queued_at, started_at, finished_at, attempts)
        VALUES ('mail', 'succeeded', {at(39.2)}, {at(44)}, {at(44.1)}, 1);
        -- other kinds, drawn as `other`
        INSERT INTO leasework.runs (kind, status, queued_at, started_at, finished_at, attempts)
        VALUES ('sms', 'succeeded', {at(10)}, {at(10.1)}, {at(10.3)}, 1),
               ('push', 'succeeded', {at(10)}, {at(10.1)}, {at(10.4)}, 1);
        -- finished before the hour: not drawn
        INSERT INTO leasework.runs (kind, status, queued_at, started_at, finished_at, attempts)
        VALUES ('mail', 'succeeded', {at(-30)}, {at(-20)}, {at(-10)}, 1);
        """
    )


def minutes(**ranges: int) -> list[int]:
    """A value per minute from `m49=3` or `m28_38=1` (an inclusive range)."""
    out = [0] * 60
    for name, value in ranges.items():
        first, _, last = name[1:].partition("_")
        for m in range(int(first), int(last or first) + 1):
            out[m] += value
    return out


def test_charts_count_by_minute_and_kind(conn: Conn) -> None:
    with conn.transaction():
        insert(conn)
        series = chart(conn, ["mail"])
    assert series["done"] == {
        "mail": minutes(m49=3, m59=1, m32=1, m44=1),
        "other": minutes(m10=2),
    }
    assert series["failed"] == {"mail": minutes(m40=1, m45=1, m22=1)}
    # A run waits at a minute's sample (its end: START + m + 1 minutes) from its queued_at up to
    # its start: queued at 48 and started at 49, it is counted at minute 47's sample only.
    assert series["depth"]["mail"] == minutes(
        m28_59=1, m39_42=1, m47=3, m57=1, m29=1, m43=1
    )
    assert series["depth"]["other"] == minutes(m9=2)  # sms and push, due at 10, started at 10.1


def test_the_overview_draws_the_charts(dsn: str, conn: Conn) -> None:
    insert(conn)
    for i in range(9):  # more kinds than a chart draws
        conn.execute("SELECT leasework.enqueue(%s)", (f"kind{i}",))
    page = DashboardApp(fast_config(dsn)).overview()
    assert '<section id="charts">' in page
    for what in ("done", "failed", "depth"):
        assert f'data-chart="{what}"' in page
    depth = page.split('data-chart="depth"')[1].split("</svg>")[0]
    kinds = depth.count("<polyline")
    assert kinds == pages.CHART_KINDS + 1  # six kinds and other
    assert 'data-kind="mail"' in depth and 'data-kind="other"' in depth


def test_charts_in_chromium(dsn: str, conn: Conn, tmp_path: Path) -> None:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    insert(conn)
    with running_dashboard(fast_config(dsn)) as dash, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.goto(dash.url)
            for what in ("done", "failed", "depth"):
                svg = page.locator(f'#charts svg[data-chart="{what}"]')
                assert svg.is_visible()
                box = svg.bounding_box()
                assert box is not None and box["width"] > 300 and box["height"] > 100
                line = svg.locator('polyline[data-kind="mail"]')
                assert line.count() == 1
                # drawn: the line has a length, in the colour the legend shows
                length = line.evaluate("e => e.getTotalLength()")
                assert length > 300
            assert "mail" in page.locator("#charts .legend").first.inner_text()
            assert not problems, problems  # nothing refused by the page's CSP
            page.locator("#charts").screenshot(path=str(tmp_path / "charts.png"))
        finally:
            browser.close()
