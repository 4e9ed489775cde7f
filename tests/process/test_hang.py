"""The watchdog's second rule: a child that holds a live lease but has gone silent for longer
than hang_timeout (its lease keeper cannot run: a C call holding the GIL, a stopped process) is
killed, and its run is recovered at once by the fast release. A handler merely blocked in a
sleep is not silent: its keeper beats (tests/process/test_blocking.py)."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path
from typing import Any

from tests.conftest import get_run, wait_for

from .conftest import alive, enqueue, holder_pid

HANG = textwrap.dedent(
    """

    @app.task("hang")
    def hang(ctx, payload):
        # One C call holding the GIL for minutes, deaf to signals: neither the handler nor the
        # lease keeper's thread can run, so no beat reaches the supervisor. A later attempt
        # finishes at once.
        if ctx.attempt == 1 and (HERE / f"hang-{ctx.run_id}").exists():
            sum(range(10**10))
        return {"attempt": ctx.attempt}
    """
)


def test_hang_timeout_kills_a_silent_child(supervise: Any, pconn: Any, app_dir: Path) -> None:
    with (app_dir / "lwtestapp.py").open("a", encoding="utf-8") as f:
        f.write(HANG)
    # A long lease, so the lease rule (lease - margin) cannot be what fires: only hang_timeout.
    sup = supervise(processes=1, lease=60.0, renew_interval=5.0, hang_timeout=2.0)
    sup.wait_children(1)
    run_id = enqueue(pconn, "hang")
    (app_dir / f"hang-{run_id}").touch()
    run = wait_for(lambda: (r := get_run(pconn, run_id))["status"] == "running" and r)
    stuck = holder_pid(run["lease_worker"])
    killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == stuck, timeout=10)
    assert killed["reason"] == "hang"
    wait_for(lambda: not alive(stuck), timeout=5)
    # Far sooner than the 60 s lease: the parent expired the dead child's lease on reaping it.
    try:
        done = wait_for(
            lambda: (r := get_run(pconn, run_id))["status"] == "succeeded" and r, timeout=10
        )
    except AssertionError:
        raise AssertionError(f"{get_run(pconn, run_id)}\n{sup.log_path.read_text()}") from None
    assert done["result"] == {"attempt": 2}
    assert [h["outcome"] for h in done["history"]] == ["crashed", "succeeded"]
    sup.signal(signal.SIGTERM)
    assert sup.wait_exit(10) == 0
