"""The maintenance stage on real Postgres: one worker wins each period however many poll;
pruning is bounded per poll, keeps what retention says to keep, and continues a backlog."""

from __future__ import annotations

import pytest

from leasework import App
from leasework.documents import Documents
from leasework.stages.maintenance import MaintenanceStage
from leasework.syncs import Syncs

HANDLERS = (
    "prune_runs",
    "fail_unknown_kinds",
    "prune_uploads",
    "prune_workers",
    "prune_tombstones",
    "reconcile_files",
    "prune_rate_windows",
)


@pytest.fixture
def workers(make_worker, tmp_path):
    app = App()
    app.use(Syncs())
    app.use(Documents())

    def make(n: int = 3, **overrides):
        out = []
        for _ in range(n):
            w = make_worker(app, file_store=str(tmp_path / "store"), **overrides)
            w.stages = [s for s in w.stages if isinstance(s, MaintenanceStage)]
            out.append(w)
        return out

    return make


def markers(conn) -> dict[str, int]:
    return dict(conn.execute("SELECT handler, runs FROM leasework.maintenance").fetchall())


def add_run(conn, status: str, age_days: float) -> int:
    return conn.execute(
        "INSERT INTO leasework.runs (kind, status, finished_at) VALUES"
        " ('t', %s, leasework.now() - make_interval(secs => %s)) RETURNING id",
        (status, age_days * 86400),
    ).fetchone()[0]


def test_each_handler_runs_once_per_period_across_workers(conn, workers):
    ws = workers(3)
    for _ in range(3):
        for w in ws:
            w.poll()
    assert markers(conn) == dict.fromkeys(HANDLERS, 1)
    # One hourly period later (moved, not slept): the hourly handlers run once more;
    # the daily prune_workers does not.
    conn.execute(
        "UPDATE leasework.maintenance SET last_run_at = last_run_at - interval '61 minutes'"
    )
    for _ in range(3):
        for w in ws:
            w.poll()
    assert markers(conn) == {
        "prune_runs": 2,
        "prune_uploads": 2,
        "prune_workers": 1,
        "prune_tombstones": 2,
        "reconcile_files": 2,
        "fail_unknown_kinds": 2,
        "prune_rate_windows": 2,
    }


def test_pruning_keeps_what_retention_says(conn, workers):
    doomed = [
        add_run(conn, "succeeded", 8),
        add_run(conn, "cancelled", 8),
        add_run(conn, "failed", 31),
        add_run(conn, "partial", 31),
    ]
    kept = [
        add_run(conn, "succeeded", 6),
        add_run(conn, "failed", 8),
        add_run(conn, "partial", 8),
        add_run(conn, "cancelled", 1),
        conn.execute("INSERT INTO leasework.runs (kind) VALUES ('t') RETURNING id").fetchone()[0],
    ]
    conn.execute(
        "INSERT INTO leasework.workers (id, host, pid, heartbeat_at, stopped_at) VALUES"
        " ('gone', 'h', 1, now() - interval '3 days', now() - interval '2 days'),"
        " ('silent', 'h', 2, now() - interval '3 days', NULL),"
        " ('recent', 'h', 3, now() - interval '2 hours', now() - interval '1 hour')"
    )
    workers(1)[0].poll()
    left = {r[0] for r in conn.execute("SELECT id FROM leasework.runs").fetchall()}
    assert left == set(kept)
    assert not set(doomed) & left
    names = {r[0] for r in conn.execute("SELECT id FROM leasework.workers").fetchall()}
    assert {"recent"} <= names and not {"gone", "silent"} & names


def test_pruning_is_bounded_and_continues_a_backlog(conn, workers):
    for _ in range(5):
        add_run(conn, "succeeded", 10)
    a, b = workers(2, maintenance_limit=2)

    def left() -> int:
        return conn.execute("SELECT count(*) FROM leasework.runs").fetchone()[0]

    a.poll()
    assert left() == 3  # at most the limit per poll
    b.poll()  # a backlog is due at once, for any worker
    assert left() == 1
    a.poll()
    assert left() == 0
    backlog = conn.execute(
        "SELECT backlog FROM leasework.maintenance WHERE handler = 'prune_runs'"
    ).fetchone()[0]
    assert backlog is False
    b.poll()
    assert markers(conn)["prune_runs"] == 3  # no backlog left: throttled until next period


def test_old_uploads_and_their_archives_are_pruned(conn, workers, tmp_path):
    ws = workers(1)
    app = ws[0].app.family(Documents)
    assert app is not None
    src = tmp_path / "a.zip"
    src.write_bytes(b"PK")
    old = app.add_upload(conn, project="p", path=src)
    new = app.add_upload(conn, project="p", path=src)
    conn.execute(
        "UPDATE leasework.uploads SET status = 'done', finished_at = now() - interval '31 days'"
        " WHERE id = %s",
        (old,),
    )
    key = conn.execute("SELECT store_key FROM leasework.uploads WHERE id = %s", (old,)).fetchone()[
        0
    ]
    assert app.file_store().size(key) == 2
    ws[0].poll()
    ids = [r[0] for r in conn.execute("SELECT id FROM leasework.uploads").fetchall()]
    assert ids == [new]
    assert app.file_store().size(key) is None


def test_old_tombstones_are_pruned_and_live_records_kept(conn, workers):
    cid = conn.execute(
        "INSERT INTO leasework.connections (workspace, provider, config)"
        " VALUES ('ws', 'files', '{}') RETURNING id"
    ).fetchone()[0]
    conn.execute(
        "INSERT INTO leasework.records (connection_id, table_name, external_id, data, deleted_at)"
        " VALUES (%(c)s, 't', 'old', '{}', leasework.now() - interval '31 days'),"
        "        (%(c)s, 't', 'recent', '{}', leasework.now() - interval '1 day'),"
        "        (%(c)s, 't', 'live', '{}', NULL)",
        {"c": cid},
    )
    workers(1)[0].poll()
    left = {r[0] for r in conn.execute("SELECT external_id FROM leasework.records").fetchall()}
    assert left == {"recent", "live"}


def test_files_left_indexing_follow_their_ended_ingest_run(conn, workers):
    """expire_and_promote fails a run whose lease expired on its last attempt without calling the
    ingest handler; maintenance then moves its file out of `indexing`."""

    def add_file(name: str, run_status: str | None) -> int:
        fid = conn.execute(
            "INSERT INTO leasework.files (project, name, store_key, size, sha256, status)"
            " VALUES ('p', %s, %s, 1, 'x', 'indexing') RETURNING id",
            (name, name),
        ).fetchone()[0]
        if run_status is not None:
            finished = None if run_status == "running" else "now()"
            conn.execute(
                "INSERT INTO leasework.runs (kind, key, status, error, finished_at, lease_owner,"
                " lease_expires_at) VALUES ('ingest', %s, %s, 'lease expired', "
                + (finished or "NULL")
                + ", %s, %s)",
                (
                    f"leasework:file:{fid}",
                    run_status,
                    "00000000-0000-0000-0000-000000000001" if run_status == "running" else None,
                    "2099-01-01" if run_status == "running" else None,
                ),
            )
        return fid

    failed = add_file("a", "failed")
    cancelled = add_file("b", "cancelled")
    live = add_file("c", "running")
    workers(1)[0].poll()
    status = dict(conn.execute("SELECT id, status FROM leasework.files").fetchall())
    assert status == {failed: "failed", cancelled: "pending", live: "indexing"}
    error = conn.execute("SELECT error FROM leasework.files WHERE id = %s", (failed,)).fetchone()[0]
    assert error == "lease expired"


@pytest.mark.parametrize(
    "history",
    [
        '"a string"',
        '{"outcome": "expired"}',
        '[1, "x", null, [2]]',
        '[{"outcome": "expired", "started_at": "not a time", "attempt": "x"}]',
        '[{"outcome": "crashed", "started_at": "2026-01-01T00:00:00Z"}]',
    ],
)
def test_deleting_a_run_whose_history_has_any_shape_keeps_its_counts(conn, history) -> None:
    """The worker role can write a run's history; the delete trigger (pruning, `leasework
    delete`) must not fail on whatever it holds, or one row would block every prune batch that
    includes it. Losses are counted from the entries that are objects with an outcome."""
    conn.execute("TRUNCATE leasework.runs, leasework.counters")
    (run_id,) = conn.execute(
        "INSERT INTO leasework.runs (kind, status, attempts, started_at, finished_at, history)"
        " VALUES ('odd', 'succeeded', 1, now() - interval '1 s', now(), %s::jsonb) RETURNING id",
        (history,),
    ).fetchone()
    conn.execute("DELETE FROM leasework.runs WHERE id = %s", (run_id,))
    counts = dict(
        conn.execute(
            "SELECT name || ':' || label, value FROM leasework.counters WHERE kind = 'odd'"
        ).fetchall()
    )
    assert counts["finished:succeeded"] == 1
    assert counts.get("lost:crashed", 0) == (1 if "crashed" in history else 0)
    assert counts.get("reclaimed:", 0) == (1 if "crashed" in history else 0)
