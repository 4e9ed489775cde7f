"""outcome.decide: what an attempt's end means for its run, over every combination of what the
handler returned or raised, why its run had to stop, and whether it was its last attempt."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from leasework.errors import Aborted, LeaseLost, Partial, Retry
from leasework.workers.outcome import NOTHING, decide

REASONS = st.sampled_from([None, "cancelled", "lost", "timeout", "shutdown"])
VALUES = st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=3), st.integers()))


@st.composite
def raised(draw: st.DrawFn) -> BaseException | None:
    which = draw(st.sampled_from(["none", "error", "retry", "partial", "aborted", "lost"]))
    if which == "none":
        return None
    if which == "error":
        return ValueError(draw(st.text(max_size=10)))
    if which == "retry":
        return Retry(draw(st.one_of(st.none(), st.floats(0, 3600))))
    if which == "partial":
        return Partial(draw(VALUES), retryable=draw(st.booleans()))
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
