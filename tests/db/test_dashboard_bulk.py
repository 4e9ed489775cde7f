"""The dashboard's bulk actions as a plain WSGI application, called in this process: the runs list
searched (error, payload, tag) with its checkboxes and "all N matching this filter"; a bulk
action answered first by a confirm page that changes nothing, then done (each checked in the
database) and audited in the log (`dashboard_bulk_action`: who, which ids or filter, how many);
the CSRF token required; a state conflict a 409 that changes nothing."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode
from wsgiref.util import setup_testing_defaults

import psycopg
import pytest

from leasework import App
from leasework.dashboard import DashboardApp, wsgi_app

from ..conftest import fast_config

Conn = psycopg.Connection[Any]
TOKEN = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str


class Browser:
    """Calls the WSGI app in this process, keeping its cookies, as one client at REMOTE_ADDR."""

    def __init__(self, app: DashboardApp, remote: str = "203.0.113.9", user: str | None = None):
        self.app = app
        self.cookies: dict[str, str] = {}
        self.remote = remote
        self.user = user

    def call(self, method: str, path: str, fields: Sequence[tuple[str, str]] = ()) -> Answer:
        body = urlencode(list(fields)).encode()
        path, _, query = path.partition("?")
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        environ.update(
            REQUEST_METHOD=method,
            PATH_INFO=path,
            QUERY_STRING=query,
            REMOTE_ADDR=self.remote,
            HTTP_COOKIE="; ".join(f"{k}={v}" for k, v in self.cookies.items()),
        )
        if self.user:
            environ["REMOTE_USER"] = self.user
        if method == "POST":
            environ.update(
                CONTENT_TYPE="application/x-www-form-urlencoded",
                CONTENT_LENGTH=str(len(body)),
            )
            environ["wsgi.input"] = io.BytesIO(body)
        got: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            got["status"] = int(status.split()[0])
            got["headers"] = headers

        out = b"".join(self.app(environ, start_response))
        for name, value in got["headers"]:
            if name == "Set-Cookie":
                key, _, rest = value.partition("=")
                self.cookies[key] = rest.split(";")[0]
        return Answer(got["status"], dict(got["headers"]), out.decode())

    def token(self, path: str) -> str:
        page = self.call("GET", path)
        assert page.status == 200, page.text
        found = TOKEN.search(page.text)
        assert found, "no form on " + path
        return found.group(1)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [dict(r.fields) for r in self.records if r.getMessage() == name]  # type: ignore[attr-defined]


@pytest.fixture
def audit() -> Iterator[Records]:
    logger = logging.getLogger("leasework")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def make_app() -> App:
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    return app


def statuses(conn: Conn, ids: Sequence[int]) -> list[str]:
    rows = conn.execute(
        "SELECT status FROM leasework.runs WHERE id = ANY(%s) ORDER BY id", (list(ids),)
    ).fetchall()
    return [str(r[0]) for r in rows]


def test_bulk_cancel_by_filter_confirms_acts_and_audits(
    dsn: str, conn: Conn, audit: Records
) -> None:
    app = make_app()
    eu = app.enqueue_many(conn, "mail", [{"account": 42}] * 3, tags=["eu"])
    us = app.enqueue(conn, "mail", {"account": 42}, tags=["us"])
    b = Browser(wsgi_app(app=app.with_config(fast_config(dsn)), actions=True), user="alice")
    page = b.call("GET", "/runs?kind=mail&tag=eu&payload=%7B%22account%22%3A+42%7D")
    assert page.status == 200
    assert 'id="bulk"' in page.text and '<span id="matching">3</span>' in page.text
    assert page.text.count('name="id" value=') == 3 and 'form="bulk"' in page.text
    token = TOKEN.search(page.text)
    assert token is not None
    fields = [
        ("csrf", token.group(1)),
        ("back", "/runs?kind=mail&tag=eu"),
        ("scope", "filter"),
        ("filter_kind", "mail"),
        ("filter_tag", "eu"),
        ("action", "cancel"),
    ]
    # no token: 403, nothing changed
    refused = b.call("POST", "/runs/bulk", [f for f in fields if f[0] != "csrf"])
    assert refused.status == 403
    # step one: the confirm page, nothing changed yet
    confirm = b.call("POST", "/runs/bulk", fields)
    assert confirm.status == 200 and 'id="confirm-count">3<' in confirm.text
    assert "every run matching kind=mail tag=eu" in confirm.text
    assert statuses(conn, [*eu, us]) == ["queued"] * 4
    assert not audit.events("dashboard_bulk_action")
    # step two: done, 303 back to the list, audited
    done = b.call("POST", "/runs/bulk", [*fields, ("confirm", "yes")])
    assert done.status == 303 and done.headers["Location"] == "/runs?kind=mail&tag=eu"
    assert statuses(conn, [*eu, us]) == ["cancelled"] * 3 + ["queued"]
    (line,) = audit.events("dashboard_bulk_action")
    assert line["action"] == "cancel" and line["scope"] == "filter"
    assert line["filter"] == "kind=mail tag=eu" and line["ids"] is None
    assert line["count"] == 3 and line["client"] == "203.0.113.9" and line["user"] == "alice"
    assert "3 run(s) cancelled" in line["outcome"]
    assert "3 run(s) cancelled" in b.call("GET", "/runs").text  # the flash


def test_bulk_retry_of_ticked_runs_and_a_conflict(
    dsn: str, conn: Conn, audit: Records
) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "mail", [{}, {}, {}])
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now(), error = 'x' "
        "WHERE id = ANY(%s)",
        (ids[:2],),
    )
    b = Browser(wsgi_app(app=app.with_config(fast_config(dsn)), actions=True))
    token = b.token("/runs")
    ticked = [("id", str(i)) for i in ids[:2]]
    base = [("csrf", token), ("back", "/runs"), ("scope", "ids"), ("action", "retry")]
    confirm = b.call("POST", "/runs/bulk", [*base, *ticked])
    assert confirm.status == 200 and 'id="confirm-count">2<' in confirm.text
    assert confirm.text.count('name="id" value=') == 2  # the ticked runs travel on
    done = b.call("POST", "/runs/bulk", [*base, *ticked, ("confirm", "yes")])
    assert done.status == 303
    assert statuses(conn, ids) == ["queued"] * 3
    (line,) = audit.events("dashboard_bulk_action")
    assert line["ids"] == ids[:2] and line["filter"] is None and line["count"] == 2
    # retrying a queued run: 409, one line, nothing changed
    before = conn.execute("SELECT * FROM leasework.runs ORDER BY id").fetchall()
    conflict = b.call("POST", "/runs/bulk", [*base, ("id", str(ids[2])), ("confirm", "yes")])
    assert conflict.status == 409 and f"run {ids[2]} is queued" in conflict.text
    assert conn.execute("SELECT * FROM leasework.runs ORDER BY id").fetchall() == before
    # nothing ticked, or all matching without a filter: 400
    assert b.call("POST", "/runs/bulk", [*base, ("confirm", "yes")]).status == 400
    nofilter = [("csrf", token), ("scope", "filter"), ("action", "delete"), ("confirm", "yes")]
    assert b.call("POST", "/runs/bulk", nofilter).status == 400
    assert len(audit.events("dashboard_bulk_action")) == 1


def test_a_read_only_dashboard_draws_no_bulk_form(dsn: str, conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "mail", tags=["eu"])
    b = Browser(wsgi_app(app=app.with_config(fast_config(dsn)), actions=False))
    page = b.call("GET", "/runs?tag=eu")
    assert page.status == 200 and ">eu<" in page.text
    assert 'id="bulk"' not in page.text and 'name="id"' not in page.text
    assert b.call("POST", "/runs/bulk", [("action", "cancel")]).status == 405
    assert b.call("GET", "/runs?payload=%7Bnope").status == 400
