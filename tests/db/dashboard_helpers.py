"""A populated database for the dashboard tests, made through the real paths (enqueue, claim,
checkpoint, poll), and a running dashboard on a free port."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from leasework import App, Context
from leasework.config import Config
from leasework.dashboard import Dashboard
from leasework.leases import lease
from leasework.workers import presence
from leasework.workers.worker import Worker

from ..conftest import expire_lease, make_due, wait_for

Conn = psycopg.Connection[Any]

HOSTILE_KEY = '<script>alert("key")</script>'
HOSTILE_TENANT = '"><img src=x onerror=alert(1)>'
HOSTILE_ERROR = "<img src=x onerror=alert('error')> went wrong"
HOSTILE_PAYLOAD = {"note": "</pre><script>alert('payload')</script>"}
TABLES_RESULT = {
    "tables": {
        "users": {"status": "ok", "upserted": 3, "tombstoned": 1, "error": None},
        "orders": {"status": "failed", "upserted": 0, "tombstoned": 0, "error": "HTTP 503 <b>"},
    }
}


@dataclass
class Scenario:
    report: int  # succeeded, per-table results, hostile key/tenant/payload
    flaky: int  # failed once, succeeded on its second attempt
    broken: int  # failed for good, hostile error
    expired: int  # its first worker's lease ran out; reclaimed and finished
    crashed: int  # its first worker died (the supervisor's fast release); reclaimed and finished
    indexing: int  # running, 4 of 10 units done, held by worker "w-indexer"
    indexing_claim: lease.Claim  # to move its progress on


def make_app() -> App:
    app = App()

    @app.task("send_report")
    def send_report(ctx: Context, payload: Any) -> Any:
        return TABLES_RESULT

    @app.task("flaky")
    def flaky(ctx: Context, payload: Any) -> Any:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return {"ok": True}

    @app.task("broken", max_attempts=1)
    def broken(ctx: Context, payload: Any) -> Any:
        raise RuntimeError(HOSTILE_ERROR)

    @app.task("steady")
    def steady(ctx: Context, payload: Any) -> Any:
        return {"done": True}

    @app.task("index_docs")
    def index_docs(ctx: Context, payload: Any) -> Any:  # claimed by hand below, never run here
        raise AssertionError("index_docs is held by another worker in these tests")

    return app


def populate(conn: Conn, make_worker: Callable[..., Worker]) -> Scenario:
    app = make_app()
    report = app.enqueue(
        conn, "send_report", HOSTILE_PAYLOAD, key=HOSTILE_KEY, tenant=HOSTILE_TENANT
    )
    flaky = app.enqueue(conn, "flaky", {})
    broken = app.enqueue(conn, "broken", {})
    expired = app.enqueue(conn, "steady", {"which": "expired"})
    crashed = app.enqueue(conn, "steady", {"which": "crashed"})
    indexing = app.enqueue(conn, "index_docs", {"documents": 10})

    # Two workers claim a run each and go away: one silently (its lease runs out), one seen dead
    # by its supervisor (fast release, recorded as a crash). A third holds index_docs, 4 of 10.
    (gone,) = lease.claim_runs(conn, ["steady"], worker="w-silent", lease=60.0)
    (dead,) = lease.claim_runs(conn, ["steady"], worker="w-crashed", lease=60.0)
    assert {gone.id, dead.id} == {expired, crashed}
    expire_lease(conn, expired)
    assert lease.expire_worker_leases(conn, "w-crashed", "child killed by signal 9") == [crashed]
    (held,) = lease.claim_runs(conn, ["index_docs"], worker="w-indexer", lease=600.0)
    assert lease.checkpoint(conn, held, 4, 10)
    presence.upsert_worker(conn, "w-indexer", "host-<1>", 4242, indexing)

    worker = make_worker(app)

    def settled() -> bool:
        worker.poll()
        rows = conn.execute(
            "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status = 'queued'",
            ([report, flaky, broken, expired, crashed],),
        ).fetchone()
        queued = rows[0] if rows else 0
        if queued:
            make_due(conn, flaky)
        return queued == 0

    wait_for(settled)
    return Scenario(report, flaky, broken, expired, crashed, indexing, held)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


def request(
    url: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
) -> Response:
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return Response(resp.status, dict(resp.headers.items()), resp.read())
    except urllib.error.HTTPError as err:
        return Response(err.code, dict(err.headers.items()), err.read())


@contextmanager
def running_dashboard(cfg: Config, **kwargs: Any) -> Iterator[Dashboard]:
    dash = Dashboard(cfg, host=kwargs.pop("host", "127.0.0.1"), port=0, **kwargs)
    dash.start()
    try:
        yield dash
    finally:
        dash.close()


class Client:
    """A browser's part over plain HTTP: keeps the dashboard's cookies, follows no redirect, and
    reads the CSRF token from a page's forms."""

    TOKEN = re.compile(r'name="csrf" value="([^"]+)"')

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base = base.rstrip("/")
        self.cookies: dict[str, str] = {}
        self.headers = headers or {}

    def _opener(self) -> urllib.request.OpenerDirector:
        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: Any, **kwargs: Any) -> None:
                return None

        return urllib.request.build_opener(NoRedirect)

    def send(
        self,
        path: str,
        *,
        method: str = "GET",
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        hdrs = {**self.headers, **(headers or {})}
        if self.cookies:
            hdrs["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        req = urllib.request.Request(self.base + path, method=method, headers=hdrs, data=data)
        try:
            resp = self._opener().open(req, timeout=20)
            status, msg, body = resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as err:
            status, msg, body = err.code, err.headers, err.read()
        for value in msg.get_all("Set-Cookie") or []:
            name, _, rest = value.partition("=")
            val = rest.split(";", 1)[0]
            if "Max-Age=0" in value:
                self.cookies.pop(name, None)
            else:
                self.cookies[name] = val
        return Response(status, dict(msg.items()), body)

    def get(self, path: str) -> Response:
        return self.send(path)

    def token(self, path: str) -> str:
        page = self.get(path)
        assert page.status == 200, page.text
        found = self.TOKEN.search(page.text)
        assert found, "no action form on " + path
        return found.group(1)

    def post(
        self, path: str, fields: dict[str, str], headers: dict[str, str] | None = None
    ) -> Response:
        body = urllib.parse.urlencode(fields).encode()
        return self.send(
            path,
            method="POST",
            data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **(headers or {})},
        )
