"""The documents family's settings: the family's own (the file store, the embedder, what its
pruners keep), the `ingest` stage's and the `expand` stage's. Sections of the config, named by
`Documents.config_sections` (keys stay flat: `ingest_limit`, LEASEWORK_INGEST_LIMIT); read with
`config.section(...)`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import DAY, RETENTION, Range, doc, section, short
from ..errors import ConfigError


@section("The documents family", order=60)
@dataclass(frozen=True)
class DocumentSettings:
    file_store: str = field(
        default=".leasework/files",
        metadata=doc("directory of the local file store (shared by every worker that ingests)"),
    )
    embedder: str | None = field(
        default=None,
        metadata=doc("MODULE:ATTR of a callable texts -> vectors; default: feature hashing"),
    )
    embedding_dim: int = field(
        default=256,
        metadata=doc("dimensions of the built-in feature-hashing embedder", range=Range(1, 16384)),
    )
    retention_uploads: float = field(
        default=30 * 86400.0,
        metadata=doc("seconds a finished upload row and its archive are kept", range=RETENTION),
    )
    reconcile_interval: float = field(
        default=60.0,
        metadata=doc(
            "seconds between checks for files left `indexing` by an ended ingest run",
            range=Range(1, DAY),
        ),
    )

    def check(self) -> None:
        if not self.file_store:
            raise ConfigError("config: file_store must be a directory path, got an empty string")
        if self.embedder is not None and ":" not in self.embedder:
            raise ConfigError(f"config: embedder must look like MODULE:ATTR, got {short(self.embedder)}")


@section("The documents family: the `ingest` stage", order=61)
@dataclass(frozen=True)
class IngestSettings:
    ingest_limit: int = field(
        default=1, metadata=doc("ingest runs executed per poll at most", range=Range(1, 100))
    )
    ingest_batch: int = field(
        default=200,
        metadata=doc("chunks embedded and upserted per checkpoint", range=Range(1, 10_000)),
    )
    ingest_chunk_chars: int = field(
        default=1000,
        metadata=doc(
            "longest chunk, in characters (chunks break between words)", range=Range(16, 1_000_000)
        ),
    )
    ingest_max_bytes: int = field(
        default=512 << 20,
        metadata=doc("a file larger than this many bytes fails to index", range=Range(1, 1 << 40)),
    )
    ingest_max_pages: int = field(
        default=5000,
        metadata=doc(
            "pages indexed per document at most; the rest is truncated", range=Range(1, 10_000_000)
        ),
    )
    ingest_max_chunks: int = field(
        default=200_000,
        metadata=doc(
            "chunks indexed per document at most; the rest is truncated",
            range=Range(1, 100_000_000),
        ),
    )


@section("The documents family: the `expand` stage", order=62)
@dataclass(frozen=True)
class ExpandSettings:
    expand_limit: int = field(
        default=2, metadata=doc("uploads expanded per poll at most", range=Range(1, 100))
    )
    expand_reclaim: float = field(
        default=900.0,
        metadata=doc(
            "seconds after which an upload stuck in processing is claimed again",
            range=Range(1, 30 * DAY),
        ),
    )
    expand_max_attempts: int = field(
        default=3,
        metadata=doc("expansions of one upload before it is marked failed", range=Range(1, 1000)),
    )
    archive_max_members: int = field(
        default=10_000,
        metadata=doc(
            "an archive with more members than this is refused", range=Range(1, 10_000_000)
        ),
    )
    archive_max_bytes: int = field(
        default=2 << 30,
        metadata=doc(
            "an archive whose members total more bytes is refused", range=Range(1, 1 << 40)
        ),
    )
    archive_max_ratio: float = field(
        default=100.0,
        metadata=doc(
            "an archive or member compressed more than this many times is refused",
            range=Range(1, 1_000_000, above=True),
        ),
    )
