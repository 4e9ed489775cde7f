"""Process-test harness: a real `leasework supervise` subprocess on the session's database, a
test app written into tmp_path (loaded with --app), short timings from a TOML config file, and
helpers that wait on conditions with a deadline (never a fixed sleep)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from leasework import App
from tests.conftest import wait_for

# The test app. `hold` runs until the file hold-<run id> disappears, calling ctx.check() (and a
# checkpoint) as it goes; then it writes its effect through the fenced transaction. `crash`
# exits the process without a word, every time.
APP = textwrap.dedent(
    """
    from __future__ import annotations

    import os
    import time
    from pathlib import Path

    from leasework import App, Aborted, LeaseLost

    app = App()
    HERE = Path(__file__).parent


    @app.task("hold")
    def hold(ctx, payload):
        marker = HERE / f"hold-{ctx.run_id}"
        n = ctx.processed
        try:
            while payload.get("hold") and marker.exists():
                ctx.check()
                n += 1
                if n % 10 == 0:
                    ctx.checkpoint(n)
                time.sleep(0.02)
        except Aborted as exc:
            if exc.reason != "lost":
                raise
        # Whether it finished or lost its lease, the effect goes through the fenced
        # transaction, which must refuse (LeaseLost) before writing if the run is not ours.
        try:
            with ctx.transaction() as conn:
                conn.execute(
                    "INSERT INTO public.supervisor_test_effects (run_id, attempt, pid) VALUES (%s, %s, %s)",
                    (ctx.run_id, ctx.attempt, os.getpid()),
                )
        except LeaseLost:
            (HERE / f"fence-refused-{ctx.run_id}-{os.getpid()}").touch()
            raise
        return {"pid": os.getpid(), "attempt": ctx.attempt}


    @app.task("crash", max_attempts=3)
    def crash(ctx, payload):
        os._exit(1)


    # For pools: `reports` holds its child until the file release-reports exists; `short`
    # returns at once. Both say which process ran them.
    @app.task("reports")
    def reports(ctx, payload):
        while not (HERE / "release-reports").exists():
            ctx.check()
            time.sleep(0.02)
        return {"pid": os.getpid()}


    @app.task("short")
    def short(ctx, payload):
        return {"pid": os.getpid()}
    """
)

BASE_CONFIG: dict[str, Any] = {
    "poll_interval": 0.2,
    "lease": 6.0,
    "renew_interval": 1.0,
    "control_interval": 0.25,
    "heartbeat_interval": 1.0,
    "graceful_timeout": 2.0,
    "watchdog_margin": 2.0,
    "hang_timeout": 5.0,
    "restart_backoff": 0.1,
    "restart_backoff_max": 1.0,
    "processes": 2,
}


def _toml(values: dict[str, Any]) -> str:
    out = []
    tables: list[str] = []  # a list of dicts is an array of tables ([[pools]]), after the keys
    for key, value in values.items():
        if value is None:  # unset: the default (e.g. timings derived from the lease)
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for table in value:
                tables.append(f"[[{key}]]")
                tables.append(_toml(table).rstrip("\n"))
            continue
        if isinstance(value, bool):
            out.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, str):
            out.append(f'{key} = "{value}"')
        elif isinstance(value, list):
            out.append(f"{key} = {orjson.dumps(value).decode()}")
        else:
            out.append(f"{key} = {value}")
    return "\n".join(out + tables) + "\n"


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (exited, not reaped yet) or dead. A
    process that goes away while its stat is read fails the read with ESRCH (ProcessLookupError,
    not FileNotFoundError): gone too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # FileNotFoundError: no such pid; ProcessLookupError: it exited meanwhile
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] not in ("Z", "X", "x")


class Supervised:
    """One running supervisor and what it logged."""

    def __init__(
        self,
        tmp: Path,
        dsn: str,
        config: dict[str, Any],
        app: str = "lwtestapp:app",
        wrap: Sequence[str] = (),
        dsn_flag: bool = True,
    ) -> None:
        """wrap: a command prefix that execs the supervisor (e.g. `ip netns exec NS`): its pid
        stays the supervisor's. dsn_flag=False: the DSN goes in the config file instead of
        --dsn (so that a reload can change it)."""
        self.tmp = tmp
        self.dsn = dsn
        self.config_path = tmp / "leasework.toml"
        self.write_config(config if dsn_flag else {"dsn": dsn, **config})
        self.log_path = tmp / f"supervisor-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        env.pop("LEASEWORK_CONFIG", None)
        self.proc = subprocess.Popen(
            [
                *wrap,
                sys.executable,
                "-m",
                "leasework",
                "supervise",
                "--app",
                app,
                "--config",
                str(self.config_path),
                *(["--dsn", dsn] if dsn_flag else []),
            ],
            cwd=tmp,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid

    def write_config(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(_toml({**BASE_CONFIG, **config}))

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_bytes().splitlines():
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(doc, dict) and (name is None or doc.get("event") == name):
                out.append(doc)
        return out

    def wait_event(
        self,
        name: str,
        where: Callable[[dict[str, Any]], bool] = lambda e: True,
        timeout: float = 10.0,
    ) -> dict[str, Any]:
        try:
            found: dict[str, Any] = wait_for(
                lambda: next((e for e in self.events(name) if where(e)), None), timeout
            )
            return found
        except AssertionError:
            raise AssertionError(f"no {name} event; log:\n{self.log_path.read_text()}") from None

    def children(self) -> list[int]:
        """Live children of the supervisor, from /proc."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:  # gone, or exiting while read (ESRCH)
            return []
        return [int(p) for p in text.split() if alive(int(p))]

    def wait_children(self, n: int, timeout: float = 10.0) -> list[int]:
        def booted() -> list[int] | None:
            kids = self.children()
            booted = {e["pid"] for e in self.events("child_booted")}
            return kids if len(kids) == n and set(kids) <= booted else None

        try:
            return wait_for(booted, timeout)  # type: ignore[no-any-return]
        except AssertionError:
            raise AssertionError(
                f"expected {n} booted children, have {self.children()}; log:\n"
                + self.log_path.read_text()
            ) from None

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"supervisor still running; log:\n{self.log_path.read_text()}"
            ) from None

    def stop(self) -> None:
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in kids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):  # it may exit in between
                    os.kill(pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "lwtestapp.py").write_text(APP)
    return tmp_path


@pytest.fixture
def pconn(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """An emptied test database with an effects table the test app writes through its fence."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS public.supervisor_test_effects (run_id bigint, attempt int, pid int)"
    )
    conn.execute("TRUNCATE public.supervisor_test_effects")
    return conn


@pytest.fixture
def supervise(app_dir: Path, dsn: str, pconn: Any) -> Iterator[Callable[..., Supervised]]:
    """supervise(**config) starts a supervisor; every one started is stopped after the test."""
    started: list[Supervised] = []

    def start(dsn_flag: bool = True, **config: Any) -> Supervised:
        s = Supervised(app_dir, dsn, config, dsn_flag=dsn_flag)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def enqueue(conn: psycopg.Connection[Any], kind: str, payload: dict[str, Any] | None = None) -> int:
    """Enqueue through the public API (the kind registered on a throwaway App)."""
    app = App()
    app.task(kind, max_attempts=3)(lambda ctx, p: None)
    return app.enqueue(conn, kind, payload or {})


def holder_pid(worker_id: str) -> int:
    """Worker ids are host-pid-suffix."""
    return int(worker_id.rsplit("-", 2)[1])
