"""The chaos app with async handlers (`--app tests.faults.chaosapp_async:app`): the same kinds,
payloads and records as chaosapp.py, each child running up to four runs at once on its event
loop. The waits never await ctx.check(): a cancel, a timeout, a lost lease or a shutdown reaches
a run only by its task being cancelled."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from typing import Any

import orjson
import psycopg

from leasework import App
from leasework.workers.acontext import AsyncContext

from .chaosapp import ORACLE_SQLSTATE

app = App()


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # every run in flight on this child dies with it


def _say(event: str, **fields: Any) -> None:
    sys.stderr.write(orjson.dumps({"event": event, "ts": time.time(), **fields}).decode() + "\n")
    sys.stderr.flush()


async def _log_exec(ctx: AsyncContext) -> None:
    try:
        async with ctx.connection() as conn:
            await conn.execute(
                "INSERT INTO public.chaos_exec (run_id, attempt, owner, pid)"
                " VALUES (%s, %s, %s, %s)",
                (ctx.run_id, ctx.attempt, ctx.claim.owner, os.getpid()),
            )
    except psycopg.Error as exc:  # a fault may cut this off; the history still has the claim
        _say("chaos_exec_not_logged", run_id=ctx.run_id, error=str(exc).splitlines()[0])


@app.task("steps", max_attempts=5, concurrency=4)
async def steps(ctx: AsyncContext, payload: Any) -> dict[str, Any]:
    first = ctx.attempt == 1
    die = payload.get("die") if first else None
    if die == "after_claim":
        _die()
    await _log_exec(ctx)
    for step in range(ctx.processed, int(payload["steps"])):
        await asyncio.sleep(float(payload.get("sleep", 0.1)))
        try:
            async with ctx.transaction() as conn:
                await conn.execute(
                    "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    (ctx.run_id, step, ctx.claim.owner, ctx.attempt, os.getpid()),
                )
                if die == "before_checkpoint" and step == 1:
                    _die()
                # Work done inside the open transaction (a partition may cut it off here).
                await asyncio.sleep(float(payload.get("tx_sleep", 0.0)))
                await ctx.checkpoint(step + 1)
        except psycopg.Error as exc:
            if exc.sqlstate == ORACLE_SQLSTATE:
                _say("oracle_rejected", run_id=ctx.run_id, step=step, owner=str(ctx.claim.owner))
            raise
        if die == "after_step" and step == 1:
            _die()
    return {"steps": int(payload["steps"]), "attempt": ctx.attempt}


@app.task("poison", max_attempts=3, concurrency=4)
async def poison(ctx: AsyncContext, payload: Any) -> None:
    await _log_exec(ctx)
    _die()


async def _external_call(ctx: AsyncContext, name: str, sleep: float, called: list[str]) -> str:
    """chaosapp's external call, awaited: it takes a while, then logs the token it returns."""
    await asyncio.sleep(sleep)
    token = uuid.uuid4().hex
    async with ctx.connection() as conn:
        await conn.execute(
            "INSERT INTO public.chaos_step_calls (run_id, name, token, attempt, owner)"
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.run_id, name, token, ctx.attempt, ctx.claim.owner),
        )
    called.append(token)
    return token


@app.task("durable", max_attempts=5, concurrency=4)
async def durable(ctx: AsyncContext, payload: Any) -> dict[str, Any]:
    await _log_exec(ctx)
    sleep = float(payload.get("sleep", 0.1))
    values = []
    for i in range(int(payload["durable"])):
        name = f"s{i}"
        called: list[str] = []
        if i % 2 == 0:
            values.append(await ctx.step(name, _external_call, ctx, name, sleep, called))
            continue
        async with ctx.transaction() as conn:
            values.append(await ctx.step(name, _external_call, ctx, name, sleep, called))
            if called:
                await conn.execute(
                    "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    (ctx.run_id, i, ctx.claim.owner, ctx.attempt, os.getpid()),
                )
    return {"values": values}
