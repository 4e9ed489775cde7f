"""outcome.decide: what an attempt's end means for its run, over every combination of what the
handler returned or raised, why its run had to stop, and whether it was its last attempt; and
the checks Snooze and Fail make where they are raised."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasework.errors import MAX_RETRY_AFTER, Aborted, Fail, LeaseLost, Partial, Retry, Snooze
from leasework.workers.outcome import NOTHING, REASON_MAX, decide

REASONS = st.sampled_from([None, "cancelled", "lost", "timeout", "shutdown"])
VALUES = st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=3), st.integers()))


@st.composite
def raised(draw: st.DrawFn) -> BaseException | None:
    which = draw(
        st.sampled_from(
            ["none", "error", "retry", "partial", "aborted", "lost", "snooze", "fail"]
        )
    )
    if which == "none":
        return None
    if which == "error":
        return ValueError(draw(st.text(max_size=10)))
    if which == "retry":
        return Retry(draw(st.one_of(st.none(), st.floats(0, 3600))))
    if which == "partial":
        return Partial(draw(VALUES), retryable=draw(st.booleans()))
    if which == "snooze":
        return Snooze(draw(st.floats(0, 3600)), draw(st.one_of(st.none(), st.text(max_size=5))))
    if which == "fail":
        return Fail(draw(st.text(max_size=10)), result=draw(VALUES))
    if which == "aborted":
        return Aborted(draw(st.sampled_from(["cancelled", "lost", "timeout", "shutdown"])))
    return LeaseLost("gone")


def end(
    returned: Any, exc: BaseException | None, reason: str | None, gathered: Any, last: bool
) -> Any:
    return decide(returned, exc, reason, gathered=gathered, last_attempt=last, timeout=3.0)


@given(VALUES, raised(), REASONS, VALUES, st.booleans())
def test_a_lost_lease_writes_nothing_whatever_the_handler_did(
    returned: Any, exc: BaseException | None, reason: str | None, gathered: Any, last: bool
) -> None:
    out = end(returned, exc, reason, gathered, last)
    if reason == "lost" or isinstance(exc, LeaseLost):
        assert out == NOTHING
    else:
        assert out.action != "nothing"


@given(VALUES, raised(), VALUES, st.booleans())
def test_the_stop_reason_beats_what_the_handler_did(
    returned: Any, exc: BaseException | None, gathered: Any, last: bool
) -> None:
    if isinstance(exc, LeaseLost):
        return
    kept = exc.result if isinstance(exc, Partial) else gathered
    if isinstance(exc, Fail) and exc.result is not None:
        kept = exc.result
    if exc is None and returned is not None:
        kept = returned
    cancelled = end(returned, exc, "cancelled", gathered, last)
    assert (cancelled.action, cancelled.status, cancelled.result) == ("seal", "cancelled", kept)
    timeout = end(returned, exc, "timeout", gathered, last)
    assert (timeout.action, timeout.label, timeout.result) == ("requeue", "timeout", kept)
    assert timeout.error == "timeout after 3 s"
    shutdown = end(returned, exc, "shutdown", gathered, last)
    assert (shutdown.action, shutdown.error) == ("release", "shutdown")


@given(VALUES, VALUES, st.booleans())
def test_a_handler_that_returns_succeeds_with_its_value(
    returned: Any, gathered: Any, last: bool
) -> None:
    out = end(returned, None, None, gathered, last)
    assert (out.action, out.status, out.result) == ("seal", "succeeded", returned)


@given(VALUES, st.booleans(), VALUES, st.booleans())
def test_a_partial_result_is_never_thrown_away_as_a_failure(
    result: Any, retryable: bool, gathered: Any, last: bool
) -> None:
    out = end(None, Partial(result, retryable=retryable), None, gathered, last)
    assert out.result == result
    if retryable and not last:
        assert (out.action, out.label) == ("requeue", "partial")
    else:
        assert (out.action, out.status) == ("seal", "partial")


@given(st.one_of(st.none(), st.floats(0, 3600)), VALUES, st.booleans())
def test_retry_requeues_after_what_it_asked_keeping_what_was_gathered(
    after: float | None, gathered: Any, last: bool
) -> None:
    out = end(None, Retry(after), None, gathered, last)
    assert (out.action, out.label, out.after, out.result) == ("requeue", "retry", after, gathered)


@given(st.text(max_size=20), VALUES, st.booleans())
def test_an_error_is_a_failed_attempt_retried_with_its_message(
    message: str, gathered: Any, last: bool
) -> None:
    out = end(None, ValueError(message), None, gathered, last)
    assert (out.action, out.label, out.result) == ("requeue", "failed", gathered)
    assert out.error == f"ValueError: {message}"


def test_aborted_without_a_tripped_signal_gives_the_run_back() -> None:
    out = end(None, Aborted("shutdown"), None, None, False)
    assert (out.action, out.error) == ("release", "shutdown")


@given(st.floats(0, MAX_RETRY_AFTER), st.one_of(st.none(), st.text(max_size=20)), VALUES, st.booleans())
def test_a_snooze_requeues_after_what_it_asked_uncharged_keeping_what_was_gathered(
    after: float, reason: str | None, gathered: Any, last: bool
) -> None:
    """Not a failure, on the last attempt too: the database gives the attempt back."""
    out = end(None, Snooze(after, reason), None, gathered, last)
    assert (out.action, out.label, out.after, out.result) == ("snooze", "snoozed", after, gathered)
    assert out.error == reason and out.status is None


@given(st.text(max_size=20), VALUES, VALUES, st.booleans())
def test_a_fail_seals_failed_whatever_attempts_are_left(
    reason: str, result: Any, gathered: Any, last: bool
) -> None:
    out = end(None, Fail(reason, result=result), None, gathered, last)
    assert (out.action, out.status, out.label) == ("seal", "failed", "failed")
    assert out.error == f"Fail: {reason}"
    assert out.result == (gathered if result is None else result)


def test_a_fail_names_its_cause_and_is_cut_to_size() -> None:
    try:
        try:
            raise KeyError("record-42")
        except KeyError as exc:
            raise Fail("record 42 was deleted") from exc
    except Fail as fail:
        out = end(None, fail, None, None, False)
    assert out.error == "Fail: record 42 was deleted\ncaused by KeyError: 'record-42'"
    long = end(None, Fail("x" * 5000), None, None, False)
    assert long.error is not None and len(long.error) == REASON_MAX and long.error.endswith("…")
    dsn = end(None, Fail("postgresql://u:secret@db/x unreachable"), None, None, False)
    assert dsn.error is not None and "secret" not in dsn.error
    napped = end(None, Snooze(1, "y" * 5000), None, None, False)
    assert napped.error is not None and len(napped.error) == REASON_MAX


def test_snooze_after_is_a_number_of_seconds_within_the_cap() -> None:
    assert Snooze(0).after == 0.0
    assert Snooze(Fraction(3, 2)).after == 1.5
    assert Snooze(MAX_RETRY_AFTER).after == MAX_RETRY_AFTER
    assert Snooze(5, "later").reason == "later" and str(Snooze(5, "later")) == "later"
    assert Snooze(5).reason is None and str(Snooze(5)) == "snoozed for 5 s"
    bad: list[Any] = [None, float("inf"), float("nan"), -0.5, MAX_RETRY_AFTER + 0.001, 10**400]
    bad += [True, "30", [30]]
    for after in bad:
        with pytest.raises(ValueError) as caught:
            Snooze(after)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("Snooze(after=") and message.endswith(
            "): after must be a number of seconds from 0 to 2592000 (30 days)"
        )


def test_fail_keeps_its_reason_and_result() -> None:
    fail = Fail("gone", result={"n": 1})
    assert (fail.reason, fail.result, str(fail)) == ("gone", {"n": 1}, "gone")
    assert Fail(404).reason == "404"
