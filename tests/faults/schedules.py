"""Fault schedules for hypothesis to draw (kill -9, SIGSTOP, partition, slow link, killed
sessions, Postgres crash and pause, cancels, bursts of new runs), and `_check_schedule`, which
plays one against a real supervisor on a fresh private cluster and checks every invariant
afterwards. The tests that draw them: tests/process/test_fault_schedules.py (a couple of
examples, in `make test`) and tests/chaos/test_schedules.py (many, `make chaos`). The name keeps
its underscore so that those tests' bodies, from which hypothesis derives the suite's fixed
examples, are as they were."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

from tests.pgcluster import private_cluster

from .harness import ChaosRun

Step = tuple[str, float, float]  # (fault, gap before it in s, parameter)

FAULTS = st.one_of(
    st.tuples(st.just("kill9"), st.floats(0, 0.8), st.just(0.0)),
    st.tuples(st.just("sigstop"), st.floats(0, 0.8), st.floats(0.5, 1.6)),  # x lease
    st.tuples(st.just("blackhole"), st.floats(0, 0.8), st.floats(0.5, 2.0)),  # x lease
    st.tuples(st.just("delay"), st.floats(0, 0.8), st.floats(0.01, 0.1)),  # s per packet
    st.tuples(
        st.sampled_from(["terminate_control", "terminate_pool"]), st.floats(0, 0.5), st.just(0.0)
    ),
    st.tuples(st.just("pg_crash"), st.floats(0, 1.0), st.just(0.0)),
    st.tuples(st.just("pg_pause"), st.floats(0, 1.0), st.floats(0.3, 1.6)),  # x lease
    st.tuples(st.just("cancel"), st.floats(0, 0.5), st.just(0.0)),
    st.tuples(st.just("burst"), st.floats(0, 0.5), st.integers(1, 10).map(float)),
)


def play(run: ChaosRun, schedule: list[Step]) -> None:
    lease = float(run.cfg["lease"])
    for kind, gap, arg in schedule:
        run.sleep(gap)
        if kind in ("kill9", "sigstop", "blackhole", "delay"):
            run.ensure_work()  # these hit a busy child
        if kind == "kill9":
            run.kill_child()
        elif kind == "sigstop":
            run.sigstop_child(arg * lease)
        elif kind == "blackhole":
            run.blackhole_child(arg * lease)
        elif kind == "delay":
            run.delay_child(1.0, arg)
        elif kind.startswith("terminate_"):
            run.terminate_backend(kind.removeprefix("terminate_"))
        elif kind == "pg_crash":
            run.crash_postgres()
        elif kind == "pg_pause":
            run.pause_postgres(arg * lease)
        elif kind == "cancel":
            run.cancel()
        elif kind == "burst":
            run.enqueue(int(arg), steps=3)


def _check_schedule(tmp: Path, seed: int, schedule: list[Step], *, pooled: bool = False) -> None:
    print(f"chaos schedule seed={seed} schedule={schedule!r} pooled={pooled}")
    with private_cluster("leasework-chaos-") as cluster:
        run = ChaosRun(cluster, tmp, "schedule", {}, random.Random(seed), pooled=pooled)
        try:
            run.start()
            run.enqueue(20, steps=4)
            run.enqueue(1, kind="poison")
            play(run, schedule)
            run.finish()
        except BaseException as exc:
            raise AssertionError(f"seed={seed} schedule={schedule!r}: {exc}") from exc
        finally:
            run.stop()


SCHEDULES = st.lists(FAULTS, min_size=1, max_size=6)
COMMON: dict[str, Any] = {
    "deadline": None,
    "phases": [Phase.explicit, Phase.reuse, Phase.generate],
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    "database": None,
}
