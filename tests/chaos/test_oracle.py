"""The oracle and the invariant checks have teeth: a stale write is refused by the trigger, and
each kind of corrupted history is reported by `ChaosRun.check()` (CONVENTIONS: every invariant
test must be able to fail)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest

from .harness import ChaosRun

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
