"""A private Postgres cluster for a benchmark: tests/pgcluster.py's (initdb + pg_ctl as the
`postgres` user, a free port, a temp directory, removed afterwards), with Postgres' defaults
apart from that helper's durability shortcuts (fsync and full-page writes off), which change
neither sizes nor vacuuming. Autovacuum is on, as on every default server."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.pgcluster import private_cluster


@contextlib.contextmanager
def private_server(prefix: str = "leasework-bench-") -> Iterator[str]:
    """Start a cluster and yield its admin DSN; stopped and deleted on exit."""
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        raise SystemExit("a private cluster needs initdb and pg_ctl on PATH (or pass --dsn)")
    with private_cluster(prefix) as c:
        yield c.dsn
