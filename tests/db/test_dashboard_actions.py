"""The dashboard's actions over plain HTTP (no browser, so these run wherever Postgres does):
cancel, retry, delete, pause and resume as POST forms, each checked in the database; the CSRF
token required (missing, empty, wrong, truncated or a prefix of the right one, from another
dashboard, without its cookie, posted from another site: 403 and nothing changed); bad input
(unknown id, live run to retry or delete, finished run to cancel, unknown kind to pause or
resume) a one-line 4xx page changing nothing; a read-only dashboard drawing no form and refusing
every POST; beyond loopback, the token still in front."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from leasework import App
from leasework.dashboard import web
from leasework.workers.worker import Worker

from ..conftest import fast_config
from .dashboard_helpers import Client, Scenario, populate, request, running_dashboard

Conn = psycopg.Connection[Any]
TOKEN = "an-operator-token-long-enough"


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def state(conn: Conn) -> tuple[list[Any], list[Any]]:
    runs = conn.execute(
        "SELECT id, status, attempts, max_attempts, cancel_requested_at, queued_at "
        "FROM leasework.runs ORDER BY id"
    ).fetchall()
    paused = conn.execute("SELECT kind FROM leasework.paused_kinds ORDER BY kind").fetchall()
    return runs, paused


def status_of(conn: Conn, run_id: int) -> str | None:
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


@pytest.fixture
def scenario(conn: Conn, make_worker: Callable[..., Worker]) -> tuple[Scenario, int]:
    """populate()'s runs (succeeded, failed, running...) plus a queued `mail` run."""
    s = populate(conn, make_worker)
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    return s, app.enqueue(conn, "mail", {"to": "ops"})


@pytest.fixture
def acting(dsn: str) -> Iterator[Any]:
    with running_dashboard(fast_config(dsn), actions=True) as d:
        yield d


def test_every_action_changes_the_database_and_redirects(
    acting: Any, scenario: tuple[Scenario, int], conn: Conn
) -> None:
    s, queued = scenario
    c = Client(acting.url)
    page = c.get(f"/runs/{queued}")
    assert page.status == 200 and 'data-action="cancel"' in page.text
    assert "leasework_csrf" in c.cookies
    cookie_line = page.headers.get("Set-Cookie") or ""
    assert "HttpOnly" in cookie_line and "SameSite=Strict" in cookie_line and "Path=/" in cookie_line
    token = c.token(f"/runs/{queued}")

    # cancel a queued run: 303 back to its page, which shows the outcome once
    done = c.post(f"/runs/{queued}/cancel", {"csrf": token, "back": f"/runs/{queued}"})
    assert done.status == 303 and done.headers["Location"] == f"/runs/{queued}"
    assert status_of(conn, queued) == "cancelled"
    shown = c.get(done.headers["Location"])
    assert f"run {queued} cancelled" in shown.text and 'id="flash"' in shown.text
    assert 'id="flash"' not in c.get(f"/runs/{queued}").text  # once

    # cancel a running run: requested, its worker stops at its next control check
    done = c.post(f"/runs/{s.indexing}/cancel", {"csrf": token, "back": "/"})
    assert done.status == 303 and done.headers["Location"] == "/"
    row = conn.execute(
        "SELECT status, cancel_requested_at FROM leasework.runs WHERE id = %s", (s.indexing,)
    ).fetchone()
    assert row is not None and row[0] == "running" and row[1] is not None

    # retry a failed run: queued again, with a fresh attempt budget and its history kept
    done = c.post(f"/runs/{s.broken}/retry", {"csrf": token, "back": "/runs?status=failed"})
    assert done.status == 303 and done.headers["Location"] == "/runs?status=failed"
    run = conn.execute(
        "SELECT status, attempts, max_attempts, jsonb_array_length(history) "
        "FROM leasework.runs WHERE id = %s",
        (s.broken,),
    ).fetchone()
    assert run is not None and run[0] == "queued" and run[2] > run[1] >= 1 and run[3] >= 1

    # delete a finished run: gone, back to the list (its own page would be a 404)
    done = c.post(
        f"/runs/{s.report}/delete", {"csrf": token, "back": f"/runs/{s.report}", "confirm": "yes"}
    )
    assert done.status == 303 and done.headers["Location"] == "/runs"
    assert status_of(conn, s.report) is None
    assert f"run {s.report} deleted" in c.get("/runs").text

    # pause and resume a kind
    done = c.post("/kinds/pause", {"csrf": token, "back": "/kinds", "kind": "mail"})
    assert done.status == 303 and done.headers["Location"] == "/kinds"
    assert state(conn)[1] == [("mail",)]
    kinds = c.get("/kinds")
    assert "kind mail paused" in kinds.text and 'data-action="resume"' in kinds.text
    again = c.post("/kinds/pause", {"csrf": token, "kind": "mail"})
    assert again.status == 303 and "already paused" in c.get("/kinds").text
    done = c.post("/kinds/resume", {"csrf": token, "kind": "mail"})
    assert done.status == 303 and done.headers["Location"] == "/kinds"
    assert state(conn)[1] == []
    again = c.post("/kinds/resume", {"csrf": token, "kind": "mail"})  # idempotent, as pause
    assert again.status == 303 and "kind mail was not paused" in c.get("/kinds").text


def test_limits_are_set_and_reset_from_the_kinds_page(
    acting: Any, scenario: tuple[Scenario, int], conn: Conn
) -> None:
    c = Client(acting.url)
    page = c.get("/kinds")
    assert 'data-action="limits"' in page.text and 'name="max_running"' in page.text
    token = c.token("/kinds")
    before = conn.execute("SELECT * FROM leasework.kind_limits").fetchall()
    for extra, code, words in [
        ({"max_running": "two"}, 409, "max_running must be a whole number or none"),
        ({"max_running": "0"}, 409, "max_running must be an integer from 1"),
        ({"rate": "fast"}, 409, "rate 'fast' is not valid"),
        ({}, 409, "no limit given"),
    ]:
        refused = c.post("/kinds/limits", {"csrf": token, "kind": "mail", **extra})
        assert refused.status == code, (extra, refused.status, refused.text[-400:])
        line = re.search(r'id="error-line">([^<]*)<', refused.text)
        assert line and words in line.group(1).replace("&#x27;", "'"), refused.text[-400:]
    assert conn.execute("SELECT * FROM leasework.kind_limits").fetchall() == before
    done = c.post(
        "/kinds/limits",
        {"csrf": token, "kind": "mail", "max_running": "2", "rate": "10/m", "group_limit": ""},
    )
    assert done.status == 303 and done.headers["Location"] == "/kinds"
    row = conn.execute("SELECT max_running, rate_count, rate_seconds, group_limit"
                       " FROM leasework.kind_limits WHERE kind = 'mail'").fetchone()  # fmt: skip
    assert row == (2, 10, 60.0, None)
    kinds = c.get("/kinds").text
    assert "kind mail: max_running 2, rate 10/m" in kinds
    assert "max_running 2*, rate 10/1m*" in kinds and 'data-action="reset-limits"' in kinds
    done = c.post("/kinds/reset-limits", {"csrf": token, "kind": "mail"})
    assert done.status == 303
    assert "max_running, rate reset" in c.get("/kinds").text
    assert conn.execute("SELECT count(*) FROM leasework.kind_limits").fetchone() == (0,)


@pytest.mark.parametrize(
    "forge",
    [
        "no token",
        "empty token",
        "wrong token",
        "truncated token",
        "a prefix of the token",
        "no cookie",
        "another dashboard's token",
        "cross-site",
    ],
)
def test_a_post_without_the_right_token_is_refused_and_changes_nothing(
    acting: Any, scenario: tuple[Scenario, int], conn: Conn, dsn: str, forge: str
) -> None:
    s, queued = scenario
    c = Client(acting.url)
    token = c.token(f"/runs/{queued}")
    fields = {"csrf": token, "back": "/"}
    headers: dict[str, str] = {}
    if forge == "no token":
        del fields["csrf"]
    elif forge == "empty token":
        fields["csrf"] = ""
    elif forge == "truncated token":  # the right token less its last character
        fields["csrf"] = token[:-1]
    elif forge == "a prefix of the token":
        fields["csrf"] = token[:1]
    elif forge == "wrong token":
        fields["csrf"] = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    elif forge == "no cookie":
        c.cookies.clear()
    elif forge == "another dashboard's token":
        with running_dashboard(fast_config(dsn), actions=True) as other:
            elsewhere = Client(other.url)
            fields["csrf"] = elsewhere.token(f"/runs/{queued}")
            c.cookies = dict(elsewhere.cookies)  # its cookie too: signed by another secret
    elif forge == "cross-site":
        headers["Sec-Fetch-Site"] = "cross-site"
    before = state(conn)
    for path, extra in (
        (f"/runs/{queued}/cancel", {}),
        (f"/runs/{s.broken}/retry", {}),
        (f"/runs/{s.report}/delete", {}),
        ("/kinds/pause", {"kind": "mail"}),
    ):
        refused = c.post(path, {**fields, **extra}, headers)
        assert refused.status == 403, (forge, path, refused.status)
        assert "nothing changed" in refused.text
        line = re.search(r'id="error-line">([^<]*)<', refused.text)
        assert line and "\n" not in line.group(1)
    assert state(conn) == before


def test_bad_input_is_a_one_line_4xx_and_changes_nothing(
    acting: Any, scenario: tuple[Scenario, int], conn: Conn
) -> None:
    s, queued = scenario
    c = Client(acting.url)
    token = c.token(f"/runs/{queued}")
    before = state(conn)
    cases = [
        (f"/runs/{10**12}/cancel", {}, 404, "no run with id"),
        (f"/runs/{10**12}/retry", {}, 404, "no run with id"),
        (f"/runs/{10**12}/delete", {"confirm": "yes"}, 404, "no run with id"),
        (f"/runs/{queued}/retry", {}, 409, "is queued: only a finished run can be retried"),
        (f"/runs/{s.indexing}/delete", {"confirm": "yes"}, 409, "is running: only a finished"),
        (f"/runs/{queued}/delete", {"confirm": "yes"}, 409, "cancel it first"),
        (f"/runs/{s.report}/delete", {}, 400, "delete needs its confirm box ticked"),
        (f"/runs/{s.report}/delete", {"confirm": "no"}, 400, "delete needs its confirm box"),
        (f"/runs/{s.report}/cancel", {}, 409, "is already succeeded: nothing to cancel"),
        (f"/runs/{s.report}/retry", {}, 409, "only failed, cancelled, partial runs"),
        ("/kinds/pause", {"kind": "no-such-kind"}, 404, "unknown kind 'no-such-kind'"),
        ("/kinds/resume", {"kind": "no-such-kind"}, 404, "unknown kind 'no-such-kind'"),
        ("/kinds/pause", {"kind": ""}, 400, "kind must be 1-200 characters"),
        (f"/runs/{2**63}/cancel", {}, 400, "positive 64-bit integer"),
        ("/runs/1/frobnicate", {}, 404, "no action"),
    ]
    for path, extra, code, words in cases:
        refused = c.post(path, {"csrf": token, **extra})
        assert refused.status == code, (path, refused.status, refused.text[-400:])
        line = re.search(r'id="error-line">([^<]*)<', refused.text)
        assert line, refused.text
        text = line.group(1).replace("&#x27;", "'")
        assert words in text and "\n" not in text, (path, text)
        # the header tells the dashboard's mode on its error pages too
        assert "actions on" in refused.text and "read-only" not in refused.text, path
    missing = c.get("/no-such-page")
    assert missing.status == 404 and "actions on" in missing.text
    assert "read-only" not in missing.text
    # a form that is not a form
    assert raw(acting.port, f"POST /runs/{queued}/cancel HTTP/1.1\r\nHost: localhost\r\n"
               "Connection: close\r\n\r\n".encode()).startswith(b"HTTP/1.1 411")  # fmt: skip
    big = {"csrf": token, "pad": "x" * (web.MAX_FORM + 1)}
    assert c.post(f"/runs/{queued}/cancel", big).status == 413
    json_body = c.send(
        f"/runs/{queued}/cancel",
        method="POST",
        data=b'{"csrf": "x"}',
        headers={"Content-Type": "application/json"},
    )
    assert json_body.status == 415
    assert state(conn) == before
    # an open redirect through `back` is not followed: the run's own page instead
    done = c.post(f"/runs/{queued}/cancel", {"csrf": token, "back": "//evil.example/x"})
    assert done.status == 303 and done.headers["Location"] == f"/runs/{queued}"


def test_a_read_only_dashboard_draws_no_form_and_refuses_every_action(
    dsn: str, scenario: tuple[Scenario, int], conn: Conn
) -> None:
    s, queued = scenario
    with running_dashboard(fast_config(dsn)) as ro, running_dashboard(
        fast_config(dsn), actions=True
    ) as rw:
        token = Client(rw.url).token(f"/runs/{queued}")  # a real token, from elsewhere
        c = Client(ro.url)
        for path in ("/", "/runs", f"/runs/{queued}", f"/runs/{s.broken}", "/kinds"):
            page = c.get(path)
            assert page.status == 200 and 'method="post"' not in page.text, path
            assert "read-only" in page.text
        assert "leasework_csrf" not in c.cookies
        before = state(conn)
        for path in (f"/runs/{queued}/cancel", f"/runs/{s.broken}/retry", "/kinds/pause"):
            refused = c.post(path, {"csrf": token, "kind": "mail"})
            assert refused.status == 405 and refused.headers["Allow"] == "GET, HEAD"
            assert "actions are off" in refused.text and "read-only" in refused.text
        assert "read-only" in c.get("/no-such-page").text
        assert state(conn) == before


def test_the_config_setting_turns_actions_on(dsn: str, scenario: tuple[Scenario, int]) -> None:
    _, queued = scenario
    with running_dashboard(fast_config(dsn, dashboard_actions=True)) as d:
        assert 'data-action="cancel"' in Client(d.url).get(f"/runs/{queued}").text
    with running_dashboard(fast_config(dsn, dashboard_actions=True), actions=False) as d:
        assert 'method="post"' not in Client(d.url).get(f"/runs/{queued}").text


def test_beyond_loopback_actions_stay_behind_the_token(
    dsn: str, scenario: tuple[Scenario, int], conn: Conn
) -> None:
    _, queued = scenario
    with running_dashboard(fast_config(dsn), host="0.0.0.0", token=TOKEN, actions=True) as d:
        url = f"http://127.0.0.1:{d.port}/"
        stranger = Client(url)
        assert stranger.get(f"/runs/{queued}").status == 401
        assert "leasework_csrf" not in stranger.cookies  # no token to steal without the password
        operator = Client(url, headers={"Authorization": f"Bearer {TOKEN}"})
        token = operator.token(f"/runs/{queued}")
        stranger.cookies = dict(operator.cookies)  # even with the operator's cookie and field
        assert stranger.post(f"/runs/{queued}/cancel", {"csrf": token}).status == 401
        assert status_of(conn, queued) == "queued"
        assert operator.post(f"/runs/{queued}/cancel", {"csrf": token}).status == 303
        assert status_of(conn, queued) == "cancelled"


def test_a_refused_post_body_is_never_read_as_the_next_request(
    acting: Any, scenario: tuple[Scenario, int]
) -> None:
    """A POST refused before its body is read closes the connection, so a body crafted to look
    like a request is never served as one."""
    _, queued = scenario
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    data = (
        f"POST /runs/{queued}/cancel HTTP/1.1\r\nHost: localhost\r\n"
        "Content-Type: text/plain\r\n"
        f"Content-Length: {len(smuggled)}\r\n\r\n"
    ).encode() + smuggled
    answer = raw(acting.port, data)
    assert answer.startswith(b"HTTP/1.1 415"), answer[:80]
    assert answer.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in answer
    assert request(f"{acting.url}healthz").status == 200


@pytest.mark.parametrize("how", ["flag", "env"])
def test_leasework_dashboard_turns_actions_on_by_flag_or_setting(
    dsn: str, conn: Conn, tmp_path: Any, how: str
) -> None:
    """The command itself: `--actions` or LEASEWORK_DASHBOARD_ACTIONS, with the app named (so
    a retry gets its task's budget), says so on start and serves the forms; a cancel works."""
    (tmp_path / "dashapp.py").write_text(
        "from leasework import App\napp = App()\n"
        "@app.task('mail', max_attempts=7)\ndef mail(ctx, payload):\n    return None\n"
    )
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    queued = app.enqueue(conn, "mail", {})
    env = {**os.environ, "LEASEWORK_DSN": dsn, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["--app", "dashapp:app"]
    if how == "flag":
        args.append("--actions")
    else:
        env["LEASEWORK_DASHBOARD_ACTIONS"] = "true"
    proc = subprocess.Popen(
        [sys.executable, "-m", "leasework", "dashboard", "--port", "0", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/) \(actions on;", line)
        assert m, line
        c = Client(m.group(1))
        token = c.token(f"/runs/{queued}")
        assert c.post(f"/runs/{queued}/cancel", {"csrf": token}).status == 303
        assert status_of(conn, queued) == "cancelled"
        assert c.post(f"/runs/{queued}/retry", {"csrf": token}).status == 303
        row = conn.execute("SELECT status, max_attempts FROM leasework.runs WHERE id = %s", (queued,))
        assert row.fetchone() == ("queued", 7)  # the task's budget, known through --app
        assert "mail" in c.get("/kinds").text
    finally:
        proc.terminate()
        proc.wait(timeout=15)
