"""The dashboard as a WSGI application: every page, /metrics, /healthz and, when enabled, the
operator's actions (cancel, retry, delete, pause, resume, a kind's limits) as POST forms with a CSRF token.

`leasework dashboard` serves it (server.py); `wsgi_app()` returns it for mounting inside your own
web application, behind your own authentication, under any path prefix (SCRIPT_NAME starts every
link, form action and redirect). No framework: the standard library only.

Reads go through read-only database sessions (at most four at once, one per request). Only an
action opens a writable session, and only when actions are on; each action calls the same code as
the CLI (`App.cancel`, `operations` through `App`), which refuses bad input with one line and
changes nothing: that line is answered as a 4xx page. A success answers 303 to a page (POST,
redirect, GET) with the outcome in a signed one-time cookie."""

from __future__ import annotations

import base64
import dataclasses
import hmac
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import orjson
import psycopg

from .. import __version__, db, log, operations, status
from ..app import App
from ..config import Config
from ..config import load as load_config
from ..documents import Documents
from ..errors import ConfigError, LeaseworkError, NotFound, SchemaMissing, StateConflict
from ..queries import load
from ..stages.schedule import list_schedules
from ..syncs import Syncs
from . import csrf, metrics, pages
from .settings import DashboardSettings

Q = load("leasework.dashboard", "dashboard.sql")

# A session per request: a database that is down is reported at once (a pool would wait out its
# timeout), and no connection is left stale across a database restart. A refresh storm still
# cannot take more than SESSIONS connections from Postgres.
SESSIONS = 4
SESSION_WAIT = 5.0  # seconds a request waits for a free session before answering 503
STATEMENT_TIMEOUT = "10s"
RECENT_RUNS = 25
RUNS_PAGE = 50
MAX_FORM = 8192  # bytes of an action's form body
TOKEN_LENGTH = (16, 4096)

_RUN_PATH = re.compile(r"^/runs/([0-9]{1,19})/?$")
_RUN_ACTION = re.compile(r"^/runs/([0-9]{1,19})/(cancel|retry|delete)$")
_BULK_ACTION = "/runs/bulk"
MAX_FIELDS = 100  # fields of an action's form: a page of ticked runs and the filters
_KIND_ACTION = re.compile(r"^/kinds/(pause|resume|limits|reset-limits)$")
_BACK = re.compile(r"^/(?!/)[^\x00-\x20\x7f\\]{0,1000}$")

# No script anywhere; styles only from our own stylesheet; forms only to ourselves; not framed.
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
TEXT = "text/plain; charset=utf-8"
HTML = "text/html; charset=utf-8"

StartResponse = Callable[..., Any]


class BadRequest(Exception):
    """A query parameter or form field that makes no sense: 400 with one line."""


class Unavailable(Exception):
    """The database did not answer (or has no leasework schema): 503, with a password-free line."""


class Refused(Exception):
    """An action refused before it ran: its status (403, 404, 409, 411, 413, 415) and one line."""

    def __init__(self, code: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.code = code


class Form(dict[str, str]):
    """An action's form: each field's last value, and every value of a field given several times
    (`all("id")`: the runs ticked in the runs list)."""

    def __init__(self, last: Mapping[str, str], pairs: Mapping[str, list[str]]) -> None:
        super().__init__(last)
        self.pairs = {k: list(v) for k, v in pairs.items()}

    def all(self, name: str) -> list[str]:
        return self.pairs.get(name, [])


@dataclass
class Response:
    code: HTTPStatus
    body: bytes
    content_type: str = HTML
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Request:
    """What a handler needs from the WSGI environ."""

    method: str
    path: str
    root: str
    query: dict[str, str]
    cookies: dict[str, str]
    environ: Mapping[str, Any]

    @classmethod
    def of(cls, environ: Mapping[str, Any]) -> Request:
        path = _text(environ.get("PATH_INFO") or "") or "/"
        root = _text(environ.get("SCRIPT_NAME") or "").rstrip("/")
        try:
            pairs = parse_qs(
                environ.get("QUERY_STRING") or "", max_num_fields=50, keep_blank_values=False
            )
        except ValueError:
            pairs = {}
        return cls(
            method=str(environ.get("REQUEST_METHOD") or "GET").upper(),
            path=path,
            root=root,
            query={k: v[-1] for k, v in pairs.items()},
            cookies=_cookies(str(environ.get("HTTP_COOKIE") or "")),
            environ=environ,
        )

    @property
    def secure(self) -> bool:
        return self.environ.get("wsgi.url_scheme") == "https"

    def header(self, name: str) -> str:
        return str(self.environ.get("HTTP_" + name.upper().replace("-", "_")) or "")


def _text(value: str) -> str:
    """A WSGI string (bytes as latin-1, PEP 3333) as the UTF-8 text the client sent."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def _cookies(header: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in header.split(";")[:50]:
        name, sep, value = part.strip().partition("=")
        if sep and name and name not in out:
            out[name] = value.strip().strip('"')
    return out


def _url(text: str) -> str:
    """A path (and query) safe for a Location or Set-Cookie header: percent-encoded ASCII."""
    return quote(text, safe="/?&=%:+,@!$'()*~-._")


class DashboardApp:
    """The dashboard as a WSGI callable (`app(environ, start_response)`).

    `actions`: draw the action forms and accept their POSTs (default: config `dashboard_actions`).
    `token`: every request must carry it (`Authorization: Bearer TOKEN`, or HTTP Basic with it as
    the password); leave it unset when the dashboard sits behind your own authentication.
    `secret`: the key of the CSRF tokens and flash cookies (16+ bytes); random per process when
    unset, so give one when several processes serve the same dashboard.
    `app`: your App, so that a retry gets each task's attempt budget and pause knows your kinds.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        app: App | None = None,
        actions: bool | None = None,
        token: str | None = None,
        secret: str | bytes | None = None,
    ) -> None:
        self.cfg = cfg
        self.app = app if app is not None else App(cfg)
        if actions is None:
            actions = cfg.section(DashboardSettings).dashboard_actions
        self.actions = bool(actions)
        self.token = token or None
        if self.token is not None and not TOKEN_LENGTH[0] <= len(self.token) <= TOKEN_LENGTH[1]:
            raise ConfigError("dashboard: the token must be 16-4096 characters long")
        try:
            self.secret = csrf.as_secret(secret)
        except ValueError as exc:
            raise ConfigError(f"dashboard: {exc}") from None
        self._sessions = threading.BoundedSemaphore(SESSIONS)

    # -- WSGI ------------------------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        req = Request.of(environ)
        resp = self.respond(req)
        headers = [
            ("Content-Type", resp.content_type),
            ("Content-Length", str(len(resp.body))),
            *resp.headers,
            *SECURITY_HEADERS.items(),
        ]
        start_response(f"{resp.code.value} {resp.code.phrase}", headers)
        return [b"" if req.method == "HEAD" else resp.body]

    def respond(self, req: Request) -> Response:
        if self.token is not None and not authorized(req.header("Authorization"), self.token):
            return Response(
                HTTPStatus.UNAUTHORIZED,
                b"a token is required (Authorization: Bearer TOKEN, or the password)\n",
                TEXT,
                [("WWW-Authenticate", 'Basic realm="leasework", charset="UTF-8"')],
            )
        v = pages.View(req.root, actions_on=self.actions)
        try:
            if "\x00" in req.path or any("\x00" in k + q for k, q in req.query.items()):
                # No page, parameter or label holds one (Postgres text cannot): a 400, not
                # the 500 of a statement that refused it.
                raise BadRequest("the path or query holds a NUL character (%00)")
            if req.method in ("GET", "HEAD"):
                return self.get(req)
            if req.method == "POST" and self.actions:
                return self.post(req)
            allow = "GET, HEAD, POST" if self.actions else "GET, HEAD"
            why = (
                f"{req.method} is not served here"
                if self.actions
                else "the dashboard is read-only: actions are off (enable them with "
                "`leasework dashboard --actions` or dashboard_actions = true); nothing changed"
            )
            return Response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                pages.error_page(405, why, v).encode(),
                headers=[("Allow", allow)],
            )
        except BadRequest as exc:
            return self._error(HTTPStatus.BAD_REQUEST, str(exc), v)
        except Refused as exc:
            return self._error(exc.code, str(exc), v)
        except Unavailable as exc:
            message = log.redact_dsn(str(exc))
            if req.path == "/healthz":
                return Response(
                    HTTPStatus.SERVICE_UNAVAILABLE, f"unavailable: {message}\n".encode(), TEXT
                )
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, message, v)
        except Exception as exc:
            log.event(
                "dashboard_error",
                logging.ERROR,
                path=req.path,
                error=log.clip(f"{type(exc).__name__}: {exc}", 2000),
            )
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (logged)", v)

    @staticmethod
    def _error(code: HTTPStatus, message: str, v: pages.View) -> Response:
        return Response(code, pages.error_page(code.value, message, v).encode())

    # -- GET ---------------------------------------------------------------------------------------

    def get(self, req: Request) -> Response:
        path = req.path
        if path == "/metrics":
            return Response(HTTPStatus.OK, self.metrics(), metrics.CONTENT_TYPE)
        if path == "/healthz":
            self.health()
            return Response(HTTPStatus.OK, b"ok\n", TEXT)
        if path == "/static/dashboard.css":
            return Response(HTTPStatus.OK, pages.CSS.encode(), "text/css; charset=utf-8")
        if path == "/static/favicon.svg":
            return Response(HTTPStatus.OK, pages.FAVICON.encode(), "image/svg+xml")
        v, cookies = self.view(req)
        code, page = HTTPStatus.OK, None
        if path == "/":
            page = self.overview(v)
        elif path in ("/runs", "/runs/"):
            page = self.runs(req.query, v)
        elif path == "/kinds":
            page = self.kinds(v)
        elif path == "/schedules":
            page = self.schedules(v)
        elif path == "/connections":
            page = self.connections(v)
        elif (m := _RUN_PATH.match(path)) is not None:
            page = self.run(int(m.group(1)), v)
            if page is None:
                code = HTTPStatus.NOT_FOUND
                page = pages.error_page(404, f"no run {m.group(1)} (it may have been pruned)", v)
        else:
            code, page = HTTPStatus.NOT_FOUND, pages.error_page(404, "no such page", v)
        return Response(code, page.encode(), HTML, cookies)

    def view(self, req: Request) -> tuple[pages.View, list[tuple[str, str]]]:
        """The page's view: its root, and with actions on the CSRF token for this browser (a new
        nonce cookie when it has none) and the flash message left by the last action."""
        if not self.actions:
            return pages.View(req.root), []
        headers: list[tuple[str, str]] = []
        nonce = req.cookies.get(csrf.COOKIE)
        if not csrf.valid_nonce(nonce):
            nonce = csrf.new_nonce()
            headers.append(("Set-Cookie", self._cookie(req, csrf.COOKIE, nonce)))
        assert nonce is not None
        flash = None
        if csrf.FLASH_COOKIE in req.cookies:
            flash = csrf.unsign(self.secret, req.cookies[csrf.FLASH_COOKIE])
            headers.append(("Set-Cookie", self._cookie(req, csrf.FLASH_COOKIE, "", max_age=0)))
        token = csrf.token_for(self.secret, nonce)
        return pages.View(req.root, token, flash, actions_on=True), headers

    @staticmethod
    def _cookie(req: Request, name: str, value: str, *, max_age: int | None = None) -> str:
        parts = [f"{name}={value}", f"Path={_url(req.root or '/')}", "HttpOnly", "SameSite=Strict"]
        if max_age is not None:
            parts.append(f"Max-Age={max_age}")
        if req.secure:
            parts.append("Secure")
        return "; ".join(parts)

    def overview(self, v: pages.View = pages.PLAIN) -> str:
        with self.session() as conn:
            snap = status.collect(
                conn,
                heartbeat_interval=self.cfg.heartbeat_interval,
                max_kinds=self.cfg.max_kinds_shown,
            )
            with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
                recent = cur.execute(Q["dashboard_recent_runs"], {"limit": RECENT_RUNS}).fetchall()
                now = cur.execute(Q["dashboard_clock"]).fetchone()
                oldest = cur.execute(Q["metrics_oldest_queued"]).fetchall()
            charts = chart(conn, pages.chart_kinds(snap.get("runs_by_kind") or {}))
        oldest_age = max((r["age"] for r in oldest), default=None)
        return pages.overview(
            snap,
            recent,
            oldest_queued=oldest_age,
            now=now["now"] if now else None,
            v=v,
            charts=charts,
        )

    def runs(self, query: Mapping[str, str], v: pages.View = pages.PLAIN) -> str:
        """`/runs?status=&kind=&key=&tenant=&error=&payload=&tag=&before=`: every run, newest
        first, filtered and searched, paged; with actions on and a filter, how many runs match
        it (the bulk form's "all N matching", counted up to pages.MATCHING_MAX)."""
        filters = {k: query[k] for k in pages.RUN_FILTERS if query.get(k)}
        before = query.get("before") or None
        if before is not None and not (before.isdigit() and 0 < int(before) < 2**63):
            raise BadRequest(f"before must be a run id, got {before!r}")
        chosen = run_filters(filters)
        matching = None
        with self.session() as conn:
            page = operations.list_runs(
                conn, chosen, limit=RUNS_PAGE, before=int(before) if before else None
            )
            paused = operations.paused(conn)
            if v.actions and not (chosen.empty and not chosen.statuses):
                matching = operations.count_matching(conn, chosen, limit=pages.MATCHING_MAX)
        here = {**filters, **({"before": before} if before else {})}
        back = "/runs" + (f"?{urlencode(here)}" if here else "")
        return pages.runs_page(
            page.runs,
            filters=filters,
            next_before=page.next_before,
            paused=paused,
            back=back,
            v=v,
            matching=matching,
        )

    def kinds(self, v: pages.View = pages.PLAIN) -> str:
        with self.session() as conn:
            snap = status.collect(
                conn,
                heartbeat_interval=self.cfg.heartbeat_interval,
                max_kinds=self.cfg.max_kinds_shown,
            )
        return pages.kinds_page(
            snap.get("runs_by_kind") or {},
            snap.get("paused") or [],
            self.app.kinds(),
            v,
            limits=snap.get("limits") or [],
            folded=int(snap.get("kinds_folded") or 0),
        )

    def schedules(self, v: pages.View = pages.PLAIN) -> str:
        with self.session() as conn:
            return pages.schedules_page(list_schedules(conn), v)

    def connections(self, v: pages.View = pages.PLAIN) -> str:
        with self.session() as conn:
            snap = status.collect(conn, heartbeat_interval=self.cfg.heartbeat_interval)
        return pages.connections_page(snap.get("connections") or [], v)

    def run(self, run_id: int, v: pages.View = pages.PLAIN) -> str | None:
        if not 0 < run_id < 2**63:
            return None
        with self.session() as conn:
            row = operations.get_run(conn, run_id)
            now = operations.db_now(conn)
            if row is not None:
                row["held_back"] = operations.held_back(conn, run_id)
                row["dependencies"] = operations.dependencies(conn, run_id)
                row["steps"] = operations.run_steps(conn, run_id)
        if row is None:
            return None
        return pages.run_page(row, now=now, v=v)

    def metrics(self) -> bytes:
        try:
            with self.session() as conn:
                snap = status.collect(conn, heartbeat_interval=self.cfg.heartbeat_interval)
                fams = metrics.families(
                    conn,
                    snap,
                    heartbeat_interval=self.cfg.heartbeat_interval,
                    version=__version__,
                    max_kinds=self.cfg.max_kinds_shown,
                )
        except Unavailable:
            fams = metrics.database_down(__version__)
        return metrics.exposition(fams)

    def health(self) -> None:
        """Raises Unavailable unless the database answers and has the leasework schema."""
        with self.session() as conn:
            conn.execute("SELECT 1")

    # -- POST: the actions -------------------------------------------------------------------------

    def post(self, req: Request) -> Response:
        run_match = _RUN_ACTION.match(req.path)
        kind_match = _KIND_ACTION.match(req.path)
        bulk = req.path == _BULK_ACTION
        if run_match is None and kind_match is None and not bulk:
            raise Refused(HTTPStatus.NOT_FOUND, f"no action at {req.path[:200]!r}; nothing changed")
        site = req.header("Sec-Fetch-Site")
        if site and site not in ("same-origin", "none"):
            raise Refused(
                HTTPStatus.FORBIDDEN, f"a form posted from another site ({site}); nothing changed"
            )
        form = self.read_form(req)
        if not csrf.check(self.secret, req.cookies.get(csrf.COOKIE), form.get(csrf.FIELD)):
            raise Refused(
                HTTPStatus.FORBIDDEN,
                "missing or wrong CSRF token: reload the page and submit the form from it; "
                "nothing changed",
            )
        back = form.get("back") or ""
        if bulk:
            return self.bulk(req, form, back)
        if run_match is not None:
            run_id = int(run_match.group(1))
            if not 0 < run_id < 2**63:
                raise BadRequest(f"run id must be a positive 64-bit integer, got {run_id}")
            action = run_match.group(2)
            if action == "delete" and form.get("confirm") != "yes":
                # The checkbox is `required` in the page; a hand-made POST must tick it too.
                raise BadRequest("delete needs its confirm box ticked (confirm=yes); nothing changed")
            message = self.act_on_run(action, run_id)
            if action == "delete" or not _BACK.match(back):
                back = "/runs" if action == "delete" else f"/runs/{run_id}"
        else:
            assert kind_match is not None
            kind = form.get("kind") or ""
            if not kind or len(kind) > 200:
                raise BadRequest("kind must be 1-200 characters; nothing changed")
            message = self.act_on_kind(kind_match.group(1), kind, form)
            if not _BACK.match(back):
                back = "/kinds"
        log.event(
            "dashboard_action",
            path=req.path,
            client=str(req.environ.get("REMOTE_ADDR") or ""),
            outcome=message,
        )
        cookie = self._cookie(req, csrf.FLASH_COOKIE, csrf.sign(self.secret, message))
        return Response(
            HTTPStatus.SEE_OTHER,
            f"{message}\n".encode(),
            TEXT,
            [("Location", _url(req.root + back)), ("Set-Cookie", cookie)],
        )

    @staticmethod
    def read_form(req: Request) -> Form:
        """The urlencoded form body, whole and small, or a 4xx."""
        length = str(req.environ.get("CONTENT_LENGTH") or "").strip()
        if not length:
            raise Refused(HTTPStatus.LENGTH_REQUIRED, "a form needs a Content-Length")
        if not (length.isascii() and length.isdigit()):  # `²` is a digit to isdigit()
            raise BadRequest(f"Content-Length {length[:20]!r} is not a number")
        if int(length) > MAX_FORM:
            raise Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a form is at most {MAX_FORM} bytes"
            )
        kind = str(req.environ.get("CONTENT_TYPE") or "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise Refused(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                "a form must be application/x-www-form-urlencoded",
            )
        raw = req.environ["wsgi.input"].read(int(length)) if int(length) else b""
        try:
            pairs = parse_qs(
                raw.decode("ascii"),
                keep_blank_values=True,
                max_num_fields=MAX_FIELDS,
                encoding="utf-8",
                errors="strict",
            )
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the form is not valid urlencoded UTF-8") from None
        if any("\x00" in k or "\x00" in v for k, vs in pairs.items() for v in vs):
            raise BadRequest("the form holds a NUL character (%00), which no field takes")
        return Form({k: v[-1] for k, v in pairs.items()}, pairs)

    def bulk(self, req: Request, form: Form, back: str) -> Response:
        """POST /runs/bulk: a bulk action (retry, cancel, run-now, delete) on the runs ticked
        (`scope=ids`, `id` fields) or on every run matching the runs list's filters
        (`scope=filter`, `filter_*` fields). Without `confirm=yes` it changes nothing and answers
        the confirm page (what, on how many); with it, it acts a page of runs at a time
        (operations: each page its own transaction, in a session of its own), logs
        `dashboard_bulk_action` (who: the remote address and user; which ids or filter; how
        many) and answers 303 back to the list."""
        action = form.get("action") or ""
        if action not in pages.BULK_ACTIONS:
            raise BadRequest(
                f"action must be one of {', '.join(pages.BULK_ACTIONS)}, got {action[:40]!r}; "
                "nothing changed"
            )
        scope = form.get("scope") or "ids"
        if not _BACK.match(back) or not back.startswith("/runs"):
            back = "/runs"
        fields: dict[str, str] = {"action": action, "scope": scope, "back": back}
        ids: list[int] | None = None
        chosen: operations.Filters | None = None
        if scope == "ids":
            given = form.all("id")
            if not given:
                raise BadRequest(
                    f"{action}: no run ticked (tick runs in the list, or choose all runs "
                    "matching the filter); nothing changed"
                )
            if not all(i.isascii() and i.isdigit() and 0 < int(i) < 2**63 for i in given):
                raise BadRequest("id must be run ids (positive integers); nothing changed")
            ids = sorted({int(i) for i in given})
            which = "runs " + ", ".join(str(i) for i in ids)
        elif scope == "filter":
            given_filters = {
                k: form[f"filter_{k}"] for k in pages.RUN_FILTERS if form.get(f"filter_{k}")
            }
            chosen = run_filters(given_filters)
            if chosen.empty and not chosen.statuses:
                raise BadRequest(
                    f"{action}: all matching needs a filter (a status, kind, key, tenant, "
                    "error, payload or tag); nothing changed"
                )
            fields.update({f"filter_{k}": value for k, value in given_filters.items()})
            which = f"every run matching {chosen.described()}"
        else:
            raise BadRequest(f"scope must be ids or filter, got {scope[:40]!r}; nothing changed")
        v, _ = self.view(req)
        if form.get("confirm") != "yes":
            with self.session() as conn:
                if ids is not None:
                    count = len(ids)
                else:
                    assert chosen is not None
                    count = operations.count(conn, chosen, action)
            page = pages.bulk_confirm_page(
                action, count=count, which=which, fields=fields, ids=ids or (), back=back, v=v
            )
            return Response(HTTPStatus.OK, page.encode())
        with self.session(write=True, paged=True) as conn:
            acted = self.act_in_bulk(conn, action, ids, chosen)
        message = bulk_message(action, acted)
        log.event(
            "dashboard_bulk_action",
            action=action,
            scope=scope,
            ids=ids if ids is not None else None,
            filter=chosen.described() if chosen is not None else None,
            count=acted.count,
            requested=len(acted.requested),
            skipped=len(acted.skipped),
            pages=acted.pages,
            client=str(req.environ.get("REMOTE_ADDR") or ""),
            user=str(req.environ.get("REMOTE_USER") or "") or None,
            outcome=message,
        )
        cookie = self._cookie(req, csrf.FLASH_COOKIE, csrf.sign(self.secret, message))
        return Response(
            HTTPStatus.SEE_OTHER,
            f"{message}\n".encode(),
            TEXT,
            [("Location", _url(req.root + back)), ("Set-Cookie", cookie)],
        )

    def act_in_bulk(
        self,
        conn: psycopg.Connection[Any],
        action: str,
        ids: list[int] | None,
        chosen: operations.Filters | None,
    ) -> operations.Acted:
        if action == "retry":
            return self.app.retry(conn, ids, filters=chosen)
        if action == "cancel":
            return operations.cancel(conn, ids, filters=chosen)
        if action == "run-now":
            return operations.run_now(conn, ids, filters=chosen)
        return self.app.delete(conn, ids, filters=chosen)

    def act_on_run(self, action: str, run_id: int) -> str:
        with self.session(write=True) as conn:
            if action == "cancel":
                with conn.transaction():
                    row = conn.execute(Q["dashboard_lock_run"], {"id": run_id}).fetchone()
                    if row is None:
                        raise NotFound(f"no run with id {run_id} (it may have been pruned)")
                    was, requested = str(row[0]), row[1]
                    if was not in pages.CANCELLABLE:
                        raise StateConflict(f"run {run_id} is already {was}: nothing to cancel")
                    if requested is not None:
                        raise StateConflict(
                            f"run {run_id}: a cancel is already requested; it stops at its next "
                            "control check"
                        )
                    now = self.app.cancel(conn, run_id)
                if now == "running":
                    return f"run {run_id}: cancel requested; it stops at its next control check"
                return f"run {run_id} cancelled"
            if action == "retry":
                self.app.retry(conn, [run_id])
                return f"run {run_id} retried: queued again with a fresh attempt budget"
            self.app.delete(conn, [run_id])
            return f"run {run_id} deleted"

    def act_on_kind(self, action: str, kind: str, form: Mapping[str, str] | None = None) -> str:
        with self.session(write=True) as conn:
            if action == "limits":
                changes = limit_changes(form or {})
                operations.set_limits(conn, kind, known=self.app.kinds(), **changes)
                shown = ", ".join(
                    f"{name} {'none' if value is None else value}" for name, value in changes.items()
                )
                return f"kind {kind}: {shown} (set at run time, until reset)"
            if action == "reset-limits":
                gone = operations.reset_limits(conn, kind)
                if not gone:
                    return f"kind {kind}: no limit was set at run time"
                return f"kind {kind}: {', '.join(gone)} reset: the app's declared limits hold"
            if action == "pause":
                newly = self.app.pause(conn, kind)
                if not newly:
                    return f"kind {kind} was already paused"
                return f"kind {kind} paused: no worker claims its runs until it is resumed"
            if not self.app.resume(conn, kind):
                return f"kind {kind} was not paused"
            return f"kind {kind} resumed"

    # -- sessions ----------------------------------------------------------------------------------

    @contextmanager
    def session(
        self, *, write: bool = False, paged: bool = False
    ) -> Iterator[psycopg.Connection[Any]]:
        """A read-only session with the leasework schema checked (`write`: an action's session,
        the only kind that may write). The database being down, busy or without the schema is
        Unavailable, with the reason on one password-free line; an action's own refusal
        (ConfigError) is a 404 or 409 with its line, and a role without the right a 403."""
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
            # Every page reads any timestamp a row holds (infinity too) rather than fail.
            status.tolerant(conn)
            with conn:  # commits at the end of the request (an action's), or rolls back
                try:
                    # One transaction per request, its settings local to it: through a pooler in
                    # transaction mode a session setting would outlive the request on a server
                    # session someone else gets. Belt and braces: read-only unless an action's,
                    # so even a bug in a page cannot write through a read session.
                    conn.read_only = not write
                    # A bulk action (`paged`) commits a page of runs at a time (operations):
                    # autocommit, each page a transaction of its own, bounded by its page size
                    # rather than the statement timeout.
                    conn.autocommit = paged
                    if not paged:
                        conn.execute(f"SET LOCAL statement_timeout = '{STATEMENT_TIMEOUT}'")
                    db.check_schema(conn)
                    yield conn
                except NotFound as exc:
                    raise Refused(HTTPStatus.NOT_FOUND, _one_line(exc)) from None
                except (ConfigError, StateConflict) as exc:
                    raise Refused(HTTPStatus.CONFLICT, _one_line(exc)) from None
                except SchemaMissing as exc:
                    raise Unavailable(str(exc)) from None
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise Refused(
                        HTTPStatus.FORBIDDEN,
                        f"the dashboard's database role may not do this: {log.first_line(exc)}; "
                        "nothing changed",
                    ) from None
                except psycopg.OperationalError as exc:
                    raise Unavailable(f"database unavailable: {log.first_line(exc)}") from None
        finally:
            self._sessions.release()


def chart(conn: psycopg.Connection[Any], kinds: list[str]) -> pages.Series:
    """The overview's charts (dashboard_chart): per minute of the last hour, for each of `kinds`
    and `other` (every other kind)."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(Q["dashboard_chart"], {"kinds": kinds}).fetchall()
    return pages.chart_series(rows)


def _one_line(exc: Exception) -> str:
    line = log.first_line(exc)
    return line if "nothing" in line else f"{line}; nothing changed"


def authorized(given: str, token: str) -> bool:
    """A bearer token, or HTTP Basic with the token as password (any user name), so that both
    scripts and browsers can pass it."""
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


def config_sections() -> tuple[type, ...]:
    """The sections a config read for the dashboard knows, as `leasework dashboard` reads it: the
    engine's stages', the built-in families' (a file written for the workers may set their
    keys) and the dashboard's own."""
    families = (*Syncs.config_sections, *Documents.config_sections)
    return (*App().sections(), *families, DashboardSettings)


def wsgi_app(
    dsn: str | None = None,
    *,
    config: Config | None = None,
    app: App | None = None,
    actions: bool | None = None,
    token: str | None = None,
    secret: str | bytes | None = None,
) -> DashboardApp:
    """The dashboard as a WSGI application, to mount in your own web app (behind your own
    authentication) under any prefix: every link, form and redirect starts with SCRIPT_NAME.

    `dsn` (else `config.dsn`; without either the usual configuration: LEASEWORK_* variables, a
    config file, DATABASE_URL); `actions=True` enables cancel, retry, delete, pause, resume and limits
    (default: config `dashboard_actions`); `app`: your App (task attempt budgets, known kinds);
    `token`: require one on every request as `leasework dashboard` does beyond loopback;
    `secret`: the CSRF key, to share between several processes serving it (16+ bytes)."""
    if config is None and app is not None:
        config = app.config
    if config is None:
        config = load_config(None, overrides={"dsn": dsn}, sections=config_sections())
    elif dsn is not None:
        db.check_dsn(dsn)
        config = dataclasses.replace(config, dsn=dsn)
    return DashboardApp(config, app=app, actions=actions, token=token, secret=secret)


def run_filters(given: Mapping[str, str]) -> operations.Filters:
    """The runs list's filters (pages.RUN_FILTERS: status, kind, key, tenant, error, payload,
    tag) as operations.Filters; BadRequest, one line, for a bad one (a status that is none, a
    payload that is not JSON)."""
    status_filter = given.get("status")
    if status_filter is not None and status_filter not in operations.STATUSES:
        raise BadRequest(f"status must be one of {', '.join(operations.STATUSES)}")
    payload = None
    if given.get("payload"):
        try:
            payload = orjson.loads(given["payload"])
        except orjson.JSONDecodeError:
            raise BadRequest(
                f"payload {given['payload'][:80]!r} is not JSON: give a JSON value the payload "
                'must contain, such as {"account": 42}'
            ) from None
    try:
        return operations.Filters(
            statuses=[status_filter] if status_filter else None,
            kind=given.get("kind"),
            key=given.get("key"),
            tenant=given.get("tenant"),
            error=given.get("error"),
            payload=payload,
            tags=[given["tag"]] if given.get("tag") else None,
        )
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None


def bulk_message(action: str, acted: operations.Acted) -> str:
    """The one line a bulk action leaves (the flash message, and the log's outcome)."""
    done = {
        "retry": "retried (queued again with a fresh attempt budget)",
        "cancel": "cancelled",
        "run-now": "made due now",
        "delete": "deleted",
    }[action]
    line = f"{len(acted.ids)} run(s) {done}"
    if acted.requested:
        line += f"; cancel requested for {len(acted.requested)} running run(s)"
    if acted.skipped:
        why = {
            "retry": "their key has another active run",
            "cancel": "already finished",
            "run-now": "due already",
        }.get(action, "left as they were")
        line += f"; {len(acted.skipped)} left as they are ({why})"
    return line


def limit_changes(form: Mapping[str, str]) -> dict[str, Any]:
    """The limits a /kinds/limits form sets: each field left empty is left as it is, `none`
    removes that limit; max_running and group_limit are whole numbers (operations.set_limits
    checks every value's range). ConfigError, one line, for a field that is neither."""
    changes: dict[str, Any] = {}
    for name in operations.LIMIT_NAMES:
        value = (form.get(name) or "").strip()
        if not value:
            continue
        if value.lower() == "none":
            changes[name] = None
        elif name in ("max_running", "group_limit"):
            if not (value.isascii() and value.isdigit()):
                raise ConfigError(f"{name} must be a whole number or none, got {value[:40]!r}")
            changes[name] = int(value)
        else:
            changes[name] = value
    if not changes:
        raise ConfigError(
            f"no limit given: fill in one of {', '.join(operations.LIMIT_NAMES)}; nothing changed"
        )
    return changes
