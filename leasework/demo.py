"""`leasework demo`: the whole story on a real supervisor with 4 worker processes. A connection
synced twice while its files change (rows tombstoned), a ZIP of documents expanded and indexed
with live progress bars, a batch of tasks (one fails once and is retried, one is cancelled
mid-run) and a long checkpointed job whose worker is killed with SIGKILL and which resumes
elsewhere from its checkpoint. Ends with a summary table; exit 0 when every outcome is right.

It writes only into a database the user named (`--dsn`, LEASEWORK_DSN, the config file's
`dsn`); without one, into a database of its own, `leasework_demo`, which it makes (and says so)
on the server DATABASE_URL or libpq's defaults reach; with no server, or none that lets it make
a database, on an embedded Postgres (the `embedded` extra) under .leasework/, removed on exit.
Never touches runs it did not make.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from . import db, operations, status
from .app import App
from .config import Config
from .documents import Documents
from .documents.embed import HashingEmbedder
from .errors import ConfigError
from .log import first_line
from .syncs import Syncs
from .syncs.kinds import connection_key
from .workers.context import Context

demo_app = App()
demo_docs = demo_app.use(Documents())
demo_app.use(Syncs())
PROCESSES = 4
DEADLINE = 110.0  # seconds for the whole story; each phase has its own, smaller one

_hashing = HashingEmbedder(256)


@demo_docs.embedder
def slow_embedder(texts: Sequence[str]) -> list[list[float]]:
    """The built-in feature hashing, slowed to the pace of a real model so progress shows."""
    time.sleep(0.02 * len(texts))
    return [list(v) for v in _hashing(texts)]


@demo_app.task("demo.hello")
def hello(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    ctx.check()
    time.sleep(0.2)
    return {"greeting": f"hello, {payload.get('name', 'world')}"}


@demo_app.task("demo.flaky", max_attempts=3)
def flaky(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise ConnectionError("upstream timed out (on purpose)")
    return {"ok_on_attempt": ctx.attempt}


@demo_app.task("demo.slow")
def slow(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Long enough to be cancelled mid-run; keeps a partial result as it goes."""
    steps = int(payload.get("steps", 200))
    ctx.set_total(steps)
    for i in range(ctx.processed, steps):
        ctx.check()  # a cancel request trips this within control_interval
        time.sleep(0.05)
        ctx.result = {"done": i + 1}
        if (i + 1) % 5 == 0:
            ctx.checkpoint(i + 1)
    return {"done": steps}


@demo_app.task("demo.long")
def long_job(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed job: each step's effect and its checkpoint commit together in the fenced
    transaction, and a new attempt resumes from ctx.processed."""
    steps = int(payload.get("steps", 60))
    resumed_from = ctx.processed
    if ctx.total is None:
        ctx.set_total(steps)
    for i in range(resumed_from, steps):
        ctx.check()
        time.sleep(0.1)  # the step's work
        with ctx.transaction():  # LeaseLost before writing if the run is no longer ours
            ctx.checkpoint(i + 1)
    return {"steps": steps, "resumed_from": resumed_from, "attempt": ctx.attempt}


def slow_outcome(row: dict[str, Any]) -> str:
    """What became of demo.slow, in words whose numbers agree: the steps its partial result
    says were done, and its last checkpoint (every 5 steps), where another attempt would resume;
    the two differ by the steps done since that checkpoint."""
    result = row.get("result")
    done = result.get("done") if isinstance(result, dict) else None
    total = row.get("total_units") or "?"
    said = f"{row['status']} after {done if done is not None else '?'} of {total} steps"
    checkpoint = row.get("processed_units")
    if checkpoint is not None:
        said += f" (last checkpoint: step {checkpoint}, taken every 5)"
    return f"{said}; partial result kept: {orjson.dumps(result).decode()}"


# -- the database ------------------------------------------------------------------------------


@dataclass
class Database:
    dsn: str
    embedded: Any = None  # a pgserver server, stopped and removed by close()
    where: str = ""  # the embedded server's directory
    note: str = ""  # which database, said when it is the demo's own

    def close(self) -> None:
        if self.embedded is not None:
            with contextlib.suppress(Exception):
                self.embedded.cleanup()
            shutil.rmtree(self.where, ignore_errors=True)


# The demo's own database, on the server DATABASE_URL or libpq's defaults reach, when no database
# is named: made by the demo (and said so), kept afterwards for a look (`leasework dashboard`).
DEMO_DATABASE = "leasework_demo"


def named_dsn(cfg: Config) -> str | None:
    """The database the user named for leasework: `--dsn`, LEASEWORK_DSN or the config file's
    `dsn`. DATABASE_URL names the application's own database (the demo would migrate into it
    and run its supervisor there), and libpq's defaults name whatever they reach: neither is
    the demo's to write in."""
    if not cfg.dsn:
        return None
    if "dsn" not in dict(cfg.origins) and cfg.dsn == os.environ.get("DATABASE_URL"):
        return None
    return cfg.dsn


def own_database(server: str | None, name: str = DEMO_DATABASE) -> Database | str:
    """Database `name` on the server `server` (a DSN; None: libpq's defaults) reaches, made if
    it is missing; or why not (no server answers, or this role may not create a database)."""
    target = make_conninfo(server or "", dbname=name)
    try:
        with db.connect(target, connect_timeout=3) as conn:
            where = _server_of(conn)
        return Database(target, note=f"database {name} on {where} (the demo's own, kept from "
                        "an earlier demo)")
    except db.DatabaseUnavailable as exc:
        return str(exc)
    except ConfigError:
        pass  # missing (or refused): made from the server's maintenance database below
    problem = f"database {name} is missing"
    for maintenance in ("postgres", "template1"):
        try:
            with db.connect(make_conninfo(server or "", dbname=maintenance), connect_timeout=3) as c:
                where = _server_of(c)
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return Database(target, note=f"database {name} on {where} (made for the demo; "
                            f"drop it with `dropdb {name}`)")
        except db.DatabaseUnavailable as exc:
            return str(exc)
        except ConfigError as exc:  # no such maintenance database: the next one
            problem = str(exc)
        except psycopg.Error as exc:  # not allowed to create a database
            return f"cannot create database {name}: {first_line(exc)}"
    return problem


def _server_of(conn: psycopg.Connection[Any]) -> str:
    host = conn.info.host
    return f"{host}:{conn.info.port}" if not host.startswith("/") else f"the socket in {host}"


def open_database(
    cfg: Config, *, embedded: bool, root: Path, own: str = DEMO_DATABASE
) -> Database:
    """Never a database the user did not name: the one named (named_dsn); else the demo's own
    (`own`, own_database) on the server DATABASE_URL or libpq's defaults reach; else, no server
    answering or none that lets it make a database, an embedded Postgres under `root`."""
    why = "no database named"
    if not embedded:
        dsn = named_dsn(cfg)
        if dsn is not None:
            return Database(dsn)
        found = own_database(cfg.dsn, own)
        if isinstance(found, Database):
            print(f"no database named (--dsn, LEASEWORK_DSN): using {found.note}", flush=True)
            return found
        why = f"no database named, and none of the demo's own: {found}"
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            import pgserver  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise ConfigError(
            f"{why}; and the embedded extra is not installed: name a database with --dsn or "
            "LEASEWORK_DSN, or install pgserver (the embedded extra): pip install 'pgserver>=0.1.4'"
        ) from None
    where = root / "pg"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = pgserver.get_server(str(where), cleanup_mode="stop")  # type: ignore[attr-defined,unused-ignore]
    print(
        f"{why if not embedded else 'asked for an embedded Postgres'}: started an embedded "
        f"Postgres in {where} (stopped and removed on exit)",
        flush=True,
    )
    return Database(str(server.get_uri()), server, str(where))


# -- the supervisor ----------------------------------------------------------------------------


def supervisor_env(dsn: str, store: Path) -> dict[str, str]:
    """Seed semantics with demo pacing: fast polls and control checks, short backoff, small
    ingest batches (so progress moves visibly), frequent worker rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEWORK_")}
    if os.environ.get("LEASEWORK_CONFIG"):
        env["LEASEWORK_CONFIG"] = os.environ["LEASEWORK_CONFIG"]
    env.update(
        {
            "LEASEWORK_APP": "leasework.demo:demo_app",
            "LEASEWORK_POLL_INTERVAL": "0.5",
            "LEASEWORK_CONTROL_INTERVAL": "0.25",
            "LEASEWORK_HEARTBEAT_INTERVAL": "1",
            "LEASEWORK_BACKOFF": "1",
            "LEASEWORK_INGEST_BATCH": "10",
            "LEASEWORK_GRACEFUL_TIMEOUT": "5",
            "LEASEWORK_FILE_STORE": str(store),
            "LEASEWORK_LOG_FORMAT": "json",
        }
    )
    if dsn:
        env["LEASEWORK_DSN"] = dsn
    return env


@contextlib.contextmanager
def supervisor(env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`leasework supervise --processes 4` in a subprocess, logging to log_path; stopped
    gracefully (TERM) on the way out, killed if it does not stop."""
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leasework", "supervise", "--processes", str(PROCESSES)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


# -- watching ----------------------------------------------------------------------------------


class Live:
    """Progress bars of the running runs, redrawn in place on a terminal, a line every 2 s
    otherwise. Reads `status.collect()`, the same snapshot `leasework status` shows."""

    def __init__(self, conn: psycopg.Connection[Any], out: io.TextIOBase | Any) -> None:
        self.conn = conn
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.snapshot: dict[str, Any] | None = None
        self.drawn = 0
        self.last_print = 0.0

    def lines(self, kinds: tuple[str, ...]) -> list[str]:
        self.snapshot = status.collect(self.conn, heartbeat_interval=1.0, previous=self.snapshot)
        out = []
        for r in self.snapshot["running"]:
            if not r["kind"].startswith(kinds):
                continue
            total = r["total_units"]
            what = f"{r['kind']} {r['key'] or ''}".strip()[:16]
            pid = worker_pid(r["lease_worker"]) or "?"
            if total is None:
                progress = f"running {status.duration(r.get('running_for'))}"
            else:
                units = f"{r['processed_units']}/{total}"
                pace = f"{status.rate_text(r.get('rate'))} eta {status.duration(r.get('eta'))}"
                progress = f"{status.bar(r['processed_units'], total, 12)} {units:>7} {pace}"
            out.append(f"  #{r['id']:<5} {what:<16} pid {pid:<6} {progress}"[:79])
        return out

    def tick(self, kinds: tuple[str, ...]) -> None:
        lines = self.lines(kinds)
        if self.tty:
            if self.drawn:
                self.out.write(f"\x1b[{self.drawn}A\x1b[J")
            self.out.write("".join(line + "\n" for line in lines))
            self.drawn = len(lines)
        elif lines and time.monotonic() - self.last_print >= 2.0:
            self.out.write("".join(line + "\n" for line in lines))
            self.last_print = time.monotonic()
        self.out.flush()

    def done(self) -> None:
        if self.tty and self.drawn:
            self.out.write(f"\x1b[{self.drawn}A\x1b[J")
        self.drawn = 0
        self.out.flush()


def wait_until(
    what: str,
    predicate: Callable[[], Any],
    *,
    timeout: float,
    live: Live | None = None,
    kinds: tuple[str, ...] = (),
    proc: subprocess.Popen[bytes] | None = None,
) -> Any:
    """Poll a condition (with live progress) until it holds; raise DemoFailed after `timeout`."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            value = predicate()
            if value:
                return value
            if proc is not None and proc.poll() is not None:
                raise DemoFailed(f"the supervisor exited ({proc.returncode}) while {what}")
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout:g} s while {what}")
            if live is not None:
                live.tick(kinds)
            time.sleep(0.2)
    finally:
        if live is not None:
            live.done()


class DemoFailed(Exception):
    """An outcome the demo did not expect."""


# -- sample data -------------------------------------------------------------------------------

TOPICS = [
    ("concrete", "slab pour curing formwork rebar cover slump test cylinder strength"),
    ("steel", "beam column connection bolt weld inspection fireproofing erection"),
    ("facade", "curtain wall panel anchor sealant mockup water test glazing"),
    ("mep", "duct riser sprinkler conduit panelboard commissioning balancing"),
    ("safety", "harness guardrail permit toolbox talk incident scaffold inspection"),
    ("schedule", "milestone float critical path lookahead delay recovery baseline"),
    ("budget", "change order allowance contingency invoice retention forecast"),
    ("handover", "punch list warranty manual training as-built closeout keys"),
]


def sample_zip(path: Path, paragraphs: int = 70) -> Path:
    """A ZIP of Markdown specs, about `paragraphs` chunks each (deterministic text)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, (topic, words) in enumerate(TOPICS):
            vocab = words.split()
            body = [f"# Tower B: {topic} specification\n"]
            for p in range(paragraphs):
                sentence = " ".join(vocab[(p + i) % len(vocab)] for i in range(12))
                body.append(f"## {topic} {p + 1}\n\n" + (sentence.capitalize() + ". ") * 8 + "\n")
            zf.writestr(f"specs/{n + 1:02d}-{topic}.md", "\n".join(body))
    return path


def write_export(root: Path, projects: list[dict[str, Any]], tasks: list[tuple[str, str]]) -> None:
    (root / "projects.jsonl").write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in projects))
    (root / "tasks.csv").write_text(
        "id,title\n" + "".join(f"{i},{t}\n" for i, t in tasks), encoding="utf-8"
    )


# -- the story ---------------------------------------------------------------------------------


@dataclass
class Story:
    app: App
    conn: psycopg.Connection[Any]
    live: Live
    proc: subprocess.Popen[bytes]
    work: Path
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def syncs(self) -> Syncs:
        syncs = self.app.family(Syncs)
        assert syncs is not None
        return syncs

    @property
    def docs(self) -> Documents:
        docs = self.app.family(Documents)
        assert docs is not None
        return docs

    def one(self, query: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        row = self.conn.execute(query, params).fetchone()
        return None if row is None else row[0]

    def run(self, run_id: int) -> dict[str, Any]:
        row = operations.get_run(self.conn, run_id)
        assert row is not None
        return row

    def finished(self, *ids: int) -> bool:
        n = self.one(
            "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND finished_at IS NOT NULL",
            (list(ids),),
        )
        return bool(n == len(ids))

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    # 1. a connection synced twice while its files change ----------------------------------------

    def connection(self) -> None:
        print("\n1. A `files` connection, synced twice while its directory changes")
        export = self.work / "export"
        export.mkdir()
        write_export(
            export,
            [{"id": 1, "name": "Depot"}, {"id": 2, "name": "Bridge"}, {"id": 3, "name": "School"}],
            [("t1", "pour slab"), ("t2", "order steel")],
        )
        cid = self.syncs.connect(
            self.conn, workspace="demo", provider="files", config={"path": str(export)}
        )
        first = self.one(
            "SELECT max(id) FROM leasework.runs WHERE key = %s", (connection_key(cid),)
        )
        wait_until("the first sync runs", lambda: self.finished(first), timeout=20, proc=self.proc)
        write_export(
            export,
            [{"id": 1, "name": "Depot"}, {"id": 3, "name": "School (phase 2)"}],
            [("t1", "pour slab"), ("t3", "inspect rebar")],
        )
        print("   files changed: project 2 and task t2 removed, project 3 renamed, t3 added")
        second = self.syncs.sync_now(self.conn, cid)
        wait_until(
            "the second sync runs", lambda: self.finished(second), timeout=20, proc=self.proc
        )
        for run_id in (first, second):
            row = self.run(run_id)
            tables = (row["result"] or {}).get("tables", {})
            parts = [
                f"{t}: +{v.get('upserted', 0)} upserted, -{v.get('tombstoned', 0)} tombstoned"
                for t, v in sorted(tables.items())
            ]
            print(f"   sync run #{run_id} {row['status']}: " + "; ".join(parts))
            self.expect(row["status"] == "succeeded", f"sync run {run_id} ended {row['status']}")
        live, gone = self.conn.execute(
            "SELECT count(*) FILTER (WHERE deleted_at IS NULL),"
            " count(*) FILTER (WHERE deleted_at IS NOT NULL)"
            " FROM leasework.records WHERE connection_id = %s",
            (cid,),
        ).fetchone() or (0, 0)
        print(f"   records: {live} live, {gone} tombstoned (deleted upstream, kept for retention)")
        self.expect((live, gone) == (4, 2), f"records {live} live / {gone} gone, expected 4 / 2")
        purge = self.syncs.delete_connection(self.conn, cid)
        wait_until("the purge runs", lambda: self.finished(purge), timeout=20, proc=self.proc)
        row = self.run(purge)
        print(f"   connection deleted: purge run #{purge} {row['status']}")
        self.expect(row["status"] == "succeeded", f"purge run {purge} ended {row['status']}")

    # 2. tasks: retried, cancelled, killed ----------------------------------------------------

    def tasks(self) -> None:
        print("\n2. A batch of tasks on 4 worker processes")
        with self.conn.transaction():
            hellos = [
                self.app.enqueue(self.conn, "demo.hello", {"name": f"site {n}"}) for n in range(6)
            ]
            flaky_id = self.app.enqueue(self.conn, "demo.flaky", {})
            slow_id = self.app.enqueue(self.conn, "demo.slow", {"steps": 200})
            long_id = self.app.enqueue(self.conn, "demo.long", {"steps": 60})
        print(
            f"   enqueued 6 x demo.hello, #{flaky_id} demo.flaky (fails once), "
            f"#{slow_id} demo.slow (to cancel), #{long_id} demo.long (to kill)"
        )
        kinds = ("demo.",)

        def progressed(run_id: int, units: int) -> Any:
            return self.one(
                "SELECT processed_units FROM leasework.runs WHERE id = %s AND status = 'running'"
                " AND processed_units >= %s",
                (run_id, units),
            )

        wait_until(
            "demo.slow gets going", lambda: progressed(slow_id, 30), timeout=20,
            live=self.live, kinds=kinds, proc=self.proc,
        )  # fmt: skip
        self.app.cancel(self.conn, slow_id)
        print(f"   cancel requested for #{slow_id} while it runs")

        at = wait_until(
            "demo.long reaches a third", lambda: progressed(long_id, 20), timeout=30,
            live=self.live, kinds=kinds, proc=self.proc,
        )  # fmt: skip
        victim = self.run(long_id)
        pid = worker_pid(victim["lease_worker"])
        if pid is None or not child_of(pid, self.proc.pid):
            raise DemoFailed(f"run {long_id} is not held by a child of the demo's supervisor")
        killed_at = self.one("SELECT clock_timestamp()")
        os.kill(pid, signal.SIGKILL)
        print(f"   kill -9 {pid}: the worker running #{long_id} (checkpoint {at}/60)")

        resumed = wait_until(
            "demo.long resumes",
            lambda: self.one(
                "SELECT started_at FROM leasework.runs WHERE id = %s AND attempts >= 2",
                (long_id,),
            ),
            timeout=30, live=self.live, kinds=kinds, proc=self.proc,
        )  # fmt: skip
        recovery = (resumed - killed_at).total_seconds()
        wait_until(
            "the batch finishes", lambda: self.finished(*hellos, flaky_id, slow_id, long_id),
            timeout=40, live=self.live, kinds=kinds, proc=self.proc,
        )  # fmt: skip

        for run_id in hellos:
            row = self.run(run_id)
            self.expect(row["status"] == "succeeded", f"demo.hello #{run_id} {row['status']}")
        row = self.run(flaky_id)
        first_error = next((h.get("error") for h in row["history"] if h.get("error")), "")
        print(
            f"   #{flaky_id} demo.flaky: {row['status']} on attempt {row['attempts']} "
            f"(attempt 1: {(first_error or '').splitlines()[0][:60]})"
        )
        self.expect(
            row["status"] == "succeeded" and row["attempts"] == 2,
            f"demo.flaky ended {row['status']} after {row['attempts']} attempts",
        )
        row = self.run(slow_id)
        print(f"   #{slow_id} demo.slow: {slow_outcome(row)}")
        self.expect(row["status"] == "cancelled", f"demo.slow ended {row['status']}")
        row = self.run(long_id)
        result = row["result"] or {}
        new_pid = worker_pid((row["history"][-1] or {}).get("worker"))
        outcomes = [h.get("outcome") for h in row["history"]]
        print(
            f"   #{long_id} demo.long: {row['status']} after {row['attempts']} attempts "
            f"{outcomes}; attempt 2 on pid {new_pid} resumed from checkpoint "
            f"{result.get('resumed_from')}, {recovery:.2f} s after the kill"
        )
        self.expect(
            row["status"] == "succeeded" and row["attempts"] == 2,
            f"demo.long ended {row['status']} after {row['attempts']} attempts",
        )
        self.expect(
            int(result.get("resumed_from") or 0) >= 20,
            f"demo.long restarted from {result.get('resumed_from')}, not its checkpoint",
        )
        self.notes.append(
            f"kill -9: run #{long_id}'s worker (pid {pid}) died at checkpoint {at}/60; the "
            f"supervisor released its lease and pid {new_pid} resumed it from "
            f"{result.get('resumed_from')} after {recovery:.2f} s."
        )

    # 3. a ZIP expanded and indexed ------------------------------------------------------------

    def documents(self) -> None:
        print(f"\n3. A ZIP of {len(TOPICS)} documents, expanded and indexed (live progress)")
        archive = sample_zip(self.work / "tower-b-specs.zip")
        upload = self.docs.add_upload(self.conn, project="tower-b", path=archive)
        print(f"   upload #{upload}: {archive.name}, {archive.stat().st_size // 1024} KiB")

        def all_ready() -> bool:
            row = self.conn.execute(
                "SELECT u.status, count(f.id), count(f.id) FILTER (WHERE f.status IN"
                " ('ready', 'failed')) FROM leasework.uploads u"
                " LEFT JOIN leasework.files f ON f.upload_id = u.id WHERE u.id = %s"
                " GROUP BY u.status",
                (upload,),
            ).fetchone()
            if row is None or row[0] == "failed":
                return row is not None
            return bool(row[0] == "done" and row[1] == len(TOPICS) and row[2] == row[1])

        started = time.monotonic()
        wait_until(
            "the documents are indexed", all_ready, timeout=60,
            live=self.live, kinds=("ingest",), proc=self.proc,
        )  # fmt: skip
        rows = self.conn.execute(
            "SELECT f.status, count(*), coalesce(sum(f.chunks), 0) FROM leasework.files f"
            " WHERE f.upload_id = %s GROUP BY f.status",
            (upload,),
        ).fetchall()
        by = {status_: (n, chunks) for status_, n, chunks in rows}
        ready, chunks = by.get("ready", (0, 0))
        print(
            f"   {ready}/{len(TOPICS)} files ready, {chunks} chunks indexed in "
            f"{time.monotonic() - started:.1f} s across the workers"
        )
        self.expect(ready == len(TOPICS), f"only {ready} of {len(TOPICS)} documents indexed")


def worker_pid(worker_id: str | None) -> int | None:
    """The pid inside a supervised worker id (`host-pid-suffix`)."""
    parts = (worker_id or "").rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def child_of(pid: int, parent: int) -> bool:
    """True if `pid` is a process whose parent is `parent` (never kill anything else)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return bool(int(stat.rsplit(")", 1)[1].split()[1]) == parent)


def summary(conn: psycopg.Connection[Any], first_id: int) -> list[str]:
    rows = conn.execute(
        "SELECT kind, count(*), count(*) FILTER (WHERE status = 'succeeded'),"
        " count(*) FILTER (WHERE status = 'cancelled'), count(*) FILTER (WHERE status = 'failed'),"
        " count(*) FILTER (WHERE status NOT IN ('succeeded', 'cancelled', 'failed')),"
        " sum(attempts) FROM leasework.runs WHERE id > %s GROUP BY kind ORDER BY min(id)",
        (first_id,),
    ).fetchall()
    head = f"  {'kind':<14} {'runs':>5} {'succeeded':>10} {'cancelled':>10} {'failed':>7} {'other':>6} {'attempts':>9}"
    out = [head, "  " + "-" * (len(head) - 2)]
    totals = [0] * 6
    for kind, *counts in rows:
        totals = [t + int(c) for t, c in zip(totals, counts, strict=True)]
        out.append(
            f"  {kind[:14]:<14} {counts[0]:>5} {counts[1]:>10} {counts[2]:>10} {counts[3]:>7}"
            f" {counts[4]:>6} {counts[5]:>9}"
        )
    out.append("  " + "-" * (len(head) - 2))
    out.append(
        f"  {'total':<14} {totals[0]:>5} {totals[1]:>10} {totals[2]:>10} {totals[3]:>7}"
        f" {totals[4]:>6} {totals[5]:>9}"
    )
    return out


def main(cfg: Config, *, embedded: bool | None = None) -> int:
    if embedded is None:
        embedded = os.environ.get("LEASEWORK_DEMO_EMBEDDED", "") not in ("", "0")
    began = time.monotonic()
    root = Path(".leasework").resolve()
    work = root / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    database = open_database(cfg, embedded=embedded, root=root)
    try:
        with db.connect(database.dsn) as conn:
            done = db.migrate(conn)
            print(
                f"schema leasework at version {done.after} ({', '.join(done.applied) or 'up to date'})"
            )
            row = conn.execute("SELECT coalesce(max(id), 0) FROM leasework.runs").fetchone()
            first_id = int(row[0]) if row else 0
            store = work / "files"
            app = demo_app.with_config(cfg.replace(dsn=database.dsn or None, file_store=str(store)))
            log_path = work / "supervisor.log"
            env = supervisor_env(database.dsn, store)
            with supervisor(env, log_path) as proc:
                print(
                    f"supervisor pid {proc.pid}: leasework supervise --processes {PROCESSES} "
                    f"(its log: {log_path})"
                )
                story = Story(app, conn, Live(conn, sys.stdout), proc, work)
                wait_until(
                    "the workers start",
                    lambda: (
                        sum(
                            child_of(pid, proc.pid)
                            for (pid,) in conn.execute(
                                "SELECT pid FROM leasework.workers WHERE stopped_at IS NULL"
                            ).fetchall()
                        )
                        >= PROCESSES
                    ),
                    timeout=30,
                    proc=proc,
                )
                try:
                    story.connection()
                    story.tasks()
                    story.documents()
                except DemoFailed as exc:
                    story.problems.append(str(exc))
            print("\nSummary (the runs this demo made)")
            print("\n".join(summary(conn, first_id)))
            for note in story.notes:
                print(f"  {note}")
        elapsed = time.monotonic() - began
        if story.problems:
            print(f"\ndemo FAILED after {elapsed:.0f} s:")
            for p in story.problems:
                print(f"  - {p}")
            print(f"  (the supervisor's log: {log_path})")
            return 1
        print(f"\ndemo finished in {elapsed:.0f} s: every outcome as expected.")
        return 0
    finally:
        database.close()
