"""Helpers shared by the ingest, expand and maintenance tests: an App with a store under
tmp_path, a counting stub embedder, generated documents and a tiny PDF writer; and the ingest
checks test_mutations runs against deliberately broken queries."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from leasework import App, Config
from leasework.documents import Documents
from leasework.documents.embed import HashingEmbedder
from leasework.documents.ingest import IngestStage
from leasework.workers.worker import Worker

from ..conftest import get_run

Conn = psycopg.Connection[Any]


class CountingEmbedder:
    """The built-in hashing embedder (small), counting what it embeds; `hook(call_number)` runs
    before each call returns, to act in the middle of an ingest."""

    def __init__(self) -> None:
        self.calls = 0
        self.texts = 0
        self.inner = HashingEmbedder(32)
        self.hook: Callable[[int], None] | None = None

    def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls += 1
        self.texts += len(texts)
        if self.hook is not None:
            self.hook(self.calls)
        return self.inner(texts)


class Env:
    """One App and its store; `worker(**overrides)` makes workers with the same settings."""

    def __init__(self, tmp_path: Path, make_worker: Callable[..., Worker], **settings: Any) -> None:
        self.tmp = tmp_path
        self.settings = {"file_store": str(tmp_path / "store"), **settings}
        self.app = App(Config.make(**self.settings))
        self.docs = self.app.use(Documents())
        self.embedder = CountingEmbedder()
        self.docs.embedder(self.embedder)
        self._make_worker = make_worker

    def worker(self, **overrides: Any) -> Worker:
        return self._make_worker(self.app, **{**self.settings, **overrides})

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return path

    def add(self, conn: Conn, name: str, text: str | bytes, project: str = "p") -> tuple[int, int]:
        file_id = self.docs.add_file(conn, project=project, path=self.write(name, text))
        return file_id, run_of(conn, file_id)


def run_of(conn: Conn, file_id: int) -> int:
    row = conn.execute(
        "SELECT id FROM leasework.runs WHERE key = %s ORDER BY id DESC LIMIT 1",
        (f"leasework:file:{file_id}",),
    ).fetchone()
    assert row is not None
    return int(row[0])


def chunks_of(conn: Conn, file_id: int) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT idx, page, project, text, embedding FROM leasework.chunks WHERE file_id = %s ORDER BY idx",
        (file_id,),
    ).fetchall()


def file_row(conn: Conn, file_id: int) -> dict[str, Any]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        row = cur.execute("SELECT * FROM leasework.files WHERE id = %s", (file_id,)).fetchone()
    assert row is not None
    return row


def document(words: int, seed: int = 0) -> str:
    """Deterministic prose-like text of `words` words, with paragraph breaks."""
    vocab = ["alpha", "beam", "column", "drawing", "elevation", "footing", "girder", "header"]
    out = []
    for i in range(words):
        out.append(f"{vocab[(i * 7 + seed) % len(vocab)]}{(i * 31 + seed) % 97}")
        out.append("\n\n" if i % 50 == 49 else " ")
    return "".join(out)


def pdf_bytes(pages: Sequence[str | None]) -> bytes:
    """A minimal valid PDF: one page per entry, with that text, or no text at all for None
    (like a scanned, image-only page)."""
    objs: list[bytes] = []
    n = len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n))
    objs.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objs.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    font_id = 3 + 2 * n
    for i, text in enumerate(pages):
        content = b"" if text is None else (f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode())
        objs.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font_id} 0 R >> >> >>".encode()
        )
        objs.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    objs.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    for off in offsets:
        out += f"{off:010d} 00000 n \n".encode()
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def ingest_only(worker: Worker) -> Worker:
    worker.stages = [s for s in worker.stages if isinstance(s, IngestStage)]
    return worker


def replaced_mid_run_is_never_ready_with_stale_chunks(conn: Conn, env: Env) -> None:
    """A file given new content while its ingest run embeds the old content: the run's re-check
    before `ready` sees the content changed, starts over on the new content, and only then
    marks the file `ready`, with exactly the chunks a clean index of the new content gives. At no
    moment is the file `ready` with the old content's chunks."""
    env.settings["ingest_batch"] = 10
    old, new = document(400), document(300, seed=5)
    file_id, run_id = env.add(conn, "replaced.txt", old)
    seen: list[tuple[str, str]] = []

    def replace(call: int) -> None:
        f = file_row(conn, file_id)
        seen.append((f["status"], f["sha256"]))
        if call == 1:  # the first batch of the old content is being embedded
            path = env.write("replaced-v2.txt", new)
            assert env.docs.replace_file(conn, file_id, path) == run_id  # joins the running run

    env.embedder.hook = replace
    try:
        ingest_only(env.worker()).poll()
    finally:
        env.embedder.hook = None
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert "ready" not in {status for status, _ in seen}, f"ready mid-run: {seen}"
    f = file_row(conn, file_id)
    assert f["sha256"] == hashlib.sha256(new.encode()).hexdigest()
    assert f["status"] == "ready", f"the new content was never indexed: file {f['status']}"

    clean_id, clean_run = env.add(conn, "clean-v2.txt", new)
    ingest_only(env.worker()).poll()
    assert get_run(conn, clean_run)["status"] == "succeeded"
    want = chunks_of(conn, clean_id)
    got = chunks_of(conn, file_id)
    assert got == want, (
        f"file marked ready with {len(got)} chunks, not the new content's {len(want)}"
        f" (stale: {sum(c not in want for c in got)})"
    )
    assert (f["chunks"], run["total_units"]) == (len(want), len(want))
    assert run["result"]["restarts"] == 1, "the replacement mid-run was not seen"
