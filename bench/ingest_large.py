"""Ingest one large generated text file end to end and print wall time and peak RSS.

    .venv/bin/python bench/ingest_large.py --mb 100 [--dsn URL] [--dim 256]

Makes its own database on the server (LEASEWORK_DSN / --dsn, default 127.0.0.1:5432), writes a
file of --mb megabytes of prose-like text, adds it with app.add_file, and polls one worker with
only the ingest stage until the run is done. Peak RSS is the process's high-water mark: it
should stay flat as --mb grows (two streaming passes, one batch of chunks in memory).
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import App, Config, db
from leasework.stages.ingest import IngestStage
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--dsn", default=os.environ.get("LEASEWORK_DSN", db_default()))
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()

    name = f"leasework_bench_{secrets.token_hex(3)}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(**{**conninfo_to_dict(args.dsn), "dbname": name})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(dsn, Path(tmp), args.mb, args.dim)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def db_default() -> str:
    return "postgresql://postgres@127.0.0.1:5432/postgres"


def run(dsn: str, tmp: Path, megabytes: float, dim: int) -> None:
    cfg = Config(dsn=dsn, file_store=str(tmp / "store"), embedding_dim=dim)
    app = App(cfg)
    source = tmp / "large.txt"
    size = write_text(source, megabytes)
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.migrate(conn)
        file_id = app.add_file(conn, project="bench", path=source)
        source.unlink()  # the store holds its copy
        base = peak_rss_mb()
        worker = Worker(app, cfg, stages=[IngestStage(app, cfg)], register=False)
        worker.open()
        worker.running = True
        started = time.monotonic()
        worker.poll()
        elapsed = time.monotonic() - started
        worker.close()
        status, processed, total = conn.execute(
            "SELECT status, processed_units, total_units FROM leasework.runs WHERE key = %s",
            (f"file:{file_id}",),
        ).fetchone() or ("?", 0, 0)
    print(f"file            {size / (1 << 20):.1f} MiB")
    print(f"run             {status}, {processed}/{total} chunks (batch {cfg.ingest_batch})")
    print(
        f"wall time       {elapsed:.1f} s ({size / (1 << 20) / elapsed:.2f} MiB/s, "
        f"{(processed or 0) / elapsed:.0f} chunks/s)"
    )
    print(f"peak RSS        {peak_rss_mb():.0f} MiB (before the ingest: {base:.0f} MiB)")


if __name__ == "__main__":
    main()
