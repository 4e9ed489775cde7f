"""The `ingest` stage: resumable, checkpointed indexing of one file per `ingest` run.

1. Claim the next ingest run that is queued, or running with an expired lease (the shared claim
   in the lease module); a reclaimed run keeps its processed_units.
2. Extract page by page and chunk deterministically, so a reclaimed run rebuilds the identical
   ordered list. Pass one only counts; pass two embeds. Neither holds the document in memory.
3. Record total_units and start at processed_units, skipping what an earlier attempt embedded.
4. Per batch of `ingest_batch` chunks: check control, embed, then upsert the batch and write the
   new processed_units in one fenced transaction (which also renews the lease).
5. Delete chunks past the new tail, re-check the file's project and content under a row lock,
   and only then mark it `ready`; if either changed, start over under the new scope.

Never writes lease columns itself: the claim, checkpoint and outcome go through the lease module
and the executor (workers/executor.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row

from .. import log
from ..errors import Aborted, Fail, LeaseLost, LeaseworkError, Snooze
from ..leases import lease
from ..leases.lease import Claim
from ..queries import load
from ..tasks import Task
from ..workers import idle
from ..workers.context import Context
from ..workers.stage import Site
from . import chunking, extract
from .chunking import Chunk
from .embed import Embedder, embed_batch
from .files import INGEST_KIND
from .settings import IngestSettings
from .store import FileStore

if TYPE_CHECKING:
    from ..config import Config
    from . import Documents

Q = load("leasework.documents", "ingest.sql")
Conn = psycopg.Connection[Any]

CHECK_EVERY = 256  # chunks between ctx.check() calls in the passes that do not write
MAX_RESTARTS = 3  # scope or content changes seen at the end of one attempt before giving up


def ingest_task() -> Task:
    """The built-in `ingest` kind, executed by this stage (never by the runs stage)."""
    return Task(INGEST_KIND, _runs_stage_guard, stage="ingest", family="documents")


def _runs_stage_guard(ctx: Context, payload: Any) -> Any:
    raise LeaseworkError("ingest runs are executed by the ingest stage, not as a plain task")


class FileGone(LeaseworkError):
    """The file row of an ingest run no longer exists."""


@dataclass(frozen=True)
class Caps:
    batch: int
    chunk_chars: int
    max_bytes: int
    max_pages: int
    max_chunks: int

    @classmethod
    def from_config(cls, cfg: Config) -> Caps:
        s = cfg.section(IngestSettings)
        return cls(
            batch=s.ingest_batch,
            chunk_chars=s.ingest_chunk_chars,
            max_bytes=s.ingest_max_bytes,
            max_pages=s.ingest_max_pages,
            max_chunks=s.ingest_max_chunks,
        )


@dataclass
class Count:
    """What the counting pass learned."""

    total: int = 0
    stats: extract.PageStats = field(default_factory=extract.PageStats)
    chunk_capped: bool = False

    @property
    def truncated_by(self) -> str | None:
        if self.chunk_capped:
            return "chunks"
        return "pages" if self.stats.truncated else None


@contextmanager
def open_chunks(
    store: FileStore, key: str, kind: extract.Kind, caps: Caps, stats: extract.PageStats
) -> Iterator[Iterator[Chunk]]:
    """The document's ordered chunks, streamed from the store (at most max_chunks + 1, so the
    counting pass can tell that the cap cut it)."""
    with store.open(key) as stream:
        pieces = extract.pages(stream, kind, max_pages=caps.max_pages, stats=stats)
        chunks = chunking.chunks(pieces, caps.chunk_chars, keep=extract.word_filter(kind))
        yield islice(chunks, caps.max_chunks + 1)


def count_chunks(
    store: FileStore, key: str, kind: extract.Kind, caps: Caps, check: Any = None
) -> Count:
    """Pass one: how many chunks the document gives, within the caps."""
    count = Count()
    with open_chunks(store, key, kind, caps, count.stats) as chunks:
        for n, _ in enumerate(chunks, start=1):
            count.total = n
            if check is not None and n % CHECK_EVERY == 0:
                check()
    if count.total > caps.max_chunks:
        count.total = caps.max_chunks
        count.chunk_capped = True
    return count


def precheck(file: dict[str, Any] | None, store: FileStore, caps: Caps) -> str | None:
    """Why a file cannot be indexed at all (permanent: no attempt would do better), or None."""
    if file is None:
        return "the file no longer exists"
    name = file["name"]
    kind = extract.kind_of(name)
    if kind is None:
        return f"file {name!r}: unsupported type (text, Markdown and PDF are supported)"
    if kind == "pdf" and not extract.pdf_available():
        return f"file {name!r}: PDF support needs pypdf (the pdf extra): pip install 'pypdf>=4'"
    size = store.size(file["store_key"])
    if size is None:
        return f"file {name!r}: its bytes are missing from the file store ({file['store_key']})"
    size = max(size, int(file["size"]))
    if size > caps.max_bytes:
        return (
            f"file {name!r} is {size} bytes, over the ingest cap of {caps.max_bytes} bytes "
            "(ingest_max_bytes)"
        )
    return None


def _file_id(payload: Any) -> int:
    value = payload.get("file_id") if isinstance(payload, dict) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FileGone(f"ingest payload needs an integer file_id, got {payload!r}")
    return value


class Indexer:
    """The handler of one ingest run (called by `Worker.execute`)."""

    def __init__(self, store: FileStore, embedder: Embedder, caps: Caps) -> None:
        self.store = store
        self.embedder = embedder
        self.caps = caps

    def __call__(self, ctx: Context, payload: Any) -> dict[str, Any]:
        file_id = _file_id(payload)
        try:
            return self._index(ctx, file_id)
        except Aborted as exc:
            if exc.reason == "cancelled":
                self._mark(ctx, file_id, "pending", "indexing cancelled")
            raise
        except (LeaseLost, Snooze):
            # A snooze (an embedder's rate limit, say) requeues the run without charging the
            # attempt, even on the last one: the file waits, it has not failed.
            raise
        except Exception as exc:
            # A Fail ends the run `failed` whatever attempts are left: so does the file.
            if (ctx.claim.last_attempt or isinstance(exc, Fail)) and not ctx.signal.tripped:
                why = f"Fail: {exc.reason}" if isinstance(exc, Fail) else f"{type(exc).__name__}: {exc}"
                self._mark(ctx, file_id, "failed", why)
            raise

    def _mark(self, ctx: Context, file_id: int, status: str, error: str) -> None:
        """The file's side of the run's outcome, written only while the run is still ours (see
        mark_file_if_ours): a stalled worker never resets a file a newer run is indexing."""
        params = {
            "id": file_id,
            "status": status,
            "error": error[:2000],
            "run_id": ctx.claim.id,
            "owner": ctx.claim.owner,
        }
        try:
            with ctx.connection() as conn:
                marked = conn.execute(Q["mark_file_if_ours"], params).fetchone()
        except psycopg.Error as exc:
            log.event("file_mark_failed", level=30, file_id=file_id, error=log.first_line(exc))
            return
        if marked is not None and not marked[0]:
            log.event(
                "lease_lost",
                run_id=ctx.claim.id,
                owner=str(ctx.claim.owner),
                action="file not marked",
            )

    def _index(self, ctx: Context, file_id: int) -> dict[str, Any]:
        restarts = 0
        embedded = 0
        while True:
            with ctx.transaction() as tx, tx.cursor(row_factory=dict_row) as cur:
                f = cur.execute(Q["start_indexing"], {"id": file_id}).fetchone()
                if f is None:
                    raise FileGone(f"file {file_id} no longer exists")
                changed = f["previous_sha256"] is not None and f["previous_sha256"] != f["sha256"]
                if changed and ctx.processed:
                    ctx.checkpoint(0)  # the content changed since that checkpoint: start over
            scope, sha = f["project"], f["sha256"]
            kind = extract.kind_of(f["name"]) or "text"

            count = count_chunks(self.store, f["store_key"], kind, self.caps, ctx.check)
            total = count.total
            ctx.set_total(total)
            start = min(ctx.processed, total)
            result: dict[str, Any] = {
                "file_id": file_id,
                "project": scope,
                "chunks": total,
                "pages": count.stats.pages,
                "empty_pages": count.stats.empty_pages,
                "truncated": count.truncated_by is not None,
                "truncated_by": count.truncated_by,
                "resumed_from": start,
                "restarts": restarts,
            }
            ctx.result = {**result, "embedded": embedded}
            embedded += self._embed_from(ctx, file_id, scope, kind, f["store_key"], start, total)
            ctx.result = {**result, "embedded": embedded}

            ctx.check()
            with ctx.transaction() as tx:
                tx.execute(Q["delete_tail_chunks"], {"id": file_id, "total": total})
                now = tx.execute(Q["lock_file"], {"id": file_id}).fetchone()
                if now is None:
                    raise FileGone(f"file {file_id} was deleted while it was being indexed")
                if (now[0], now[1]) == (scope, sha):
                    tx.execute(
                        Q["mark_ready"],
                        {"id": file_id, "chunks": total, "project": scope, "sha256": sha},
                    )
                    ctx.checkpoint(total, total)
                    log.event("file_indexed", file_id=file_id, chunks=total, embedded=embedded)
                    return {**result, "embedded": embedded}
                # Moved to another project or given new content mid-run: never `ready` under
                # the old scope. Start over from a clean slate under the new one.
                tx.execute(Q["delete_file_chunks"], {"id": file_id})
                ctx.checkpoint(0)
            restarts += 1
            log.event("ingest_restarted", file_id=file_id, old_project=scope, project=now[0])
            if restarts > MAX_RESTARTS:
                raise LeaseworkError(f"file {file_id} kept changing while it was indexed")

    def _embed_from(
        self,
        ctx: Context,
        file_id: int,
        scope: str,
        kind: extract.Kind,
        key: str,
        start: int,
        total: int,
    ) -> int:
        """Pass two: embed chunks [start, total) in batches, one fenced commit per batch."""
        embedded = 0
        batch: list[Chunk] = []
        stats = extract.PageStats()
        with open_chunks(self.store, key, kind, self.caps, stats) as chunks:
            for chunk in islice(chunks, total):
                if chunk.index < start:
                    if chunk.index % CHECK_EVERY == 0:
                        ctx.check()
                    continue
                batch.append(chunk)
                if len(batch) == self.caps.batch:
                    embedded += self._flush(ctx, file_id, scope, batch)
                    batch = []
        if batch:
            embedded += self._flush(ctx, file_id, scope, batch)
        return embedded

    def _flush(self, ctx: Context, file_id: int, scope: str, batch: list[Chunk]) -> int:
        ctx.check()
        vectors = embed_batch(self.embedder, [c.text for c in batch])
        ctx.check()  # embedding is the slow part: a cancel seen now writes nothing
        rows = [
            {
                "file_id": file_id,
                "idx": c.index,
                "project": scope,
                "page": c.page,
                "text": c.text,
                "embedding": v,
            }
            for c, v in zip(batch, vectors, strict=True)
        ]
        with ctx.transaction() as tx, tx.cursor() as cur:
            cur.executemany(Q["upsert_chunks"], rows)
            ctx.checkpoint(batch[-1].index + 1)
        return len(batch)


def _raising(exc: Exception) -> Callable[[Context, Any], Any]:
    def handler(ctx: Context, payload: Any) -> Any:
        raise exc

    return handler


class IngestStage:
    """Claims `ingest` runs (one at a time, up to `limit` per poll) and runs the Indexer."""

    name = "ingest"
    wakes = frozenset({INGEST_KIND})
    settings = IngestSettings

    def __init__(self, docs: Documents, config: Config, *, limit: int | None = None) -> None:
        self.docs = docs
        self.config = config
        self.limit = limit if limit is not None else config.section(IngestSettings).ingest_limit
        self.caps = Caps.from_config(config)
        self._indexer: Indexer | None = None
        self._due: idle.Seen = None

    def indexer(self) -> Indexer:
        if self._indexer is None:
            self._indexer = Indexer(self.docs.file_store(), self.docs.get_embedder(), self.caps)
        return self._indexer

    def step(self, site: Site) -> int:
        handled = 0
        self._due = None
        if not site.claimable([INGEST_KIND]):  # a pool (config `pools`) that does not take it
            self._due = None, time.monotonic()
            return 0
        # Before any claim: an embedder that cannot be loaded fails the stage (logged each poll)
        # and strands no run under a lease nobody works on.
        indexer = self.indexer()
        for _ in range(self.limit):
            if site.stopping:
                break
            with site.conns.pooled() as conn:
                claims = lease.claim_runs(
                    conn, [INGEST_KIND], worker=site.worker_id, lease=site.config.lease, limit=1
                )
            if not claims:
                # Dry: when is the next run due (`next_due`: how long an idle worker may sleep)?
                with site.conns.pooled() as conn:
                    self._due = lease.next_due(conn, [INGEST_KIND]), time.monotonic()
                break
            claim = claims[0]
            try:
                why = self._precheck(site, claim)
            except Exception as exc:
                # A claimed run is never left to its lease: the error goes through the executor
                # as if the handler had raised it (retried with backoff, failed on the last
                # attempt, the error on the run).
                site.executor.run(claim, _raising(exc))
                handled += 1
                continue
            if why is not None:
                self._reject(site, claim, why)
            else:
                site.executor.run(claim, indexer)
            handled += 1
        return handled

    def next_due(self, site: Site) -> float | None:
        """Seconds until an ingest run is next due (delayed, retried, a lease running out), as
        the last step that ran dry read it (workers/stage.py, Due)."""
        return idle.due_now(self._due, time.monotonic())

    def _precheck(self, site: Site, claim: Claim) -> str | None:
        try:
            file_id = _file_id(claim.payload)
        except FileGone as exc:
            return str(exc)
        with site.conns.pooled() as conn, conn.cursor(row_factory=dict_row) as cur:
            file = cur.execute(Q["get_file"], {"id": file_id}).fetchone()
        return precheck(file, self.indexer().store, self.caps)

    def _reject(self, site: Site, claim: Claim, why: str) -> None:
        """A file no attempt could index: fail the run at once (no retries) and the file."""
        with site.conns.pooled() as conn, conn.transaction():
            if not lease.fence(conn, claim):
                return
            if isinstance(claim.payload, dict) and isinstance(claim.payload.get("file_id"), int):
                conn.execute(
                    Q["mark_file"],
                    {"id": claim.payload["file_id"], "status": "failed", "error": why},
                )
            lease.finish(conn, claim, "failed", error=why)
        log.event("ingest_rejected", level=30, run_id=claim.id, error=why)
