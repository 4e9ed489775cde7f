"""What one attempt's end means for its run: a pure decision from what the handler returned or
raised and why its run had to stop. No I/O; the executor writes what this decides."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from .. import log
from ..errors import Aborted, Fail, LeaseLost, Partial, Retry, Snooze

# A Fail's or a Snooze's reason is cut to this many characters (passwords hidden) for the run's
# error and history, as an exception's message is (context.describe_error).
REASON_MAX = 1000

Action = Literal["seal", "requeue", "snooze", "release", "nothing"]
Sealed = Literal["succeeded", "partial", "failed", "cancelled"]


class Outcome(NamedTuple):
    """seal: a terminal status (`succeeded`, `partial`, `failed`: a handler's Fail, `cancelled`);
    a seal `failed` still ends `cancelled` if a cancel was requested meanwhile. requeue: back to
    queued after a backoff (`after` overrides it) unless the database ends the run (no attempt
    left, cancel requested); `label` is the attempt's outcome in the run's history. snooze: back
    to queued after `after` seconds, the attempt not charged, unless the database ends the run
    (cancel requested: `cancelled`; the run's snoozes used up: `failed`). release: back to
    queued at once, the attempt not charged (shutdown). nothing: the lease is lost, write
    nothing.
    A tuple: every run's end, each success included, makes one (a frozen dataclass costs
    several times as much to build)."""

    action: Action
    status: Sealed | None = None
    label: str | None = None
    error: str | None = None
    after: float | None = None
    result: Any = None


NOTHING = Outcome("nothing")


def stopped(reason: str | None, result: Any, timeout: float | None) -> Outcome:
    """The run had to stop (its abort signal tripped): the reason decides, whatever the handler
    did. A cancel keeps what was gathered; a timeout is a failed attempt, retried."""
    if reason == "lost":
        return NOTHING
    if reason == "cancelled":
        return Outcome("seal", status="cancelled", error="cancelled", result=result)
    if reason == "timeout":
        return Outcome(
            "requeue", label="timeout", error=f"timeout after {timeout or 0:g} s", result=result
        )
    return Outcome("release", error=reason or "shutdown")


def decide(
    returned: Any,
    raised: BaseException | None,
    reason: str | None,
    *,
    gathered: Any,
    last_attempt: bool,
    timeout: float | None,
    describe: Any = None,
) -> Outcome:
    """One attempt's end. `returned`: the handler's value (when `raised` is None); `reason`:
    why the run's abort signal tripped, if it did; `gathered`: ctx.result, what the handler
    stored so far; `describe(exc)` renders an error for the history (default `Type: message`).
    Results are returned unencoded."""
    if isinstance(raised, LeaseLost):
        return NOTHING
    if isinstance(raised, Partial) or (isinstance(raised, Fail) and raised.result is not None):
        gathered = raised.result
    if reason is not None or isinstance(raised, Aborted):
        if raised is None and returned is not None:
            gathered = returned
        return stopped(reason, gathered, timeout)
    if raised is None:
        return Outcome("seal", status="succeeded", result=returned)
    if isinstance(raised, Retry):
        # What the handler gathered is kept across the retry, as on cancel: a sync's per-table
        # results accumulate on the one run.
        return Outcome(
            "requeue", label="retry", error=f"Retry: {raised}", after=raised.after, result=gathered
        )
    render = describe or (lambda e: f"{type(e).__name__}: {e}")
    if isinstance(raised, Snooze):
        # Not a failure: no attempt charged, the error left as it was (the reason goes into the
        # history entry). What the handler gathered is kept, as on a retry.
        why = None if raised.reason is None else log.clip(raised.reason, REASON_MAX)
        return Outcome("snooze", label="snoozed", error=why, after=raised.after, result=gathered)
    if isinstance(raised, Fail):
        error = log.clip(f"Fail: {raised.reason}", REASON_MAX)
        cause = raised.__cause__
        if cause is not None:
            error = f"{error}\ncaused by {render(cause)}"
        return Outcome("seal", status="failed", label="failed", error=error, result=gathered)
    if isinstance(raised, Partial):
        if raised.retryable and not last_attempt:
            return Outcome("requeue", label="partial", error=f"Partial: {raised}", result=gathered)
        # Not retryable, or no attempt left to retry with: sealed as partial, its result kept
        # (a partial result is never thrown away as a failure).
        return Outcome("seal", status="partial", error=str(raised), result=gathered)
    return Outcome("requeue", label="failed", error=render(raised), result=gathered)
