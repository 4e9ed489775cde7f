"""The supervisor's pure decisions: exit-status meaning, restart backoff, the watchdog verdict,
which child to retire; plus the liveness-pipe encoding. No database, no fork."""

from __future__ import annotations

import signal
import uuid

from hypothesis import given
from hypothesis import strategies as st

from leasework.config import Config, lease_timing
from leasework.supervisor import policy
from leasework.supervisor.liveness import (
    Beat,
    LineBuffer,
    decode,
    encode_beat,
    encode_error,
    latest,
)
from leasework.supervisor.policy import (
    Candidate,
    ChildExit,
    ExitKind,
    Liveness,
    Verdict,
    exit_meaning,
    next_failures,
    pick_to_retire,
    restart_delay,
    watchdog,
)

times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


# -- exit status --------------------------------------------------------------------------------


def test_exit_codes_have_fixed_meanings() -> None:
    assert exit_meaning(0).kind is ExitKind.OK and exit_meaning(0).clean
    assert exit_meaning(ChildExit.BOOT_ERROR).halts
    assert exit_meaning(ChildExit.DB_UNAVAILABLE).kind is ExitKind.DB_UNAVAILABLE
    assert exit_meaning(1).kind is ExitKind.CRASHED
    killed = exit_meaning(-signal.SIGKILL)
    assert killed.kind is ExitKind.KILLED and killed.signal == signal.SIGKILL
    assert killed.hint and "memory" in killed.hint
    assert killed.describe() == "killed by SIGKILL"
    assert exit_meaning(3).describe() == "exited with code 3"


@given(st.integers(min_value=-64, max_value=255))
def test_only_a_boot_error_halts_and_only_exit_0_is_clean(code: int) -> None:
    meaning = exit_meaning(code)
    assert meaning.halts == (code == ChildExit.BOOT_ERROR)
    assert meaning.clean == (code == 0)
    assert (meaning.signal is not None) == (code < 0)


# -- restart backoff ----------------------------------------------------------------------------


@given(
    st.integers(min_value=0, max_value=10_000),
    st.floats(min_value=0.001, max_value=10),
    st.floats(min_value=0.001, max_value=600),
    st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_restart_delay_is_bounded_by_the_cap(
    failures: int, base: float, cap: float, rand: float
) -> None:
    delay = restart_delay(failures, base=base, cap=cap, rand=rand)
    if failures == 0:
        assert delay == 0
    else:
        ceiling = min(cap, base * 2 ** min(failures - 1, 64))
        assert ceiling / 2 <= delay <= ceiling <= cap


@given(st.integers(min_value=1, max_value=60), st.floats(min_value=0, max_value=0.999))
def test_restart_delay_grows_with_failures(failures: int, rand: float) -> None:
    """Same jitter draw: one more failure never gives a shorter delay."""
    a = restart_delay(failures, base=0.1, cap=30, rand=rand)
    b = restart_delay(failures + 1, base=0.1, cap=30, rand=rand)
    assert b >= a


def test_restart_delay_doubles_from_base_to_cap() -> None:
    upper = [restart_delay(n, base=0.1, cap=30, rand=0.999999) for n in range(1, 12)]
    assert abs(upper[0] - 0.1) < 1e-3 and abs(upper[1] - 0.2) < 1e-3
    assert abs(upper[-1] - 30) < 1e-3


@given(st.integers(min_value=0, max_value=100), times, st.floats(min_value=0, max_value=1000))
def test_crash_streak(previous: int, uptime: float, reset_after: float) -> None:
    assert next_failures(previous, exit_meaning(0), uptime, reset_after) == 0
    after_crash = next_failures(previous, exit_meaning(1), uptime, reset_after)
    assert after_crash == (1 if uptime >= reset_after else previous + 1)
    assert next_failures(previous, exit_meaning(-9), uptime, reset_after) == after_crash


# -- watchdog -------------------------------------------------------------------------------------


def _verdict(now: float, child: Liveness, **kw: float | bool) -> Verdict | None:
    args: dict[str, float | bool] = {"enabled": True, "hang_timeout": 120.0}
    args.update(kw)
    cfg = Config.make(lease=120.0, watchdog_margin=20.0)
    timing = None if child.lease is None else lease_timing(cfg, child.lease)
    return watchdog(now, child, timing=timing, **args)  # type: ignore[arg-type]


def test_watchdog_kills_a_holder_that_stopped_renewing() -> None:
    child = Liveness(last_beat=1000.0, run_id=7, renewed=1000.0, lease=120.0)
    assert _verdict(1099.0, child) is None
    assert _verdict(1101.0, child) is Verdict.LEASE
    assert _verdict(1101.0, child, enabled=False) is None
    # A task with a 12 s lease gets a tenth of the margin: killed after 10 s unrenewed.
    short = Liveness(last_beat=1000.0, run_id=7, renewed=1000.0, lease=12.0)
    assert _verdict(1009.5, short) is None
    assert _verdict(1010.5, short) is Verdict.LEASE


def test_watchdog_kills_a_silent_child_unless_hang_timeout_is_off() -> None:
    idle = Liveness(last_beat=1000.0)
    assert _verdict(1119.0, idle) is None
    assert _verdict(1121.0, idle) is Verdict.HANG
    assert _verdict(10_000.0, idle, hang_timeout=0.0) is None


@given(
    times,
    st.floats(min_value=0, max_value=1000),
    st.floats(min_value=1, max_value=1000),
    st.floats(min_value=0, max_value=0.9),
)
def test_watchdog_never_kills_a_child_that_just_renewed_and_beat(
    now: float, lease: float, config_lease: float, margin_share: float
) -> None:
    child = Liveness(last_beat=now, run_id=1, renewed=now, lease=lease)
    assert (
        watchdog(
            now,
            child,
            enabled=True,
            timing=lease_timing(
                Config.make(lease=config_lease, watchdog_margin=config_lease * margin_share), lease
            ),
            hang_timeout=1.0,
        )
        is None
    )


@given(times, times, st.floats(min_value=1, max_value=1000))
def test_an_idle_child_is_never_killed_for_its_lease(now: float, beat: float, lease: float) -> None:
    verdict = watchdog(
        now,
        Liveness(last_beat=beat),
        enabled=True,
        timing=lease_timing(Config.make(lease=lease, watchdog_margin=0.0)),
        hang_timeout=0.0,
    )
    assert verdict is None


def test_a_run_that_must_stop_gets_abort_grace_then_its_child_is_killed() -> None:
    cancelled = Liveness(
        last_beat=1000.0, run_id=7, renewed=1000.0, lease=120.0, abort="cancelled", abort_at=1000.0
    )
    assert _verdict(1004.9, cancelled, abort_grace=5.0) is None
    assert _verdict(1005.0, cancelled, abort_grace=5.0) is Verdict.ABORT
    # Even with the watchdog off: a cancel must end a handler that ignores it.
    assert _verdict(1005.0, cancelled, abort_grace=5.0, enabled=False) is Verdict.ABORT
    # A timeout passed counts without any report from the child (it may be unable to send one).
    timed = Liveness(last_beat=900.0, run_id=7, renewed=1000.0, lease=120.0, timeout_at=1010.0)
    assert policy.must_stop(timed, 1009.0) is None
    assert policy.must_stop(timed, 1011.0) == ("timeout", 1010.0)
    assert _verdict(1014.0, timed, abort_grace=5.0, hang_timeout=0.0) is None
    assert _verdict(1015.0, timed, abort_grace=5.0, hang_timeout=0.0) is Verdict.ABORT
    # An idle child has nothing to stop.
    assert policy.must_stop(Liveness(last_beat=1.0, abort="cancelled", abort_at=1.0), 99.0) is None


@given(times, st.floats(min_value=0.1, max_value=1e4), st.floats(min_value=0, max_value=1e4))
def test_an_abort_is_never_acted_on_before_its_grace(
    at: float, grace: float, before: float
) -> None:
    child = Liveness(last_beat=at, run_id=1, renewed=at, lease=1e6, abort="timeout", abort_at=at)
    now = at + grace * (before / (before + 1.0))  # strictly inside the grace
    assert (
        watchdog(
            now,
            child,
            enabled=True,
            timing=lease_timing(Config.make(lease=1e6, watchdog_margin=0.0), 1e6),
            hang_timeout=0.0,
            abort_grace=grace,
        )
        is None
    )


def test_what_the_parent_writes_for_a_run_it_killed() -> None:
    assert policy.outcome_after_kill("cancelled") == "cancelled"
    assert policy.outcome_after_kill("timeout") == "timeout"
    assert policy.outcome_after_kill("shutdown") == "released"
    assert policy.outcome_after_kill("lost") is None  # no longer ours: write nothing
    assert policy.outcome_after_kill(None) is None


# -- retiring -------------------------------------------------------------------------------------


def test_pick_to_retire_prefers_idle_then_youngest() -> None:
    assert pick_to_retire([]) is None
    kids = [Candidate(1, 10.0, False), Candidate(2, 20.0, True), Candidate(3, 15.0, False)]
    assert pick_to_retire(kids) == 3
    assert pick_to_retire([Candidate(1, 10.0, True), Candidate(2, 20.0, True)]) == 2


@given(st.lists(st.tuples(times, st.booleans()), min_size=1, max_size=20))
def test_pick_to_retire_never_picks_busy_when_idle_exists(rows: list[tuple[float, bool]]) -> None:
    kids = [Candidate(pid, started, busy) for pid, (started, busy) in enumerate(rows, start=1)]
    picked = next(k for k in kids if k.pid == pick_to_retire(kids))
    assert not picked.busy or all(k.busy for k in kids)


# -- liveness pipe --------------------------------------------------------------------------------


@given(
    times,
    st.none() | st.integers(min_value=1, max_value=2**62),
    st.none() | times,
    st.none() | st.floats(min_value=0.1, max_value=1e4),
    st.integers(min_value=0, max_value=10**9),
)
def test_beats_round_trip_through_the_pipe_encoding(
    t: float, run: int | None, renewed: float | None, lease: float | None, jobs: int
) -> None:
    extra = (
        {}
        if run is None
        else {
            "owner": str(uuid.UUID(int=run)),
            "attempt": 3,
            "timeout_at": t + 5.0,
            "abort": "cancelled",
            "abort_at": t,
        }
    )
    beat = Beat(t, run, renewed, lease, jobs, **extra)  # type: ignore[arg-type]
    data = encode_beat(beat)
    assert len(data) < 512  # far below PIPE_BUF: each write is atomic
    buf = LineBuffer()
    lines = buf.feed(data[:5]) + buf.feed(data[5:] + encode_error("boom\nsecond line"))
    assert [decode(line) for line in lines] == [beat, "boom"]


def test_the_parent_takes_the_last_beat_read_and_an_error_wherever_it_stands() -> None:
    """A pass reads many beats of a busy child; only the last is its state, and a boot error
    among them is not lost (liveness.latest)."""
    beats = [Beat(float(t), t, float(t), 30.0, t) for t in range(1, 6)]
    lines = [encode_beat(b).rstrip(b"\n") for b in beats]
    error = encode_error("cannot import app").rstrip(b"\n")
    assert latest(lines) == (beats[-1], None)
    assert latest([lines[0], error, *lines[1:]]) == (beats[-1], "cannot import app")
    assert latest([*lines, error]) == (beats[-1], "cannot import app")
    assert latest([*lines, b"not json", b"[1]"]) == (beats[-1], None)
    assert latest([error, b"garbage"]) == (None, "cannot import app")
    assert latest([]) == (None, None)


def test_garbage_on_the_pipe_is_ignored() -> None:
    assert decode(b"not json") is None
    assert decode(b"[1, 2]") is None
    assert decode(b'{"t": "x"}') is None
