"""The dashboard mounted inside someone else's web application: `wsgi_app()` served by a real
WSGI server (wsgiref, on a thread) under a path prefix, through a framework-free dispatcher that
also serves the host application's own pages and its own authentication. Every link, form action,
redirect and cookie path carries the prefix; the actions work through it; the application passes
wsgiref's WSGI conformance checker (wsgiref.validate) on every request."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.validate import validator

import psycopg
import pytest

from leasework import App, Context
from leasework.dashboard import DashboardApp, wsgi_app
from leasework.errors import ConfigError
from leasework.testing import drain

from ..conftest import fast_config
from .dashboard_helpers import Client

Conn = psycopg.Connection[Any]
PREFIX = "/ops/leasework"
HOST_PASSWORD = "the-host-apps-own-login"


class Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def dispatcher(dashboard: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """The host application: its own page at /, its own authentication (a header) in front of
    everything, and the dashboard under PREFIX (SCRIPT_NAME and PATH_INFO moved as PEP 3333
    says a mount must)."""

    def host_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("HTTP_X_HOST_LOGIN") != HOST_PASSWORD:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"the host app's login is required\n"]
        path = environ.get("PATH_INFO") or "/"
        if path == PREFIX or path.startswith(PREFIX + "/"):
            environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + PREFIX
            environ["PATH_INFO"] = path[len(PREFIX) :]
            return dashboard(environ, start_response)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"the host application\n"]

    return host_app


@contextmanager
def serving(app: Callable[..., Iterable[bytes]]) -> Iterator[str]:
    server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.daemon = True
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


@pytest.fixture
def runs(conn: Conn) -> dict[str, int]:
    app = App()
    app.task("mail")(lambda ctx, payload: None)
    return {
        "queued": app.enqueue(conn, "mail", {"n": 1}),
        "other": app.enqueue(conn, "mail", {"n": 2}, key="k-é"),
    }


def test_mounted_under_a_prefix_in_wsgiref(dsn: str, conn: Conn, runs: dict[str, int]) -> None:
    app = App(fast_config(dsn))
    app.task("mail")(lambda ctx, payload: None)
    dash = wsgi_app(dsn, app=app, actions=True)
    assert isinstance(dash, DashboardApp) and dash.actions
    with serving(validator(dispatcher(validator(dash)))) as base:
        outsider = Client(base)
        assert outsider.get(PREFIX + "/").status == 403  # the host's own auth is in front
        assert outsider.get("/").status == 403
        c = Client(base, headers={"X-Host-Login": HOST_PASSWORD})
        assert c.get("/").text == "the host application\n"

        for path in ("", "/", "/runs", "/kinds", "/schedules", "/connections",
                     f"/runs/{runs['queued']}", "/runs?kind=mail&status=queued"):  # fmt: skip
            page = c.get(PREFIX + path)
            assert page.status == 200, (path, page.status)
            links = re.findall(r' (?:href|action)="([^"]*)"', page.text)
            assert links, path
            outside = [u for u in links if not u.startswith(PREFIX + "/")]
            assert not outside, (path, outside)
        fresh = Client(base, headers={"X-Host-Login": HOST_PASSWORD}).get(PREFIX + "/runs")
        assert f"Path={PREFIX}; HttpOnly; SameSite=Strict" in fresh.headers["Set-Cookie"]
        assert c.get(PREFIX + "/static/dashboard.css").status == 200
        assert c.get(PREFIX + "/healthz").text == "ok\n"
        assert "leasework_runs" in c.get(PREFIX + "/metrics").text
        assert c.get(PREFIX + "/no-such-page").status == 404

        # an action through the mount: redirected under the prefix, done in the database
        token = c.token(PREFIX + f"/runs/{runs['queued']}")
        done = c.post(PREFIX + f"/runs/{runs['queued']}/cancel", {"csrf": token})
        assert done.status == 303
        assert done.headers["Location"] == f"{PREFIX}/runs/{runs['queued']}"
        assert f"run {runs['queued']} cancelled" in c.get(done.headers["Location"]).text
        row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (runs["queued"],))
        assert row.fetchone() == ("cancelled",)
        # a filtered page is where a row's action returns to, under the prefix
        listing = c.get(PREFIX + "/runs?kind=mail")
        assert 'name="back" value="/runs?kind=mail"' in listing.text
        # the CSRF guard holds under the mount too
        refused = c.post(PREFIX + f"/runs/{runs['other']}/cancel", {"csrf": "forged"})
        assert refused.status == 403
        row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (runs["other"],))
        assert row.fetchone() == ("queued",)


def test_a_mounted_dashboard_is_read_only_unless_asked(
    dsn: str, conn: Conn, runs: dict[str, int]
) -> None:
    with serving(validator(dispatcher(wsgi_app(dsn)))) as base:
        c = Client(base, headers={"X-Host-Login": HOST_PASSWORD})
        page = c.get(PREFIX + f"/runs/{runs['queued']}")
        assert page.status == 200 and 'method="post"' not in page.text
        refused = c.post(PREFIX + f"/runs/{runs['queued']}/cancel", {"csrf": "x"})
        assert refused.status == 405
        row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (runs["queued"],))
        assert row.fetchone() == ("queued",)


def test_a_shared_secret_lets_another_process_accept_the_form(
    dsn: str, conn: Conn, runs: dict[str, int]
) -> None:
    """Two instances (as two worker processes of a WSGI server would be) with the same secret
    accept each other's tokens; with their own random secrets they do not."""
    secret = "a-secret-shared-by-the-processes"
    one, two = wsgi_app(dsn, actions=True, secret=secret), wsgi_app(dsn, actions=True, secret=secret)
    three = wsgi_app(dsn, actions=True)
    with serving(one) as a, serving(two) as b, serving(three) as other:
        first = Client(a)
        token = first.token(f"/runs/{runs['queued']}")
        stranger = Client(other)
        stranger.cookies = dict(first.cookies)
        assert stranger.post(f"/runs/{runs['queued']}/cancel", {"csrf": token}).status == 403
        second = Client(b)
        second.cookies = dict(first.cookies)
        assert second.post(f"/runs/{runs['queued']}/cancel", {"csrf": token}).status == 303
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (runs["queued"],))
    assert row.fetchone() == ("cancelled",)


def test_wsgi_app_refuses_bad_arguments_in_one_line(dsn: str) -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        wsgi_app(dsn, secret="short")
    with pytest.raises(ConfigError, match="16-4096 characters"):
        wsgi_app(dsn, token="short")
    with pytest.raises(ConfigError, match="malformed"):
        wsgi_app("host=x port=notanumber =oops", config=fast_config(dsn))


def test_a_runs_page_shows_its_durable_steps_escaped(dsn: str, conn: Conn) -> None:
    """The run page lists the run's durable steps (ctx.step, as `leasework show` does): name,
    when stored, attempt, size and the start of the stored value, every part escaped: a value
    (or a name) holding markup is shown as text, never run."""
    app = App()

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> Any:
        ctx.step("fetch <b>", lambda: {"html": "<script>alert(1)</script>"})
        ctx.step("long", lambda: "x" * 500)
        return None

    run_id = app.enqueue(conn, "job")
    plain = app.enqueue(conn, "job", {}, delay=3600)  # no steps: no section
    drain(app, dsn, ["job"])
    with serving(validator(dispatcher(wsgi_app(dsn)))) as base:
        c = Client(base, headers={"X-Host-Login": HOST_PASSWORD})
        page = c.get(PREFIX + f"/runs/{run_id}")
        assert page.status == 200
        section = page.text[page.text.index('<section id="steps">') :]
        section = section[: section.index("</section>")]
        assert "Durable steps (2)" in section
        assert "<script>" not in page.text and "<b>" not in section
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in section
        assert "fetch &lt;b&gt;" in section
        stored = conn.execute(
            "SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
            " FROM leasework.run_steps WHERE run_id = %s AND name = 'long'",
            (run_id,),
        ).fetchone()
        assert stored is not None and stored[0] in section
        assert '"' + "x" * 119 + "…" in section.replace("&quot;", '"')  # a short view
        assert "x" * 200 not in section
        assert 'id="steps"' not in c.get(PREFIX + f"/runs/{plain}").text
