"""The oracles and the invariant checks have teeth: a stale write is refused by the trigger,
each kind of corrupted history is reported by `ChaosRun.check()`, and the attempt oracle of the
non-cooperative tier reports overlapping attempts and runs held by the dead (CONVENTIONS: every
invariant test must be able to fail)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson
import psycopg
import pytest

from tests.conftest import wait_for
from tests.faults.attempts import AttemptLog
from tests.faults.harness import ChaosRun

Chaos = Callable[..., ChaosRun]


def test_the_oracle_refuses_a_stale_write_and_every_invariant_can_fail(chaos: Chaos) -> None:
    run = chaos()
    a, b, c, d = run.enqueue(4, steps=2)
    with run.connect() as conn:
        # A write by a token that does not hold the run: refused, whatever the code path.
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(
                "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
                " VALUES (%s, 0, %s, 1, 0)",
                (a, uuid.uuid4()),
            )
        assert refused.value.sqlstate == "LW001"
        # Corrupt the history behind the triggers' backs, one invariant at a time.
        conn.execute("SET session_replication_role = replica")
        owner = uuid.uuid4()
        conn.execute(
            "INSERT INTO public.chaos_effects (run_id, step, owner, attempt, pid)"
            " VALUES (%s, 0, %s, 1, 0), (%s, 0, %s, 1, 0)",
            (a, owner, a, owner),
        )
        conn.execute(
            "INSERT INTO public.chaos_transitions (run_id, old_status, new_status, old_owner,"
            " new_owner, new_attempts, max_attempts, new_units, cancel_requested) VALUES"
            " (%(b)s, 'succeeded', 'running', NULL, gen_random_uuid(), 1, 5, 0, false),"
            " (%(c)s, 'queued', 'running', NULL, gen_random_uuid(), 6, 5, 0, false),"
            " (%(d)s, 'queued', 'running', NULL, gen_random_uuid(), 1, 5, 0, true)",
            {"b": b, "c": c, "d": d},
        )
        conn.execute(
            "UPDATE leasework.runs SET status = 'running', lease_owner = gen_random_uuid(),"
            " lease_expires_at = now() - interval '1 hour' WHERE id = %s",
            (d,),
        )
    found = "\n".join(run.check(control=True))
    for expected in [
        f"run {a} step 0 committed 2 times",
        f"effect of run {a} step 0 by {owner}, never its owner",
        f"run {b} left terminal succeeded for running",
        f"run {c} attempt 6 > max 5",
        f"run {d} claimed after its cancel was requested",
        f"run {d} running with a lease expired",
        f"run {d} not terminal: running",
        f"fault-free run {a} executed 0 times",
    ]:
        assert expected in found, f"{expected!r} not reported in:\n{found}"


def test_the_attempt_oracle_reports_overlaps_and_runs_held_by_the_dead(
    chaos: Chaos, tmp_path: Path
) -> None:
    """The non-cooperative tier's oracle (attempts.py): two attempts of one run alive at once are
    reported (one whose handler never left, its process alive then gone; one that left), two one
    after the other are not; a run left `running` under the token of a process that died, for
    good or too long, is reported."""
    run = chaos()
    a, b, c = run.enqueue(3, steps=1)
    victim = subprocess.Popen(["sleep", "60"])
    me, t = os.getpid(), time.time()
    tokens = {name: str(uuid.uuid4()) for name in ("a1", "a2", "b1", "b2", "c1")}

    def line(run_id: int, name: str, pid: int, event: str, at: float) -> bytes:
        doc = {"run": run_id, "attempt": int(name[1]), "owner": tokens[name], "pid": pid}
        return orjson.dumps({**doc, "event": event, "t": at, "how": "returned"}) + b"\n"

    journal = tmp_path / "journal.jsonl"
    journal.write_bytes(
        line(a, "a1", victim.pid, "start", t)  # never leaves: alive while its process is
        + line(a, "a2", me, "start", t + 0.01)
        + line(a, "a2", me, "end", t + 0.02)
        + line(b, "b1", me, "start", t)
        + line(b, "b1", me, "end", t + 0.01)
        + line(b, "b2", me, "start", t + 0.02)  # after b1 left: no overlap
        + line(c, "c1", victim.pid, "start", t)
    )
    log = AttemptLog(journal, lambda: [victim.pid])
    try:
        wait_for(lambda: log.last_alive.get(victim.pid, 0) > t + 0.02)
        victim.kill()
        victim.wait()
        gone = wait_for(lambda: log.gone(victim.pid))
        found = log.overlaps([a, b, c])
        assert len(found) == 1 and found[0].startswith(f"run {a}: attempt 1"), found
        with run.connect() as conn:
            conn.execute("SET session_replication_role = replica")
            conn.execute(
                "INSERT INTO public.chaos_transitions (run_id, old_status, new_status, old_owner,"
                " new_owner, new_attempts, max_attempts, new_units, cancel_requested, new_expires,"
                " at) VALUES"
                " (%(a)s, 'queued', 'running', NULL, %(a1)s, 1, 5, 0, false, now(), now()),"
                " (%(c)s, 'queued', 'running', NULL, %(c1)s, 1, 5, 0, false, now(), now()),"
                " (%(c)s, 'running', 'queued', %(c1)s, NULL, 1, 5, 0, false, NULL,"
                "  to_timestamp(%(late)s))",
                {**tokens, "a": a, "c": c, "late": gone + 60},
            )
        held = "\n".join(log.held_by_the_dead(run.query, slack=8.0))
        assert f"run {a} still running under token {tokens['a1']}" in held, held
        assert f"run {c} left running under token {tokens['c1']}" in held, held
    finally:
        log.close()
        if victim.poll() is None:
            victim.kill()
            victim.wait()
