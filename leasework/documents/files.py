"""Adding documents: copy the bytes into the file store, then record the file or upload and
enqueue its work in the caller's transaction (the job and its effects commit together).

Bytes are written before the row, so a rolled-back transaction can leave unreferenced bytes in
the store but never a row pointing at missing bytes.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from ..errors import ConfigError
from ..queries import load
from ..tasks import RESERVED_KEY_PREFIX
from ..text import control_problem
from .settings import ExpandSettings, IngestSettings
from .store import FileStore, StoreError, new_key

if TYPE_CHECKING:
    from . import Documents

Q = load("leasework.documents", "files.sql")
Conn = psycopg.Connection[Any]

INGEST_KIND = "ingest"


def file_key(file_id: int) -> str:
    """The run key of a file's ingest runs: at most one active per file. Under the reserved
    prefix: no application enqueue can take it."""
    return f"{RESERVED_KEY_PREFIX}file:{file_id}"


def _project(project: object) -> str:
    if not isinstance(project, str) or not project.strip() or len(project) > 200:
        raise ConfigError(
            "project must be a non-empty string of at most 200 characters, got "
            f"{reprlib.repr(project)}"
        )
    problem = control_problem(project)  # the rule of labels (leasework.text)
    if problem is not None:
        raise ConfigError(f"project {reprlib.repr(project)} {problem}")
    return project


_KINDS = {
    stat.S_ISDIR: "is a directory, not a file",
    stat.S_ISFIFO: "is a FIFO, not a regular file",
    stat.S_ISCHR: "is a device, not a regular file",
    stat.S_ISBLK: "is a device, not a regular file",
    stat.S_ISSOCK: "is a socket, not a regular file",
}


def _source(path: str | os.PathLike[str], max_bytes: int, setting: str) -> Path:
    """`path` if it is a regular file of at most `max_bytes`, checked before anything is copied;
    else ConfigError with the real reason."""
    p = Path(path)
    shown = reprlib.repr(str(p))
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot be read: {exc.strerror}") from None
    for test, why in _KINDS.items():
        if test(st.st_mode):
            raise ConfigError(f"{shown} {why}")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{shown} is not a regular file")
    if st.st_size > max_bytes:
        raise ConfigError(
            f"{shown} is {st.st_size} bytes, over {setting} ({max_bytes} bytes): nothing was stored"
        )
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{shown}: cannot be read: permission denied")
    return p


def _put(store: FileStore, prefix: str, source: Path, max_bytes: int) -> tuple[str, int, str]:
    key = new_key(prefix, source.name)
    try:
        with open(source, "rb") as src:
            stored = store.put(key, src, max_bytes=max_bytes)  # a file that grew meanwhile
    except StoreError as exc:
        raise ConfigError(f"{reprlib.repr(str(source))}: {exc}: nothing was stored") from None
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
    cap = docs.config.section(IngestSettings).ingest_max_bytes
    source = _source(path, cap, "ingest_max_bytes")
    key, size, sha = _put(docs.file_store(), "files", source, cap)
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
    cap = docs.config.section(ExpandSettings).archive_max_bytes
    source = _source(path, cap, "archive_max_bytes")
    key, size, _ = _put(docs.file_store(), "uploads", source, cap)
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
    cap = docs.config.section(IngestSettings).ingest_max_bytes
    source = _source(path, cap, "ingest_max_bytes")
    store = docs.file_store()
    key, size, sha = _put(store, "files", source, cap)
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
