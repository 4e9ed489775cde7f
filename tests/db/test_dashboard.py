"""The dashboard's pages, /metrics and /healthz over real HTTP against real Postgres: what each
page shows, that user data is escaped, that it never writes, that the DSN's password never
appears, and that it answers 503 (not a traceback) when the database is away."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import __version__
from leasework.dashboard import Dashboard
from leasework.workers.worker import Worker

from ..conftest import fast_config, wait_for
from .dashboard_helpers import (
    HOSTILE_ERROR,
    HOSTILE_KEY,
    HOSTILE_TENANT,
    Scenario,
    populate,
    request,
    running_dashboard,
)

Conn = psycopg.Connection[Any]
PASSWORD = "s3cret-Pa55word"


def with_password(dsn: str) -> str:
    """The test DSN with a password in it (the test server trusts local connections, so the
    password is carried along but never checked: it must still never reach a page)."""
    params = conninfo_to_dict(dsn)
    params["password"] = PASSWORD
    return make_conninfo(**params)


def without_schema(server_dsn: str) -> str:
    """A database with no leasework schema (template1 is never migrated)."""
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = "template1"
    return make_conninfo(**params)


@pytest.fixture
def scenario(conn: Conn, make_worker: Callable[..., Worker]) -> Scenario:
    return populate(conn, make_worker)


@pytest.fixture
def dash(dsn: str, conn: Conn) -> Iterator[Dashboard]:
    with running_dashboard(fast_config(with_password(dsn))) as d:
        yield d


def test_overview_shows_the_whole_picture(dash: Dashboard, scenario: Scenario) -> None:
    resp = request(dash.url)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/html")
    page = resp.text
    # the running run with its progress bar, its worker and a link to its page
    assert re.search(r'<progress value="4" max="10">', page)
    assert f'href="/runs/{scenario.indexing}"' in page
    assert "w-indexer" in page and "host-&lt;1&gt;" in page
    # runs by kind, recent failures, newest runs link to every run
    for kind in ("send_report", "flaky", "broken", "steady", "index_docs"):
        assert f"<td>{kind}</td>" in page
    assert 'id="failures"' in page and f'href="/runs/{scenario.broken}"' in page
    for rid in (scenario.report, scenario.flaky, scenario.expired, scenario.crashed):
        assert f'href="/runs/{rid}"' in page
    # it refreshes itself, without a script
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "<script" not in page.lower()


def test_user_data_is_escaped_everywhere(dash: Dashboard, scenario: Scenario) -> None:
    pages = [request(dash.url).text] + [
        request(f"{dash.url}runs/{rid}").text for rid in (scenario.report, scenario.broken)
    ]
    joined = "\n".join(pages)
    assert "<script" not in joined.lower()
    assert "<img" not in joined.lower()
    assert "&lt;script&gt;alert(&quot;key&quot;)&lt;/script&gt;" in joined
    assert "&lt;img src=x onerror=alert(&#x27;error&#x27;)&gt;" in joined
    assert (
        HOSTILE_KEY not in joined and HOSTILE_TENANT not in joined and HOSTILE_ERROR not in joined
    )


def test_run_page_shows_attempts_tables_payload_and_result(
    dash: Dashboard, scenario: Scenario
) -> None:
    report = request(f"{dash.url}runs/{scenario.report}")
    assert report.status == 200
    page = report.text
    assert f"Run #{scenario.report}" in page
    assert 'id="tables"' in page and "<td>users</td>" in page and "<td>orders</td>" in page
    assert "HTTP 503 &lt;b&gt;" in page
    assert 'id="payload"' in page and "&lt;/pre&gt;&lt;script&gt;" in page
    assert 'id="result"' in page and "&quot;upserted&quot;: 3" in page
    assert 'http-equiv="refresh"' not in page  # finished: nothing left to watch

    flaky = request(f"{dash.url}runs/{scenario.flaky}").text
    history = flaky.split('id="history"')[1].split("</section>")[0]
    assert history.count("<tr>") == 3  # header + two attempts
    assert "first attempt fails" in history and "s-succeeded" in history

    for rid, outcome in ((scenario.expired, "expired"), (scenario.crashed, "crashed")):
        page = request(f"{dash.url}runs/{rid}").text
        history = page.split('id="history"')[1].split("</section>")[0]
        assert f"s-{outcome}" in history and "s-succeeded" in history

    live = request(f"{dash.url}runs/{scenario.indexing}").text
    assert '<progress value="4" max="10">' in live and "w-indexer" in live
    history = live.split('id="history"')[1].split("</section>")[0]
    assert history.count("<tr>") == 2 and "s-running" in history  # the attempt in progress
    assert 'http-equiv="refresh"' in live  # running: it refreshes itself


def _row_of(page: str, run_id: int) -> list[str]:
    """The cells of the table row that links to run `run_id`."""
    for row in re.findall(r"<tr>(.*?)</tr>", page, re.S):
        if f'href="/runs/{run_id}"' in row:
            return re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
    raise AssertionError(f"no row for run {run_id}")


def test_a_delayed_runs_last_change_is_its_enqueue_on_every_page(
    dash: Dashboard, conn: Conn
) -> None:
    """A run enqueued for ten minutes from now last changed when it was enqueued: the overview's
    "last change" column says so, as /runs does, never its due time in the future."""
    from leasework.dashboard.pages import when

    (run_id,) = conn.execute("SELECT leasework.enqueue('later', delay => 600)").fetchone()
    created, due = conn.execute(
        "SELECT created_at, queued_at FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert when(created) != when(due)
    overview = _row_of(request(dash.url).text, run_id)
    listed = _row_of(request(f"{dash.url}runs").text, run_id)
    # the overview's last column, /runs' "last change (UTC)" (after "created (UTC)")
    assert overview[-1] == listed[7] == when(created), (overview, listed)
    assert when(due) not in overview


def test_unknown_pages_and_runs_are_404(dash: Dashboard, conn: Conn) -> None:
    assert request(f"{dash.url}runs/999999").status == 404
    assert request(f"{dash.url}runs/abc").status == 404
    assert request(f"{dash.url}nope").status == 404
    css = request(f"{dash.url}static/dashboard.css")
    assert css.status == 200 and css.headers["Content-Type"].startswith("text/css")


def test_metrics_in_prometheus_format(dash: Dashboard, scenario: Scenario, conn: Conn) -> None:
    resp = request(f"{dash.url}metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert get("leasework_database_up") == 1
    assert get("leasework_runs", kind="steady", status="succeeded") == 2
    assert get("leasework_runs", kind="flaky", status="succeeded") == 1
    assert get("leasework_runs", kind="broken", status="failed") == 1
    assert get("leasework_runs", kind="index_docs", status="running") == 1
    assert get("leasework_workers", state="alive") >= 2  # w-indexer and the test's own worker
    assert get("leasework_lease_losses_total", kind="steady", outcome="expired") == 1
    assert get("leasework_lease_losses_total", kind="steady", outcome="crashed") == 1
    assert get("leasework_reclaims_total", kind="steady") == 2
    assert get("leasework_runs_finished_total", kind="steady", outcome="succeeded") == 2
    assert get("leasework_runs_finished_total", kind="broken", outcome="failed") == 1
    assert get("leasework_runs_finished_total", kind="broken", outcome="cancelled") == 0
    assert get("leasework_run_duration_seconds_count", kind="steady") == 2
    assert get("leasework_run_duration_seconds_bucket", kind="steady", le="+Inf") == 2
    assert get("leasework_build_info", version=__version__) == 1
    assert get("leasework_oldest_queued_age_seconds") == 0  # present, and 0: nothing waits

    # counters only go up: deleting (pruning) the finished runs keeps their counts
    conn.execute("DELETE FROM leasework.runs WHERE kind = 'steady'")
    after = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(request(f"{dash.url}metrics").text)
        for s in f.samples
    }
    for name, labels in (
        ("leasework_lease_losses_total", {"kind": "steady", "outcome": "expired"}),
        ("leasework_reclaims_total", {"kind": "steady"}),
        ("leasework_runs_finished_total", {"kind": "steady", "outcome": "succeeded"}),
        ("leasework_run_duration_seconds_count", {"kind": "steady"}),
    ):
        key = (name, tuple(sorted(labels.items())))
        assert after[key] == samples[key], name
    assert after[("leasework_runs", (("kind", "steady"), ("status", "succeeded")))] == 0

    # a due queued run shows its age; a delayed one does not count
    conn.execute(
        "INSERT INTO leasework.runs (kind, queued_at) VALUES ('later', now() + interval '1 hour'),"
        " ('backlog', now() - interval '90 seconds')"
    )
    text = request(f"{dash.url}metrics").text
    ages = {
        s.labels["kind"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "leasework_kind_oldest_queued_age_seconds"
        for s in f.samples
    }
    assert ages["later"] == 0 and 89 <= ages["backlog"] < 200
    overall = [
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "leasework_oldest_queued_age_seconds"
        for s in f.samples
    ]
    assert len(overall) == 1 and 89 <= overall[0] < 200


def test_metrics_show_each_limit_and_the_runs_it_holds_back(dash: Dashboard, conn: Conn) -> None:
    from leasework import operations
    from leasework.leases import lease

    conn.execute(
        "INSERT INTO leasework.kinds (kind) VALUES ('export'), ('crm.sync');"
        "SELECT leasework.enqueue('export') FROM generate_series(1, 3);"
        "SELECT leasework.enqueue('crm.sync', tenant => 'acme') FROM generate_series(1, 3)"
    )
    operations.set_limits(conn, "export", max_running=1)
    operations.set_limits(conn, "crm.sync", rate="1/10s", rate_per="tenant")
    for i in range(3):
        lease.claim_runs(conn, ["export", "crm.sync"], worker=f"w{i}", lease=30, limit=2)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(request(f"{dash.url}metrics").text)
        for s in f.samples
    }

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert get("leasework_kind_max_running", kind="export") == 1
    assert get("leasework_kind_live_leases", kind="export") == 1
    assert get("leasework_rate_limited", kind="export", reason="capped") == 2
    assert get("leasework_kind_rate_limit", kind="crm.sync", per="tenant") == 1
    assert get("leasework_kind_rate_period_seconds", kind="crm.sync") == 10
    assert get("leasework_rate_limited", kind="crm.sync", reason="rate_limited") == 2
    assert get("leasework_rate_limited", kind="crm.sync", reason="capped") == 0
    # The overview's Limits section, and a held-back run's page says why.
    page = request(dash.url).text
    assert '<section id="limits">' in page and "1 of 1*" in page and "1/10s* per tenant" in page
    held = conn.execute(
        "SELECT min(id) FROM leasework.runs WHERE kind = 'export' AND status = 'queued'"
    ).fetchone()
    assert held is not None
    assert "capped: 1 of 1 running (max_running)" in request(f"{dash.url}runs/{held[0]}").text
    if PROMTOOL is not None:
        check = subprocess.run(
            [PROMTOOL, "check", "metrics"],
            input=request(f"{dash.url}metrics").text,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool: `apt-get install -y prometheus` (.ci/run installs it)",
)
def test_metrics_pass_promtool(dash: Dashboard, scenario: Scenario, conn: Conn) -> None:
    assert PROMTOOL is not None
    for _ in range(2):  # with runs, and with an empty table
        text = request(f"{dash.url}metrics").text
        check = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.strip() == "" and check.stderr.strip() == "", (
            check.stdout + check.stderr
        )
        conn.execute("DELETE FROM leasework.runs")


def test_healthz(dash: Dashboard, conn: Conn) -> None:
    resp = request(f"{dash.url}healthz")
    assert (resp.status, resp.text) == (200, "ok\n")


def test_read_only(dash: Dashboard, scenario: Scenario, conn: Conn) -> None:
    def snapshot() -> list[Any]:
        return conn.execute(
            "SELECT id, status, attempts, cancel_requested_at FROM leasework.runs ORDER BY id"
        ).fetchall()

    before = snapshot()
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        for path in (
            "",
            f"runs/{scenario.indexing}",
            "metrics",
            f"runs/{scenario.indexing}/cancel",
        ):
            resp = request(f"{dash.url}{path}", method=method, data=b"x=1")
            assert resp.status == 405, (method, path)
            assert resp.headers["Allow"] == "GET, HEAD"
    head = request(dash.url, method="HEAD")
    assert head.status == 200 and head.body == b""
    assert snapshot() == before
    # and its own database sessions refuse writes even if a page tried
    with dash.session() as c, pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        c.execute("UPDATE leasework.runs SET priority = 1")


def test_security_headers_and_host_check(dsn: str, conn: Conn) -> None:
    with running_dashboard(fast_config(dsn), allow_hosts=["dash.internal"]) as d:
        resp = request(d.url)
        assert "script-src" not in resp.headers["Content-Security-Policy"]
        assert resp.headers["Content-Security-Policy"].startswith("default-src 'none'")
        assert resp.headers["X-Frame-Options"] == "DENY"
        # DNS rebinding: a name that resolved to 127.0.0.1 for someone else's page is refused
        assert request(d.url, headers={"Host": "evil.example"}).status == 421
        assert request(d.url, headers={"Host": f"localhost:{d.port}"}).status == 200
        assert request(d.url, headers={"Host": "dash.internal"}).status == 200


def test_the_password_never_appears(dsn: str, dash: Dashboard, scenario: Scenario) -> None:
    for path in ("", f"runs/{scenario.report}", "runs/424242", "metrics", "healthz", "x"):
        assert PASSWORD not in request(f"{dash.url}{path}").text
    # a database that is down: 503 with the reason, never the password
    params = conninfo_to_dict(with_password(dsn))
    params.update(host="127.0.0.1", port="1", connect_timeout="2")
    with running_dashboard(fast_config(make_conninfo(**params))) as down:
        health = request(f"{down.url}healthz")
        assert health.status == 503 and health.text.startswith(
            "unavailable: cannot connect to the database"
        )
        page = request(down.url)
        assert page.status == 503 and "cannot connect to the database" in page.text
        metrics = request(f"{down.url}metrics")
        assert metrics.status == 200 and "leasework_database_up 0.0" in metrics.text
        for r in (health, page, metrics):
            assert PASSWORD not in r.text


def test_schema_missing_is_503(server_dsn: str, conn: Conn) -> None:
    with running_dashboard(fast_config(without_schema(server_dsn))) as d:
        resp = request(f"{d.url}healthz")
        assert resp.status == 503 and "leasework migrate" in resp.text


def test_cli_serves_until_sigterm(dsn: str, conn: Conn) -> None:
    env = {**os.environ, "LEASEWORK_DSN": dsn}
    proc = subprocess.Popen(
        [sys.executable, "-m", "leasework", "dashboard", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert m, line
        assert request(f"{m.group(1)}healthz").status == 200
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: proc.poll() is not None, timeout=15)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_a_missing_schema_and_a_bad_port(server_dsn: str) -> None:
    env = {**os.environ, "LEASEWORK_DSN": without_schema(server_dsn)}
    run = subprocess.run(
        [sys.executable, "-m", "leasework", "dashboard", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and "leasework migrate" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "leasework", "dashboard", "--port", "70000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and "--port" in run.stderr


def test_runs_schedules_and_connections_pages(dash: Dashboard, conn: Conn) -> None:
    from leasework import App

    app = App()
    app.task("mail")(lambda ctx, payload: None)
    ids = [app.enqueue(conn, "mail", tenant="acme") for _ in range(3)]
    page = request(f"{dash.url}runs?tenant=acme&status=queued")
    assert page.status == 200
    assert all(f'href="/runs/{i}"' in page.text for i in ids)
    assert "acme" in page.text and 'form class="filters" method="get"' in page.text
    assert "no runs match" in request(f"{dash.url}runs?kind=other").text
    assert request(f"{dash.url}runs?before=abc").status == 400
    assert request(f"{dash.url}runs?status=bogus").status == 400
    assert request(f"{dash.url}schedules").status == 200
    assert request(f"{dash.url}connections").status == 200
