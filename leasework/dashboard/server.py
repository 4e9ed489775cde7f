"""The dashboard's HTTP server: the standard library's threading server, GET and HEAD only, one
read-only database session per request (at most four at once). Never writes: the sessions refuse
writes, and every other method is answered 405."""

from __future__ import annotations

import base64
import hmac
import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg

from .. import __version__, db, log, operations, status
from ..config import Config
from ..errors import ConfigError, LeaseworkError, SchemaMissing
from ..queries import load
from . import metrics, pages

Q = load("leasework.dashboard", "dashboard.sql")
RUNS = load("leasework", "runs.sql")

# A session per request: a database that is down is reported at once (a pool would wait out its
# timeout), and no connection is left stale across a database restart. A refresh storm still
# cannot take more than SESSIONS connections from Postgres.
SESSIONS = 4
SESSION_WAIT = 5.0  # seconds a request waits for a free session before answering 503
STATEMENT_TIMEOUT = "10s"
RECENT_RUNS = 25
RUNS_PAGE = 50
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_CONNECTIONS = 32  # open connections at once; more are answered 503 and closed
REQUEST_DEADLINE = 30.0  # seconds from a request's first byte to its answer, however it trickles

_RUN_PATH = re.compile(r"^/runs/([0-9]{1,18})/?$")

# No script anywhere; styles only from our own stylesheet; not to be framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; base-uri 'none'; "
        "form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class BadRequest(Exception):
    """A query parameter that makes no sense: 400 with one line."""


class Unavailable(Exception):
    """The database did not answer (or has no leasework schema): 503, with a password-free line."""


class Dashboard:
    """Owns the listening socket. `serve_forever()` in the foreground (the CLI) or
    `start()` on a thread (tests); `close()` stops both."""

    def __init__(
        self,
        cfg: Config,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        allow_hosts: Iterable[str] = (),
        token: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.token = token or None
        if not is_loopback(host) and self.token is None:
            raise ConfigError(
                f"dashboard: --host {host} listens beyond loopback, where anyone who reaches it "
                "could read every run's payload: give a token requests must carry "
                "(LEASEWORK_DASHBOARD_TOKEN or --token-file FILE), or listen on 127.0.0.1"
            )
        self._sessions = threading.BoundedSemaphore(SESSIONS)
        try:
            server = _Server6 if ":" in host else _Server
            self.httpd = server((host, port), _Handler)
        except OSError as exc:
            raise ConfigError(
                f"dashboard: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self.httpd.dashboard = self
        self.host, self.port = host, int(self.httpd.server_address[1])
        self.allowed_hosts = _allowed_hosts(host, self.port, allow_hosts)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.serve_forever, name="leasework-dashboard", daemon=True
        )
        self._thread.start()

    def shutdown(self) -> None:
        """Stop serve_forever() from another thread (or a signal handler's thread)."""
        threading.Thread(target=self.httpd.shutdown, daemon=True).start()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()

    # -- pages: each opens one read-only session for the length of one request ---------------

    def overview(self) -> str:
        with self.session() as conn:
            snap = status.collect(conn, heartbeat_interval=self.cfg.heartbeat_interval)
            with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
                recent = cur.execute(Q["dashboard_recent_runs"], {"limit": RECENT_RUNS}).fetchall()
                now = cur.execute(Q["dashboard_clock"]).fetchone()
                oldest = cur.execute(Q["metrics_oldest_queued"]).fetchall()
        oldest_age = max((r["age"] for r in oldest), default=None)
        return pages.overview(
            snap, recent, oldest_queued=oldest_age, now=now["now"] if now else None
        )

    def runs(self, query: dict[str, str]) -> str:
        """`/runs?status=&kind=&key=&tenant=&before=`: every run, newest first, filtered, paged."""
        filters = {k: query[k] for k in pages.RUN_FILTERS if query.get(k)}
        before = query.get("before") or None
        if before is not None and not before.isdigit():
            raise BadRequest(f"before must be a run id, got {before!r}")
        status_filter = filters.get("status")
        if status_filter is not None and status_filter not in operations.STATUSES:
            raise BadRequest(f"status must be one of {', '.join(operations.STATUSES)}")
        with self.session() as conn:
            page = operations.list_runs(
                conn,
                operations.Filters(
                    statuses=[status_filter] if status_filter else None,
                    kind=filters.get("kind"),
                    key=filters.get("key"),
                    tenant=filters.get("tenant"),
                ),
                limit=RUNS_PAGE,
                before=int(before) if before else None,
            )
            paused = operations.paused(conn)
        return pages.runs_page(
            page.runs, filters=filters, next_before=page.next_before, paused=paused
        )

    def schedules(self) -> str:
        from ..stages.schedule import list_schedules

        with self.session() as conn:
            return pages.schedules_page(list_schedules(conn))

    def connections(self) -> str:
        with self.session() as conn:
            snap = status.collect(conn, heartbeat_interval=self.cfg.heartbeat_interval)
        return pages.connections_page(snap.get("connections") or [])

    def run(self, run_id: int) -> str | None:
        with self.session() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            row = cur.execute(RUNS["get_run"], {"id": run_id}).fetchone()
            now = cur.execute(Q["dashboard_clock"]).fetchone()
        if row is None:
            return None
        return pages.run_page(row, now=now["now"] if now else None)

    def metrics(self) -> bytes:
        try:
            with self.session() as conn:
                snap = status.collect(conn, heartbeat_interval=self.cfg.heartbeat_interval)
                fams = metrics.families(
                    conn,
                    snap,
                    heartbeat_interval=self.cfg.heartbeat_interval,
                    version=__version__,
                )
        except Unavailable:
            fams = metrics.database_down(__version__)
        return metrics.exposition(fams)

    def health(self) -> None:
        """Raises Unavailable unless the database answers and has the leasework schema."""
        with self.session() as conn:
            conn.execute("SELECT 1")

    @contextmanager
    def session(self) -> Iterator[psycopg.Connection[Any]]:
        """A read-only session with the leasework schema checked. The database being down, busy
        or without the schema is Unavailable, with the reason on one password-free line."""
        if not self._sessions.acquire(timeout=SESSION_WAIT):
            raise Unavailable(f"busy: all {SESSIONS} database sessions are in use")
        try:
            try:
                conn = db.connect(
                    self.cfg.dsn,
                    application_name="leasework-dashboard",
                    connect_timeout=5,
                    pooler=self.cfg.pooler,
                )
            except LeaseworkError as exc:  # down, or a malformed DSN
                raise Unavailable(log.redact_dsn(str(exc))) from None
            with conn:
                try:
                    # One read-only transaction per request, its settings local to it (through a
                    # pooler in transaction mode a session setting would outlive the request on
                    # a server session someone else gets). Belt and braces: even a bug in a page
                    # cannot write through it.
                    conn.read_only = True
                    conn.autocommit = False
                    conn.execute(f"SET LOCAL statement_timeout = '{STATEMENT_TIMEOUT}'")
                    db.check_schema(conn)
                    yield conn
                except SchemaMissing as exc:
                    raise Unavailable(str(exc)) from None
                except psycopg.OperationalError as exc:
                    raise Unavailable(f"database unavailable: {log.first_line(exc)}") from None
        finally:
            self._sessions.release()


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP literal (brackets, an IPv4-mapped IPv6 form, any spelling of it) as one address
    object; None for a name."""
    try:
        ip = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(host: str) -> bool:
    """True for `localhost` and any loopback address however written (127.x, ::1,
    0:0:0:0:0:0:0:1, ::ffff:127.0.0.1)."""
    if host.lower() == "localhost":
        return True
    ip = _address(host)
    return ip is not None and ip.is_loopback


def _allowed_hosts(host: str, port: int, extra: Iterable[str]) -> frozenset[str] | None:
    """Host names (lower case) and addresses (normalized) accepted in the Host header when bound
    to loopback: a guard against DNS rebinding (a page on another site whose name resolves to
    127.0.0.1 must not read the dashboard). None: any (beyond loopback a token is required)."""
    if not is_loopback(host):
        return None
    allowed: set[str] = set()
    for name in {*LOOPBACK, host, *extra}:
        ip = _address(name)
        allowed.add(str(ip) if ip is not None else name.lower())
    return frozenset(allowed)


def host_allowed(header: str, allowed: frozenset[str], port: int) -> bool:
    """The Host header parsed (name or IP literal, optional port) and compared as an address
    when it is one, so no spelling of an address slips past and no other name does."""
    value = header.strip().lower()
    if not value or any(ch in value for ch in "/@?#\\ "):
        return False
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        given_port = rest[1:] if rest.startswith(":") else None
        if rest and given_port is None:
            return False
    elif value.count(":") == 1:
        name, _, given_port = value.partition(":")
    else:
        name, given_port = value, None
    if given_port is not None and given_port != str(port):
        return False
    ip = _address(name)
    return (str(ip) if ip is not None else name.rstrip(".")) in allowed


BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    + b"".join(f"{k}: {v}\r\n".encode() for k, v in SECURITY_HEADERS.items())
    + b"Connection: close\r\nContent-Length: 29\r\n\r\ntoo many connections: retry\r\n"
)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    dashboard: Dashboard
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def server_activate(self) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # one per server
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        # A connection cap: past it a client gets a short 503 at once, not a thread.
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "leasework-dashboard"
    protocol_version = "HTTP/1.1"
    # The standard library answers a request line it cannot parse as HTTP/0.9 (a bare body, no
    # status line, no headers): answer it as HTTP/1.0, with the security headers.
    default_request_version = "HTTP/1.0"
    timeout = 30  # a read that waits this long ends the connection
    _deadline: threading.Timer | None = None

    def handle_one_request(self) -> None:
        # A whole-request deadline: a client trickling a byte at a time gets REQUEST_DEADLINE
        # from when we start reading, not a fresh `timeout` per read. On expiry the socket is
        # shut, which ends whatever read or write is blocked on it.
        timer = threading.Timer(REQUEST_DEADLINE, self._expire)
        timer.daemon = True
        timer.start()
        try:
            super().handle_one_request()
        finally:
            timer.cancel()

    def _expire(self) -> None:
        self.close_connection = True
        with suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def end_headers(self) -> None:
        # Every response carries the security headers, the standard library's own errors
        # (400, 414, 431, 501...) included.
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    # -- read-only: GET and HEAD; everything else is refused ---------------------------------

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _refuse(self) -> None:
        self.close_connection = True  # its body, if any, is never read
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED,
            b"the dashboard is read-only: GET and HEAD only\n",
            "text/plain; charset=utf-8",
            head=False,
            extra={"Allow": "GET, HEAD", "Connection": "close"},
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse

    def _authorized(self, token: str) -> bool:
        """A bearer token, or HTTP Basic with the token as password (any user name), so that
        both scripts and browsers can pass it."""
        given = self.headers.get("Authorization") or ""
        scheme, _, value = given.partition(" ")
        secret = ""
        if scheme.lower() == "bearer":
            secret = value.strip()
        elif scheme.lower() == "basic":
            try:
                secret = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                secret = ""
        return hmac.compare_digest(secret.encode(), token.encode())

    def _route(self, *, head: bool) -> None:
        d = self.server.dashboard
        if d.token is not None and not self._authorized(d.token):
            self._send(
                HTTPStatus.UNAUTHORIZED,
                b"a token is required (Authorization: Bearer TOKEN, or the password)\n",
                "text/plain; charset=utf-8",
                head=head,
                extra={"WWW-Authenticate": 'Basic realm="leasework", charset="UTF-8"'},
            )
            return
        host = self.headers.get("Host") or ""
        if d.allowed_hosts is not None and not host_allowed(host, d.allowed_hosts, d.port):
            self._send(
                HTTPStatus.MISDIRECTED_REQUEST,
                b"unexpected Host header (see --allow-host)\n",
                "text/plain; charset=utf-8",
                head=head,
            )
            return
        parts = urlsplit(self.path)
        path = parts.path
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            if path == "/":
                self._html(HTTPStatus.OK, d.overview(), head=head)
            elif path in ("/runs", "/runs/"):
                self._html(HTTPStatus.OK, d.runs(query), head=head)
            elif path == "/schedules":
                self._html(HTTPStatus.OK, d.schedules(), head=head)
            elif path == "/connections":
                self._html(HTTPStatus.OK, d.connections(), head=head)
            elif (m := _RUN_PATH.match(path)) is not None:
                page = d.run(int(m.group(1)))
                if page is None:
                    self._html(
                        HTTPStatus.NOT_FOUND,
                        pages.error_page(404, f"no run {m.group(1)} (it may have been pruned)"),
                        head=head,
                    )
                else:
                    self._html(HTTPStatus.OK, page, head=head)
            elif path == "/metrics":
                self._send(HTTPStatus.OK, d.metrics(), metrics.CONTENT_TYPE, head=head)
            elif path == "/healthz":
                d.health()
                self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8", head=head)
            elif path == "/static/dashboard.css":
                self._send(HTTPStatus.OK, pages.CSS.encode(), "text/css; charset=utf-8", head=head)
            elif path == "/static/favicon.svg":
                self._send(HTTPStatus.OK, pages.FAVICON.encode(), "image/svg+xml", head=head)
            else:
                self._html(HTTPStatus.NOT_FOUND, pages.error_page(404, "no such page"), head=head)
        except BadRequest as exc:
            self._html(HTTPStatus.BAD_REQUEST, pages.error_page(400, str(exc)), head=head)
        except Unavailable as exc:
            message = log.redact_dsn(str(exc))
            if path == "/healthz":
                body = f"unavailable: {message}\n".encode()
                self._send(
                    HTTPStatus.SERVICE_UNAVAILABLE, body, "text/plain; charset=utf-8", head=head
                )
            else:
                self._html(
                    HTTPStatus.SERVICE_UNAVAILABLE, pages.error_page(503, message), head=head
                )
        except Exception as exc:
            log.event(
                "dashboard_error",
                logging.ERROR,
                path=path,
                error=log.redact_dsn(f"{type(exc).__name__}: {exc}"),
            )
            self._html(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                pages.error_page(500, "internal error (logged)"),
                head=head,
            )

    def _html(self, code: HTTPStatus, page: str, *, head: bool) -> None:
        self._send(code, page.encode(), "text/html; charset=utf-8", head=head)

    def _send(
        self,
        code: HTTPStatus,
        body: bytes,
        content_type: str,
        *,
        head: bool,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        log.event(
            "dashboard_request",
            logging.DEBUG,
            client=self.client_address[0],
            request=format % args,
        )
