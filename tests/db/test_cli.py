"""The CLI end to end, as a user runs it: `python -m leasework ...` in a subprocess against the
test database, with an --app module written to tmp_path. Bad input gives one line on stderr,
exit 2 (or 1 for an unreachable database), no password echoed, and nothing written."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from leasework import App
from leasework.leases import lease

from ..conftest import get_run

Conn = psycopg.Connection[Any]

APP_MODULE = """
from leasework import App

app = App()


@app.task("hello")
def hello(ctx, payload):
    ctx.check()
    return {"echo": payload}


@app.task("boom", max_attempts=1)
def boom(ctx, payload):
    raise RuntimeError("boom")
"""


@pytest.fixture
def cli(tmp_path: Path, dsn: str) -> Any:
    return make_cli(tmp_path, dsn)


def make_cli(tmp_path: Path, dsn: str) -> Any:
    """`run(*args)`: `python -m leasework ARGS --dsn DSN` in tmp_path, with cliapp.py there."""
    (tmp_path / "cliapp.py").write_text(APP_MODULE, encoding="utf-8")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LEASEWORK_", "PG")) and k != "DATABASE_URL"
    }

    def run(
        *args: str,
        with_dsn: bool = True,
        extra_env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "leasework", *args]
        if with_dsn:
            argv += ["--dsn", dsn]
        return subprocess.run(
            argv,
            cwd=tmp_path,
            env={**env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def count_runs(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM leasework.runs").fetchone()
    assert row is not None
    return int(row[0])


def test_migrate_enqueue_worker_cancel_status(conn: Conn, cli: Any) -> None:
    assert "version" in ok(cli("migrate"))  # idempotent: the session database is migrated

    out = ok(cli("enqueue", "hello", "--app", "cliapp:app", "--payload", '{"a": 1}', "--key", "k1"))
    run_id = int(out.strip())
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["payload"] == {"a": 1} and row["key"] == "k1"

    flags = ["--delay", "3600", "--tenant", "ws-1", "--group", "g", "--priority", "-1"]
    later = int(ok(cli("enqueue", "hello", "--app", "cliapp:app", *flags, "--max-attempts", "5")))
    row = get_run(conn, later)
    assert (row["tenant"], row["group"], row["priority"], row["max_attempts"]) == (
        "ws-1",
        "g",
        -1,
        5,
    )
    assert row["queued_at"] > row["created_at"]

    snap = orjson.loads(ok(cli("status", "--json")))
    assert snap["runs_by_status"] == {"queued": 2}

    assert "cancelled" in ok(cli("cancel", str(later)))
    assert get_run(conn, later)["status"] == "cancelled"

    ok(cli("worker", "--once", "--app", "cliapp:app"))
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded" and row["result"] == {"echo": {"a": 1}}

    app = App()
    app.task("hello")(lambda ctx, payload: None)
    running = app.enqueue(conn, "hello")
    claims = lease.claim_runs(conn, ["hello"], worker="elsewhere", lease=30.0)
    assert [c.id for c in claims] == [running]
    assert "cancel requested" in ok(cli("cancel", str(running)))
    assert lease.control(conn, claims[0]) == "cancelled"

    text = ok(cli("status"))
    assert "succeeded 1" in text and "cancelled 1" in text and "running 1" in text
    assert "cancel requested" in text


def test_enqueue_with_a_unique_window_or_a_debounce_says_which_run_it_returned(
    conn: Conn, cli: Any
) -> None:
    """`leasework enqueue --unique-for S` / `--debounce S [--debounce-max S]`: the run's id on
    stdout, and on stderr what became of the enqueue when it made no run."""
    window = [*ENQUEUE, "--key", "acct-7", "--unique-for", "3600"]
    first = int(ok(cli(*window)))
    app = App()
    app.task("hello")(lambda ctx, payload: None)
    claims = lease.claim_runs(conn, ["hello"], worker="w", lease=30.0)
    assert [c.id for c in claims] == [first] and lease.finish(conn, claims[0], "succeeded")
    again = cli(*window)
    assert int(ok(again)) == first
    assert again.stderr == (
        f"leasework: key 'acct-7' has run {first} in its unique window: returned it, enqueued "
        "nothing\n"
    )
    debounce = [*ENQUEUE, "--key", "doc", "--debounce", "30", "--debounce-max", "300"]
    pending = int(ok(cli(*debounce, "--payload", '{"v": 1}')))
    merged = cli(*debounce, "--payload", '{"v": 2}')
    assert int(ok(merged)) == pending
    assert "has pending run" in merged.stderr and "took this payload" in merged.stderr
    row = get_run(conn, pending)
    assert row["payload"] == {"v": 2} and row["debounce_count"] == 2
    assert "debounce:  2 enqueues merged" in ok(cli("show", str(pending)))


def test_enqueue_after_other_runs(conn: Conn, cli: Any) -> None:
    """`leasework enqueue --after ID [--after ID ...] [--on-parent-failure cancel|run]`: the run
    waits (`blocked`) for them; a bad or unknown id, or the policy without --after, is one line
    on stderr, exit 2, nothing written."""
    first = int(ok(cli(*ENQUEUE, "--delay", "3600")))
    second = int(ok(cli(*ENQUEUE, "--delay", "3600")))
    child = int(ok(cli(*ENQUEUE, "--after", str(first), "--after", str(second))))
    anyway = int(ok(cli(*ENQUEUE, "--after", str(first), "--on-parent-failure", "run")))
    assert get_run(conn, child)["status"] == "blocked"
    rows = conn.execute(
        "SELECT child, parent, anyway FROM leasework.run_deps ORDER BY child, parent"
    ).fetchall()
    assert rows == [(child, first, False), (child, second, False), (anyway, first, True)]
    shown = ok(cli("show", str(child)))
    assert f"#{first}" in shown and f"#{second}" in shown and "on failure: cancel" in shown
    before = count_runs(conn)
    bad = [
        (["--after", "12x"], "enqueue: argument --after: must be the id of a run (a positive "
         "integer below 2**63), got '12x'"),
        (["--after", "0"], "got '0'"),
        (["--after", str(10**12)], f"enqueue: after: there is no run {10**12} (a run can only "
         "wait for runs that exist)"),
        (["--on-parent-failure", "run"], "--on-parent-failure needs --after RUN_ID"),
        (["--after", str(first), "--on-parent-failure", "maybe"], "invalid choice: 'maybe'"),
        (["--after", str(first), "--key", "k"], "after cannot be combined with key"),
    ]
    for args, line in bad:
        done = cli(*ENQUEUE, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1 and line in done.stderr, (args, done.stderr)
    assert count_runs(conn) == before


BAD_DSNS = [
    "postgresql://bob:s3cretpw@127.0.0.1:1/nodb",
    "host=127.0.0.1 port=1 password=s3cretpw nonsense_option=1",
]
ENQUEUE = ["enqueue", "hello", "--app", "cliapp:app"]

# (case, argv, extra environment, text the one stderr line must contain, allowed exit codes)
BAD_INPUT: list[tuple[str, list[str], dict[str, str], str, tuple[int, ...]]] = [
    ("unknown kind", ["enqueue", "nosuch", "--app", "cliapp:app"], {}, "unknown kind", (2,)),
    ("bad json", [*ENQUEUE, "--payload", "{bad"], {}, "--payload", (2,)),
    (
        "oversize payload",
        [*ENQUEUE, "--payload", '"' + "x" * 64 + '"'],
        {"LEASEWORK_PAYLOAD_MAX_BYTES": "32"},
        "payload",
        (2,),
    ),
    ("no app", ["enqueue", "hello"], {}, "--app", (2,)),
    (
        "app not importable",
        ["enqueue", "hello", "--app", "nosuchmodule:app"],
        {},
        "nosuchmodule",
        (2,),
    ),
    ("app not an App", ["enqueue", "hello", "--app", "cliapp:hello"], {}, "cliapp:hello", (2,)),
    # The error names where the app came from: the flag, the variable or the file's key.
    (
        "app flag not importable",
        ["enqueue", "hello", "--app", "nosuchmodule:app"],
        {},
        "--app 'nosuchmodule:app': cannot import nosuchmodule",
        (2,),
    ),
    (
        "app from the environment not importable",
        ["enqueue", "hello"],
        {"LEASEWORK_APP": "nosuchmodule:app"},
        "LEASEWORK_APP 'nosuchmodule:app': cannot import nosuchmodule",
        (2,),
    ),
    (
        "app from the config file not a factory",
        ["enqueue", "hello", "--config", "{appfile}"],
        {},
        "appfile.toml: app 'cliapp:hello': calling hello() failed",
        (2,),
    ),
    ("bad max attempts", [*ENQUEUE, "--max-attempts", "0"], {}, "max_attempts", (2,)),
    (
        "bad unique window",
        [*ENQUEUE, "--key", "k", "--unique-for", "0"],
        {},
        "unique_for must be a number of seconds above 0",
        (2,),
    ),
    ("unique window without a key", [*ENQUEUE, "--unique-for", "60"], {}, "needs a key", (2,)),
    (
        "debounce_max below debounce",
        [*ENQUEUE, "--key", "k", "--debounce", "60", "--debounce-max", "30"],
        {},
        "debounce_max must be at least debounce (60), got 30",
        (2,),
    ),
    # An embedder that cannot be loaded stops workers at start-up, not the ingest stage each poll.
    *(
        (
            f"embedder not loadable ({argv[0]})",
            [*argv, "--app", "leasework.cli:builtin_app"],
            {"LEASEWORK_EMBEDDER": "nosuchembedder:embed"},
            "LEASEWORK_EMBEDDER 'nosuchembedder:embed' cannot be loaded: ModuleNotFoundError",
            (2,),
        )
        for argv in (["worker"], ["supervise"])
    ),
    (
        "embedder not callable",
        ["worker", "--once", "--app", "leasework.cli:builtin_app"],
        {"LEASEWORK_EMBEDDER": "cliapp:app"},
        "LEASEWORK_EMBEDDER 'cliapp:app' is not callable",
        (2,),
    ),
    ("bad env value", ENQUEUE, {"LEASEWORK_POOL_SIZE": "many"}, "pool_size", (2,)),
    ("no such run", ["cancel", "424242"], {}, "424242", (2,)),
    ("unknown command", ["frobnicate"], {}, "frobnicate", (2,)),
    ("config unknown key", [*ENQUEUE, "--config", "{bogus}"], {}, "bogus_knob", (2,)),
    ("config bad value", ["status", "--config", "{badvalue}"], {}, "lease", (2,)),
    ("config not TOML", ["migrate", "--config", "{badtoml}"], {}, "TOML", (2,)),
    *(
        (f"unreachable {i}", [*cmd, "--dsn", dsn], {}, "", (1, 2))
        for i, (dsn, cmd) in enumerate(
            zip(BAD_DSNS, (["status"], ENQUEUE, ["migrate"]), strict=False)
        )
    ),
    (
        "unknown role (a refusal no retry fixes)",
        ["status", "--dsn", "postgresql://no_such_role_lw:s3cretpw@127.0.0.1:5432/postgres"],
        {},
        "refused",
        (2,),
    ),
    (
        "unreachable via DATABASE_URL",
        ["status"],
        {"DATABASE_URL": BAD_DSNS[0]},
        "cannot connect",
        (1,),
    ),
]


def test_bad_input_is_one_line_exit_2_nothing_written(conn: Conn, cli: Any, tmp_path: Path) -> None:
    files = {
        "bogus": "bogus_knob = 1\n",
        "badvalue": 'lease = "long"\n',
        "badtoml": "lease = = 1\n",
        "appfile": 'app = "cliapp:hello"\n',
    }
    paths = {"missing": str(tmp_path / "missing.toml")}
    for name, text in files.items():
        (tmp_path / f"{name}.toml").write_text(text, encoding="utf-8")
        paths[name] = str(tmp_path / f"{name}.toml")

    def attempt(case: tuple[str, list[str], dict[str, str], str, tuple[int, ...]]) -> str | None:
        name, argv, env, needle, codes = case
        argv = [paths.get(a.strip("{}"), a) if a.startswith("{") else a for a in argv]
        explicit_dsn = "--dsn" in argv or "DATABASE_URL" in env
        result = cli(*argv, with_dsn=not explicit_dsn, extra_env=env)
        # a --dsn with a password adds its warning line first (see tests/security)
        lines = [
            line
            for line in result.stderr.strip().splitlines()
            if not line.startswith("leasework: warning: --dsn carries a password")
        ]
        problems = []
        if result.returncode not in codes:
            problems.append(f"exit {result.returncode}")
        if len(lines) != 1 or not lines[0].startswith("leasework: ") or needle not in lines[0]:
            problems.append(f"stderr {result.stderr!r}")
        if result.stdout:
            problems.append(f"stdout {result.stdout!r}")
        if "s3cretpw" in result.stderr + result.stdout:
            problems.append("the password was echoed")
        return f"{name}: {'; '.join(problems)}" if problems else None

    # The cases are independent processes: run them side by side to keep the suite fast.
    with ThreadPoolExecutor(max_workers=8) as pool:
        failures = [f for f in pool.map(attempt, BAD_INPUT) if f]
    assert not failures, "\n".join(failures)
    assert count_runs(conn) == 0, "bad input wrote something"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_worker_with_a_bad_database_fails_in_one_line_within_seconds(
    cli: Any, server_dsn: str
) -> None:
    # The worker's pool used to retry these for its whole 30 s start-up wait, logging every try,
    # then exit 1 on a PoolTimeout. Like the other commands: one line, exit 2 for a refusal, 1
    # for a server that cannot be reached. 25 s is a deadline for the process, not a measurement:
    # under the old 30 s wait it still fails; two at a time, so that the six processes' own
    # start-up does not crowd a busy machine past it.
    no_db = make_conninfo(server_dsn, dbname=f"lw_no_such_db_{secrets.token_hex(3)}")
    no_role = make_conninfo(server_dsn, user="no_such_role_lw", password="s3cretpw")
    closed = make_conninfo(server_dsn, host="127.0.0.1", port=str(free_port()))
    refused, unreachable = (
        "the database refused the connection: ",
        "cannot connect to the database: ",
    )
    cases = [
        (f"{' '.join(['worker', *once])} with {what}", [*once, "--dsn", bad], code, needle)
        for once in (["--once"], [])
        for what, bad, code, needle in (
            ("no such database", no_db, 2, refused),
            ("no such role", no_role, 2, refused),
            ("a closed port", closed, 1, unreachable),
        )
    ]

    def attempt(case: tuple[str, list[str], int, str]) -> str | None:
        name, args, code, needle = case
        argv = ["worker", "--app", "cliapp:app", *args]
        try:
            result = cli(*argv, with_dsn=False, timeout=25)
        except subprocess.TimeoutExpired:
            return f"{name}: still running after 25 s"
        # a --dsn with a password adds its warning line first (see tests/security)
        lines = [
            line
            for line in result.stderr.strip().splitlines()
            if not line.startswith("leasework: warning: --dsn carries a password")
        ]
        problems = []
        if result.returncode != code:
            problems.append(f"exit {result.returncode}, not {code}")
        if len(lines) != 1 or not lines[0].startswith(f"leasework: {needle}"):
            problems.append(f"stderr {result.stderr!r}")
        if result.stdout:
            problems.append(f"stdout {result.stdout!r}")
        if "s3cretpw" in result.stderr:
            problems.append("the password was echoed")
        return f"{name}: {'; '.join(problems)}" if problems else None

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(attempt, cases) if f]
    assert not failures, "\n".join(failures)


def test_show_lists_a_runs_parents_children_and_graph(conn: Conn, cli: Any) -> None:
    """docs/workflows.md: `leasework show` of a run in a graph says what it waits for, what
    waits for it, and the graph's runs by status; of a blocked run, which parents hold it."""
    from leasework import Client

    client = Client()
    a = client.enqueue(conn, "hello", {})
    b = client.enqueue(conn, "hello", {}, after=[a])
    c = client.enqueue(conn, "hello", {}, after=[b], on_parent_failure="run")
    shown = ok(cli("show", str(b)))
    assert "parents (1):" in shown and f"#{a}" in shown
    assert "children (1):" in shown and f"#{c}" in shown and "on failure: run" in shown
    assert "graph: 3 runs: 2 blocked, 1 queued" in shown
    assert f"held:      blocked: waits for #{a} to end" in shown
    plain = client.enqueue(conn, "hello", {})
    assert "parents" not in ok(cli("show", str(plain)))
