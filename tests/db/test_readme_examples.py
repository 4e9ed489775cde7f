"""The manual's code examples, run as they stand there (docs/): "Testing your tasks"
(docs/testing.md), its two files written out and run by pytest in a subprocess with the leasework
plugin, on a database of their own; the plugin's refusals (no database named, a database whose
name does not say `test`); the sharding example of "Scaling" (docs/scaling.md) against two
databases; the examples of "Flow control" and "Workflows"."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import db

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """A page of the manual, docs/NAME.md, whole."""
    return (DOCS / f"{name}.md").read_text(encoding="utf-8")


def files_of(name: str) -> dict[str, str]:
    """The page's python blocks that start with `# path`: {path: code}."""
    blocks = re.findall(r"```python\n(# (\S+\.py)\n.*?)```", page(name), re.S)
    return {path: code for code, path in blocks}


@pytest.fixture
def plugin_db(server_dsn: str) -> Iterator[str]:
    name = f"lw_plugin_test_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = name
    yield make_conninfo(**params)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def run_pytest(
    where: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """pytest in a subprocess, with the plugin loaded as the entry point would load it."""
    installed = any(ep.value == "leasework.pytest_plugin" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "leasework.pytest_plugin"]
    full_env = {k: v for k, v in os.environ.items() if k != "LEASEWORK_PYTEST_DSN"}
    full_env.update({"PYTHONPATH": f"{where}{os.pathsep}{ROOT}", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *args],
        cwd=where,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_testing_example_passes_as_written(tmp_path: Path, plugin_db: str) -> None:
    files = files_of("testing")
    assert set(files) == {"myapp/tasks.py", "tests/test_reports.py"}
    for path, code in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code, encoding="utf-8")
    (tmp_path / "myapp" / "__init__.py").write_text("")
    done = run_pytest(tmp_path, "--leasework-dsn", plugin_db, "tests/test_reports.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    # the plugin migrated the named database and emptied its runs before each test: the last
    # test's three runs are all that is left
    with psycopg.connect(plugin_db) as conn:
        kinds = conn.execute("SELECT kind FROM leasework.runs ORDER BY id").fetchall()
    assert kinds == [("reports.weekly",), ("reports.send",), ("reports.send",)]


def test_the_plugin_refuses_a_database_not_named_for_tests(tmp_path: Path, dsn: str) -> None:
    (tmp_path / "test_x.py").write_text("def test_x(leasework_conn):\n    pass\n")
    params = conninfo_to_dict(dsn)
    params["dbname"] = "production"
    params["password"] = "hunter2secret"
    done = run_pytest(tmp_path, "--leasework-dsn", make_conninfo(**params), "test_x.py")
    out = done.stdout + done.stderr
    assert done.returncode == 4, out  # pytest's usage error, once for the session
    assert "names database 'production'" in out and "contains 'test'" in out
    assert out.count("names database") == 1 and "hunter2secret" not in out


def test_the_plugin_reports_an_unreachable_database_once_without_its_password(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_x.py").write_text(
        "def test_x(leasework_conn):\n    pass\n\ndef test_y(leasework_conn):\n    pass\n"
    )
    dsn = "postgresql://postgres:hunter2secret@127.0.0.1:1/x_test?connect_timeout=3"
    done = run_pytest(tmp_path, "--leasework-dsn", dsn, "test_x.py")
    out = done.stdout + done.stderr
    assert done.returncode == 4, out
    assert out.count("cannot prepare the test database") == 1 and "hunter2secret" not in out


def test_the_plugin_without_a_database_says_how_to_name_one(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x(leasework_conn):\n    pass\n")
    done = run_pytest(tmp_path, "test_x.py")
    assert done.returncode == 4
    out = done.stdout + done.stderr
    assert "pass --leasework-dsn, set LEASEWORK_PYTEST_DSN" in out


def test_the_plugin_takes_the_dsn_from_the_environment(tmp_path: Path, plugin_db: str) -> None:
    (tmp_path / "test_x.py").write_text(
        "def test_x(leasework_conn):\n"
        "    assert leasework_conn.execute('SELECT count(*) FROM leasework.runs').fetchone() == (0,)\n"
    )
    done = run_pytest(tmp_path, "test_x.py", env={"LEASEWORK_PYTEST_DSN": plugin_db})
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_entry_point_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '[project.entry-points.pytest11]\nleasework = "leasework.pytest_plugin"' in text


@pytest.fixture
def two_databases(server_dsn: str) -> Iterator[list[str]]:
    """Two fresh databases, migrated: the two shards of the example in "Scaling"."""
    names = [f"lw_shard_test_{os.getpid()}_{secrets.token_hex(3)}" for _ in range(2)]
    dsns = []
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        for name in names:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            dsns.append(make_conninfo(**{**conninfo_to_dict(server_dsn), "dbname": name}))
    try:
        for shard in dsns:
            with psycopg.connect(shard, autocommit=True) as conn:
                db.migrate(conn)
        yield dsns
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            for name in names:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


def test_the_sharding_example_puts_each_tenant_in_one_database(
    two_databases: list[str],
) -> None:
    """docs/scaling.md: the example as written, its SHARDS pointed at two test databases;
    every tenant's runs land in one database, the same each time, and both databases get some."""
    files = files_of("scaling")
    assert set(files) == {"myproject/shards.py"}
    module: dict[str, Any] = {"__name__": "shards"}
    exec(compile(files["myproject/shards.py"], "myproject/shards.py", "exec"), module)
    module["SHARDS"] = two_databases
    tenants = [f"tenant-{i}" for i in range(12)]
    placed = {}
    for tenant in tenants:
        run = module["enqueue_report"](tenant, 48)
        again = module["enqueue_report"](tenant, 48)  # the same key: the same run, same shard
        assert again == run
        placed[tenant] = module["shard_of"](tenant)
    for shard in two_databases:
        with psycopg.connect(shard) as conn:
            keys = {k for (k,) in conn.execute("SELECT key FROM leasework.runs").fetchall()}
        assert keys == {f"{t}:48" for t, s in placed.items() if s == shard}
        assert keys, "every shard gets some of the twelve tenants"


def test_the_flow_control_examples_do_what_the_section_says(dsn: str, conn: Any) -> None:
    """The Python blocks of "Flow control" (docs/flow-control.md), run as they stand with an app, a DSN and a
    connection: a second report of the account returns the first; two reindex enqueues of a
    document make one run with both ids."""
    from leasework import App

    blocks = re.findall(r"```python\n(.*?)```", page("flow-control"), re.S)
    windows = [b for b in blocks if "unique_for=" in b]
    debounces = [b for b in blocks if "debounce=" in b]
    assert len(windows) == 1 and len(debounces) == 1
    window: dict[str, Any] = {"app": App(), "psycopg": psycopg, "dsn": dsn}
    exec(windows[0], window)
    assert window["first"] == window["again"]
    debounce: dict[str, Any] = {"app": App(), "psycopg": psycopg, "conn": conn}
    exec(debounces[0], debounce)
    rows = conn.execute(
        "SELECT payload, debounce_count FROM leasework.runs WHERE kind = 'reindex'"
    ).fetchall()
    assert rows == [({"ids": [1, 2]}, 2)]



def test_the_workflows_examples_run_as_written(dsn: str, conn: Any) -> None:
    """The blocks of "Workflows" (docs/workflows.md), run as they stand: the dependencies and the builder
    enqueue what they say, and the fan-out over discovered pages, with a page that adds another
    and a page that fails, writes one summary once every page has ended."""
    from leasework import App, Fail
    from leasework.testing import drain

    blocks = re.findall(r"```python\n(.*?)```", page("workflows"), re.S)
    depends, own_policy, builder, fanout = blocks[:4]
    app = App()

    @app.task("fetch")
    def fetch(ctx: Any, payload: Any) -> Any:
        return {"text": "three small words"}

    @app.task("alert")
    def alert(ctx: Any, payload: Any) -> None:
        return None

    space: dict[str, Any] = {"app": app, "psycopg": psycopg, "dsn": dsn, "url": "https://x"}
    exec(depends, space)
    drain(app, conn)
    assert app.get_run(conn, space["parsed"])["result"] == {"words": 3}  # type: ignore[index]

    # a policy per dependency: the index runs although the mirror failed
    @app.task("mirror", max_attempts=1)
    def mirror(ctx: Any, payload: Any) -> None:
        raise RuntimeError("the mirror is down")

    @app.task("index")
    def index(ctx: Any, payload: Any) -> Any:
        return sorted(p.status for p in ctx.parents())

    space = {"app": app, "psycopg": psycopg, "dsn": dsn, "url": "https://x"}
    exec(own_policy, space)
    drain(app, conn)
    row = conn.execute("SELECT status, result FROM leasework.runs WHERE kind = 'index'").fetchone()
    assert row == ("succeeded", ["failed", "succeeded"])
    conn.execute("DELETE FROM leasework.runs")

    @app.task("summarise")
    def summarise(ctx: Any, payload: Any) -> None:
        return None

    space = {"app": app, "conn": conn, "url": "https://x"}
    exec(builder, space)
    assert list(space["ids"]) == ["fetch", "pages[0]", "pages[1]", "pages[2]", "summary"]
    drain(app, conn)
    statuses = {r[0] for r in conn.execute("SELECT status FROM leasework.runs").fetchall()}
    assert statuses == {"succeeded"}

    conn.execute("DROP TABLE IF EXISTS summaries")
    conn.execute("CREATE TABLE summaries (site text, words int, ok int, failed int)")
    crawl_app = App()
    space = {"app": crawl_app, "psycopg": psycopg, "dsn": dsn, "Fail": Fail}
    exec(fanout, space)
    drain(crawl_app, conn)
    # pages 0-4 and 99, page 3 failed: 100 + 101 + 102 + 104 + 199 words from five pages
    assert conn.execute("SELECT * FROM summaries").fetchall() == [("example.org", 606, 5, 1)]
    callbacks = conn.execute(
        "SELECT status FROM leasework.runs WHERE kind = 'summarise' AND payload ? 'site'"
    ).fetchall()
    assert callbacks == [("succeeded",)]


def _draining(app: Any, dsn: str, kind: str, stop: Any) -> Any:
    """A worker of sorts on a thread: drains `kind` (retries' delays jumped) until `stop`."""
    import threading

    from leasework.testing import drain

    def loop() -> None:
        while not stop.is_set():
            drain(app, dsn, [kind], jump_delays=True)
            stop.wait(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_the_workflows_wait_example_answers_a_web_request(dsn: str, conn: Any) -> None:
    """docs/workflows.md: the web request waiting for a report's result, as written, with a
    worker draining beside it: 200 and the result; 500 and the error once the report fails."""
    import threading

    files = files_of("workflows")
    assert "myproject/views.py" in files
    module: dict[str, Any] = {"__name__": "views"}
    exec(compile(files["myproject/views.py"], "myproject/views.py", "exec"), module)
    stop = threading.Event()
    worker = _draining(module["app"], dsn, "report", stop)
    try:
        assert module["report_view"](dsn, 48) == (200, {"week": 48, "total": 288})

        def broken(week: int) -> list[int]:
            raise RuntimeError("the warehouse is offline")

        module["load_rows"] = broken
        status, body = module["report_view"](dsn, 49)
    finally:
        stop.set()
        worker.join(30)
    assert status == 500 and body["status"] == "failed"
    assert "the warehouse is offline" in body["error"]


def test_the_workflows_steps_example_calls_each_step_once(dsn: str, conn: Any) -> None:
    """docs/workflows.md, "Durable steps": the onboarding handler as written, with stand-ins for the three
    services; a first attempt that dies after the mail resumes with the stored account."""
    from types import SimpleNamespace

    from leasework import App, Context
    from leasework.testing import drain

    blocks = re.findall(r"```python\n(.*?)```", page("workflows"), re.S)
    [steps] = [b for b in blocks if "def onboard" in b]
    conn.execute("CREATE TABLE IF NOT EXISTS public.invoices (account int, number text)")
    conn.execute("TRUNCATE public.invoices")
    calls: list[str] = []
    died: list[bool] = []

    def invoice(account: int) -> dict[str, Any]:
        calls.append("invoice")
        if not died:
            died.append(True)
            raise ConnectionError("billing timed out")
        return {"number": f"INV-{account}"}

    services: dict[str, Any] = {
        "app": App(),
        "Context": Context,
        "crm": SimpleNamespace(create_account=lambda email: calls.append("crm") or {"id": 7}),
        "mailer": SimpleNamespace(send=lambda email, template: calls.append("mail")),
        "billing": SimpleNamespace(invoice=invoice),
    }
    exec(steps, services)
    app = services["app"]
    run_id = app.enqueue(conn, "onboard", {"email": "ada@example.org"})
    drain(app, dsn, ["onboard"], jump_delays=True)
    run = app.get_run(conn, run_id)
    assert run is not None and run["status"] == "succeeded", run
    assert run["result"] == {"account": 7, "invoice": "INV-7"}
    assert calls == ["crm", "mail", "invoice", "invoice"]
    assert conn.execute("SELECT * FROM public.invoices").fetchall() == [(7, "INV-7")]
