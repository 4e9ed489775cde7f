"""Page-by-page extraction from a binary stream: plain text and Markdown built in, PDF through
pypdf (the `pdf` extra). Yields bounded (page, text) pieces and counts pages as it goes; never
reads a whole document into memory. Image-only PDF pages yield no text (there is no OCR)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import BinaryIO, Literal

from ..errors import LeaseworkError
from .chunking import Piece, keep_markdown_word

Kind = Literal["text", "markdown", "pdf"]

TEXT_SUFFIXES = frozenset({"", ".txt", ".text", ".log", ".csv", ".tsv", ".rst", ".adoc"})
MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown", ".mkd"})
READ_BLOCK = 64 * 1024


class ExtractError(LeaseworkError):
    """A document that cannot be read: unsupported type, corrupt or encrypted PDF."""


def kind_of(name: str) -> Kind | None:
    """The extractor for a file name, by suffix; None when the type is not supported."""
    suffix = PurePosixPath(name.lower()).suffix
    if suffix in MARKDOWN_SUFFIXES:
        return "markdown"
    if suffix == ".pdf":
        return "pdf"
    if suffix in TEXT_SUFFIXES:
        return "text"
    return None


def pdf_available() -> bool:
    try:
        import pypdf  # noqa: F401
    except ImportError:
        return False
    return True


def word_filter(kind: Kind) -> Callable[[str], bool] | None:
    return keep_markdown_word if kind == "markdown" else None


@dataclass
class PageStats:
    pages: int = 0  # pages read (up to the cap)
    empty_pages: int = 0  # pages with no extractable text (image-only PDF pages)
    truncated: bool = False  # the document had more pages than the cap


def pages(stream: BinaryIO, kind: Kind, *, max_pages: int, stats: PageStats) -> Iterator[Piece]:
    """(page, text) pieces of at most READ_BLOCK characters (PDF: one page each)."""
    if kind == "pdf":
        yield from _pdf_pages(stream, max_pages, stats)
    else:
        yield from _text_pages(stream, max_pages, stats)


def _text_pages(stream: BinaryIO, max_pages: int, stats: PageStats) -> Iterator[Piece]:
    """UTF-8 (a BOM is dropped, invalid bytes become U+FFFD); a form feed starts a new page."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    page = 1
    stats.pages = 1
    while True:
        block = stream.read(READ_BLOCK)
        text = decoder.decode(block, final=not block)
        parts = text.split("\f")
        for i, part in enumerate(parts):
            if i > 0:
                if page >= max_pages:
                    stats.truncated = True
                    return
                page += 1
                stats.pages = page
            if part:
                yield page, part
        if not block:
            return


def _pdf_pages(stream: BinaryIO, max_pages: int, stats: PageStats) -> Iterator[Piece]:
    try:
        import pypdf
        from pypdf.errors import PdfReadError
    except ImportError:
        raise ExtractError(
            "PDF support needs pypdf (the pdf extra): pip install 'pypdf>=4'"
        ) from None
    try:
        reader = pypdf.PdfReader(stream)
        if reader.is_encrypted:
            raise ExtractError("the PDF is encrypted")
        count = len(reader.pages)
    except PdfReadError as exc:
        raise ExtractError(f"the PDF cannot be read: {exc}") from None
    for i in range(min(count, max_pages)):
        try:
            text = reader.pages[i].extract_text() or ""
        except PdfReadError as exc:
            raise ExtractError(f"page {i + 1} of the PDF cannot be read: {exc}") from None
        stats.pages = i + 1
        if not text.strip():
            stats.empty_pages += 1
            continue
        yield i + 1, text
    stats.truncated = count > max_pages
