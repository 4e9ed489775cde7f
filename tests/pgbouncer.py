"""A private PgBouncer for tests that go through a pooler: Debian's `pgbouncer` on a free port in a
temp directory, `pool_mode = transaction` (no session survives a transaction: no LISTEN, no
session SET, no protocol-level prepared statement), trust auth, every database name passed
through to one upstream server. Run as `postgres` when the tests run as root (it refuses root).

The driver signals only the pid it started. Skipped, with the reason, when `pgbouncer` is not
installed (`.ci/run` installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.pgcluster import free_port


class Bouncer:
    def __init__(
        self,
        root: Path,
        upstream_host: str,
        upstream_port: int,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        listen: Sequence[str] = (),
    ) -> None:
        """listen: addresses to listen on besides 127.0.0.1 (e.g. the machine's side of veth
        pairs, for clients in network namespaces)."""
        self.root = root
        self.upstream = (upstream_host, upstream_port)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.listen = ",".join(["127.0.0.1", *listen])
        self.port = free_port()
        self.log = root / "pgbouncer.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def dsn(self, upstream_dsn: str) -> str:
        """`upstream_dsn` (its database and user) through this pooler instead."""
        params = conninfo_to_dict(upstream_dsn)
        params.update(host="127.0.0.1", port=str(self.port))
        return make_conninfo(**params)

    def start(self) -> None:
        host, port = self.upstream
        (self.root / "userlist.txt").write_text('"postgres" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {self.listen}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.root / 'userlist.txt'}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 1000\n"
            "server_login_retry = 1\n"
            "admin_users = postgres\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n"
        )
        cmd = [executable() or "pgbouncer"]
        if os.geteuid() == 0:  # it refuses to run as root
            self.root.chmod(0o755)
            cmd += ["-u", "postgres"]
        cmd.append(str(self.root / "pgbouncer.ini"))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with psycopg.connect(
                    f"host=127.0.0.1 port={self.port} dbname=pgbouncer user=postgres",
                    autocommit=True,
                    connect_timeout=2,
                ):
                    return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"pgbouncer did not start: {self.log.read_text(errors='replace')[-2000:]}"
                    ) from None
                time.sleep(0.05)  # polling interval of this start-up wait

    def admin(self, command: str) -> list[tuple[object, ...]]:
        """A command on the admin console (SHOW POOLS, SHOW SERVERS, ...)."""
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} dbname=pgbouncer user=postgres",
            autocommit=True,
            connect_timeout=5,
        ) as conn:
            # The console speaks the simple query protocol only.
            cur = conn.cursor()
            cur.execute(command.encode(), prepare=False)
            return cur.fetchall() if cur.description else []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)  # immediate shutdown
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def executable() -> str | None:
    """Debian installs it in /usr/sbin, which a user's PATH may not hold."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")


@contextlib.contextmanager
def pgbouncer(upstream_dsn: str, **kwargs: object) -> Iterator[Bouncer]:
    """A PgBouncer in front of the server `upstream_dsn` names (its host and port)."""
    if executable() is None:
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer; .ci/run does)")
    params = conninfo_to_dict(upstream_dsn)
    host = str(params.get("host") or "127.0.0.1")
    port = int(params.get("port") or 5432)
    root = Path(tempfile.mkdtemp(prefix="leasework-pgbouncer-"))
    b = Bouncer(root, host, port, **kwargs)  # type: ignore[arg-type]
    try:
        b.start()
        yield b
    finally:
        b.stop()
        shutil.rmtree(root, ignore_errors=True)
