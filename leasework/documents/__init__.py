"""The documents family: files and ZIP uploads kept in a file store, expanded (`expand` stage)
and indexed into chunks and vectors by resumable, checkpointed `ingest` runs (`ingest` stage).
Opt in with `docs = app.use(Documents())`; `docs` is then the family's API (add_file,
add_upload, replace_file, move_file, embedder, use_store). Nothing in the engine imports this
package."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import psycopg

from ..app import App, Family
from ..config import Config
from ..stages.maintenance import Pruner
from ..stages.maintenance import settings as maintenance
from ..workers.stage import Stage
from . import files
from .embed import Embedder, HashingEmbedder, load_embedder
from .expand import ExpandStage
from .ingest import IngestStage, ingest_task
from .settings import DocumentSettings, ExpandSettings, IngestSettings
from .store import FileStore, LocalStore

Conn = psycopg.Connection[Any]
E = TypeVar("E", bound=Embedder)

__all__ = [
    "DocumentSettings",
    "Documents",
    "Embedder",
    "ExpandSettings",
    "FileStore",
    "IngestSettings",
    "LocalStore",
]


class Documents(Family):
    """The family: installed on one app with `app.use(Documents())`."""

    name = "documents"
    config_sections = (DocumentSettings, IngestSettings, ExpandSettings)

    def __init__(self) -> None:
        self._embedder: Embedder | None = None
        self._store: FileStore | None = None

    @property
    def settings(self) -> DocumentSettings:
        return self.config.section(DocumentSettings)

    # -- the family's side of the app ---------------------------------------------------------

    def install(self, app: App) -> None:
        app.register(ingest_task())

    def stages(self, config: Config) -> list[Stage]:
        return [IngestStage(self, config), ExpandStage(self, config)]

    def check_start(self, config: Config) -> None:
        """An `embedder` setting that cannot be loaded is refused when workers start, rather
        than failing the ingest stage at every poll. One registered with `@app.embedder` wins,
        and then the setting is not used."""
        spec = config.section(DocumentSettings).embedder
        if self._embedder is None and spec:
            load_embedder(spec, where=config.origin("embedder"))

    def pruners(self) -> list[Pruner]:
        return [
            Pruner("prune_uploads", lambda c: maintenance(c).prune_interval, self._prune_uploads),
            Pruner(
                "reconcile_files",
                lambda c: c.section(DocumentSettings).reconcile_interval,
                self._reconcile_files,
            ),
        ]

    def _prune_uploads(self, conn: Conn, config: Config, limit: int) -> int:
        """Finished uploads past retention: the archive's bytes, then the row (the files
        expanded from it stay; their upload_id becomes NULL)."""
        rows = conn.execute(
            files.Q["old_uploads"], {"retention": config.section(DocumentSettings).retention_uploads, "limit": limit}
        ).fetchall()
        if not rows:
            return 0
        store = self.file_store()
        for _, key in rows:
            store.delete(key)
        ids = [r[0] for r in rows]
        return len(conn.execute(files.Q["delete_uploads"], {"ids": ids}).fetchall())

    def _reconcile_files(self, conn: Conn, config: Config, limit: int) -> int:
        """Files stuck `indexing` after their ingest run ended without its handler."""
        return len(conn.execute(files.Q["reconcile_files"], {"limit": limit}).fetchall())

    # -- the API ------------------------------------------------------------------------------

    def embedder(self, fn: E) -> E:
        """Register the embedding callable (texts -> one vector each) the ingest stage uses
        instead of the `embedder` setting or the built-in feature-hashing embedder."""
        self._embedder = fn
        return fn

    def get_embedder(self) -> Embedder:
        if self._embedder is not None:
            return self._embedder
        if self.settings.embedder:
            return load_embedder(self.settings.embedder)
        return HashingEmbedder(self.settings.embedding_dim)

    def use_store(self, store: FileStore) -> None:
        """Keep file bytes in `store` (e.g. an object store) instead of the local directory."""
        self._store = store

    def file_store(self) -> FileStore:
        return self._store if self._store is not None else LocalStore(self.settings.file_store)

    def add_file(self, conn: Conn, *, project: str, path: str | os.PathLike[str]) -> int:
        """Copy a document into the file store and enqueue its ingest run (in the caller's
        transaction). Returns the file id."""
        return files.add_file(self, conn, project=project, path=path)[0]

    def add_upload(self, conn: Conn, *, project: str, path: str | os.PathLike[str]) -> int:
        """Copy a ZIP archive into the file store for the expand stage. Returns the upload id."""
        return files.add_upload(self, conn, project=project, path=path)

    def replace_file(self, conn: Conn, file_id: int, path: str | os.PathLike[str]) -> int:
        """New bytes for a file; it is indexed again from the start. Returns the run id."""
        return files.replace_file(self, conn, file_id, path)

    def move_file(self, conn: Conn, file_id: int, project: str) -> None:
        """Move a file and its chunks to another project (scope)."""
        files.move_file(conn, file_id, project)
