"""The `expand` stage: ZIP uploads expanded into files, each then indexed by an ingest run.

The second claim shape (no lease): `processing_since`, reclaimed when stuck for
`expand_reclaim` seconds. An archive is checked whole before a byte is written (paths, links,
encryption, member count, total size, compression ratio); members are then written into the
file store under keys derived from the upload id and member position, and one transaction
creates every file row (keyed by upload and member path) and its ingest run, and marks the
upload done. A redo after a crash rewrites the same keys and inserts nothing twice.
"""

from __future__ import annotations

import re
import reprlib
import time
import unicodedata
import zipfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .. import log
from ..errors import LeaseworkError
from ..queries import load
from ..text import control_problem
from ..workers import idle
from ..workers.stage import Site
from .extract import kind_of
from .files import enqueue_ingest
from .settings import ExpandSettings
from .store import FileStore, StoreError, safe_name

if TYPE_CHECKING:
    from ..config import Config
    from . import Documents

Q = load("leasework.documents", "expand.sql")
Conn = psycopg.Connection[Any]

# Below this many uncompressed bytes a member's compression ratio is not held against it: small
# repetitive text compresses very well and is harmless.
RATIO_FLOOR = 1 << 20
_JUNK = re.compile(r"(^|/)(__MACOSX/|\.DS_Store$|Thumbs\.db$|desktop\.ini$)")
_S_IFMT, _S_IFREG, _S_IFDIR, _S_IFLNK = 0o170000, 0o100000, 0o040000, 0o120000
# Characters in a member's path: past Linux's PATH_MAX (4,096 bytes) nothing could extract it,
# and a name that long is an attack, not a document.
MAX_MEMBER_NAME = 1024


class ArchiveRejected(LeaseworkError):
    """A hostile, corrupt or oversized archive: the upload fails with this one message."""


@dataclass(frozen=True)
class ArchiveCaps:
    max_members: int
    max_bytes: int
    max_ratio: float

    @classmethod
    def from_config(cls, cfg: Config) -> ArchiveCaps:
        s = cfg.section(ExpandSettings)
        return cls(s.archive_max_members, s.archive_max_bytes, s.archive_max_ratio)


@dataclass(frozen=True)
class Member:
    position: int
    path: str
    size: int


def _unsafe_path(name: str) -> str | None:
    if len(name) > MAX_MEMBER_NAME:
        return f"is {len(name)} characters long, over the limit of {MAX_MEMBER_NAME}"
    if "\x00" in name:
        return "contains a NUL character"
    problem = control_problem(name)  # the rule of labels and project names (leasework.text)
    if problem is not None:
        return problem
    # Checked as given and as a consumer that normalizes names would read it (NFKC): U+2025
    # (two dot leader) becomes `..`, U+FF0F (fullwidth solidus) `/`.
    for form in dict.fromkeys((name, unicodedata.normalize("NFKC", name))):
        shown = "" if form == name else " once Unicode-normalized (NFKC)"
        # A drive letter followed by a separator is absolute on Windows; `a:notes.txt` is a
        # plain name (members are stored under keys of their own, never extracted to a path).
        if form.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[\\/]", form):
            return f"is an absolute path{shown}"
        if ".." in re.split(r"[\\/]", form):
            return f"contains '..'{shown}"
    return None


def _shown(name: str) -> str:
    """A member's name for an error line: its repr (controls escaped), cut at 80 characters."""
    r = reprlib.Repr()
    r.maxstring = 80
    return r.repr(name)


def _folded(name: str) -> str:
    """The name as a case-insensitive, normalizing file system or consumer sees it."""
    return unicodedata.normalize("NFKC", name).casefold()


def plan(infos: list[zipfile.ZipInfo], caps: ArchiveCaps) -> tuple[list[Member], list[str]]:
    """Decide from the central directory alone: the members to expand and those skipped (with
    why), or ArchiveRejected. Pure: reads no member data."""
    if len(infos) > caps.max_members:
        raise ArchiveRejected(
            f"archive has {len(infos)} members, over the cap of {caps.max_members} "
            "(archive_max_members)"
        )
    members: list[Member] = []
    skipped: list[str] = []
    seen: dict[str, str] = {}  # folded name: the member's name
    total = compressed = 0
    for position, info in enumerate(infos):
        name = info.filename
        why = _unsafe_path(name)
        if why is not None:
            raise ArchiveRejected(f"member {_shown(name)} {why}")
        if info.flag_bits & 0x1:
            raise ArchiveRejected(f"member {name!r} is encrypted")
        mode = (info.external_attr >> 16) & _S_IFMT
        if mode == _S_IFLNK:
            raise ArchiveRejected(f"member {name!r} is a symbolic link")
        if mode not in (0, _S_IFREG, _S_IFDIR):
            raise ArchiveRejected(f"member {name!r} is not a regular file")
        if info.is_dir() or mode == _S_IFDIR:
            continue
        folded = _folded(name)
        if folded in seen:
            other = seen[folded]
            raise ArchiveRejected(
                f"member {name!r} appears twice"
                if other == name
                else f"members {other!r} and {name!r} differ only in case or Unicode form: "
                "one file on a case-insensitive file system; rename one"
            )
        seen[folded] = name
        total += info.file_size
        compressed += info.compress_size
        if total > caps.max_bytes:
            raise ArchiveRejected(
                f"archive expands to more than {caps.max_bytes} bytes (archive_max_bytes)"
            )
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size > RATIO_FLOOR and ratio > caps.max_ratio:
            raise ArchiveRejected(
                f"member {name!r} is compressed {ratio:.0f} times, over the cap of "
                f"{caps.max_ratio:g} (archive_max_ratio): a zip bomb?"
            )
        if _JUNK.search(name):
            continue
        if kind_of(PurePosixPath(name).name) is None:
            skipped.append(f"{name}: unsupported type")
            continue
        members.append(Member(position, name, info.file_size))
    if total > RATIO_FLOOR and total / max(compressed, 1) > caps.max_ratio:
        raise ArchiveRejected(
            f"archive is compressed {total / max(compressed, 1):.0f} times, over the cap of "
            f"{caps.max_ratio:g} (archive_max_ratio): a zip bomb?"
        )
    return members, skipped


def member_key(upload_id: int, member: Member) -> str:
    """Deterministic, so a redo overwrites instead of adding: position makes it unique."""
    return (
        f"expanded/{upload_id}/{member.position:06d}-{safe_name(PurePosixPath(member.path).name)}"
    )


class ExpandStage:
    name = "expand"
    wakes = frozenset({"upload"})  # files.add_upload NOTIFYs it
    settings = ExpandSettings

    def __init__(self, docs: Documents, config: Config, *, limit: int | None = None) -> None:
        self.docs = docs
        self.own = config.section(ExpandSettings)
        self.limit = limit if limit is not None else self.own.expand_limit
        self.caps = ArchiveCaps.from_config(config)
        self._due: idle.Seen = None

    def step(self, site: Site) -> int:
        params = {
            "reclaim": self.own.expand_reclaim,
            "max_attempts": self.own.expand_max_attempts,
        }
        # With the stuck ones failed, when the next one would be stuck (`next_due`), in the same
        # transaction: an idle worker's turn of this stage is two commits.
        with site.conns.pooled() as conn, conn.transaction():
            handled = len(conn.execute(Q["fail_stuck_uploads"], params).fetchall())
            row = conn.execute(Q["next_stuck"], params).fetchone()
        self._due = (None if row is None or row[0] is None else float(row[0])), time.monotonic()
        for _ in range(self.limit):
            if site.stopping:
                break
            with site.conns.pooled() as conn, conn.cursor(row_factory=dict_row) as cur:
                upload = cur.execute(Q["claim_upload"], params).fetchone()
            if upload is None:
                break
            log.event("upload_claimed", upload_id=upload["id"], attempt=upload["attempts"])
            with site.conns.pooled() as conn:
                self.expand(conn, upload)
            handled += 1
        return handled

    def next_due(self, site: Site) -> float | None:
        """Seconds until an upload in `processing` is due to be claimed again (its worker may
        be dead), as the last step read it (workers/stage.py, Due)."""
        return idle.due_now(self._due, time.monotonic())

    def expand(self, conn: Conn, upload: dict[str, Any]) -> str | None:
        """Expand one claimed upload. Returns its new status, or None if it was no longer ours."""
        store = self.docs.file_store()
        uid, since = upload["id"], upload["processing_since"]
        written: list[str] = []
        try:
            with store.open(upload["store_key"]) as stream:
                try:
                    archive = zipfile.ZipFile(stream)
                except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
                    raise ArchiveRejected(f"not a readable ZIP archive: {exc}") from None
                with archive:
                    members, skipped = plan(archive.infolist(), self.caps)
                    done = {r[0] for r in conn.execute(Q["member_files"], {"id": uid})}
                    stored = {}
                    for m in members:
                        if m.path in done:
                            continue
                        stored[m.path] = self._write(store, archive, uid, m)
                        written.append(stored[m.path][0])
            return self._commit(conn, upload, members, stored, skipped)
        except ArchiveRejected as exc:
            for key in written:
                store.delete(key)
            log.event("upload_rejected", level=30, upload_id=uid, error=str(exc))
            return self._finish(conn, uid, since, "failed", error=str(exc))
        except (psycopg.Error, OSError, StoreError) as exc:
            # Worth another try: back to pending now (or left to the reclaim if even this fails).
            log.event("upload_failed", level=40, upload_id=uid, error=str(exc))
            status = (
                "failed" if upload["attempts"] >= self.own.expand_max_attempts else "pending"
            )
            return self._finish(conn, uid, since, status, error=f"{type(exc).__name__}: {exc}")

    def _write(
        self, store: FileStore, archive: zipfile.ZipFile, uid: int, m: Member
    ) -> tuple[str, int, str]:
        key = member_key(uid, m)
        try:
            with archive.open(m.path) as src:
                # zipfile stops at the declared size and checks the CRC at the end; the cap is
                # a second guard against a lying header.
                s = store.put(key, src, max_bytes=m.size)  # type: ignore[arg-type]
        except (zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError, StoreError) as exc:
            raise ArchiveRejected(f"member {m.path!r} is corrupt or unreadable: {exc}") from None
        except Exception as exc:  # zlib.error and friends from a damaged stream
            if type(exc).__module__ == "zlib":
                raise ArchiveRejected(f"member {m.path!r} is corrupt: {exc}") from None
            raise
        return s.key, s.size, s.sha256

    def _commit(
        self,
        conn: Conn,
        upload: dict[str, Any],
        members: list[Member],
        stored: dict[str, tuple[str, int, str]],
        skipped: list[str],
    ) -> str | None:
        uid, since = upload["id"], upload["processing_since"]
        created = 0
        with conn.transaction():
            if conn.execute(Q["fence_upload"], {"id": uid, "since": since}).fetchone() is None:
                log.event("upload_lost", level=30, upload_id=uid)
                return None
            for m in members:
                if m.path not in stored:
                    continue  # a file row from an earlier attempt already has it
                key, size, sha = stored[m.path]
                row = conn.execute(
                    Q["insert_member_file"],
                    {
                        "project": upload["project"],
                        "name": PurePosixPath(m.path).name,
                        "store_key": key,
                        "size": size,
                        "sha256": sha,
                        "upload_id": uid,
                        "member": m.path,
                    },
                ).fetchone()
                if row is not None:
                    enqueue_ingest(self.docs, conn, int(row[0]))
                    created += 1
            result = {"members": len(members), "files_created": created, "skipped": skipped}
            status = self._finish(conn, uid, since, "done", result=result)
        log.event("upload_expanded", upload_id=uid, files=created, skipped=len(skipped))
        return status

    @staticmethod
    def _finish(
        conn: Conn,
        uid: int,
        since: datetime,
        status: str,
        *,
        result: Any = None,
        error: str | None = None,
    ) -> str | None:
        row = conn.execute(
            Q["finish_upload"],
            {
                "id": uid,
                "since": since,
                "status": status,
                "result": None if result is None else Jsonb(result),
                "error": error,
            },
        ).fetchone()
        return status if row is not None else None
