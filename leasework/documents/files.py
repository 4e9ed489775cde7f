"""Adding documents: copy the bytes into the file store, then record the file or upload and
enqueue its work in the caller's transaction (the job and its effects commit together).

Bytes are written before the row, so a rolled-back transaction can leave unreferenced bytes in
the store but never a row pointing at missing bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from ..errors import ConfigError
from ..queries import load
from .store import FileStore, new_key

if TYPE_CHECKING:
    from . import Documents

Q = load("leasework.documents", "files.sql")
Conn = psycopg.Connection[Any]

INGEST_KIND = "ingest"


def file_key(file_id: int) -> str:
    """The run key of a file's ingest runs: at most one active per file."""
    return f"file:{file_id}"


def _project(project: object) -> str:
    if not isinstance(project, str) or not project.strip() or len(project) > 200:
        raise ConfigError(
            f"project must be a non-empty string of at most 200 characters, got {project!r}"
        )
    return project


def _source(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such file")
    return p


def _put(store: FileStore, prefix: str, source: Path) -> tuple[str, int, str]:
    key = new_key(prefix, source.name)
    with open(source, "rb") as src:
        stored = store.put(key, src)
    return stored.key, stored.size, stored.sha256


def enqueue_ingest(docs: Documents, conn: Conn, file_id: int) -> int:
    return docs.enqueue(conn, INGEST_KIND, {"file_id": file_id}, key=file_key(file_id))


def add_file(
    docs: Documents,
    conn: Conn,
    *,
    project: str,
    path: str | os.PathLike[str],
    name: str | None = None,
) -> tuple[int, int]:
    """Store a document and enqueue its ingest run. Returns (file id, run id)."""
    project = _project(project)
    source = _source(path)
    key, size, sha = _put(docs.file_store(), "files", source)
    with conn.transaction():
        row = conn.execute(
            Q["insert_file"],
            {
                "project": project,
                "name": name or source.name,
                "store_key": key,
                "size": size,
                "sha256": sha,
            },
        ).fetchone()
        assert row is not None
        file_id = int(row[0])
        run_id = enqueue_ingest(docs, conn, file_id)
    return file_id, run_id


def add_upload(
    docs: Documents,
    conn: Conn,
    *,
    project: str,
    path: str | os.PathLike[str],
    name: str | None = None,
) -> int:
    """Store a ZIP archive for the expand stage. Returns the upload id."""
    project = _project(project)
    source = _source(path)
    key, size, _ = _put(docs.file_store(), "uploads", source)
    with conn.transaction():
        row = conn.execute(
            Q["insert_upload"],
            {"project": project, "name": name or source.name, "store_key": key, "size": size},
        ).fetchone()
        assert row is not None
        conn.execute(Q["notify_upload"])
    return int(row[0])


def replace_file(docs: Documents, conn: Conn, file_id: int, path: str | os.PathLike[str]) -> int:
    """New bytes for a file; enqueues (or joins) its ingest run, which starts over because the
    content changed. Returns the run id."""
    source = _source(path)
    store = docs.file_store()
    key, size, sha = _put(store, "files", source)
    with conn.transaction():
        row = conn.execute(
            Q["replace_file_bytes"],
            {"id": file_id, "store_key": key, "size": size, "sha256": sha},
        ).fetchone()
        if row is None:
            raise ConfigError(f"no file with id {file_id}")
        run_id = enqueue_ingest(docs, conn, file_id)
    # Only once committed (not inside a caller's open transaction, which could still roll
    # back): a run still reading the old bytes fails its attempt and is retried on the new ones.
    if row[0] != key and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        store.delete(str(row[0]))
    return run_id


def move_file(conn: Conn, file_id: int, project: str) -> None:
    """Move a file (and its chunks) to another project."""
    project = _project(project)
    with conn.transaction():
        if conn.execute(Q["file_exists"], {"id": file_id}).fetchone() is None:
            raise ConfigError(f"no file with id {file_id}")
        conn.execute(Q["move_file"], {"id": file_id, "project": project})
