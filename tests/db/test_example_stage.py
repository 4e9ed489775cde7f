"""The example stage of ARCHITECTURE.md, run as it stands there: adding a stage is its module, its
query and one registration line (`app.use(...)`), and the worker polls it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg

from leasework import App

Conn = psycopg.Connection[Any]
DOC = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"


def example() -> dict[str, Any]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## An example stage") :]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "ARCHITECTURE.md has no example stage"
    namespace: dict[str, Any] = {"__name__": "example_stage"}
    exec(compile(block.group(1), str(DOC), "exec", dont_inherit=True), namespace)
    return namespace


def test_the_documented_example_stage_is_polled_by_a_worker(conn: Conn, make_worker: Any) -> None:
    ns = example()
    assert ns["BumpSettings"] in ns["app"].sections()  # declared by its family, not registered
    polled(ns, conn, make_worker)


def polled(ns: dict[str, Any], conn: Conn, make_worker: Any) -> None:
    app: App = ns["app"]
    app.task("report")(lambda ctx, payload: None)
    stages = app.stages()
    assert [s.name for s in stages] == ["schedule", "runs", "bump", "deps", "maintenance"]

    old = app.enqueue(conn, "report", delay=3600)  # not due: the runs stage leaves it alone
    new = app.enqueue(conn, "report", delay=3600)
    conn.execute(
        "UPDATE leasework.runs SET created_at = created_at - interval '2 hours' WHERE id = %s",
        (old,),
    )
    worker = make_worker(app, bump_limit=1)  # its own setting, through the config as any other
    assert worker.stages[2].limit == 1
    assert "bump" in [s.name for s in worker.stages]
    worker.poll()

    rows = dict(conn.execute("SELECT id, priority FROM leasework.runs").fetchall())
    assert rows == {old: -1, new: 0}
