"""The bulk actions, searches and tags by subprocess on real Postgres: `cancel` with several ids
and with filters (refused without --yes off a terminal, the count named), `run-now`, `runs
--error --payload --tag`, `enqueue --tag` and `show` listing tags; a state conflict exits 2 with
one line and changes nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from leasework import App
from leasework.leases import lease

from ..conftest import get_run
from .test_cli import make_cli, ok

Conn = psycopg.Connection[Any]


@pytest.fixture
def cli(tmp_path: Path, dsn: str) -> Any:
    return make_cli(tmp_path, dsn)


def snapshot(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT * FROM leasework.runs ORDER BY id").fetchall()


def one_line_exit_2(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leasework: "), result.stderr
    assert says in lines[0], lines[0]


def app() -> App:
    a = App()
    a.task("hello")(lambda ctx, payload: None)
    return a


def test_cancel_several_ids(conn: Conn, cli: Any) -> None:
    a = app()
    running = a.enqueue(conn, "hello")
    (claim,) = lease.claim_runs(conn, ["hello"], worker="w", lease=30)
    queued = a.enqueue(conn, "hello")
    done = a.enqueue(conn, "hello")
    a.cancel(conn, done)
    out = ok(cli("cancel", str(queued), str(running), str(done)))
    assert f"cancelled 1 run(s): {queued}" in out
    assert f"cancel requested for 1 running run(s), which stop at their next control check: {running}" in out
    assert f"already finished, left as they are: {done}" in out
    assert get_run(conn, queued)["status"] == "cancelled"
    assert lease.control(conn, claim) == "cancelled"
    before = snapshot(conn)
    one_line_exit_2(cli("cancel", str(queued), "424242"), "no run with id 424242")
    one_line_exit_2(cli("cancel", str(queued), "--kind", "hello"), "run ids or filters, not both")
    one_line_exit_2(cli("cancel"), "name run ids, or filters")
    assert snapshot(conn) == before


def test_cancel_by_filter_counts_and_asks_for_yes(conn: Conn, cli: Any) -> None:
    a = app()
    mine = a.enqueue_many(conn, "hello", [{"account": 42}, {"account": 42}], tags=["eu"])
    other = a.enqueue(conn, "hello", {"account": 7}, tags=["eu"])
    before = snapshot(conn)
    filters = ["--kind", "hello", "--payload", '{"account": 42}', "--tag", "eu"]
    one_line_exit_2(cli("cancel", *filters), "2 run(s) match (kind=hello")
    assert "add --yes" in cli("cancel", *filters).stderr
    assert ok(cli("cancel", *filters, "--dry-run")).strip() == "would cancel 2 run(s)"
    assert snapshot(conn) == before
    out = ok(cli("cancel", *filters, "--yes"))
    assert out.startswith(f"cancelled 2 run(s): {mine[0]} {mine[1]}")
    assert [get_run(conn, i)["status"] for i in [*mine, other]] == ["cancelled", "cancelled", "queued"]
    one_line_exit_2(cli("cancel", "--payload", "{nope"), "--payload '{nope' is not JSON")
    one_line_exit_2(
        cli("cancel", "--status", "failed", "--yes"), "is not one of blocked, waiting, queued, running"
    )


def test_run_now_by_id_and_filter(conn: Conn, cli: Any) -> None:
    a = app()
    later = a.enqueue(conn, "hello", delay=3600)
    backoff = a.enqueue(conn, "hello", delay=600, tags=["retrying"])
    (claim,) = lease.claim_runs(conn, ["hello"], worker="w", lease=30) or [None]
    assert claim is None  # neither is due
    out = ok(cli("run-now", str(later)))
    assert out.strip() == f"made 1 run(s) due now: {later}"
    assert [c.id for c in lease.claim_runs(conn, ["hello"], worker="w", lease=30)] == [later]
    before = snapshot(conn)
    one_line_exit_2(cli("run-now", str(later)), f"run {later} is running: only queued runs")
    one_line_exit_2(cli("run-now", "--tag", "retrying"), "1 run(s) match (tag=retrying)")
    assert snapshot(conn) == before
    assert ok(cli("run-now", "--tag", "retrying", "--yes")).strip() == (
        f"made 1 run(s) due now: {backoff}"
    )
    assert [c.id for c in lease.claim_runs(conn, ["hello"], worker="w", lease=30)] == [backoff]


def test_retry_of_a_queued_run_is_a_conflict_exit_2(conn: Conn, cli: Any) -> None:
    queued = app().enqueue(conn, "hello", delay=60)
    one_line_exit_2(cli("retry", str(queued)), "leasework run-now ID")


def test_search_and_tags(conn: Conn, cli: Any) -> None:
    tagged = int(ok(cli("enqueue", "hello", "--app", "cliapp:app", "--tag", "b", "--tag", "a",
                        "--payload", '{"account": 42}')).strip())
    plain = int(ok(cli("enqueue", "hello", "--app", "cliapp:app")).strip())
    assert get_run(conn, tagged)["tags"] == ["a", "b"] and get_run(conn, plain)["tags"] is None
    assert "tags:      a, b" in ok(cli("show", str(tagged)))
    assert orjson.loads(ok(cli("show", str(tagged), "--json")))["tags"] == ["a", "b"]
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now(), "
        "error = 'HTTP 429 Too Many Requests' WHERE id = %s",
        (plain,),
    )

    def ids(*flags: str) -> list[int]:
        doc = orjson.loads(ok(cli("runs", *flags, "--json")))
        return [r["id"] for r in doc["runs"]]

    assert ids("--tag", "a") == [tagged]
    assert ids("--tag", "a", "--tag", "c") == []
    assert ids("--payload", '{"account": 42}') == [tagged]
    assert ids("--error", "too many") == [plain]
    assert ids("--error", "429", "--status", "failed", "--kind", "hello") == [plain]
    assert "[a, b]" in ok(cli("runs", "--tag", "b"))
    one_line_exit_2(
        cli("enqueue", "hello", "--app", "cliapp:app", "--tag", "x\x7fy"),
        "tag 1 of 1 contains control characters (U+007F",
    )
    assert ok(cli("retry", "--error", "429", "--app", "cliapp:app")).startswith(
        f"retried 1 run(s): {plain}"
    )
