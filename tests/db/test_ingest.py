"""The ingest stage on real Postgres: resume after a lost worker, tail clean-up, scope and
content re-check, cancel, ceilings, PDF pages. Leases are expired by moving columns, never by
sleeping."""

from __future__ import annotations

import pytest

from leasework import Fail, Snooze
from leasework.documents import LocalStore, files
from leasework.documents.files import INGEST_KIND
from leasework.documents.ingest import Q as INGEST_Q
from leasework.leases import lease

from ..conftest import expire_lease, get_run, make_due
from .ingest_helpers import (
    Env,
    chunks_of,
    document,
    file_row,
    ingest_only,
    pdf_bytes,
    replaced_mid_run_is_never_ready_with_stale_chunks,
    run_of,
)

# No control query or renewal inside a test's lifetime unless a test asks for one, so the only
# ownership check a "dead" worker meets is the fence of its next write.
QUIET = {"lease": 60.0, "renew_interval": 25.0, "control_interval": 20.0}


@pytest.fixture
def env(tmp_path, make_worker):
    return Env(tmp_path, make_worker, ingest_chunk_chars=64)


def test_ingest_indexes_a_text_file(conn, env):
    file_id, run_id = env.add(conn, "notes.txt", document(600))
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded", run["error"]
    chunks = chunks_of(conn, file_id)
    assert run["total_units"] == run["processed_units"] == len(chunks) > 1
    assert [c[0] for c in chunks] == list(range(len(chunks)))
    assert all(len(c[3]) <= 64 and c[2] == "p" for c in chunks)
    f = file_row(conn, file_id)
    assert (f["status"], f["chunks"]) == ("ready", len(chunks))
    assert run["result"]["truncated"] is False


def test_killed_worker_is_resumed_from_its_checkpoint(conn, env):
    text = document(8000)
    file_id, run_id = env.add(conn, "big.txt", text)

    # Worker A "dies" after committing two batches: its lease runs out while it embeds the
    # third, so that batch's fenced write is refused and A stops, writing nothing more.
    def die(call: int) -> None:
        if call == 3:
            expire_lease(conn, run_id)

    env.embedder.hook = die
    ingest_only(env.worker(**QUIET)).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "running" and run["processed_units"] == 400
    assert len(chunks_of(conn, file_id)) == 400
    total = run["total_units"]
    assert total > 1000

    env.embedder.hook = None
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["attempts"] == 2
    assert run["processed_units"] == total
    assert run["result"]["resumed_from"] == 400
    # Across both attempts at most one batch was embedded twice.
    assert env.embedder.texts <= total + 200

    # The final chunks equal a clean single-pass run of the same bytes.
    clean_id, clean_run = env.add(conn, "clean.txt", text)
    ingest_only(env.worker()).poll()
    assert get_run(conn, clean_run)["status"] == "succeeded"
    assert chunks_of(conn, file_id) == chunks_of(conn, clean_id)


def test_file_that_shrank_between_attempts_loses_its_tail(conn, env):
    env.settings["ingest_batch"] = 10
    file_id, run_id = env.add(conn, "long.txt", document(600))

    def die(call: int) -> None:
        if call == 4:
            expire_lease(conn, run_id)

    env.embedder.hook = die
    ingest_only(env.worker(**QUIET)).poll()
    assert len(chunks_of(conn, file_id)) == 30

    short = document(40, seed=3)
    assert env.docs.replace_file(conn, file_id, env.write("short.txt", short)) == run_id
    env.embedder.hook = None
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["result"]["resumed_from"] == 0  # new content: the old checkpoint is stale
    clean_id, _ = env.add(conn, "short-clean.txt", short)
    ingest_only(env.worker()).poll()
    got = chunks_of(conn, file_id)
    assert len(got) == run["total_units"] < 30
    assert got == chunks_of(conn, clean_id)

    # And after a finished index, a shorter replacement deletes the chunks past the new tail.
    env.docs.replace_file(conn, file_id, env.write("tiny.txt", "just a few words"))
    ingest_only(env.worker()).poll()
    assert [c[3] for c in chunks_of(conn, file_id)] == ["just a few words"]


def test_scope_change_mid_run_is_not_marked_ready_under_the_old_scope(conn, env):
    env.settings["ingest_batch"] = 10
    file_id, run_id = env.add(conn, "scoped.md", "# Title\n\n" + document(400), project="old")
    statuses = []

    def move(call: int) -> None:
        statuses.append(file_row(conn, file_id)["status"])
        if call == 2:
            env.docs.move_file(conn, file_id, "new")

    env.embedder.hook = move
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert "ready" not in statuses
    assert run["result"]["restarts"] == 1 and run["result"]["project"] == "new"
    f = file_row(conn, file_id)
    assert (f["status"], f["project"]) == ("ready", "new")
    chunks = chunks_of(conn, file_id)
    assert len(chunks) == run["total_units"]
    assert {c[2] for c in chunks} == {"new"}


def test_content_replaced_mid_run_is_not_marked_ready_with_stale_chunks(conn, env):
    replaced_mid_run_is_never_ready_with_stale_chunks(conn, env)


def test_cancel_mid_ingest_keeps_progress_and_writes_nothing_after(conn, env):
    env.settings["ingest_batch"] = 10
    file_id, run_id = env.add(conn, "doc.txt", document(500))

    def cancel(call: int) -> None:
        if call == 2:
            assert env.app.cancel(conn, run_id) == "running"

    env.embedder.hook = cancel
    ingest_only(env.worker(control_interval=0.0001)).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "cancelled"
    # Batch 1 committed; batch 2 was embedded when the cancel was seen and never written.
    assert run["processed_units"] == 10
    assert [c[0] for c in chunks_of(conn, file_id)] == list(range(10))
    assert env.embedder.calls == 2
    assert run["result"]["chunks"] == run["total_units"]
    assert file_row(conn, file_id)["status"] == "pending"


def test_a_stale_attempts_cancel_leaves_a_newer_attempts_file_alone(conn, env):
    env.settings["ingest_batch"] = 10
    file_id, run_id = env.add(conn, "doc.txt", document(500))
    worker = ingest_only(env.worker(control_interval=0.0001))
    newer = []

    def stall(call: int) -> None:
        if call != 2:
            return
        # Worker A sees the cancel with its own control query, while the run is still its own...
        assert env.app.cancel(conn, run_id) == "running"
        assert worker.current is not None
        worker.current.refresh()
        assert worker.current.signal.reason == "cancelled"
        # ...then stalls past its lease before its cancel path runs. Meanwhile the run is settled
        # `cancelled`, the file is indexed again, and the newer run has started on it.
        expire_lease(conn, run_id)
        lease.expire_and_promote(conn, 10)
        assert get_run(conn, run_id)["status"] == "cancelled"
        again = files.enqueue_ingest(env.docs, conn, file_id)
        [claim] = lease.claim_runs(conn, [INGEST_KIND], worker="newer", lease=60.0)
        assert claim.id == again != run_id
        with conn.transaction():
            assert lease.fence(conn, claim)
            conn.execute(INGEST_Q["start_indexing"], {"id": file_id})
        newer.append(claim)

    env.embedder.hook = stall
    worker.poll()
    [claim] = newer
    # A woke to its cancel path and wrote nothing: the file is still the newer run's.
    f = file_row(conn, file_id)
    assert (f["status"], f["error"]) == ("indexing", None)
    row = get_run(conn, claim.id)
    assert row["status"] == "running" and row["lease_owner"] == claim.owner
    assert get_run(conn, run_id)["status"] == "cancelled"


def test_a_cancel_seen_after_an_untaken_lease_ran_out_still_resets_the_file(conn, env):
    # Nobody takes a run whose cancel was requested, so a worker that sees the cancel only after
    # its lease ran out (a slow embed) still owns the run: it records the cancel, and the file
    # goes back to pending with it (a fence that wants a live lease would leave it `indexing`).
    env.settings["ingest_batch"] = 10
    file_id, run_id = env.add(conn, "doc.txt", document(500))

    def slow(call: int) -> None:
        if call == 2:
            assert env.app.cancel(conn, run_id) == "running"
            expire_lease(conn, run_id)

    env.embedder.hook = slow
    ingest_only(env.worker(control_interval=0.0001)).poll()
    assert get_run(conn, run_id)["status"] == "cancelled"
    f = file_row(conn, file_id)
    assert (f["status"], f["error"]) == ("pending", "indexing cancelled")


def test_over_the_byte_cap_fails_at_once_with_a_clear_error(conn, env):
    file_id, run_id = env.add(conn, "huge.txt", document(300))
    ingest_only(env.worker(ingest_max_bytes=1000)).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "failed" and run["attempts"] == 1
    assert "over the ingest cap of 1000 bytes" in run["error"]
    f = file_row(conn, file_id)
    assert f["status"] == "failed" and "ingest_max_bytes" in f["error"]
    assert chunks_of(conn, file_id) == []
    assert env.embedder.calls == 0


def test_over_the_chunk_cap_is_truncated_and_says_so(conn, env):
    file_id, run_id = env.add(conn, "long.txt", document(900))
    ingest_only(env.worker(ingest_max_chunks=7)).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded"
    assert run["result"]["truncated"] is True and run["result"]["truncated_by"] == "chunks"
    assert len(chunks_of(conn, file_id)) == 7 == run["total_units"]


def test_over_the_page_cap_is_truncated_and_says_so(conn, env):
    text = "\f".join(f"page {i} text" for i in range(1, 11))
    file_id, run_id = env.add(conn, "paged.txt", text)
    ingest_only(env.worker(ingest_max_pages=3)).poll()
    run = get_run(conn, run_id)
    assert run["result"]["truncated_by"] == "pages"
    assert [(c[1], c[3]) for c in chunks_of(conn, file_id)] == [
        (1, "page 1 text"),
        (2, "page 2 text"),
        (3, "page 3 text"),
    ]


def test_pdf_pages_and_image_only_pages(conn, env):
    pytest.importorskip("pypdf")
    data = pdf_bytes(["Foundation plan level one", None, "Roof framing plan"])
    file_id, run_id = env.add(conn, "set.pdf", data)
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["result"]["empty_pages"] == 1 and run["result"]["pages"] == 3
    assert [(c[1], c[3]) for c in chunks_of(conn, file_id)] == [
        (1, "Foundation plan level one"),
        (3, "Roof framing plan"),
    ]


def test_unsupported_type_fails_without_retry(conn, env):
    file_id, run_id = env.add(conn, "photo.jpeg", b"\xff\xd8\xff")
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert run["status"] == "failed" and "unsupported type" in run["error"]
    assert run["attempts"] == 1 and file_row(conn, file_id)["status"] == "failed"


def test_an_embedder_that_snoozes_on_the_last_attempt_leaves_the_file_waiting(conn, env):
    """An embedding API's rate limit: the embedder raises Snooze. The run is requeued without
    charging its (last) attempt, and the file is not marked failed: it has not failed."""
    file_id, run_id = env.add(conn, "notes.txt", document(50))
    conn.execute("UPDATE leasework.runs SET max_attempts = 1 WHERE id = %s", (run_id,))

    def limited(call: int) -> None:
        if call == 1:
            raise Snooze(after=60, reason="429 from the embedding API")

    env.embedder.hook = limited
    worker = ingest_only(env.worker())
    worker.poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"], run["snoozes"]) == ("queued", 0, 1)
    assert file_row(conn, file_id)["status"] != "failed"
    make_due(conn, run_id)
    worker.poll()
    assert get_run(conn, run_id)["status"] == "succeeded"
    assert file_row(conn, file_id)["status"] == "ready"


def test_an_embedder_that_fails_fails_the_run_and_the_file_at_once(conn, env):
    file_id, run_id = env.add(conn, "notes.txt", document(50))

    def gone(call: int) -> None:
        raise Fail("the embedding model was withdrawn")

    env.embedder.hook = gone
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"]) == ("failed", 1)
    assert run["error"] == "Fail: the embedding model was withdrawn"
    f = file_row(conn, file_id)
    assert f["status"] == "failed" and f["error"] == "Fail: the embedding model was withdrawn"


def test_runs_stage_does_not_serve_ingest(conn, env):
    _, run_id = env.add(conn, "a.txt", "hello there")
    w = env.worker()
    w.stages = [s for s in w.stages if s.name == "runs"]
    w.poll()
    assert get_run(conn, run_id)["status"] == "queued"
    assert run_of(conn, 1) == run_id


def test_an_embedder_that_cannot_be_loaded_fails_the_stage_before_any_claim(conn, env):
    """A misconfigured embedder is the stage's failure, logged at every poll; no run is claimed
    and left under a lease nobody works on."""
    _, run_id = env.add(conn, "notes.txt", document(50))
    env.docs._embedder = None  # no registered callable: the `embedder` setting is used
    ingest_only(env.worker(embedder="leasework_no_such_module:embed")).poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"], run["lease_owner"]) == ("queued", 0, None)


class UnreachableStore(LocalStore):
    """An object store that stops answering after the upload (the user's plug-in)."""

    def size(self, key):
        raise OSError("store unreachable")


def test_a_failure_between_the_claim_and_the_handler_is_recorded_not_stranded(conn, env, tmp_path):
    """The pre-check after the claim raising (a store that does not answer) goes through the
    executor like a handler's failure: the attempt is charged, the error is on the run and it is
    queued for a retry, never left `running` until its lease expires."""
    _, run_id = env.add(conn, "notes.txt", document(50))
    env.docs.use_store(UnreachableStore(env.settings["file_store"]))
    ingest_only(env.worker()).poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"]) == ("queued", 1)
    assert "store unreachable" in run["error"]
