"""A private Postgres cluster for tests that crash, pause or restart the server: initdb/pg_ctl
(as the `postgres` user when run as root), a free port, a temp directory, `fsync=off` (speed: a
crash here is a process crash, not a power cut, so the page cache survives) but
`synchronous_commit=on`, so a commit acknowledged to a client is in the WAL the restart replays.

The driver only signals pids it can name: the postmaster from `postmaster.pid` and its children
from /proc. Shared by tests/chaos/, the fault harness (tests/faults/) and bench/."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest


def as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:  # the server refuses to run as root
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _own(directory: Path) -> None:
    """As root, the server runs as `postgres`, who must own (and reach) the directory."""
    if os.geteuid() == 0:
        directory.chmod(0o755)
        shutil.chown(directory, "postgres")


_TEMPLATE: Path | None = None


def _template() -> Path:
    """The data directory of one initdb per process, copied by every Cluster.init (removed at
    exit). Never started: copies share no state, only the files initdb wrote."""
    global _TEMPLATE
    if _TEMPLATE is None:
        root = Path(tempfile.mkdtemp(prefix="leasework-pg-template-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _own(root)
        subprocess.run(
            as_postgres(["initdb", "-D", str(root / "data"), "-U", "postgres", "--auth=trust"]),
            check=True,
            capture_output=True,
        )
        _TEMPLATE = root / "data"
    return _TEMPLATE


class Cluster:
    def __init__(
        self,
        root: Path,
        listen: Sequence[str] = (),
        hba: Sequence[str] = (),
        settings: Sequence[str] = (),
    ) -> None:
        """listen: addresses to listen on besides 127.0.0.1; hba: networks (CIDR) admitted
        with trust besides loopback (e.g. the host side of a test's veth pairs); settings:
        `name=value` server settings after the defaults below (the last of a name wins)."""
        self.root = root
        self.settings = list(settings)
        self.listen = ",".join(["127.0.0.1", *listen])
        self.hba = list(hba)
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.paused: list[int] = []

    def init(self) -> None:
        """A fresh data directory: a copy of this process's one initdb (the same files a new
        initdb writes, in a tenth of the time; each cluster still has its own directory)."""
        _own(self.data.parent)
        subprocess.run(
            as_postgres(["cp", "-a", str(_template()), str(self.data)]),
            check=True,
            capture_output=True,
        )
        if self.hba:
            with open(self.data / "pg_hba.conf", "a") as f:
                f.writelines(f"host all all {net} trust\n" for net in self.hba)

    def start(self) -> None:
        opts = (
            f"-p {self.port} -c listen_addresses={self.listen}"
            f" -c unix_socket_directories={self.data}"
            " -c fsync=off -c synchronous_commit=on -c full_page_writes=off -c max_connections=200"
        ) + "".join(f" -c {setting}" for setting in self.settings)
        subprocess.run(
            as_postgres(
                ["pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start"]
            ),
            check=True,
            capture_output=True,
        )

    def crash(self) -> None:
        """Immediate shutdown: no checkpoint, WAL not flushed; the restart replays the WAL."""
        self.resume()
        subprocess.run(
            as_postgres(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"]),
            check=True,
            capture_output=True,
        )

    def postmaster(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None

    def server_pids(self) -> list[int]:
        """The postmaster and its children (backends and auxiliary processes)."""
        pm = self.postmaster()
        if pm is None:
            return []
        try:
            kids = Path(f"/proc/{pm}/task/{pm}/children").read_text().split()
        except OSError:  # gone, or exiting while read (ESRCH)
            return []
        return [pm, *(int(k) for k in kids)]

    def pause(self) -> None:
        """SIGSTOP the whole server: connections stay open and simply go silent."""
        pids = self.server_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self.paused = pids

    def resume(self) -> None:
        for pid in reversed(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused = []

    def stop(self) -> None:
        self.resume()
        subprocess.run(
            as_postgres(["pg_ctl", "-D", str(self.data), "-m", "immediate", "stop"]),
            capture_output=True,
        )


@contextlib.contextmanager
def private_cluster(
    prefix: str = "leasework-pg-",
    listen: Sequence[str] = (),
    hba: Sequence[str] = (),
    settings: Sequence[str] = (),
) -> Iterator[Cluster]:
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        pytest.skip("initdb / pg_ctl not on PATH")
    # Not under tmp_path: as root, the server runs as `postgres`, who must reach the directory.
    root = Path(tempfile.mkdtemp(prefix=prefix))
    c = Cluster(root, listen, hba, settings)
    try:
        c.init()
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
