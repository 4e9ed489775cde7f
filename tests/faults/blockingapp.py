"""The app of the non-cooperative chaos tier (`--app tests.faults.blockingapp:app`): handlers that
never call ctx.check().

Each run does `payload.steps` steps; each step blocks in one call that knows nothing of leasework
(`payload.block`: `sleep`, `socket`, `subprocess`, `gil` or `tx`) and then writes one effect row
through the fenced transaction, with its checkpoint. `tx` blocks inside that open transaction
instead (a few statements apart, so the server never finds it idle for a whole lease). An attempt
up to `payload.stuck` blocks for `payload.stuck_seconds` (`gil`: in one C call holding the GIL
for minutes, deaf to signals) so that only a fault, a cancel or a timeout ends it.

Every attempt appends its start and its end (when its handler leaves, however it leaves) to the
journal file `payload.journal`, one JSON line each with its pid and wall-clock time: a local file,
so the record survives the faults under test (a dead or black-holed database, a held reply),
which the oracle reads with the processes' liveness (tests/faults/attempts.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from typing import Any

import orjson
import psycopg

from leasework import Aborted, App, Context

from .chaosapp import ORACLE_SQLSTATE, _say

app = App()

BLOCKS = ("sleep", "socket", "subprocess", "gil", "tx")
GIL_STEP = 3 * 10**6  # tens of milliseconds in one C call holding the GIL
GIL_STUCK = 10**10  # minutes in one
TX_BEAT = 1.0  # a statement at least this often inside an open transaction (lease 4 s)
TIMEOUT = 1.5  # seconds, the `<block>_timeout` kinds' attempt timeout


def record(path: str, doc: dict[str, Any]) -> None:
    """Append one line to the journal. An interruption (Aborted) landing in the middle is let
    through only after the line is written (a second copy is harmless: the oracle takes the
    earliest time)."""
    line = orjson.dumps(doc) + b"\n"
    caught: Aborted | None = None
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write, O_APPEND: lines never interleave
            finally:
                os.close(fd)
            break
        except Aborted as exc:  # raised at most once per attempt
            caught = exc
    if caught is not None:
        raise caught


def block(kind: str, seconds: float, payload: Any, stuck: bool) -> None:
    """One call of `seconds` that never looks at the run's state."""
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "socket":
        with socket.create_connection(tuple(payload["silent"]), timeout=5) as sock:
            sock.settimeout(seconds)  # a read from a server that never answers
            with contextlib.suppress(TimeoutError):
                sock.recv(1)
    elif kind == "subprocess":
        subprocess.run(["sleep", f"{seconds:.3f}"], check=True)
    elif kind == "gil":
        sum(range(GIL_STUCK if stuck else GIL_STEP))
    else:
        raise ValueError(f"unknown block {kind!r}")


def hold_open(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Keep the fenced transaction open `seconds`, never idle for a whole lease."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, TX_BEAT))
        conn.execute("SELECT 1")


def blocking(ctx: Context, payload: Any) -> dict[str, Any]:
    kind = payload["block"]
    me = {
        "run": ctx.run_id,
        "attempt": ctx.attempt,
        "owner": str(ctx.claim.owner),
        "pid": os.getpid(),
    }
    how = "returned"
    try:
        record(payload["journal"], {**me, "event": "start", "t": time.time()})
        stuck = ctx.attempt <= int(payload.get("stuck", 0))
        seconds = float(payload["stuck_seconds"] if stuck else payload.get("seconds", 0.1))
        for step in range(ctx.processed, int(payload["steps"])):
            if kind != "tx":
                block(kind, seconds, payload, stuck)
            try:
                with ctx.transaction() as conn:
                    conn.execute(
                        "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
                        " VALUES (%s, %s, %s, %s, %s)",
                        (ctx.run_id, step, ctx.claim.owner, ctx.attempt, os.getpid()),
                    )
                    if kind == "tx":
                        hold_open(conn, seconds)
                    ctx.checkpoint(step + 1)
            except psycopg.Error as exc:
                if exc.sqlstate == ORACLE_SQLSTATE:
                    _say("oracle_rejected", run_id=ctx.run_id, step=step, owner=me["owner"])
                raise
        return {"steps": int(payload["steps"]), "attempt": ctx.attempt}
    except BaseException as exc:
        how = type(exc).__name__
        raise
    finally:
        record(payload["journal"], {**me, "event": "end", "t": time.time(), "how": how})


for _block in BLOCKS:
    app.task(_block, max_attempts=10, timeout=None)(blocking)
    app.task(f"{_block}_timeout", max_attempts=3, timeout=TIMEOUT)(blocking)
