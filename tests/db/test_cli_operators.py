"""The operator's commands end to end, by subprocess on real Postgres: runs, show, retry, delete,
pause, resume; the CLI's conventions (--version, global options before the command, usage on a
bare `leasework`, help for every flag, "did you mean", a closed pipe); enqueue telling a key's
existing run; worker refusing without an app and removing its row on a clean exit; a handler's
own `logging` records in the worker's output with its run."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from leasework.cli import build_parser

from ..conftest import get_run
from .test_cli import make_cli, ok

Conn = psycopg.Connection[Any]

LOGGING_APP = """
import logging
from leasework import App

app = App()
log = logging.getLogger("opsapp.handlers")


@app.task("chatty")
def chatty(ctx, payload):
    log.info("working on week %s", payload["week"])
    log.warning("almost done")
    return {"sent": payload["week"]}
"""


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


def test_runs_show_retry_delete_pause_resume(conn: Conn, cli: Any) -> None:
    app = ["--app", "cliapp:app"]
    hello = int(ok(cli("enqueue", "hello", "--payload", '{"week": 48}', "--key", "acct-7", *app)))
    again = cli("enqueue", "hello", "--key", "acct-7", *app)
    assert again.returncode == 0 and int(again.stdout) == hello
    assert "already has an active run: returned run" in again.stderr
    boom = int(ok(cli("enqueue", "boom", *app)))
    ok(cli("worker", "--once", *app))
    assert get_run(conn, hello)["status"] == "succeeded"
    assert get_run(conn, boom)["status"] == "failed"

    listing = ok(cli("runs"))
    lines = listing.splitlines()
    assert lines[1].split()[:3] == [str(boom), "boom", "failed"]
    assert lines[2].split()[:3] == [str(hello), "hello", "succeeded"]
    assert "RuntimeError: boom" in lines[1]
    page = orjson.loads(ok(cli("runs", "--limit", "1", "--json")))
    assert [r["id"] for r in page["runs"]] == [boom] and page["next_before"] == boom
    page2 = orjson.loads(ok(cli("runs", "--limit", "1", "--before", str(boom), "--json")))
    assert [r["id"] for r in page2["runs"]] == [hello] and page2["next_before"] is None
    only = orjson.loads(ok(cli("runs", "--status", "failed", "--kind", "boom", "--json")))
    assert [r["id"] for r in only["runs"]] == [boom]
    assert orjson.loads(ok(cli("runs", "--key", "acct-7", "--since", "1h", "--json")))["runs"]

    shown = ok(cli("show", str(hello)))
    assert "status:    succeeded" in shown and '"echo"' in shown and '"week": 48' in shown
    assert "#1 succeeded" in shown
    doc = orjson.loads(ok(cli("show", str(boom), "--json")))
    assert doc["status"] == "failed" and "RuntimeError: boom" in doc["error"]
    assert doc["history"][0]["outcome"] == "failed"

    # bad input: one line, exit 2, nothing changed
    before = snapshot(conn)
    one_line_exit_2(cli("show", "424242"), "no run with id 424242")
    one_line_exit_2(cli("retry", str(hello)), f"run {hello} is succeeded")
    one_line_exit_2(cli("retry", "424242"), "no run with id 424242")
    one_line_exit_2(cli("retry"), "name run ids, or filters")
    one_line_exit_2(cli("delete", str(boom), "--kind", "boom"), "run ids or filters, not both")
    one_line_exit_2(cli("runs", "--status", "bogus"), "status 'bogus' is not one of")
    one_line_exit_2(cli("runs", "--since", "yesterday"), "--since 'yesterday'")
    one_line_exit_2(cli("pause", "nope"), "unknown kind 'nope'")
    one_line_exit_2(cli("resume", "nope"), "unknown kind 'nope'")
    assert snapshot(conn) == before

    assert ok(cli("retry", "--kind", "boom", "--dry-run")).strip() == "would retry 1 run(s)"
    assert ok(cli("retry", str(boom), *app)).startswith(f"retried 1 run(s): {boom}")
    run = get_run(conn, boom)
    assert run["status"] == "queued" and run["max_attempts"] == 2  # one more: the task's figure

    # a live run: retry and delete refuse it
    before = snapshot(conn)
    one_line_exit_2(cli("delete", str(boom)), f"run {boom} is queued")
    one_line_exit_2(cli("retry", str(boom)), f"run {boom} is queued")
    assert snapshot(conn) == before

    assert "hello: paused" in ok(cli("pause", "hello"))
    paused = ok(cli("status"))
    assert "paused: hello" in paused
    queued = int(ok(cli("enqueue", "hello", *app)))
    ok(cli("worker", "--once", *app))
    assert get_run(conn, queued)["status"] == "queued"  # paused: not claimed
    assert get_run(conn, boom)["status"] == "failed"  # its other kind ran
    assert ok(cli("resume", "hello")).strip() == "hello: resumed"
    # idempotent, as pause is: exit 0, saying so
    assert ok(cli("resume", "hello")).strip() == "hello: not paused; nothing to resume"
    ok(cli("worker", "--once", *app))
    assert get_run(conn, queued)["status"] == "succeeded"

    assert ok(cli("delete", "--kind", "hello", "--dry-run")).strip() == "would delete 2 run(s)"
    assert ok(cli("delete", str(hello))).strip() == f"deleted 1 run(s): {hello}"
    assert conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE id = %s", (hello,)
    ).fetchone() == (0,)


def test_version_global_options_bare_usage_and_did_you_mean(
    conn: Conn, cli: Any, tmp_path: Path, dsn: str
) -> None:
    from leasework import __version__

    assert ok(cli("--version", with_dsn=False)).strip() == f"leasework {__version__}"
    # global options before the command
    before = cli("--dsn", dsn, "status", "--json", with_dsn=False)
    assert before.returncode == 0, before.stderr
    assert "runs_by_status" in orjson.loads(before.stdout)
    # given after the command too, the later one wins
    both = cli("--dsn", "postgresql://nobody@127.0.0.1:1/x", "status", "--dsn", dsn, with_dsn=False)
    assert both.returncode == 0, both.stderr
    bare = cli(with_dsn=False)
    assert bare.returncode == 2 and "usage: leasework" in bare.stderr
    assert "retry" in bare.stderr and "pause" in bare.stderr
    (tmp_path / "typo.toml").write_text("leese = 30\n", encoding="utf-8")
    one_line_exit_2(cli("status", "--config", "typo.toml"), "did you mean `lease`?")


def _actions(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    out: list[tuple[str, argparse.Action]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _actions(sub, f"{path} {name}")
        else:
            out.append((path, action))
    return out


def test_every_flag_and_argument_has_help() -> None:
    missing = [
        f"{path}: {action.option_strings or action.dest}"
        for path, action in _actions(build_parser(), "leasework")
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert not missing, missing


def test_status_watch_into_a_closed_pipe_exits_quietly(conn: Conn, dsn: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "leasework", "--dsn", dsn, "status", "--watch", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()  # it printed; now the reader goes away, as `head` does
    proc.stdout.close()
    try:
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert rc == 0 and err == "", (rc, err)


def test_worker_without_an_app_refuses(cli: Any) -> None:
    one_line_exit_2(cli("worker", "--once"), "no app given")


def test_worker_once_removes_its_row(conn: Conn, cli: Any) -> None:
    ok(cli("worker", "--once", "--app", "cliapp:app"))
    assert conn.execute("SELECT count(*) FROM leasework.workers").fetchone() == (0,)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_handlers_own_log_records_reach_the_workers_output_with_its_run(
    conn: Conn, cli: Any, tmp_path: Path, fmt: str
) -> None:
    (tmp_path / "logapp.py").write_text(LOGGING_APP, encoding="utf-8")
    app = ["--app", "logapp:app"]
    run_id = int(ok(cli("enqueue", "chatty", "--payload", '{"week": 48}', *app)))
    # Every success at info (a quick one is at debug by default: test_worker.py).
    slower = {"LEASEWORK_LOG_RUNS_SLOWER_THAN": "0"}
    result = cli("worker", "--once", "--log-format", fmt, *app, extra_env=slower)
    assert result.returncode == 0, result.stderr
    assert get_run(conn, run_id)["status"] == "succeeded"
    lines = result.stderr.splitlines()
    if fmt == "json":
        docs = [orjson.loads(line) for line in lines]  # every line is JSON: no bare text
        mine = [d for d in docs if d["event"] == "log"]
        assert [(d["level"], d["message"]) for d in mine] == [
            ("info", "working on week 48"),
            ("warning", "almost done"),
        ]
        for d in mine:
            assert d["logger"] == "opsapp.handlers"
            assert (d["run_id"], d["kind"], d["attempt"]) == (run_id, "chatty", 1)
        done = [d for d in docs if d["event"] == "run_succeeded"]
        assert len(done) == 1 and isinstance(done[0]["duration"], float)
    else:
        mine = [line for line in lines if "opsapp.handlers:" in line]
        assert len(mine) == 2, lines
        assert " INFO  opsapp.handlers: working on week 48 " in mine[0] + " "
        assert f"run_id={run_id}" in mine[0] and "kind=chatty" in mine[0]
        assert "attempt=1" in mine[1] and "WARNING" in mine[1]


def test_runs_and_show_escape_control_characters_and_show_payloads_from_sql(
    conn: Conn, cli: Any
) -> None:
    """What runs and show print comes from the database: an error text's escape sequence is
    shown escaped, never sent to the terminal; a payload written through SQL with an integer
    past 64 bits (Python's enqueue refuses one; jsonb keeps it) is still shown, as text and as
    JSON."""
    run_id = conn.execute(
        "SELECT leasework.enqueue('odd', '{\"a\": 1180591620717411303424}'::jsonb)"
    ).fetchone()[0]
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = leasework.now(), "
        "error = %s WHERE id = %s",
        ("kaboom \x1b[31mred\x07", run_id),
    )
    listed = ok(cli("runs"))
    shown = ok(cli("show", str(run_id)))
    for text in (listed, shown):
        assert "\x1b" not in text and "\x07" not in text
        assert "kaboom \\x1b[31mred\\x07" in text
    assert "1180591620717411303424" in shown
    doc = ok(cli("show", str(run_id), "--json"))
    assert '"a": 1180591620717411303424' in doc and "\\u001b[31mred" in doc


def test_a_kind_filter_matching_nothing_hints_at_a_kind_a_worker_serves(conn: Conn, cli: Any) -> None:
    conn.execute("INSERT INTO leasework.kinds (kind) VALUES ('send_report')")
    for args in (
        ["runs", "--kind", "send_reprot"],
        ["retry", "--kind", "send_reprot", "--dry-run"],
        ["delete", "--kind", "send_reprot", "--dry-run"],
    ):
        done = cli(*args)
        assert done.returncode == 0, done.stderr
        assert "no worker serves kind 'send_reprot'; did you mean 'send_report'?" in done.stderr
    quiet = cli("runs", "--kind", "send_report")  # a served kind with no runs: no hint
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_tenants_lists_and_sets_a_weight(conn: Conn, cli: Any) -> None:
    conn.execute("SELECT leasework.enqueue('k', tenant => 'acme')")
    assert "weight 3" in ok(cli("tenants", "set", "acme", "--weight", "3"))
    listed = orjson.loads(ok(cli("tenants", "--json")))
    assert [(t["name"], t["weight"], t["queued"]) for t in listed] == [("acme", 3.0, 1)]
    assert "acme" in ok(cli("tenants"))
    before = conn.execute("SELECT * FROM leasework.tenants").fetchall()
    one_line_exit_2(cli("tenants", "set", "acme", "--weight", "0"), "weight must be a number")
    one_line_exit_2(cli("tenants", "set", "acme", "--weight", "nan"), "weight must be a number")
    assert conn.execute("SELECT * FROM leasework.tenants").fetchall() == before


def test_tenants_set_a_weight_for_runs_without_a_tenant(conn: Conn, cli: Any) -> None:
    conn.execute("SELECT leasework.enqueue('k')")
    assert "runs without a tenant: weight 2" in ok(
        cli("tenants", "set", "--untenanted", "--weight", "2")
    )
    assert conn.execute("SELECT weight FROM leasework.untenanted_turn").fetchall() == [(2.0,)]
    listed = ok(cli("tenants"))
    assert "(runs without a tenant)" in listed and "acme" not in listed
    line = next(x for x in listed.splitlines() if x.startswith("(runs without a tenant)"))
    assert line.split()[4:7] == ["2", "1", "0"]  # weight, queued, running
    one_line_exit_2(cli("tenants", "set", "--weight", "2"), "name a tenant, or give --untenanted")
    one_line_exit_2(
        cli("tenants", "set", "acme", "--untenanted", "--weight", "2"),
        "name a tenant, or give --untenanted",
    )
    one_line_exit_2(cli("tenants", "set", "--untenanted", "--weight", "0"), "weight must be")
    assert conn.execute("SELECT weight FROM leasework.untenanted_turn").fetchall() == [(2.0,)]
    assert conn.execute("SELECT count(*) FROM leasework.tenants").fetchone() == (0,)


LIMITS_APP = """
from leasework import App

app = App()


@app.task("export", max_running=5)
def export(ctx, payload):
    return None


@app.task("crm.sync", rate="100/10s", rate_per="tenant", group_limit=3)
def crm_sync(ctx, payload):
    return None
"""


def test_limits_lists_sets_and_resets_at_run_time(
    conn: Conn, cli: Any, tmp_path: Path
) -> None:
    (tmp_path / "limitsapp.py").write_text(LIMITS_APP, encoding="utf-8")
    app = ["--app", "limitsapp:app"]
    assert "no kind has a limit" in ok(cli("limits"))
    ok(cli("worker", "--once", *app))  # a worker declares its app's limits before claiming
    listed = orjson.loads(ok(cli("limits", "--json")))
    assert [(r["kind"], r["max_running"], r["rate_count"], r["rate_per"]) for r in listed] == [
        ("crm.sync", None, 100, "tenant"),
        ("export", 5, None, None),
    ]
    text = ok(cli("limits"))
    assert "export: max_running 0/5" in text and "crm.sync: group_limit 3; rate 100/10s" in text
    assert "until `leasework limits reset export`" in ok(
        cli("limits", "set", "export", "--max-running", "2", "--rate", "10/m")
    )
    assert "export: max_running* 0/2; rate* 10/1m" in ok(cli("limits"))
    ok(cli("limits", "set", "crm.sync", "--tenant", "acme", "--rate", "500/10s"))
    assert "tenant acme: rate* 500/10s" in ok(cli("limits"))
    # Per group: each tenant's group its own budget, the tenant's own rate holding each group.
    ok(cli("limits", "set", "crm.sync", "--rate-per", "group"))
    text = ok(cli("limits"))
    assert "rate 100/10s per group*" in text and "tenant acme: rate* 500/10s" in text, text
    ok(cli("limits", "reset", "crm.sync", "rate_per"))
    before = conn.execute("SELECT * FROM leasework.kind_limits ORDER BY kind").fetchall()
    for args, says in [
        (("export", "--max-running", "x"), "must be a whole number or none"),
        (("export", "--max-running", "0"), "max_running must be an integer from 1"),
        (("export", "--rate", "10/10x"), "write COUNT/PERIOD"),
        (("export", "--rate-per", "key"), "rate_per must be 'tenant' or 'group'"),
        (("export", "--rate-per", "tenant", "--rate", "none"), "needs a rate"),
        (("export", "--tenant", "acme", "--rate", "1/s"), "export has no rate per tenant"),
        (("export", "--tenant", "acme", "--max-running", "1"), "give --rate"),
        (("exprot", "--max-running", "1"), "unknown kind 'exprot'"),
        (("export",), "no limit given"),
    ]:
        one_line_exit_2(cli("limits", "set", *args, *app), says)
    one_line_exit_2(cli("limits", "reset", "export", "speed"), "unknown limit 'speed'")
    assert conn.execute("SELECT * FROM leasework.kind_limits ORDER BY kind").fetchall() == before
    assert "reset max_running" in ok(cli("limits", "reset", "export", "max_running"))
    assert "export: max_running 0/5; rate* 10/1m" in ok(cli("limits"))
    ok(cli("limits", "reset", "export"))
    ok(cli("limits", "reset", "crm.sync", "--tenant", "acme"))
    assert "*" not in ok(cli("limits"))


def test_show_says_why_a_queued_run_is_not_claimed(conn: Conn, cli: Any) -> None:
    run = conn.execute("SELECT leasework.enqueue('metered', tenant => 'acme')").fetchone()
    grouped = conn.execute(
        "SELECT leasework.enqueue('metered', tenant => 'acme', \"group\" => 'crm')"
    ).fetchone()
    assert run is not None and grouped is not None
    conn.execute(
        "INSERT INTO leasework.kind_limits (kind, overrides)"
        " VALUES ('metered', '{\"max_running\": 1, \"rate\": [1, 60]}')"
    )
    ok(cli("limits", "set", "metered", "--group-limit", "1"))
    assert "held:" not in ok(cli("show", str(run[0])))  # nothing holds it yet
    # A claim of the kind recorded in its rate's window (what leasework.admit does for each one it
    # admits), and a run of the same tenant and group running: the cap is full, the rate used,
    # the group has its one.
    conn.execute(
        "SELECT leasework.admit(ARRAY[%s]::bigint[], ARRAY['metered'], ARRAY['acme'], 1, NULL,"
        " 'w')",
        (grouped[0] + 1000,),
    )
    other = conn.execute(
        "SELECT leasework.enqueue('metered', tenant => 'acme', \"group\" => 'crm')"
    ).fetchone()
    assert other is not None
    conn.execute(
        "UPDATE leasework.runs SET status = 'running', attempts = 1, lease_owner = gen_random_uuid(),"
        " lease_expires_at = leasework.now() + interval '1 minute', started_at = leasework.now()"
        " WHERE id = %s",
        (other[0],),
    )
    shown = ok(cli("show", str(grouped[0])))
    assert "held:      capped: 1 of 1 running (max_running)" in shown
    assert "rate-limited until" in shown and "rate 1/1m is used" in shown
    assert "group full: 1 of 1 running in group crm of tenant acme (group_limit)" in shown
    held = orjson.loads(ok(cli("show", str(grouped[0]), "--json")))["held_back"]
    assert [h["reason"] for h in held] == ["capped", "rate_limited", "group_full"]
    ok(cli("pause", "metered"))
    assert "its kind is paused" in ok(cli("show", str(run[0])))
