"""Tracing (docs/operations.md, "Tracing"): the enqueue keeps the caller's trace context in the run, and the
worker continues it: `leasework.claim`, `leasework.run` (around the handler: run id, kind,
attempt, tenant, outcome; an error status when the attempt failed) and `leasework.seal` spans in
the same trace. Recorded with the SDK's in-memory exporter; without opentelemetry, nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("opentelemetry.sdk")

import opentelemetry.trace as otel_trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode
from opentelemetry.util._once import Once

from leasework import App
from leasework.testing import drain
from leasework.workers.context import Context
from leasework.workers.worker import Worker

from ..conftest import wait_for

Conn = psycopg.Connection[Any]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider recording into memory, as the process's global one for this test
    (the API sets it once per process: its once-guard is reset around the test)."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    saved = otel_trace._TRACER_PROVIDER, otel_trace._TRACER_PROVIDER_SET_ONCE
    otel_trace._TRACER_PROVIDER_SET_ONCE = Once()
    otel_trace.set_tracer_provider(provider)
    try:
        yield spans
    finally:
        otel_trace._TRACER_PROVIDER, otel_trace._TRACER_PROVIDER_SET_ONCE = saved
        provider.shutdown()


def make_app() -> App:
    app = App()
    tracer = otel_trace.get_tracer("handler")

    @app.task("report")
    def report(ctx: Context, payload: Any) -> Any:
        with tracer.start_as_current_span("handler work"):
            return {"ok": True}

    @app.task("report_async")
    async def report_async(ctx: Any, payload: Any) -> Any:
        with tracer.start_as_current_span("async work"):
            return {"ok": True}

    @app.task("broken", max_attempts=2)
    def broken(ctx: Context, payload: Any) -> Any:
        raise RuntimeError("it broke")

    return app


def named(spans: Any, name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_the_worker_continues_the_enqueues_trace(
    exporter: InMemorySpanExporter, conn: Conn
) -> None:
    app = make_app()
    tracer = otel_trace.get_tracer("web")
    with tracer.start_as_current_span("POST /reports") as request:
        run_id = app.enqueue(conn, "report", {}, tenant="acme")
    web = request.get_span_context()
    row = conn.execute("SELECT traceparent FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    assert row[0] == f"00-{web.trace_id:032x}-{web.span_id:016x}-{int(web.trace_flags):02x}"

    drain(app, conn)
    spans = exporter.get_finished_spans()
    (run,) = named(spans, "leasework.run")
    (claim,) = named(spans, "leasework.claim")
    (seal,) = named(spans, "leasework.seal")
    (work,) = named(spans, "handler work")
    for span in (run, claim, seal, work):
        assert span.context is not None and span.context.trace_id == web.trace_id, span.name
    assert run.parent is not None and run.parent.span_id == web.span_id
    assert claim.parent is not None and claim.parent.span_id == web.span_id
    assert run.context is not None
    assert seal.parent is not None and seal.parent.span_id == run.context.span_id
    assert work.parent is not None and work.parent.span_id == run.context.span_id
    assert claim.start_time is not None and run.start_time is not None
    assert claim.start_time <= run.start_time
    assert dict(run.attributes or {}) | {"leasework.worker": ""} == {
        "leasework.run.id": run_id,
        "leasework.run.kind": "report",
        "leasework.run.attempt": 1,
        "leasework.run.tenant": "acme",
        "leasework.run.outcome": "succeeded",
        "leasework.worker": "",
    }
    assert run.status.status_code == StatusCode.UNSET


def test_an_async_run_is_traced_too(exporter: InMemorySpanExporter, conn: Conn) -> None:
    app = make_app()
    with otel_trace.get_tracer("web").start_as_current_span("enqueue") as request:
        run_id = app.enqueue(conn, "report_async", {})
    drain(app, conn)
    spans = exporter.get_finished_spans()
    (run,) = named(spans, "leasework.run")
    (work,) = named(spans, "async work")
    (seal,) = named(spans, "leasework.seal")
    web = request.get_span_context()
    assert run.context is not None and run.context.trace_id == web.trace_id
    assert run.parent is not None and run.parent.span_id == web.span_id
    assert work.parent is not None and work.parent.span_id == run.context.span_id
    assert seal.parent is not None and seal.parent.span_id == run.context.span_id
    attributes = run.attributes or {}
    assert attributes["leasework.run.id"] == run_id
    assert attributes["leasework.run.outcome"] == "succeeded"


def test_a_failed_attempt_has_an_error_status(exporter: InMemorySpanExporter, conn: Conn) -> None:
    app = make_app()
    with otel_trace.get_tracer("web").start_as_current_span("enqueue"):
        app.enqueue(conn, "broken", {})
    drain(app, conn, jump_delays=True)
    runs = sorted(
        named(exporter.get_finished_spans(), "leasework.run"), key=lambda s: s.start_time or 0
    )
    assert [(s.attributes or {}).get("leasework.run.outcome") for s in runs] == [
        "requeued",
        "failed",
    ]
    assert [(s.attributes or {}).get("leasework.run.attempt") for s in runs] == [1, 2]
    for span in runs:
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description == "it broke"
        assert any(e.name == "exception" for e in span.events)
    assert len({s.context.trace_id for s in runs if s.context}) == 1


def test_enqueue_many_keeps_the_trace_too(exporter: InMemorySpanExporter, conn: Conn) -> None:
    app = make_app()
    with otel_trace.get_tracer("web").start_as_current_span("import") as request:
        copied = app.enqueue_many(conn, "report", [{}, {}])
        keyed = app.enqueue_many(conn, "report", [{}, {}], keys=["a", "b"])
    untraced = app.enqueue_many(conn, "report", [{}])
    web = request.get_span_context()
    parent = f"00-{web.trace_id:032x}-{web.span_id:016x}-{int(web.trace_flags):02x}"
    rows = dict(
        conn.execute(
            "SELECT id, traceparent FROM leasework.runs WHERE id = ANY(%s)",
            (copied + keyed + untraced,),
        ).fetchall()
    )
    assert rows == {**dict.fromkeys(copied + keyed, parent), untraced[0]: None}


def test_without_a_span_the_run_has_no_parent(exporter: InMemorySpanExporter, conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "report", {})
    row = conn.execute("SELECT traceparent FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row == (None,)
    drain(app, conn)
    (run,) = named(exporter.get_finished_spans(), "leasework.run")
    assert run.parent is None


def test_trace_run_takes_a_traceparent_once(conn: Conn) -> None:
    (run_id,) = conn.execute("SELECT leasework.enqueue('report')").fetchone() or (0,)
    first = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert conn.execute("SELECT leasework.trace_run(%s, %s)", (run_id, first)).fetchone() == (True,)
    second = "00-" + "c" * 32 + "-" + "d" * 16 + "-01"
    assert conn.execute("SELECT leasework.trace_run(%s, %s)", (run_id, second)).fetchone() == (
        False,
    )
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"traceparent .* is not valid"):
        conn.execute("SELECT leasework.trace_run(%s, 'not-a-traceparent')", (run_id,))
    row = conn.execute("SELECT traceparent FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row == (first,)


NO_OTEL = """
import sys
sys.modules["opentelemetry"] = None  # as if the extra were not installed
import psycopg
from leasework import App, tracing
from leasework.testing import drain
assert not tracing.AVAILABLE and not tracing.enabled() and tracing.traceparent() is None
app = App()
@app.task("report")
def report(ctx, payload):
    return 1
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    run_id = app.enqueue(conn, "report", {})
    assert [r.status for r in drain(app, conn)] == ["succeeded"]
    print(conn.execute("SELECT traceparent FROM leasework.runs WHERE id = %s", (run_id,)).fetchone())
"""


def test_without_opentelemetry_nothing_is_traced(dsn: str, conn: Conn) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_OTEL, dsn],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(None,)"


def test_a_worker_traces_run_after_run(
    exporter: InMemorySpanExporter, conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    """A worker's own loop, one run at a time (each success sealed with the next claim, through
    lease.Chain): every run traced under its enqueue's span, and sealed."""
    app = make_app()
    with otel_trace.get_tracer("web").start_as_current_span("batch") as request:
        ids = [app.enqueue(conn, "report", {}) for _ in range(5)]
    worker = make_worker(app)

    def sealed() -> bool:
        worker.poll()
        row = conn.execute(
            "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status = 'succeeded'",
            (ids,),
        ).fetchone()
        return row == (5,)

    wait_for(sealed)
    runs = named(exporter.get_finished_spans(), "leasework.run")
    assert sorted((s.attributes or {})["leasework.run.id"] for s in runs) == ids
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in runs if s.context} == {trace_id}
    assert {(s.attributes or {})["leasework.run.outcome"] for s in runs} == {"succeeded"}
