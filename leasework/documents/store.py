"""Where file bytes live: a small interface (`FileStore`) and the local-directory store.

Keys are relative POSIX paths chosen by leasework; a store never lets a key escape its root
(no `..`, no absolute paths, no links followed out). Never touches the database.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol

from ..errors import LeaseworkError

_COPY_BLOCK = 1 << 20
_SAFE = re.compile(r"[^A-Za-z0-9._ +@=-]+")


class StoreError(LeaseworkError):
    """A key that would escape the store, or bytes that cannot be read or written."""


@dataclass(frozen=True)
class Stored:
    key: str
    size: int
    sha256: str


class FileStore(Protocol):
    """What the ingest and expand stages need from a store. An object store implements the same
    four methods (put streams in, open streams out)."""

    def put(self, key: str, src: BinaryIO, *, max_bytes: int | None = None) -> Stored:
        """Write `src` under `key` atomically (replacing any previous bytes); returns size and
        sha256. Raises StoreError, writing nothing, if more than `max_bytes` arrive."""
        ...

    def open(self, key: str) -> AbstractContextManager[BinaryIO]:
        """The bytes under `key`, as a binary stream (seekable for the local store)."""
        ...

    def size(self, key: str) -> int | None:
        """Size in bytes, or None when nothing is stored under `key`."""
        ...

    def delete(self, key: str) -> None:
        """Remove `key` if present."""
        ...


def check_key(key: str) -> PurePosixPath:
    """A key is a relative POSIX path of plain components: no `..`, `.`, empty parts, absolute
    paths, backslashes or NULs."""
    if not key or "\\" in key or "\x00" in key or key.startswith("/"):
        raise StoreError(f"store key {key!r} is not a relative path")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"store key {key!r} has an empty, '.' or '..' component")
    return PurePosixPath(key)


def safe_name(name: str, limit: int = 120) -> str:
    """One path component from a user-supplied name (kept readable, never a separator)."""
    base = _SAFE.sub("_", name.replace("/", "_").replace("\\", "_")).strip(" .") or "file"
    return base[-limit:]


def new_key(prefix: str, name: str) -> str:
    """A fresh key for a file that is being added: `prefix/<uuid>/<name>`."""
    return f"{prefix}/{uuid.uuid4().hex}/{safe_name(name)}"


class LocalStore:
    """Files under one directory. Writes go to a temporary file beside the target and are
    renamed into place, so a reader never sees half a file and a redo simply replaces it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def path(self, key: str) -> Path:
        rel = check_key(key)
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root):
            raise StoreError(f"store key {key!r} resolves outside the store")
        return path

    def put(self, key: str, src: BinaryIO, *, max_bytes: int | None = None) -> Stored:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.resolve().is_relative_to(self.root):
            raise StoreError(f"store key {key!r} resolves outside the store")
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        digest = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "xb") as out:
                while True:
                    block = src.read(_COPY_BLOCK)
                    if not block:
                        break
                    size += len(block)
                    if max_bytes is not None and size > max_bytes:
                        raise StoreError(f"{key}: more than {max_bytes} bytes")
                    digest.update(block)
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        return Stored(key, size, digest.hexdigest())

    @contextmanager
    def open(self, key: str) -> Iterator[BinaryIO]:
        try:
            f = open(self.path(key), "rb")  # noqa: SIM115 (closed by the context manager)
        except FileNotFoundError:
            raise StoreError(f"nothing is stored under {key!r}") from None
        with f:
            yield f

    def size(self, key: str) -> int | None:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        path = self.path(key)
        with suppress(FileNotFoundError):
            path.unlink()
        # Remove the per-file directory a fresh key made, if it is now empty.
        with suppress(OSError):
            if path.parent != self.root:
                path.parent.rmdir()
