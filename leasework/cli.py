"""The `leasework` command. Parses flags, loads config and the user's app, and maps errors to
exit codes: 0 ok, 2 bad usage or bad config (one line on stderr), 1 anything else."""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, NoReturn, TypeVar

import orjson

from . import config as configmod
from . import db, log
from .app import App, Family
from .config import Config
from .dashboard.settings import DashboardSettings
from .errors import ConfigError, LeaseworkError, SchemaMissing, StateConflict
from .operations import LIMIT_NAMES, STATUSES
from .status import (
    duration,
    held_back_lines,
    instant_text,
    number_text,
    rate_spec,
    seconds_text,
    terminal_safe,
    tolerant,
)
from .tasks import EnqueueOptions
from .text import json_visible, tags_text

F = TypeVar("F", bound=Family)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
CHECK_TIMEOUT = 5  # seconds for the one connection a long-running command checks the database with


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog.removeprefix('leasework').strip() or 'usage'}: {message}")


def builtin_app(cfg: Config | None = None) -> App:
    """The app the CLI's own commands use when none is given: the built-in families and no task
    of its own (connections sync with the built-in connectors; documents are ingested). Workers
    for it: `leasework supervise --app leasework.cli:builtin_app`."""
    from .documents import Documents
    from .syncs import Syncs

    app = App(cfg)
    app.use(Syncs())
    app.use(Documents())
    return app


def load_app(spec: str | None, cfg: Config, *, required: bool = True) -> App:
    """Import MODULE:ATTR (an App instance, or a callable returning one). A refusal names where
    the spec came from (`--app`, `LEASEWORK_APP`, the config file's `app`), as `cfg` records."""
    if not spec:
        if required:
            raise ConfigError(
                "no app given: pass --app MODULE:ATTR or set LEASEWORK_APP (the built-in "
                "connections and documents alone: --app leasework.cli:builtin_app)"
            )
        return builtin_app(cfg)
    given = cfg.origin("app") if spec == cfg.app else "app"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{given} {spec!r} must look like MODULE:ATTR, e.g. myproject.jobs:app")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module failing to import is a config error
        raise ConfigError(
            f"{given} {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{given} {spec!r}: {module_name} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, App):
        try:
            obj = obj()
        except Exception as exc:  # a factory that fails, or a callable that is not a factory
            raise ConfigError(
                f"{given} {spec!r}: calling {attr}() failed: {type(exc).__name__}: {exc}"
            ) from None
    if not isinstance(obj, App):
        raise ConfigError(f"{given} {spec!r} is a {type(obj).__name__}, not a leasework.App")
    return obj.with_config(cfg)


def _run_id(text: str) -> int:
    """A run or connection id: a positive 64-bit integer (argparse reports the refusal)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a positive integer") from None
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError("must be a positive integer below 2**63")
    return value


def _parent_id(text: str) -> int:
    """A run id given to --after, named in the refusal."""
    try:
        return _run_id(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be the id of a run (a positive integer below 2**63), got {text!r}"
        ) from None


def _count_or_none(text: str) -> int | None:
    """A limit's count (its range is checked with the others') or `none`."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number or none, got {text!r}") from None


def _text_or_none(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text


def _common(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """--dsn, --config and --log-format, accepted before the command (`top`) and after it; given
    after, they win (SUPPRESS: an option not given after the command leaves the earlier one)."""
    default = None if top else argparse.SUPPRESS
    p.add_argument(
        "--dsn",
        default=default,
        help="database (else LEASEWORK_DSN, DATABASE_URL, libpq defaults)",
    )
    p.add_argument("--config", default=default, help="TOML config file (else LEASEWORK_CONFIG)")
    p.add_argument(
        "--log-format",
        default=default,
        choices=("auto", "json", "text"),
        help="log lines on stderr: JSON, text, or auto (text on a terminal; else config)",
    )


def _with_app(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    p.add_argument(
        "--app",
        default=None if top else argparse.SUPPRESS,
        help="MODULE:ATTR of your App (else LEASEWORK_APP)",
    )


def _filters(p: argparse.ArgumentParser, *, statuses: str) -> None:
    p.add_argument(
        "--status", metavar="STATUS[,STATUS]", help=f"only runs in these statuses ({statuses})"
    )
    p.add_argument("--kind", help="only runs of this kind")
    p.add_argument("--key", help="only runs with this key (in every tenant unless --tenant)")
    p.add_argument("--tenant", help="only runs of this tenant")
    p.add_argument(
        "--since",
        metavar="AGE|TIME",
        help="only runs created since: an age (30m, 2h, 7d) or a time (2026-05-01T12:00, UTC)",
    )
    p.add_argument(
        "--error", metavar="TEXT", help="only runs whose error holds TEXT (case-insensitive)"
    )
    p.add_argument(
        "--payload",
        metavar="JSON",
        help='only runs whose payload contains this JSON, e.g. \'{"account": 42}\'',
    )
    p.add_argument(
        "--tag",
        action="append",
        metavar="TAG",
        help="only runs with this tag; repeat for runs with every one of them",
    )


def _bulk(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--dry-run", action="store_true", help=f"{verb} nothing; print how many")
    p.add_argument(
        "--yes",
        action="store_true",
        help=f"by filter: {verb} without asking (else asked on a terminal, refused elsewhere)",
    )


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="leasework", description="Leased background jobs in Postgres.")
    parser.add_argument(
        "--version", action="version", version=f"leasework {__version__}", help="print the version"
    )
    _common(parser, top=True)
    _with_app(parser, top=True)
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )

    p = sub.add_parser("migrate", help="apply the pending schema migrations")
    _common(p)
    p.add_argument(
        "--check", action="store_true", help="apply nothing; exit 1 if migrations are pending"
    )

    p = sub.add_parser(
        "worker",
        help="run one worker in the foreground (a development tool; production: supervise)",
        description=STANDALONE_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    _with_app(p)
    p.add_argument("--once", action="store_true", help="run a single poll and exit")
    p.add_argument(
        "--pool", metavar="NAME", help="claim only the kinds of this pool (config `pools`)"
    )

    p = sub.add_parser("supervise", help="run N worker processes under a supervisor")
    _common(p)
    _with_app(p)
    p.add_argument("--processes", type=int, help="worker processes (else config `processes`)")
    p.add_argument(
        "--pool",
        action="append",
        metavar="NAME:N:KINDS",
        help="a pool of N children claiming only KINDS (comma-separated; `*`: every kind no "
        "other pool names); repeat for each pool; replaces config `pools`",
    )

    p = sub.add_parser("enqueue", help="enqueue a run and print its id")
    _common(p)
    _with_app(p)
    p.add_argument("kind", help="the task kind to run")
    p.add_argument("--payload", default=None, help="JSON payload (default {})")
    p.add_argument(
        "--key",
        help="at most one active run per key in its --tenant: while one is queued or running, its "
        "id is returned (keys starting with 'leasework:' are reserved)",
    )
    p.add_argument(
        "--tenant", help="rate limiter: with --group or --exclusive, limits this tenant's runs"
    )
    p.add_argument(
        "--group", help="runs of one tenant sharing a group never run at once (needs --tenant)"
    )
    p.add_argument(
        "--exclusive",
        action="store_true",
        help="runs alone in its tenant; with a busy --key, waits for the key's run to end",
    )
    p.add_argument("--priority", type=int, default=0, help="lower runs first (default 0)")
    p.add_argument(
        "--delay", type=float, default=0.0, metavar="SECONDS", help="due this many seconds from now"
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        metavar="N",
        help="attempts before it ends failed (default: the task's, else config max_attempts)",
    )
    p.add_argument(
        "--unique-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --key: while the key's run enqueued less than this ago (finished or not, unless "
        "it failed or was cancelled) exists, its id is returned (default: the task's)",
    )
    p.add_argument(
        "--debounce",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --key: the key's pending run of this kind takes this payload and is due this "
        "long from now; else a new one is (default: the task's)",
    )
    p.add_argument(
        "--debounce-max",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --debounce: due at the latest this long after the pending run's first enqueue",
    )
    p.add_argument(
        "--after",
        type=_parent_id,
        action="append",
        metavar="RUN_ID",
        help="wait (blocked) until this run has ended; repeat for each run it waits for",
    )
    p.add_argument(
        "--on-parent-failure",
        choices=("cancel", "run"),
        default=None,
        help="with --after: a run waited for that ended failed or cancelled cancels this one "
        "(cancel, the default) or not (run)",
    )
    p.add_argument(
        "--tag",
        action="append",
        metavar="TAG",
        help="a label to find the run by (runs --tag); repeat for several, at most 20",
    )

    p = sub.add_parser(
        "cancel", help="cancel runs by id or filter: queued now, running at their next check"
    )
    _common(p)
    p.add_argument("run_ids", type=_run_id, nargs="*", metavar="RUN_ID", help="the runs to cancel")
    _filters(p, statuses="blocked, waiting, queued, running; default all four")
    _bulk(p, "cancel")

    p = sub.add_parser(
        "run-now", help="queued runs waiting for a delay or a backoff: due now, by id or filter"
    )
    _common(p)
    p.add_argument("run_ids", type=_run_id, nargs="*", metavar="RUN_ID", help="the runs to start")
    _filters(p, statuses="queued only")
    _bulk(p, "start")

    p = sub.add_parser("runs", help="list runs, newest first, with filters and paging")
    _common(p)
    _filters(p, statuses=", ".join(STATUSES))
    p.add_argument("--limit", type=int, default=50, help="runs per page, 1-1000 (default 50)")
    p.add_argument(
        "--before", type=int, metavar="ID", help="the next page: runs older than this id"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("show", help="one run: payload, result, error, history, lease, worker")
    _common(p)
    p.add_argument("run_id", type=_run_id, metavar="RUN_ID", help="the run to show")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "retry", help="failed, cancelled or partial runs back to queued with fresh attempts"
    )
    _common(p)
    _with_app(p)
    p.add_argument("run_ids", type=_run_id, nargs="*", metavar="RUN_ID", help="the runs to retry")
    _filters(p, statuses="failed, cancelled, partial; default all three")
    p.add_argument(
        "--attempts",
        type=int,
        metavar="N",
        help="attempts it gets (default: the task's max_attempts, else config max_attempts)",
    )
    p.add_argument("--dry-run", action="store_true", help="change nothing; print how many")
    p.add_argument(
        "--clear-steps",
        action="store_true",
        help="delete the runs' durable steps (ctx.step), so every step runs again "
        "(default: kept, the retry resumes after the last stored step)",
    )
    p.add_argument("--yes", action="store_true", help="accepted for scripts; retry never asks")

    p = sub.add_parser(
        "delete", help="delete finished runs (succeeded, partial, failed, cancelled)"
    )
    _common(p)
    p.add_argument("run_ids", type=_run_id, nargs="*", metavar="RUN_ID", help="the runs to delete")
    _filters(p, statuses="succeeded, partial, failed, cancelled; default all four")
    p.add_argument("--dry-run", action="store_true", help="delete nothing; print how many")
    p.add_argument("--yes", action="store_true", help="accepted for scripts; delete never asks")

    p = sub.add_parser("pause", help="pause kinds: no worker claims their runs until resumed")
    _common(p)
    _with_app(p)
    p.add_argument("kinds", nargs="+", metavar="KIND", help="a kind to pause")

    p = sub.add_parser("resume", help="resume paused kinds (one not paused is left as it is)")
    _common(p)
    _with_app(p)
    p.add_argument("kinds", nargs="+", metavar="KIND", help="a paused kind to resume")

    p = sub.add_parser("status", help="workers, runs by status, running runs with progress")
    _common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh in place every SECONDS (default 2) until Ctrl-C",
    )

    p = sub.add_parser("ingest", help="store a document and enqueue its indexing")
    _common(p)
    _with_app(p)
    p.add_argument("path", metavar="PATH", help="a text, Markdown or PDF file")
    p.add_argument("--project", required=True, help="the scope its chunks belong to")

    p = sub.add_parser("upload", help="store a ZIP of documents to expand and index")
    _common(p)
    _with_app(p)
    p.add_argument("path", metavar="ZIP", help="a ZIP archive of documents")
    p.add_argument("--project", required=True, help="the scope its files belong to")

    p = sub.add_parser("connections", help="connections kept synced: add, list, sync, delete")
    csub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    c = csub.add_parser("add", help="make a connection, enqueue its first sync, print its id")
    _common(c)
    _with_app(c)
    c.add_argument("--workspace", required=True, help="the tenant it belongs to")
    c.add_argument("--provider", required=True, help="its connector, e.g. files")
    c.add_argument(
        "--connector-config",
        dest="connection_config",
        default=None,
        metavar="JSON",
        help='the connector\'s settings, e.g. {"path": "./export"}',
    )
    c.add_argument(
        "--every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="sync again every SECONDS (default: only on demand)",
    )
    c.add_argument("--no-sync", action="store_true", help="do not enqueue a first sync")
    c = csub.add_parser("list", help="connections with their status, schedule and records")
    _common(c)
    c.add_argument("--json", action="store_true", help="machine-readable output")
    for action, text in (
        ("sync", "enqueue a sync now and print its run id"),
        ("delete", "delete: purge its records, then the connection; print the purge run id"),
        ("disconnect", "stop syncing it (its records stay)"),
    ):
        c = csub.add_parser(action, help=text)
        _common(c)
        c.add_argument("connection_id", type=_run_id, metavar="ID", help="the connection's id")

    p = sub.add_parser("tenants", help="tenants with their weight and turn; `tenants set` a weight")
    _common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    tsub = p.add_subparsers(dest="tenants_action", metavar="ACTION")
    t = tsub.add_parser("set", help="set a tenant's weight (its share of turns; default 1)")
    _common(t)
    t.add_argument("name", metavar="NAME", nargs="?", help="the tenant")
    t.add_argument(
        "--untenanted",
        action="store_true",
        help="the runs without a tenant instead (one more participant in the turns)",
    )
    t.add_argument(
        "--weight",
        type=float,
        required=True,
        help="turns for each turn of a tenant of weight 1, from 0.001 to 1000",
    )

    p = sub.add_parser(
        "limits",
        help="flow control: each kind's caps and rates and how full they are; "
        "`limits set` / `limits reset` at run time",
    )
    _common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    lsub = p.add_subparsers(dest="limits_action", metavar="ACTION")
    s = lsub.add_parser(
        "set", help="set a kind's limits for every host now (they win over the app's until reset)"
    )
    _common(s)
    _with_app(s)
    s.add_argument("kind", metavar="KIND", help="the kind")
    s.add_argument(
        "--max-running",
        type=_count_or_none,
        default=argparse.SUPPRESS,
        metavar="N|none",
        help="runs of the kind holding a live lease at once, across every host (none: no cap)",
    )
    s.add_argument(
        "--group-limit",
        type=_count_or_none,
        default=argparse.SUPPRESS,
        metavar="N|none",
        help="runs of one tenant's group at once (none: one at a time)",
    )
    s.add_argument(
        "--rate",
        type=_text_or_none,
        default=argparse.SUPPRESS,
        metavar="COUNT/PERIOD|none",
        help="claims at most per period, such as 100/10s or 5/m (none: no rate)",
    )
    s.add_argument(
        "--rate-per",
        type=_text_or_none,
        default=argparse.SUPPRESS,
        metavar="tenant|group|none",
        help="tenant: each tenant its own rate; group: each tenant's group its own (none: one"
        " rate for the kind)",
    )
    s.add_argument(
        "--tenant",
        default=None,
        help="with --rate: this tenant's own rate (a kind rated per tenant, or per group: then"
        " each of its groups')",
    )
    r = lsub.add_parser(
        "reset", help="drop what was set at run time: the app's declared limits hold again"
    )
    _common(r)
    r.add_argument("kind", metavar="KIND", help="the kind")
    r.add_argument(
        "names",
        nargs="*",
        metavar="LIMIT",
        help=f"only these ({', '.join(LIMIT_NAMES)}; default all)",
    )
    r.add_argument("--tenant", default=None, help="reset this tenant's own rate instead")

    p = sub.add_parser("schedules", help="periodic tasks with their next run")
    _common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "dashboard", help="web page (read-only unless --actions), /metrics and /healthz"
    )
    _common(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a further Host header to accept on loopback, e.g. behind a local proxy",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the token every request must carry (else LEASEWORK_DASHBOARD_TOKEN); "
        "required beyond loopback",
    )
    p.add_argument(
        "--actions",
        action="store_true",
        default=None,
        help="offer cancel, retry, delete, pause, resume and limits (POST forms with a CSRF token; "
        "else config dashboard_actions)",
    )
    _with_app(p)

    p = sub.add_parser("config", help="print the settings in effect, or the reference")
    _common(p)
    p.add_argument(
        "--reference",
        action="store_true",
        help="every setting with its default and meaning, as a Markdown table",
    )

    p = sub.add_parser("demo", help="run the whole story end to end on 4 worker processes")
    _common(p)
    p.add_argument(
        "--embedded",
        action="store_true",
        help="use an embedded Postgres even if a server is reachable (else LEASEWORK_DEMO_EMBEDDED)",
    )
    _with_app(p)  # accepted for symmetry; the demo runs its own app (leasework.demo:demo_app)
    return parser


def config_sections(app: str | None = None) -> list[type]:
    """The sections a config is read with, before any key is checked: the built-in app's (the
    engine's stages', the syncs and documents families': a file may set their keys whether or
    not the app uses them, as one file serves several apps), the dashboard's, and those the app
    named declares (its families', `App.section`). An app that cannot be imported or built is
    left for `load_app` to report."""
    found = [*builtin_app().sections(), DashboardSettings]
    module_name, _, attr = (app or "").partition(":")
    if module_name:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        with suppress(Exception):  # reported by load_app with its own message
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            if callable(obj) and not isinstance(obj, App):
                obj = obj()  # a factory: the app it builds says what it reads
            if isinstance(obj, App):
                found.extend(obj.sections())
    return found


def _config(args: argparse.Namespace, **overrides: Any) -> Config:
    return configmod.load(
        getattr(args, "config", None),
        prepare=config_sections,
        overrides={
            "dsn": getattr(args, "dsn", None),
            "app": getattr(args, "app", None),
            "processes": getattr(args, "processes", None),
            "pools": getattr(args, "pool", None)
            if getattr(args, "command", "") == "supervise"
            else None,
            "log_format": getattr(args, "log_format", None),
            **overrides,
        },
    )


def cmd_migrate(args: argparse.Namespace, cfg: Config) -> int:
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        if args.check:
            have, todo = db.current_version(conn), db.pending(conn)
            if not todo:
                print(f"schema leasework is at version {have}: up to date")
                return EXIT_OK
            names = ", ".join(f"{m.version:04d}_{m.name}" for m in todo)
            state = "not installed" if have is None else f"at version {have}"
            print(f"schema leasework is {state}, this leasework needs {db.SCHEMA_VERSION}: {names}")
            return EXIT_ERROR
        done = db.migrate(conn)
    if done.before is None:
        print(f"schema leasework installed at version {done.after}")
    elif done.applied:
        print(
            f"schema leasework migrated from version {done.before} to {done.after}: "
            + ", ".join(done.applied)
        )
    else:
        print(f"schema leasework is at version {done.after}: up to date")
    return EXIT_OK


STANDALONE_NOTE = """\
One worker process, no supervisor: a development tool. Its lease keeper renews
and watches each run whatever the handler does, a cancel, a timeout or a stop
interrupts a blocked handler, and a kernel timer kills the process before a lease
it can no longer confirm expires, exactly as under `leasework supervise`. What
only the supervisor gives:
  - a handler stuck in a C call holding the GIL is not killed on cancel (nothing
    in the process can see it): the timer kills the process before its lease
    expires, and the run ends `cancelled` only once the lease has expired;
  - a worker that dies (kill -9, the timer) has its run released only when its
    lease expires, not at once; nobody restarts it.
"""


def cmd_worker(args: argparse.Namespace, cfg: Config) -> int:
    from .workers.worker import Worker

    # One direct connection before the worker opens its pool, which would retry a database that
    # does not exist, refused credentials or a closed port for its whole 30 s start-up wait,
    # logging each try. This way they are one line within CHECK_TIMEOUT, as for the other
    # commands: exit 2 for a refusal or a missing schema, 1 for a server that cannot be reached.
    with db.connect(cfg.dsn, connect_timeout=CHECK_TIMEOUT, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
    app = load_app(cfg.app, cfg)  # as supervise: a worker of no app would poll for nothing
    check_pools(cfg, app.kinds())
    app.check_start()  # e.g. an embedder that cannot be loaded: exit 2, not an error each poll
    if args.pool is not None:
        cfg.pool(args.pool)  # an unknown pool: one line, exit 2
    worker = Worker(app, cfg, deadman=cfg.deadman, pool=args.pool)
    log.event(
        "worker_standalone",
        level=30,
        note="a development tool: a handler stuck in a C call holding the GIL is not killed on "
        "cancel, and a dead worker's run waits out its lease; production hosts run "
        "`leasework supervise` (leasework worker --help)",
    )
    if args.once:
        worker.open()
        try:
            worker.running = True
            handled = worker.poll()
        finally:
            worker.close()
        print(f"poll handled {handled} item(s)")
        return EXIT_OK
    import signal

    def on_signal(signum: int, frame: object) -> None:
        graceful = not worker.stopping  # the first asks for a graceful stop, a second is fast
        worker.stop(graceful=graceful)
        if not graceful:
            worker.interrupt_now()  # Aborted in the handler, if one is running

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()
    return EXIT_OK


def cmd_supervise(args: argparse.Namespace, cfg: Config) -> int:
    from .supervisor.parent import Supervisor

    app = load_app(cfg.app, cfg)  # before any fork: an app that does not import is exit 2
    if cfg.pools and args.processes is not None:
        raise ConfigError(
            "supervise: --processes and pools both set the children; give each pool its "
            "processes (NAME:N:KINDS) or drop the pools"
        )
    check_pools(cfg, app.kinds())
    app.check_start()  # before any fork: what would fail every poll of every child is exit 2

    def reload() -> Config:
        return check_pools(_config(args), app.kinds())

    supervisor = Supervisor(app, cfg, reload=reload)
    code = supervisor.run()
    if supervisor.halt_message:
        print(f"leasework: {log.redact_dsn(supervisor.halt_message)}", file=sys.stderr)
    return code


def check_pools(cfg: Config, known: list[str]) -> Config:
    """Every kind a pool names is one of the app's: a misspelt kind would leave its runs to no
    child (and the pool idle). Before anything starts; one line."""
    for pool in cfg.pools:
        for kind in pool.kinds or ():
            if kind not in known:
                hint = difflib.get_close_matches(kind, known, n=1)
                also = f"; did you mean {hint[0]!r}?" if hint else ""
                raise ConfigError(
                    f"pools: pool {pool.name!r} names kind {kind!r}, which the app does not "
                    f"register{also} (known kinds: {', '.join(known) or 'none'})"
                )
    return cfg


def _parse_payload(text: str | None, flag: str = "--payload") -> Any:
    """JSON from the command line, kept exact: integers stay integers (a 64-bit one is stored as
    is, a larger one is refused by the enqueue rather than rounded to a float), and NaN or
    Infinity, which JSON does not have, are refused."""
    if text is None:
        return {}

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON: use null, a finite number or a string")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{flag} is nested too deeply") from None


def cmd_enqueue(args: argparse.Namespace, cfg: Config) -> int:
    import psycopg

    app = load_app(cfg.app, cfg)
    payload = _parse_payload(args.payload)
    options: EnqueueOptions = {
        "key": args.key,
        "tenant": args.tenant,
        "group": args.group,
        "exclusive": args.exclusive,
        "priority": args.priority,
        "delay": args.delay,
        "max_attempts": args.max_attempts,
    }
    # Given only when set: a flag left out keeps the task's own window or debounce.
    if args.unique_for is not None:
        options["unique_for"] = args.unique_for
    if args.debounce is not None:
        options["debounce"] = args.debounce
    if args.debounce_max is not None:
        options["debounce_max"] = args.debounce_max
    if args.on_parent_failure is not None and args.after is None:
        raise ConfigError("enqueue: --on-parent-failure needs --after RUN_ID: the runs it waits for")
    if args.after is not None:
        options["after"] = args.after
    if args.on_parent_failure is not None:
        options["on_parent_failure"] = args.on_parent_failure
    if args.tag:
        options["tags"] = args.tag
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        try:
            with conn.transaction():
                done = app.enqueue_run(conn, args.kind, payload, **options)
        except psycopg.errors.InvalidParameterValue as exc:
            # leasework.enqueue's refusal (an --after run that does not exist): its one line
            raise ConfigError(f"enqueue: {exc.diag.message_primary or exc}") from None
    print(done.run_id)
    said = {
        "active": "already has an active run: returned run {id}, enqueued nothing",
        "window": "has run {id} in its unique window: returned it, enqueued nothing",
        "debounced": "has pending run {id}: it took this payload and its due time moved",
    }
    if done.how in said:
        line = said[done.how].format(id=done.run_id)
        print(f"leasework: key {args.key!r} {line}", file=sys.stderr)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    if len(args.run_ids) == 1 and not _has_filter(args) and not args.dry_run:
        (run_id,) = args.run_ids
        with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
            db.check_schema(conn)
            status = App(cfg).cancel(conn, run_id)
        if status == "running":
            print(f"run {run_id}: cancel requested; it stops at its next control check")
        elif status == "cancelled":
            print(f"run {run_id}: cancelled")
        else:
            print(f"run {run_id}: already finished ({status})")
        return EXIT_OK
    _ids_or_filters(args, "cancel")
    with db.connect(cfg.dsn, pooler=cfg.pooler, autocommit=True) as conn:
        db.check_schema(conn)
        filters = None
        if not args.run_ids:
            filters = _filters_from(args, conn, operations.CANCELLABLE)
            if not args.dry_run:
                _confirm(args, "cancel", operations.count(conn, filters, "cancel"), filters)
        acted = operations.cancel(
            conn, args.run_ids or None, filters=filters, dry_run=args.dry_run
        )
    if acted.dry_run:
        print(f"would cancel {acted.count} run(s)")
        return EXIT_OK
    cancelled = len(acted.ids)
    print(f"cancelled {cancelled} run(s)" + (": " + _id_list(acted.ids) if acted.ids else ""))
    if acted.requested:
        print(
            f"cancel requested for {len(acted.requested)} running run(s), which stop at their "
            f"next control check: {_id_list(acted.requested)}"
        )
    if acted.skipped:
        print(f"already finished, left as they are: {_id_list(acted.skipped)}")
    return EXIT_OK


def cmd_run_now(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    _ids_or_filters(args, "run-now")
    with db.connect(cfg.dsn, pooler=cfg.pooler, autocommit=True) as conn:
        db.check_schema(conn)
        filters = None
        if not args.run_ids:
            filters = _filters_from(args, conn, operations.RUN_NOW)
            if not args.dry_run:
                _confirm(args, "run now", operations.count(conn, filters, "run-now"), filters)
        acted = operations.run_now(
            conn, args.run_ids or None, filters=filters, dry_run=args.dry_run
        )
    if acted.dry_run:
        print(f"would make {acted.count} run(s) due now")
        return EXIT_OK
    print(f"made {acted.count} run(s) due now" + (": " + _id_list(acted.ids) if acted.ids else ""))
    if acted.skipped:
        print(f"due already, left as they are: {_id_list(acted.skipped)}")
    return EXIT_OK


def _confirm(args: argparse.Namespace, verb: str, count: int, filters: Any) -> None:
    """A bulk action by filter: with --yes, go; on a terminal, ask with the count; else refuse
    (exit 2, one line with the count and --yes)."""
    if args.yes or count == 0:
        return
    what = f"{count} run(s) match ({filters.described()})"
    if sys.stdin.isatty() and sys.stderr.isatty():
        print(f"leasework: {what}: {verb} them? [y/N] ", end="", file=sys.stderr, flush=True)
        if sys.stdin.readline().strip().lower() in ("y", "yes"):
            return
        raise ConfigError(f"{verb}: not confirmed; nothing changed")
    raise ConfigError(
        f"{verb}: {what}; add --yes to {verb} them (or --dry-run to count only); nothing changed"
    )


def _filters_from(args: argparse.Namespace, conn: Any, allowed: Sequence[str]) -> Any:
    from . import operations

    since = None
    if args.since:
        since = operations.parse_since(args.since, operations.db_now(conn))
    payload = None
    if args.payload is not None:
        try:
            payload = orjson.loads(args.payload)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(
                f"--payload {args.payload[:80]!r} is not JSON ({exc}): give a JSON value the "
                'payload must contain, such as \'{"account": 42}\''
            ) from None
    return operations.Filters(
        statuses=operations.check_statuses(args.status, allowed),
        kind=args.kind,
        key=args.key,
        tenant=args.tenant,
        since=since,
        error=args.error,
        payload=payload,
        tags=args.tag,
    )


def _has_filter(args: argparse.Namespace) -> bool:
    return any(
        (args.status, args.kind, args.key, args.tenant, args.since, args.error, args.tag)
    ) or args.payload is not None


def _hint_kind(conn: Any, kind: str) -> None:
    """Nothing matched a --kind: if no worker serves that kind but one close to it, say so on
    stderr (the answer itself stays empty; a kind may have no runs yet)."""
    import difflib

    declared = [r[0] for r in conn.execute("SELECT kind FROM leasework.kinds").fetchall()]
    if kind in declared:
        return
    close = difflib.get_close_matches(kind, declared, n=1, cutoff=0.75)
    if close:
        print(
            f"leasework: no worker serves kind {terminal_safe(repr(kind))}; did you mean "
            f"{terminal_safe(repr(close[0]))}?",
            file=sys.stderr,
        )


def cmd_runs(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        tolerant(conn)  # a reader: any value a row holds is shown, none is an error
        db.check_schema(conn)
        filters = _filters_from(args, conn, operations.STATUSES)
        page = operations.list_runs(conn, filters, limit=args.limit, before=args.before)
        if not page.runs and args.kind:
            _hint_kind(conn, args.kind)
    if args.json:
        doc = {"runs": [_plain_row(r) for r in page.runs], "next_before": page.next_before}
        sys.stdout.write(json_text(doc) + "\n")
        return EXIT_OK
    sys.stdout.write(render_runs(page.runs))
    if page.next_before is not None:
        sys.stdout.write(f"(more: leasework runs ... --before {page.next_before})\n")
    return EXIT_OK


def json_text(value: Any, *, indent: bool = True) -> str:
    """JSON of a row's values, indented unless `indent` is false, unsafe characters
    `\\u`-escaped (leasework.text). A payload written outside Python (SQL, another language) may
    hold integers past 64 bits, which orjson refuses: the standard library prints those. A
    float's NaN or Infinity is null, as orjson writes it."""
    try:
        text = orjson.dumps(
            value, option=orjson.OPT_INDENT_2 if indent else None, default=str
        ).decode()
    except (orjson.JSONEncodeError, TypeError):
        text = json.dumps(
            _finite(value), indent=2 if indent else None, default=str, ensure_ascii=False
        )
    return json_visible(text)


def _finite(value: Any) -> Any:
    """`value` with each float that is not finite as None (valid JSON, orjson's choice)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (str(v) if k == "lease_owner" and v is not None else _plain(v)) for k, v in row.items()
    }


def _when(value: Any) -> str:
    return instant_text(value)


def render_runs(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "no runs\n"
    out = [f"{'id':>8}  {'kind':<20} {'status':<10} {'att':>5}  {'created (UTC)':<19}  key / error"]
    for r in rows:
        tries = f"{r['attempts']}/{r['max_attempts']}"
        note = r["key"] or ""
        if tags_text(r.get("tags")):
            note = f"{note}  [{tags_text(r['tags'])}]".strip()
        if r.get("error"):
            first = r["error"].splitlines()[0] if r["error"].strip() else ""
            note = f"{note}  {first}".strip()
        line = (
            f"{r['id']:>8}  {r['kind'][:20]:<20} {r['status']:<10} {tries:>5}  "
            f"{_when(r['created_at']):<19}  {note}"
        )
        out.append(terminal_safe(line)[:160])
    return "\n".join(out) + "\n"


def cmd_show(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        tolerant(conn)  # a reader: any value a row holds is shown, none is an error
        db.check_schema(conn)
        run = operations.get_run(conn, args.run_id)
        now = operations.db_now(conn)
        if run is not None:
            run["held_back"] = operations.held_back(conn, args.run_id)
            run["dependencies"] = operations.dependencies(conn, args.run_id)
            run["steps"] = operations.run_steps(conn, args.run_id)
    if run is None:
        raise ConfigError(f"no run with id {args.run_id} (it may have been pruned)")
    if args.json:
        sys.stdout.write(json_text(_plain_row(run)) + "\n")
        return EXIT_OK
    sys.stdout.write(render_run(run, now))
    return EXIT_OK


def render_run(run: dict[str, Any], now: Any) -> str:
    paused = " (kind paused)" if run.get("kind_paused") else ""
    fields = [
        ("run", f"#{run['id']}"),
        ("kind", f"{run['kind']}{paused}"),
        (
            "status",
            run["status"]
            + (
                " (cancel requested)"
                if run["cancel_requested_at"] and run["status"] == "running"
                else ""
            ),
        ),
        ("key", run["key"] or "-"),
        ("tenant", run["tenant"] or "-"),
        ("group", run["group"] or "-"),
        ("priority", str(run["priority"])),
        ("tags", tags_text(run.get("tags")) or "-"),
        ("attempts", f"{run['attempts']} of {run['max_attempts']}"),
        *(
            [("snoozes", f"{run['snoozes']} (not charged as attempts)")]
            if run.get("snoozes")
            else []
        ),
        (
            "progress",
            "none reported"
            if not run["processed_units"] and run["total_units"] is None
            else f"{run['processed_units']} / {run['total_units'] if run['total_units'] is not None else '?'}",
        ),
        *[("held", why) for why in held_back_lines(run.get("held_back") or [], now)],
        ("created", _when(run["created_at"])),
        ("due", _when(run["queued_at"])),
        ("started", _when(run["started_at"])),
        ("finished", _when(run["finished_at"])),
    ]
    fields.extend(_windows_lines(run))
    if run["lease_owner"] is not None:
        fields.append(("worker", run["lease_worker"] or "-"))
        expires = run["lease_expires_at"]
        if expires is None:  # an owner without a lease (a row written by hand)
            lease_text = f"{run['lease_owner']}, no expiry"
        else:
            left = (expires - now).total_seconds()
            lease_text = (
                f"{run['lease_owner']}, expires in {duration(left)}"
                if left >= 0
                else f"{run['lease_owner']}, expired {duration(-left)} ago"
            )
        fields.append(("lease", lease_text))
    out = [f"{name + ':':<10} {value}" for name, value in fields]

    def block(title: str, value: Any) -> None:
        out.append("")
        out.append(f"{title}:")
        text = (
            value
            if isinstance(value, str)
            else json_text(value)
        )
        out.extend("  " + line for line in text.splitlines())

    out.extend(_dependency_lines(run.get("dependencies")))
    block("payload", run["payload"])
    if run["result"] is not None:
        block("result", run["result"])
    elif run["status"] in ("succeeded", "partial", "failed", "cancelled"):
        out.extend(["", "result:   none"])
    if run["error"]:
        block("error", run["error"])
    steps = run.get("steps") or []
    if steps:
        out.extend(["", f"steps ({len(steps)} stored, ctx.step):"])
        out.extend(
            f"  {s['name']}  {number_text(s['bytes'])} B  attempt {s['attempt']}  "
            f"{_when(s['created_at'])}"
            for s in steps
        )
    out.append("")
    # The history is jsonb that a worker-role write can set to any value: a list of entries as
    # written by leasework, else each entry (or the whole value) shown as its JSON.
    history = run["history"] if isinstance(run["history"], list) else [run["history"]]
    if run["history"] is None:
        history = []
    out.append(f"history ({len(history)} attempt{'s' if len(history) != 1 else ''} ended):")
    for h in history:
        if not isinstance(h, dict):
            out.append(f"  {json.dumps(h, ensure_ascii=False)[:160]}")
            continue
        first = str(h.get("error") or "").strip().splitlines()
        err = f"  {first[0][:100]}" if first else ""
        # A snooze's entry says until when (its `due_at`): the run is queued, not failing.
        due = h.get("due_at") if h.get("outcome") == "snoozed" else None
        until = f"  until {str(due)[:19]}" if due else ""
        out.append(
            f"  #{h.get('attempt')} {h.get('outcome')!s:<10} {str(h.get('started_at') or '')[:19]} -> "
            f"{str(h.get('ended_at') or '')[:19]}  {h.get('worker') or '-'}{until}{err}"
        )
    # Every value from the database is shown with its control characters escaped (as `status`
    # does): an error text or a payload cannot move the cursor or forge a line.
    return "\n".join(terminal_safe(line) for line in out) + "\n"


def _dependency_lines(found: dict[str, Any] | None) -> list[str]:
    """What `show` says of a run's parents, children and graph (docs/workflows.md)."""
    if not found or not (found["parents"] or found["children"]):
        return []
    out = [""]
    for title in ("parents", "children"):
        rows = found[title]
        if not rows:
            continue
        out.append(f"{title} ({len(rows)}):")
        for r in rows:
            notes = [f"on failure: {r['on_failure']}"]
            if r["member"]:
                notes.append("batch member")
            out.append(f"  #{r['id']:<8} {r['kind'] or '-'!s:<24} {r['status']:<10} {', '.join(notes)}")
    graph = found.get("graph") or {}
    if graph:
        total = sum(graph.values())
        parts = ", ".join(f"{n} {s}" for s, n in sorted(graph.items()))
        out.append(f"graph: {total} runs: {parts}")
    return out


def _windows_lines(run: dict[str, Any]) -> list[tuple[str, str]]:
    """What `show` says of a run's unique window and debounce (docs/flow-control.md)."""
    lines = []
    merged = run.get("debounce_count")
    if merged is not None:
        latest = run.get("debounce_deadline")
        bound = _when(latest) if latest else "never bounded"
        text = (
            f"{number_text(merged)} enqueue{'s' if merged != 1 else ''} merged; due "
            f"{_when(run['queued_at'])}, at the latest {bound}"
        )
        if run["status"] == "waiting":
            text += "; waits for its key's running run to end"
        lines.append(("debounce", text))
    opened = run.get("unique_at")
    if opened is not None:
        lines.append(
            (
                "window",
                f"unique window opened {_when(opened)}: an enqueue of its key with unique_for=S "
                "returns this run until S after that (unless it failed or was cancelled)",
            )
        )
    return lines


def _ids_or_filters(args: argparse.Namespace, action: str) -> None:
    has_filter = _has_filter(args)
    if args.run_ids and has_filter:
        raise ConfigError(f"{action}: give run ids or filters, not both")
    if not args.run_ids and not has_filter:
        raise ConfigError(
            f"{action}: name run ids, or filters (--kind, --status, --key, --tenant, --since, "
            "--error, --payload, --tag)"
        )


def cmd_retry(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    _ids_or_filters(args, "retry")
    app = load_app(cfg.app, cfg, required=False)
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        filters = None if args.run_ids else _filters_from(args, conn, operations.RETRYABLE)
        acted = app.retry(
            conn,
            args.run_ids or None,
            filters=filters,
            attempts=args.attempts,
            dry_run=args.dry_run,
            clear_steps=args.clear_steps,
        )
        if not acted.count and args.kind:
            _hint_kind(conn, args.kind)
    if acted.dry_run:
        print(f"would retry {acted.count} run(s)")
    else:
        print(
            f"retried {acted.count} run(s): " + _id_list(acted.ids)
            if acted.ids
            else "retried 0 runs"
        )
    return EXIT_OK


def _id_list(ids: Sequence[int]) -> str:
    shown = " ".join(str(i) for i in ids[:20])
    return shown + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")


def cmd_delete(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    _ids_or_filters(args, "delete")
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        filters = None if args.run_ids else _filters_from(args, conn, operations.TERMINAL)
        acted = operations.delete(conn, args.run_ids or None, filters=filters, dry_run=args.dry_run)
        if not acted.count and args.kind:
            _hint_kind(conn, args.kind)
    if acted.dry_run:
        print(f"would delete {acted.count} run(s)")
    else:
        print(f"deleted {acted.count} run(s)" + (": " + _id_list(acted.ids) if acted.ids else ""))
    return EXIT_OK


def cmd_pause(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    known: list[str] = []
    if cfg.app:
        known = load_app(cfg.app, cfg).kinds()
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        newly = operations.pause(conn, args.kinds, known=known)
    for kind in args.kinds:
        state = "paused" if kind in newly else "already paused"
        print(f"{kind}: {state}; no worker claims its runs until `leasework resume {kind}`")
    return EXIT_OK


def cmd_resume(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    known: list[str] = []
    if cfg.app:
        known = load_app(cfg.app, cfg).kinds()
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        resumed = operations.resume(conn, args.kinds, known=known)
    for kind in args.kinds:
        print(f"{kind}: resumed" if kind in resumed else f"{kind}: not paused; nothing to resume")
    return EXIT_OK


def cmd_status(args: argparse.Namespace, cfg: Config) -> int:
    import time

    from . import status

    if args.watch is not None and not 0 < args.watch <= 86400:
        raise ConfigError(
            f"status: --watch must be a number of seconds above 0 and at most 86400, got {args.watch}"
        )
    tty = sys.stdout.isatty()
    snapshot: dict[str, Any] | None = None
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        while True:
            snapshot = status.collect(
                conn,
                heartbeat_interval=cfg.heartbeat_interval,
                previous=snapshot,
                max_kinds=cfg.max_kinds_shown,
            )
            if args.json:
                sys.stdout.write(json_text(snapshot, indent=args.watch is None) + "\n")
            elif args.watch is None:
                sys.stdout.write(status.render(snapshot))
            else:
                # In place on a terminal (home, clear to end); one block after another otherwise.
                text = status.render(snapshot)
                stamp = time.strftime("%H:%M:%S")
                head = f"leasework status at {stamp}, every {args.watch:g}s (Ctrl-C to stop)\n\n"
                sys.stdout.write(("\x1b[H\x1b[J" if tty else "\n") + head + text)
            sys.stdout.flush()
            if args.watch is None:
                return EXIT_OK
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return EXIT_OK


def _family(cfg: Config, cls: type[F]) -> F:
    """The app's family of type `cls`: the user's app must use it; without an app, a fresh one
    of its own (the family's commands need nothing of the user's code)."""
    app = load_app(cfg.app, cfg, required=False)
    family = app.family(cls)
    if family is not None:
        return family
    if cfg.app:
        raise ConfigError(
            f"{cfg.origin('app')} {cfg.app!r} does not use the {cls.name} family: "
            f"add app.use({cls.__name__}())"
        )
    return app.use(cls())


def cmd_ingest(args: argparse.Namespace, cfg: Config) -> int:
    from .documents import Documents, files

    docs = _family(cfg, Documents)
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        file_id, run_id = files.add_file(docs, conn, project=args.project, path=args.path)
    print(f"file {file_id}: ingest run {run_id} queued")
    return EXIT_OK


def cmd_upload(args: argparse.Namespace, cfg: Config) -> int:
    from .documents import Documents

    docs = _family(cfg, Documents)
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        db.check_schema(conn)
        upload_id = docs.add_upload(conn, project=args.project, path=args.path)
    print(f"upload {upload_id}: queued for expansion")
    return EXIT_OK


def cmd_connections(args: argparse.Namespace, cfg: Config) -> int:
    from .syncs import Syncs, kinds

    syncs = _family(cfg, Syncs)
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        tolerant(conn)  # a reader: any value a row holds is shown, none is an error
        db.check_schema(conn)
        if args.action == "add":
            config = _parse_payload(args.connection_config, "--connector-config")
            if not isinstance(config, dict):
                raise ConfigError(
                    f"--connector-config must be a JSON object, got {args.connection_config}"
                )
            connection_id = syncs.connect(
                conn,
                workspace=args.workspace,
                provider=args.provider,
                config=config,
                every=args.every,
                sync=not args.no_sync,
            )
            print(connection_id)
        elif args.action == "list":
            rows = kinds.list_connections(conn)
            if args.json:
                plain = [{k: _plain(v) for k, v in r.items()} for r in rows]
                sys.stdout.write(json_text(plain) + "\n")
            else:
                sys.stdout.write(_render_connections(rows))
        elif args.action == "sync":
            print(syncs.sync_now(conn, args.connection_id))
        elif args.action == "delete":
            run_id = syncs.delete_connection(conn, args.connection_id)
            row = syncs.app.get_run(conn, run_id)
            waiting = row is not None and row["status"] == "waiting"
            note = " (waiting for the running sync to finish)" if waiting else ""
            print(f"{run_id}{note}")
        else:
            syncs.disconnect(conn, args.connection_id)
            print(f"connection {args.connection_id}: disconnected")
    return EXIT_OK


def _plain(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _render_connections(rows: list[dict[str, Any]]) -> str:
    out = [
        f"{'id':>5}  {'workspace':<14} {'provider':<10} {'status':<12} {'every':>7}  "
        f"{'next run':<19} {'live':>6} {'gone':>6}"
    ]
    for r in rows:
        every = seconds_text(r["sync_interval_seconds"]) if r["sync_interval_seconds"] else "-"
        nxt = instant_text(r["next_run_at"])
        out.append(
            f"{r['id']:>5}  {r['workspace'][:14]:<14} {r['provider'][:10]:<10} "
            f"{r['status']:<12} {every:>7}  {nxt:<19} {r['live_records']:>6} "
            f"{r['tombstoned_records']:>6}"
        )
    return "\n".join(terminal_safe(line) for line in out) + "\n"


def cmd_tenants(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations

    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        tolerant(conn)  # a reader: any value a row holds is shown, none is an error
        db.check_schema(conn)
        if getattr(args, "tenants_action", None) == "set":
            if (args.name is None) == (not args.untenanted):
                raise ConfigError("tenants set: name a tenant, or give --untenanted (not both)")
            operations.set_tenant_weight(conn, args.name, args.weight)
            who = "runs without a tenant" if args.name is None else args.name
            print(terminal_safe(f"{who}: weight {args.weight:g}"))
            return EXIT_OK
        rows = operations.tenants(conn)
        shared = operations.untenanted_turn(conn)
    if getattr(args, "json", False):
        sys.stdout.write(json_text(rows) + "\n")
        return EXIT_OK
    out = [f"{'tenant':<32} {'weight':>8} {'queued':>8} {'running':>8}  turn"]
    out.append(
        f"{'(runs without a tenant)':<32} {number_text(shared['weight']):>8} "
        f"{shared['queued']:>8} {shared['running']:>8}  {number_text(shared['turn'])}"
    )
    for r in rows:
        out.append(
            f"{r['name'][:32]:<32} {number_text(r['weight']):>8} {r['queued']:>8} "
            f"{r['running']:>8}  {number_text(r['turn'])}"
        )
    sys.stdout.write("\n".join(terminal_safe(line) for line in out) + "\n")
    return EXIT_OK


def cmd_limits(args: argparse.Namespace, cfg: Config) -> int:
    from . import operations, status

    action = getattr(args, "limits_action", None)
    known: list[str] = []
    if action == "set" and cfg.app:
        known = load_app(cfg.app, cfg).kinds()
    given = {
        name: getattr(args, name) for name in LIMIT_NAMES if hasattr(args, name)
    } if action == "set" else {}
    if action == "set" and args.tenant is not None and set(given) != {"rate"}:
        raise ConfigError("limits set --tenant: give --rate (a tenant has a rate of its own only)")
    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        tolerant(conn)  # a reader: any value a row holds is shown, none is an error
        db.check_schema(conn)
        if action == "set" and args.tenant is not None:
            operations.set_tenant_rate(conn, args.kind, args.tenant, given["rate"])
            what = f"rate {given['rate']}" if given["rate"] else "the kind's rate again"
            print(terminal_safe(f"{args.kind}: tenant {args.tenant}: {what}"))
            return EXIT_OK
        if action == "set":
            overrides = operations.set_limits(conn, args.kind, known=known, **given)
            shown = ", ".join(
                f"{k} {_limit_text(v)}" for k, v in sorted(overrides.items()) if k in given
            )
            print(terminal_safe(f"{args.kind}: {shown} (until `leasework limits reset {args.kind}`)"))
            return EXIT_OK
        if action == "reset":
            if args.tenant is not None:
                operations.set_tenant_rate(conn, args.kind, args.tenant, None)
                print(terminal_safe(f"{args.kind}: tenant {args.tenant}: the kind's rate again"))
                return EXIT_OK
            gone = operations.reset_limits(conn, args.kind, args.names or None)
            print(
                terminal_safe(
                    f"{args.kind}: reset {', '.join(gone)}; the app's declared limits hold"
                    if gone
                    else f"{args.kind}: nothing was set at run time"
                )
            )
            return EXIT_OK
        rows = status.limits(conn)
        now = operations.db_now(conn)
    if args.json:
        sys.stdout.write(json_text([_plain_row(r) for r in rows]) + "\n")
        return EXIT_OK
    if not rows:
        print("no kind has a limit (docs/flow-control.md)")
        return EXIT_OK
    lines = status.limit_lines(rows, now.timestamp())
    sys.stdout.write("\n".join(terminal_safe(line) for line in lines) + "\n")
    return EXIT_OK


def _limit_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list) and len(value) == 2:
        return rate_spec(int(value[0]), float(value[1]))
    return str(value)


def cmd_schedules(args: argparse.Namespace, cfg: Config) -> int:
    from .stages.schedule import list_schedules

    with db.connect(cfg.dsn, pooler=cfg.pooler) as conn:
        tolerant(conn)  # a reader: any value a row holds is shown, none is an error
        db.check_schema(conn)
        rows = list_schedules(conn)
    if args.json:
        plain = [{k: _plain(v) for k, v in r.items()} for r in rows]
        sys.stdout.write(json_text(plain) + "\n")
        return EXIT_OK
    out = [f"{'name':<24} {'schedule':<28} {'next run (UTC)':<19}  last run"]
    # Workers enqueue a due schedule within a poll; past this, no running worker has the task.
    stale_after = max(60.0, 3 * cfg.poll_interval)
    for r in rows:
        spec = (
            f"every {seconds_text(r['every_seconds'])}"
            if r["every_seconds"] is not None
            else f"{r['cron']} {r['timezone']}"
        )
        nxt = instant_text(r["next_run_at"])
        last = f"#{r['last_run_id']} {r['last_run_status']}" if r["last_run_id"] else "-"
        line = f"{r['name'][:24]:<24} {spec[:28]:<28} {nxt:<19}  {last}"
        if r["overdue_seconds"] > stale_after:
            line += (
                f"  (overdue {duration(r['overdue_seconds'])}: no running worker has this task;"
                " removed from the code, or its workers are down)"
            )
        out.append(line)
    sys.stdout.write("\n".join(terminal_safe(line) for line in out) + "\n")
    return EXIT_OK


def cmd_dashboard(args: argparse.Namespace, cfg: Config) -> int:
    import signal

    from .dashboard import Dashboard

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"dashboard: --port must be 0-65535, got {args.port}")
    # A missing schema is bad usage (exit 2); a database that is down is served as 503 until back.
    try:
        with db.connect(cfg.dsn, connect_timeout=CHECK_TIMEOUT, pooler=cfg.pooler) as conn:
            db.check_schema(conn)
    except db.DatabaseUnavailable as exc:
        log.event("dashboard_database_unavailable", logging.WARNING, error=str(exc))
    token = os.environ.get("LEASEWORK_DASHBOARD_TOKEN") or None
    if args.token_file:
        try:
            with open(args.token_file, "rb") as fh:
                token = fh.read(4097).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"dashboard: --token-file {args.token_file}: {exc}") from None
    if token is not None and not 16 <= len(token) <= 4096:
        raise ConfigError("dashboard: the token must be 16-4096 characters long")
    from .dashboard.server import is_loopback

    if not is_loopback(args.host):
        print(
            f"leasework: warning: the dashboard listens on {terminal_safe(args.host)}, beyond "
            "loopback: every request must carry the token; put TLS in front of it, or the token "
            "and every page cross the network in clear",
            file=sys.stderr,
        )
    # With --app, a retry gets each task's attempt budget and pause and resume know the
    # registered kinds.
    app = load_app(cfg.app, cfg, required=False) if cfg.app else None
    dash = Dashboard(
        cfg,
        host=args.host,
        port=args.port,
        allow_hosts=args.allow_host,
        token=token,
        app=app,
        actions=args.actions,
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: dash.shutdown())
    mode = "actions on" if dash.actions else "read-only"
    print(f"leasework dashboard on {dash.url} ({mode}; Ctrl-C stops it)", flush=True)
    try:
        dash.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dash.close()
    return EXIT_OK


def cmd_config(args: argparse.Namespace, cfg: Config) -> int:
    if args.reference:
        sys.stdout.write(configmod.reference(cfg.sections))
        return EXIT_OK
    for name in configmod.all_keys(cfg.sections):
        value = configmod.value(cfg, name)
        text = "unset" if value is None else configmod.toml_value(value)
        if name in ("dsn", "listen_dsn") and value:
            try:
                db.check_dsn(value)
            except ConfigError:  # what libpq cannot parse cannot be redacted reliably: hide it
                text = '"(malformed, not shown: any command that connects says why)"'
            else:
                text = configmod.toml_value(log.redact_dsn(value))
        # Valid TOML as printed (an unset key is a comment), so the output can seed a file.
        print(f"# {name} is unset" if value is None else f"{name} = {text}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, cfg: Config) -> int:
    from . import demo

    return demo.main(cfg, embedded=args.embedded or None)


_RUNNERS: dict[str, Callable[[argparse.Namespace, Config], int]] = {
    "migrate": cmd_migrate,
    "worker": cmd_worker,
    "supervise": cmd_supervise,
    "enqueue": cmd_enqueue,
    "cancel": cmd_cancel,
    "run-now": cmd_run_now,
    "runs": cmd_runs,
    "show": cmd_show,
    "retry": cmd_retry,
    "delete": cmd_delete,
    "pause": cmd_pause,
    "resume": cmd_resume,
    "status": cmd_status,
    "ingest": cmd_ingest,
    "upload": cmd_upload,
    "connections": cmd_connections,
    "tenants": cmd_tenants,
    "limits": cmd_limits,
    "schedules": cmd_schedules,
    "dashboard": cmd_dashboard,
    "config": cmd_config,
    "demo": cmd_demo,
}


MAX_ERROR_CHARS = 400  # an error line quotes at most this much (the input can be megabytes)


def one_line(message: str) -> str:
    """An error message as one printable, password-free line of bounded length: control
    characters (which a terminal or `splitlines` would break on) are shown escaped."""
    text = terminal_safe(log.clip(message.strip(), MAX_ERROR_CHARS))
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 1] + "…"
    return text


def _fail(message: str, code: int) -> int:
    print(f"leasework: {one_line(message)}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:  # a bare `leasework`: the usage and the commands, not one error line
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return _main(parser, argv)
    except BrokenPipeError:
        # `leasework status --watch | head`: the reader left. Quietly, and without Python's own
        # complaint when it flushes stdout at exit.
        with suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _main(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    try:
        args = parser.parse_args(argv)
        if getattr(args, "dsn", None) and log.has_password(args.dsn):
            print(
                "leasework: warning: --dsn carries a password, which any user of this host can "
                "read in `ps` and /proc (of this process and every worker it starts): put it in "
                "LEASEWORK_DSN, a service file (PGSERVICEFILE) or ~/.pgpass instead",
                file=sys.stderr,
            )
        cfg = _config(args)
        log.setup(cfg.log_level, cfg.log_format)
        return _RUNNERS[args.command](args, cfg)
    except (ConfigError, SchemaMissing, StateConflict) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except LeaseworkError as exc:
        return _fail(str(exc), EXIT_ERROR)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise
    except Exception as exc:  # a one-line report, not a traceback, for anything unexpected
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return _fail(f"{type(exc).__name__}: {first}", EXIT_ERROR)
