"""Tracing with OpenTelemetry (the `otel` extra; docs/operations.md, "Tracing"): the enqueuing span's W3C
traceparent carried in the run, and the worker's spans of a run (its claim, its handler, its
seal) continuing that trace. The import is tried once, here: without opentelemetry every entry
point answers a constant and nothing is done per job. Imports nothing of leasework."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the extra is not installed: tracing is off, at no cost
    _trace = None  # type: ignore[assignment]

AVAILABLE: bool = _trace is not None
TRACER = "leasework"
# Whether the API keeps its provider where enabled() can read it without get_tracer_provider()
# (then unset means none, unless the environment names one to load).
_GLOBAL = _trace is not None and hasattr(_trace, "_TRACER_PROVIDER")
_NAMED_IN_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
# The API's providers that record nothing: the default (a proxy until one is set) and the no-op.
_SILENT: tuple[type, ...] = (
    (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider) if _trace is not None else ()
)


def traceparent() -> str | None:
    """The W3C traceparent of the caller's active span, or None: no span (or no opentelemetry),
    and then the enqueue sends nothing more."""
    if _trace is None:
        return None
    ctx = _trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def enabled() -> bool:
    """Whether this process traces its runs: opentelemetry is installed and a tracer provider was
    set (the API's default provider makes spans that go nowhere: then the worker reads no
    traceparent and makes no span)."""
    if _trace is None:
        return False
    if _GLOBAL:
        # The API's global, read as it is: get_tracer_provider() looks in os.environ at each
        # call while none is set (a microsecond a run, for nothing).
        provider = _trace._TRACER_PROVIDER
        if provider is None and not _NAMED_IN_ENV:
            return False
    return not isinstance(_trace.get_tracer_provider(), _SILENT)


class RunSpans:
    """The spans of one run in a worker, under the trace its enqueue was in (`parent`, its
    traceparent; a trace of its own without one): `leasework.claim`, from the claim statement's
    send to the run's start; `leasework.run`, the current span while the handler runs and its end
    is written, with the run's attributes and, at its end, its outcome; `leasework.seal` within
    it, the writing of that end."""

    def __init__(
        self,
        parent: str | None,
        *,
        run_id: int,
        kind: str,
        attempt: int,
        tenant: str | None,
        worker: str,
        claim_sent: float,
    ) -> None:
        assert _trace is not None
        self.tracer = _trace.get_tracer(TRACER)
        self.parent = (
            TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
        )
        self.attributes: dict[str, Any] = {
            "leasework.run.id": run_id,
            "leasework.run.kind": kind,
            "leasework.run.attempt": attempt,
            "leasework.worker": worker,
        }
        if tenant is not None:
            self.attributes["leasework.run.tenant"] = tenant
        # The claim's send time on this process's monotonic clock, as the epoch nanoseconds a
        # span's start takes.
        self.claim_sent_ns = time.time_ns() - int((time.monotonic() - claim_sent) * 1e9)

    @contextmanager
    def run(self) -> Iterator[Any]:
        claim = self.tracer.start_span(
            "leasework.claim",
            context=self.parent,
            kind=SpanKind.CONSUMER,
            attributes=self.attributes,
            start_time=self.claim_sent_ns,
        )
        claim.end()
        with self.tracer.start_as_current_span(
            "leasework.run",
            context=self.parent,
            kind=SpanKind.CONSUMER,
            attributes=self.attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span

    @contextmanager
    def seal(self) -> Iterator[Any]:
        with self.tracer.start_as_current_span("leasework.seal", attributes=self.attributes):
            yield

    @staticmethod
    def ended(span: Any, outcome: str, error: BaseException | None, failed: bool) -> None:
        """The run span's outcome (the run's status after the attempt, `requeued` when it is
        queued again, `lost` when nothing was written) and, for a failed attempt, its error."""
        span.set_attribute("leasework.run.outcome", outcome)
        if error is not None:
            span.record_exception(error)
        if failed:
            span.set_status(Status(StatusCode.ERROR, str(error) if error is not None else outcome))
