"""Logs: one event per line, JSON or text, chosen by `log_format` (auto: text on a terminal), and
a DSN's password never appears in either."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from collections.abc import Iterator

import orjson
import pytest

from leasework import log

SECRET = "hunter2-s3cret"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    for h in list(log.logger.handlers):
        log.logger.removeHandler(h)
    yield stream
    for h in list(log.logger.handlers):
        log.logger.removeHandler(h)


def _emit() -> None:
    log.event(
        "db_unavailable",
        level=logging.WARNING,
        dsn=f"postgresql://app:{SECRET}@db/app",
        error=f"connection to host=db password={SECRET} failed",
        retry_in=1.5,
        tables={"a": 1},
    )
    try:
        raise RuntimeError(f"boom password={SECRET}")
    except RuntimeError:
        log.event("stage_failed", level=logging.ERROR, exc_info=True, stage="runs")


def test_json_lines(captured: io.StringIO) -> None:
    log.setup("info", "json", captured)
    _emit()
    lines = captured.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (orjson.loads(line) for line in lines)
    assert first["event"] == "db_unavailable" and first["level"] == "warning"
    assert first["retry_in"] == 1.5 and first["tables"] == {"a": 1}
    assert second["event"] == "stage_failed" and "RuntimeError" in second["exc"]
    assert SECRET not in captured.getvalue()


def test_text_lines(captured: io.StringIO) -> None:
    log.setup("info", "text", captured)
    _emit()
    out = captured.getvalue()
    first = out.splitlines()[0]
    assert " WARNING db_unavailable " in first
    assert "retry_in=1.5" in first and 'tables={"a":1}' in first
    assert 'error="connection to host=db password=*** failed"' in first
    assert "stage_failed stage=runs" in out and "    Traceback" in out
    assert SECRET not in out


def test_auto_is_text_on_a_terminal_only() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert log.resolve_format("auto", Tty()) == "text"
    assert log.resolve_format("auto", io.StringIO()) == "json"
    assert log.resolve_format("json", Tty()) == "json"
    assert log.resolve_format("TEXT", io.StringIO()) == "text"


def test_every_command_takes_log_format() -> None:
    from leasework.cli import build_parser

    parser = build_parser()
    bad = subprocess.run(
        [sys.executable, "-m", "leasework", "status", "--log-format", "xml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--log-format" in bad.stderr
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in action.choices.items():
            nested = [a for a in sub._actions if isinstance(a, type(action))]
            subs = list(nested[0].choices.values()) if nested else [sub]
            for p in subs:
                flags = {f for a in p._actions for f in a.option_strings}
                assert "--log-format" in flags, f"leasework {name} {p.prog} lacks --log-format"


def test_records_made_during_a_run_carry_it_and_still_pickle() -> None:
    """install_record_factory stamps the run on records as they are made (any handler sees it,
    a QueueHandler's pickling included), keeps an application's factory, and is idempotent."""
    import pickle

    before = logging.getLogRecordFactory()
    made: list[str] = []

    def apps_own(*args: object, **kwargs: object) -> logging.LogRecord:
        made.append("app")
        return logging.LogRecord(*args, **kwargs)  # type: ignore[arg-type]

    logging.setLogRecordFactory(apps_own)
    try:
        log.install_record_factory()
        log.install_record_factory()
        token = log.RUN.set({"run_id": 7, "kind": "sync", "attempt": 2})
        try:
            record = logging.getLogger("x").makeRecord("x", logging.INFO, "f", 1, "m", None, None)
        finally:
            log.RUN.reset(token)
        plain = logging.getLogger("x").makeRecord("x", logging.INFO, "f", 1, "m", None, None)
    finally:
        logging.setLogRecordFactory(before)
    assert made == ["app", "app"]  # chained once, not twice
    assert (record.run_id, record.kind, record.attempt) == (7, "sync", 2)  # type: ignore[attr-defined]
    copy = pickle.loads(pickle.dumps(record))
    assert copy.run_id == 7 and copy.leasework_run == {"run_id": 7, "kind": "sync", "attempt": 2}
    assert not hasattr(plain, "run_id") and not hasattr(plain, "leasework_run")
    doc = orjson.loads(log.JsonFormatter().format(record))  # formatted later, outside the run
    assert (doc["run_id"], doc["kind"], doc["attempt"]) == (7, "sync", 2)
