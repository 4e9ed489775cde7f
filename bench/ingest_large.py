"""Ingest one large generated text file end to end and print wall time and peak RSS; with
--kill-after, also what a resume after kill -9 redoes.

    .venv/bin/python bench/ingest_large.py --mb 100 [--dsn URL] [--dim 256]
                                           [--embedder hashing|stub] [--kill-after SECONDS]

Makes its own database on the server (LEASEWORK_DSN / --dsn, default 127.0.0.1:5432), writes a
file of --mb megabytes of prose-like text, adds it with docs.add_file, and polls one worker with
only the ingest stage until the run is done. Peak RSS is the process's high-water mark: it
should stay flat as --mb grows (two streaming passes, one batch of chunks in memory).

--embedder stub replaces the built-in hashing embedder (pure Python, ~1.2 MiB/s) with one that
returns the same unit vector for every chunk: everything else (extraction, chunking, both
passes, the vectors' upsert, one fenced checkpoint per batch) is unchanged, so a 1 GiB file's
memory figure takes minutes instead of a quarter of an hour. Its wall time is not an ingest
rate; it is labelled in the output.

--kill-after S: a forked child runs the worker and is killed with SIGKILL after S seconds; its
leases are expired as the supervisor's fast release does, and this process resumes the run.
Printed: chunks the child had embedded, chunks committed (processed_units) when it died, and so
how many the resume redoes (the target: at most one batch, 200), and the killed child's peak RSS
beside this process's.

--results FILE (default $LEASEWORK_BENCH_RESULTS) appends the figures for bench/summary.py
(issue 7, target 7: peak RSS ≤ 150 MB and ≤ 200 chunks redone for a 1 GiB file; a smaller file
is recorded as a short run).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import secrets
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from common import record, results_arg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import App, Config, db
from leasework.documents import Documents, IngestSettings
from leasework.documents.embed import HashingEmbedder
from leasework.documents.files import file_key
from leasework.documents.ingest import IngestStage
from leasework.leases import lease
from leasework.workers.worker import Worker


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def write_text(path: Path, megabytes: float) -> int:
    vocab = ["alpha", "beam", "column", "drawing", "elevation", "footing", "girder", "header"]
    line = " ".join(f"{vocab[i % 8]}{i % 97}" for i in range(160)) + "\n"
    para = (line * 6 + "\n").encode()
    target = int(megabytes * (1 << 20))
    written = 0
    with open(path, "wb") as f:
        while written < target:
            f.write(para)
            written += len(para)
    return written


class Counting:
    """Wraps an embedder and counts the texts it embedded (shared with the parent)."""

    def __init__(self, inner: Any, counter: Any) -> None:
        self.inner = inner
        self.counter = counter

    def __call__(self, texts: Sequence[str]) -> Sequence[Sequence[float]]:
        out = self.inner(texts)
        with self.counter.get_lock():
            self.counter.value += len(texts)
        return out  # type: ignore[no-any-return]


class StubEmbedder:
    """The same unit vector for every text: no embedding work at all (memory figure only)."""

    def __init__(self, dim: int) -> None:
        self.vec = [1.0] + [0.0] * (dim - 1)

    def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.vec for _ in texts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--dsn", default=os.environ.get("LEASEWORK_DSN", db_default()))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--embedder", choices=["hashing", "stub"], default="hashing")
    ap.add_argument("--kill-after", type=float, default=None, metavar="SECONDS")
    results_arg(ap)
    args = ap.parse_args()

    name = f"leasework_bench_{secrets.token_hex(3)}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(**{**conninfo_to_dict(args.dsn), "dbname": name})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(dsn, Path(tmp), args.mb, args.dim, args.embedder, args.kill_after, args.results)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def db_default() -> str:
    return "postgresql://postgres@127.0.0.1:5432/postgres"


def drain(app: App, cfg: Config, worker_id: str | None = None) -> None:
    docs = app.family(Documents)
    assert docs is not None
    worker = Worker(app, cfg, stages=[IngestStage(docs, cfg)], register=False, worker_id=worker_id)
    worker.open()
    worker.running = True
    try:
        worker.poll()
    finally:
        worker.close()


def run(
    dsn: str,
    tmp: Path,
    megabytes: float,
    dim: int,
    embedder: str,
    kill_after: float | None,
    results: str | None = None,
) -> None:
    # The default caps (512 MiB, 200,000 chunks) refuse or truncate a larger file: raised here so
    # that every byte is chunked and embedded.
    cfg = Config.make(
        dsn=dsn,
        file_store=str(tmp / "store"),
        embedding_dim=dim,
        ingest_max_bytes=max(512 << 20, int(megabytes * (1 << 20)) + (1 << 20)),
        ingest_max_chunks=max(200_000, int(megabytes * 1200)),
    )
    app = App(cfg)
    docs = app.use(Documents())
    counter = mp.get_context("fork").Value("q", 0)
    inner = StubEmbedder(dim) if embedder == "stub" else HashingEmbedder(dim)
    docs.embedder(Counting(inner, counter))
    source = tmp / "large.txt"
    size = write_text(source, megabytes)
    key = ""
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.migrate(conn)
        file_id = docs.add_file(conn, project="bench", path=source)
        key = file_key(file_id)
        source.unlink()  # the store holds its copy
        base = peak_rss_mb()
        started = time.monotonic()
        if kill_after is not None:
            wid = f"bench-ingest-{secrets.token_hex(3)}"
            child = mp.get_context("fork").Process(target=drain, args=(app, cfg, wid))
            child.start()
            time.sleep(kill_after)
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            # The killed child's high-water mark (the largest waited-for child's).
            child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            embedded_before = int(counter.value)
            committed = conn.execute(
                "SELECT processed_units FROM leasework.runs WHERE key = %s", (key,)
            ).fetchone()[0]  # type: ignore[index]
            lease.expire_worker_leases(conn, wid, "bench: child killed")
            counter.value = 0
        drain(app, cfg)
        elapsed = time.monotonic() - started
        status, processed, total = conn.execute(
            "SELECT status, processed_units, total_units FROM leasework.runs WHERE key = %s",
            (key,),
        ).fetchone() or ("?", 0, 0)
    label = " (stub embedder: not an ingest rate)" if embedder == "stub" else ""
    if kill_after is not None:
        label += f" (includes the killed child's {kill_after:g} s)"
    print(f"file            {size / (1 << 20):.1f} MiB, embedder {embedder}")
    print(f"run             {status}, {processed}/{total} chunks (batch {cfg.section(IngestSettings).ingest_batch})")
    print(
        f"wall time       {elapsed:.1f} s ({size / (1 << 20) / elapsed:.2f} MiB/s, "
        f"{(processed or 0) / elapsed:.0f} chunks/s){label}"
    )
    peak = peak_rss_mb()
    killed = f", the killed child's {child_peak:.0f} MiB" if kill_after is not None else ""
    print(f"peak RSS        {peak:.0f} MiB (before the ingest: {base:.0f} MiB{killed})")
    if kill_after is not None:
        peak = max(peak, child_peak)
        resumed = int(counter.value)
        redone = embedded_before - committed
        print(
            f"kill -9 after   {kill_after:g} s: child had embedded {embedded_before:,} chunks,"
            f" {committed:,} committed; the resume embedded {resumed:,}"
            f" ({(processed or 0) - committed:,} left): redone {redone:,} chunks"
        )
    mib = size / (1 << 20)
    short = size < 10**9  # the target is for a 1 GB file
    what = f"ingest {mib:,.0f} MiB ({embedder} embedder)"
    record(
        results, 7, f"{what}: peak RSS", peak, "MiB", target_text="≤ 150 MB (143 MiB)",
        met=peak * 2**20 <= 150e6 and status == "succeeded", short=short,
        notes=f"run {status}, {processed or 0:,}/{total or 0:,} chunks; before the ingest {base:.0f}"
        f" MiB" + ("; the larger of the resuming process's and the killed child's" if killed else ""),
    )  # fmt: skip
    if kill_after is not None:
        record(
            results, 7, f"{what}: redone after kill -9 at {kill_after:g} s", redone,
            "chunks", target_text="≤ 200", met=redone <= 200 and status == "succeeded",
            short=short,
            notes=f"embedded {embedded_before:,}, committed {committed:,} when killed",
        )  # fmt: skip


if __name__ == "__main__":
    main()
