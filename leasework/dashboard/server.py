"""`leasework dashboard`: the dashboard's WSGI application (web.py) served by the standard
library's threading HTTP server, hardened for a socket of its own: loopback by default with a
guard on the Host header, a token required beyond loopback, a whole-request deadline, a cap on
connections, and the security headers on every answer, the server's own errors included. Reads
go through read-only database sessions; only the actions (when enabled) write."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg

from .. import log
from ..app import App
from ..config import Config
from ..errors import ConfigError
from .web import SECURITY_HEADERS, DashboardApp

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_CONNECTIONS = 32  # open connections at once; more are answered 503 and closed
REQUEST_DEADLINE = 30.0  # seconds from a request's first byte to its answer, however it trickles


class Dashboard:
    """Owns the listening socket and serves a DashboardApp on it. `serve_forever()` in the
    foreground (the CLI) or `start()` on a thread (tests); `close()` stops both. `actions`,
    `app`: as DashboardApp (actions default to config `dashboard_actions`)."""

    def __init__(
        self,
        cfg: Config,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        allow_hosts: Iterable[str] = (),
        token: str | None = None,
        actions: bool | None = None,
        app: App | None = None,
    ) -> None:
        self.cfg = cfg
        self.token = token or None
        if not is_loopback(host) and self.token is None:
            raise ConfigError(
                f"dashboard: --host {host} listens beyond loopback, where anyone who reaches it "
                "could read every run's payload: give a token requests must carry "
                "(LEASEWORK_DASHBOARD_TOKEN or --token-file FILE), or listen on 127.0.0.1"
            )
        self.wsgi = DashboardApp(cfg, app=app, actions=actions, token=self.token)
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
    def actions(self) -> bool:
        return self.wsgi.actions

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

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[psycopg.Connection[Any]]:
        with self.wsgi.session(write=write) as conn:
            yield conn


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

    # -- every method goes to the WSGI application, which serves GET and HEAD, and POST to an
    # action when actions are on; the standard library answers methods it has no do_X for 501.

    def do_GET(self) -> None:
        self._serve()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_GET

    def _serve(self) -> None:
        d = self.server.dashboard
        problem = framing_problem(self.headers.get_all("Content-Length") or [])
        if problem is not None:
            # Where the body ends is in doubt: answer without reading it and close, so none of
            # its bytes is ever taken for a request of its own (smuggling behind a proxy that
            # read the framing the other way).
            self.close_connection = True
            page = f"{problem}\n".encode()
            self._send(
                HTTPStatus.BAD_REQUEST,
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(page)))],
                b"" if self.command == "HEAD" else page,
            )
            return
        body = _Body(self.rfile, self.headers.get("Content-Length"))
        if self.headers.get("Transfer-Encoding") or body.invalid:
            self.close_connection = True  # a body we will not read to its end
        host = self.headers.get("Host") or ""
        if d.allowed_hosts is not None and not host_allowed(host, d.allowed_hosts, d.port):
            self.close_connection = self.close_connection or body.left > 0
            page = b"unexpected Host header (see --allow-host)\n"
            self._send(
                HTTPStatus.MISDIRECTED_REQUEST,
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(page)))],
                b"" if self.command == "HEAD" else page,
            )
            return
        parts = urlsplit(self.path)
        environ = self._environ(parts.path, parts.query, body)
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            answer[:] = [status, headers]
            return lambda data: None

        result = d.wsgi(environ, start_response)
        try:
            data = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status, headers = answer
        if body.left > 0:  # the application refused before reading the body: do not parse it
            self.close_connection = True
        self._send(HTTPStatus(int(status.split(" ", 1)[0])), headers, data)

    def _environ(self, path: str, query: str, body: _Body) -> dict[str, Any]:
        environ: dict[str, Any] = {
            "REQUEST_METHOD": self.command,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, encoding="latin-1"),
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type") or "",
            "CONTENT_LENGTH": self.headers.get("Content-Length") or "",
            "SERVER_NAME": self.server.dashboard.host,
            "SERVER_PORT": str(self.server.dashboard.port),
            "SERVER_PROTOCOL": self.request_version,
            "REMOTE_ADDR": self.client_address[0],
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": body,
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in self.headers.items():
            key = name.upper().replace("-", "_")
            if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                continue
            key = "HTTP_" + key
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ

    def _send(self, code: HTTPStatus, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(code)
        for name, value in headers:
            if name not in SECURITY_HEADERS:  # end_headers adds them, to every answer
                self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
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


def framing_problem(lengths: list[str]) -> str | None:
    """Why the Content-Length headers leave the body's end in doubt, or None: more than one
    (even equal: a proxy may have read another), or one that is not ASCII digits (`²` and `٣`
    are digits to `str.isdigit`, and `int` refuses the first)."""
    if len(lengths) > 1:
        return "more than one Content-Length header: send exactly one"
    if lengths and not (lengths[0].strip().isascii() and lengths[0].strip().isdigit()):
        return f"Content-Length must be ASCII digits, got {lengths[0].strip()[:20]!r}"
    return None


class _Body:
    """wsgi.input: reads at most Content-Length bytes of the request body, never past it, and
    knows how many are left unread (then the connection is closed after the answer)."""

    def __init__(self, rfile: Any, length: str | None) -> None:
        self.rfile = rfile
        text = (length or "").strip()
        digits = text.isascii() and text.isdigit()
        self.invalid = bool(text) and not digits
        self.left = int(text) if digits else 0

    def read(self, size: int = -1) -> bytes:
        n = self.left if size is None or size < 0 else min(size, self.left)
        if n <= 0:
            return b""
        data: bytes = self.rfile.read(n)
        self.left -= len(data)
        return data
