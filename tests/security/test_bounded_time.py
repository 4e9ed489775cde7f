"""Issue 34's reproductions of input that froze a process, end to end: a handler's exception of
250,000 characters (the redaction regex held the GIL for a minute, the lease keeper starved with
it and the run stayed `running` on an expired lease) and `leasework config` with a DSN of
200,000 characters (35 s and more). Each now ends in bounded time with its outcome recorded;
the bounds are generous for a busy machine (the fix takes milliseconds, the bug took a minute)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from leasework import App, Context

from ..conftest import get_run

LONG = 250_000


def test_a_handlers_huge_exception_ends_its_run_with_the_error_recorded(
    conn: Any, make_worker: Any
) -> None:
    app = App()

    @app.task("huge_error", max_attempts=1, lease=10)
    def huge_error(ctx: Context, payload: Any) -> None:
        raise RuntimeError(payload["msg"])

    # Letters and digits (the quadratic case), then a DSN whose password must not be kept.
    message = "a1" * (LONG // 2) + " postgresql://app:HiddenPw@db/app"
    run_id = app.enqueue(conn, "huge_error", {"msg": message})
    worker = make_worker(app, keeper_thread=True)
    started = time.monotonic()
    assert worker.poll() == 1
    assert time.monotonic() - started < 10.0
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["lease_owner"] is None
    assert row["error"].startswith("RuntimeError: a1a1") and len(row["error"]) <= 4000
    assert "HiddenPw" not in row["error"]
    [entry] = row["history"]
    assert entry["outcome"] == "failed" and entry["error"] == row["error"]


def test_config_with_a_dsn_of_200000_characters_answers_quickly(tmp_path: Path, cli: Any) -> None:
    """Through a config file: one environment variable or argument holds at most 128 KiB."""
    long_dsn = "postgresql://app:HiddenPw@db/app?application_name=" + "a1" * 100_000
    path = tmp_path / "long.toml"
    path.write_text(f'dsn = "{long_dsn}"\n')
    started = time.monotonic()
    result = cli("config", "--config", str(path), with_dsn=False, timeout=120)
    assert time.monotonic() - started < 20.0  # the process's start included; the bug: minutes
    assert result.returncode == 0, result.stderr[:500]
    assert 'dsn = "postgresql://app:***@db/app?application_name=a1a1' in result.stdout
    assert "HiddenPw" not in result.stdout + result.stderr
