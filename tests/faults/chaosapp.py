"""The app the chaos supervisor runs (`--app tests.faults.chaosapp:app`).

`steps` does `payload.steps` steps; each sleeps a little (calling ctx.check() as it waits), then
writes one effect row through the fenced transaction, together with its checkpoint, so a retry
resumes after the last committed step. Every start of a handler is logged (autocommit) to
public.chaos_exec: executions, not only commits. `payload.die` kills the worker with SIGKILL at a
critical point on the first attempt. `payload.tx_sleep` sleeps inside each step's
open transaction. `poison` kills its worker on every attempt. `durable` does `payload.durable`
durable steps (ctx.step), each an "external call" that waits a little and logs a fresh token to
public.chaos_step_calls; the odd ones inside a fenced transaction with an effect row that commits
with the step's record."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from typing import Any

import orjson
import psycopg

from leasework import App, Context

app = App()

ORACLE_SQLSTATE = "LW001"  # raised by the chaos_effects trigger (tests/faults/oracle.sql)


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _say(event: str, **fields: Any) -> None:
    sys.stderr.write(orjson.dumps({"event": event, "ts": time.time(), **fields}).decode() + "\n")
    sys.stderr.flush()


def _log_exec(ctx: Context) -> None:
    try:
        with ctx.connection() as conn:
            conn.execute(
                "INSERT INTO public.chaos_exec (run_id, attempt, owner, pid)"
                " VALUES (%s, %s, %s, %s)",
                (ctx.run_id, ctx.attempt, ctx.claim.owner, os.getpid()),
            )
    except psycopg.Error as exc:  # a fault may cut this off; the history still has the claim
        _say("chaos_exec_not_logged", run_id=ctx.run_id, error=str(exc).splitlines()[0])


def _wait(ctx: Context, seconds: float) -> None:
    end = time.monotonic() + seconds
    while True:
        ctx.check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


@app.task("steps", max_attempts=5)
def steps(ctx: Context, payload: Any) -> dict[str, Any]:
    first = ctx.attempt == 1
    die = payload.get("die") if first else None
    if die == "after_claim":
        _die()
    _log_exec(ctx)
    for step in range(ctx.processed, int(payload["steps"])):
        _wait(ctx, float(payload.get("sleep", 0.1)))
        try:
            with ctx.transaction() as conn:
                conn.execute(
                    "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    (ctx.run_id, step, ctx.claim.owner, ctx.attempt, os.getpid()),
                )
                if die == "before_checkpoint" and step == 1:
                    _die()
                # Work done inside the open transaction (a partition may cut it off here).
                time.sleep(float(payload.get("tx_sleep", 0.0)))
                ctx.checkpoint(step + 1)
        except psycopg.Error as exc:
            if exc.sqlstate == ORACLE_SQLSTATE:
                _say("oracle_rejected", run_id=ctx.run_id, step=step, owner=str(ctx.claim.owner))
            raise
        if die == "after_step" and step == 1:
            _die()
    return {"steps": int(payload["steps"]), "attempt": ctx.attempt}


@app.task("poison", max_attempts=3)
def poison(ctx: Context, payload: Any) -> None:
    _log_exec(ctx)
    _die()


def _external_call(ctx: Context, name: str, sleep: float, called: list[str]) -> str:
    """A call with an effect outside the database's transaction: it takes a while (a kill or a
    SIGSTOP lands here), then logs the token it returns."""
    _wait(ctx, sleep)
    token = uuid.uuid4().hex
    with ctx.connection() as conn:
        conn.execute(
            "INSERT INTO public.chaos_step_calls (run_id, name, token, attempt, owner)"
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.run_id, name, token, ctx.attempt, ctx.claim.owner),
        )
    called.append(token)
    return token


@app.task("durable", max_attempts=5)
def durable(ctx: Context, payload: Any) -> dict[str, Any]:
    _log_exec(ctx)
    sleep = float(payload.get("sleep", 0.1))
    values = []
    for i in range(int(payload["durable"])):
        name = f"s{i}"
        called: list[str] = []
        if i % 2 == 0:
            values.append(ctx.step(name, _external_call, ctx, name, sleep, called))
            continue
        with ctx.transaction() as conn:
            values.append(ctx.step(name, _external_call, ctx, name, sleep, called))
            if called:  # stored now: its effect commits with it (else both did before)
                conn.execute(
                    "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    (ctx.run_id, i, ctx.claim.owner, ctx.attempt, os.getpid()),
                )
    return {"values": values}
