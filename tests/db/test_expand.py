"""The expand stage on real Postgres: a real archive expanded and indexed, a stuck upload
reclaimed after the timeout (moved columns, no sleeping), hostile archives refused whole."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from leasework.documents.expand import ExpandStage
from leasework.documents.ingest import IngestStage

from .ingest_helpers import Env, document


@pytest.fixture
def env(tmp_path, make_worker):
    return Env(tmp_path, make_worker, ingest_chunk_chars=200)


def only(worker, *kinds):
    worker.stages = [s for s in worker.stages if isinstance(s, kinds)]
    return worker


def make_zip(entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info, data in entries:
            z.writestr(info, data)
    return buf.getvalue()


def upload_row(conn, upload_id):
    with conn.cursor(row_factory=__import__("psycopg").rows.dict_row) as cur:
        return cur.execute("SELECT * FROM leasework.uploads WHERE id = %s", (upload_id,)).fetchone()


def store_files(env: Env) -> set[str]:
    root = Path(env.settings["file_store"])
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def all_files(tmp: Path) -> set[str]:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()}


def test_archive_is_expanded_and_every_member_indexed(conn, env):
    data = make_zip(
        [
            ("specs/concrete.md", ("# Concrete\n\n" + document(300)).encode()),
            ("specs/steel.txt", document(200, seed=1).encode()),
            ("notes/readme.txt", b"short note"),
            ("images/photo.png", b"\x89PNG...."),
            ("__MACOSX/._junk", b"junk"),
            ("emptydir/", b""),
        ]
    )
    upload_id = env.docs.add_upload(conn, project="site", path=env.write("docs.zip", data))
    w = env.worker()
    only(w, ExpandStage).poll()
    up = upload_row(conn, upload_id)
    assert up["status"] == "done", up["error"]
    assert up["result"]["files_created"] == 3
    assert up["result"]["skipped"] == ["images/photo.png: unsupported type"]
    rows = conn.execute(
        "SELECT member, project, status FROM leasework.files WHERE upload_id = %s ORDER BY member",
        (upload_id,),
    ).fetchall()
    assert [r[0] for r in rows] == ["notes/readme.txt", "specs/concrete.md", "specs/steel.txt"]
    assert {r[1] for r in rows} == {"site"}
    only(env.worker(ingest_limit=10), IngestStage).poll()
    statuses = conn.execute(
        "SELECT f.status, r.status FROM leasework.files f JOIN leasework.runs r ON r.key = 'leasework:file:' || f.id"
    ).fetchall()
    assert statuses == [("ready", "succeeded")] * 3
    n = conn.execute("SELECT count(*) FROM leasework.chunks WHERE project = 'site'").fetchone()[0]
    assert n > 3

    # A redo of the same upload (as after a crash just before it was marked done) is harmless.
    conn.execute(
        "UPDATE leasework.uploads SET status = 'pending', processing_since = NULL WHERE id = %s",
        (upload_id,),
    )
    only(env.worker(), ExpandStage).poll()
    assert upload_row(conn, upload_id)["result"]["files_created"] == 0
    assert conn.execute("SELECT count(*) FROM leasework.files").fetchone()[0] == 3
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone()[0] == 3


def test_stuck_upload_is_reclaimed_only_after_the_timeout(conn, env):
    upload_id = env.docs.add_upload(
        conn, project="p", path=env.write("a.zip", make_zip([("a.txt", b"hello")]))
    )
    # A worker claimed it and died: processing for 5 minutes is not stuck yet...
    conn.execute(
        "UPDATE leasework.uploads SET status = 'processing', attempts = 1,"
        " processing_since = leasework.now() - interval '5 minutes' WHERE id = %s",
        (upload_id,),
    )
    only(env.worker(), ExpandStage).poll()
    assert upload_row(conn, upload_id)["status"] == "processing"
    # ...but past the 15-minute reclaim it is claimed again and finished.
    conn.execute(
        "UPDATE leasework.uploads SET processing_since = leasework.now() - interval '16 minutes'"
        " WHERE id = %s",
        (upload_id,),
    )
    only(env.worker(), ExpandStage).poll()
    up = upload_row(conn, upload_id)
    assert (up["status"], up["attempts"]) == ("done", 2)
    # The dead worker's late finish (scoped by its processing_since) matches nothing.
    stale = conn.execute(
        "UPDATE leasework.uploads SET status = 'failed' WHERE id = %s AND processing_since"
        " = leasework.now() - interval '16 minutes' RETURNING id",
        (upload_id,),
    ).fetchone()
    assert stale is None


def test_upload_stuck_on_its_last_attempt_fails(conn, env):
    upload_id = env.docs.add_upload(
        conn, project="p", path=env.write("a.zip", make_zip([("a.txt", b"hello")]))
    )
    conn.execute(
        "UPDATE leasework.uploads SET status = 'processing', attempts = 3,"
        " processing_since = leasework.now() - interval '1 hour' WHERE id = %s",
        (upload_id,),
    )
    only(env.worker(), ExpandStage).poll()
    up = upload_row(conn, upload_id)
    assert up["status"] == "failed" and "3 attempts" in up["error"]


def _link() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("link.txt")
    info.external_attr = 0o120777 << 16
    return info


def _encrypted(data: bytes) -> bytes:
    """Set the 'encrypted' flag bit in the local and central headers."""
    out = bytearray(data)
    for sig, off in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        i = out.find(sig)
        out[i + off] |= 0x01
    return bytes(out)


def _corrupt_crc(data: bytes) -> bytes:
    out = bytearray(data)
    i = out.find(b"PK\x03\x04")
    name_len = int.from_bytes(out[i + 26 : i + 28], "little")
    extra_len = int.from_bytes(out[i + 28 : i + 30], "little")
    start = i + 30 + name_len + extra_len
    out[start + 5] ^= 0xFF  # damage the compressed data of the first member
    return bytes(out)


HOSTILE = {
    "dotdot": (lambda: make_zip([("ok.txt", b"fine"), ("../evil.txt", b"x")]), "contains '..'"),
    "absolute": (lambda: make_zip([("/etc/evil.txt", b"x")]), "is an absolute path"),
    "lookalike_dotdot": (
        lambda: make_zip([("ok.txt", b"fine"), ("\u2025/evil.txt", b"x")]),
        "contains '..' once Unicode-normalized (NFKC)",
    ),
    "bidi_name": (
        lambda: make_zip([("ok.txt", b"fine"), ("\u202etxt.exe", b"x")]),
        "contains control characters (U+202E;",
    ),
    "long_name": (
        lambda: make_zip([("ok.txt", b"fine"), ("a" * 60_000 + ".txt", b"x")]),
        "is 60004 characters long, over the limit of 1024",
    ),
    "case_collision": (
        lambda: make_zip([("A.txt", b"one"), ("a.txt", b"two")]),
        "members 'A.txt' and 'a.txt' differ only in case or Unicode form",
    ),
    "link": (lambda: make_zip([(_link(), b"/etc/passwd")]), "is a symbolic link"),
    "too_many": (
        lambda: make_zip([(f"f{i}.txt", b"x") for i in range(6)]),
        "over the cap of 5 (archive_max_members)",
    ),
    "too_big": (
        lambda: make_zip([("a.txt", document(3000).encode())]),
        "(archive_max_bytes)",
    ),
    "bomb": (lambda: make_zip([("zeros.txt", b"0" * (4 << 20))]), "zip bomb"),
    "encrypted": (lambda: _encrypted(make_zip([("secret.txt", b"secret text")])), "encrypted"),
    "not_zip": (lambda: b"this is not an archive at all", "not a readable ZIP archive"),
    "corrupt_member": (
        lambda: _corrupt_crc(make_zip([("a.txt", document(2000).encode()), ("b.txt", b"ok")])),
        "corrupt",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_fails_clearly_and_writes_nothing(conn, env, case):
    build, message = HOSTILE[case]
    caps = {"too_many": {"archive_max_members": 5}, "too_big": {"archive_max_bytes": 10_000}}
    before = all_files(env.tmp)
    upload_id = env.docs.add_upload(conn, project="p", path=env.write(f"{case}.zip", build()))
    archive_files = store_files(env)
    only(env.worker(**caps.get(case, {})), ExpandStage).poll()
    up = upload_row(conn, upload_id)
    assert up["status"] == "failed"
    assert message in up["error"], up["error"]
    assert store_files(env) == archive_files  # nothing expanded into the store
    new = all_files(env.tmp) - before - {f"{case}.zip"}
    assert new == {f"store/{k}" for k in archive_files}  # and nothing anywhere else
    assert conn.execute("SELECT count(*) FROM leasework.files").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone()[0] == 0
