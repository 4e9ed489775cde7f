"""Deterministic, streaming chunking: (page, text) pieces in, ordered chunks out.

The same text always gives the identical list of chunks, however it is cut into pieces: words
are runs of non-whitespace, never split across pieces (only a word longer than a chunk is cut,
at fixed offsets from its start), chunks never span pages and hold as many whole words as fit.
Memory is one chunk plus one piece, whatever the document's size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

Piece = tuple[int, str]  # (page number, some text of that page)


@dataclass(frozen=True)
class Chunk:
    index: int
    page: int
    text: str


def words(pieces: Iterable[Piece], max_word: int) -> Iterator[tuple[int, str]]:
    """(page, word) for every word, in order. A word longer than `max_word` comes out in
    `max_word`-sized parts. NUL characters (which Postgres text cannot hold) count as spaces."""
    if max_word < 1:
        raise ValueError("max_word must be >= 1")
    page: int | None = None
    carry = ""  # the unfinished last word of the previous piece (always < max_word long)
    for pg, text in pieces:
        if pg != page:
            if carry and page is not None:
                yield page, carry
            carry = ""
            page = pg
        if not text:
            continue
        buf = carry + text.replace("\x00", " ")
        tokens = buf.split()
        carry = tokens.pop() if tokens and not buf[-1].isspace() else ""
        for token in tokens:
            for i in range(0, len(token), max_word):
                yield pg, token[i : i + max_word]
        # Cutting an unfinished word at max_word now gives the same parts as cutting it whole.
        while len(carry) >= max_word:
            yield pg, carry[:max_word]
            carry = carry[max_word:]
    if carry and page is not None:
        yield page, carry


def chunks(
    pieces: Iterable[Piece],
    max_chars: int,
    *,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[Chunk]:
    """Ordered chunks of at most `max_chars` characters: words joined by single spaces, filled
    greedily, a new chunk at each page. `keep` drops words (e.g. bare Markdown syntax)."""
    index = 0
    current: list[str] = []
    length = 0
    page = 0
    for pg, word in words(pieces, max_chars):
        if keep is not None and not keep(word):
            continue
        if current and (pg != page or length + 1 + len(word) > max_chars):
            yield Chunk(index, page, " ".join(current))
            index += 1
            current = []
        if not current:
            page = pg
            length = len(word)
        else:
            length += 1 + len(word)
        current.append(word)
    if current:
        yield Chunk(index, page, " ".join(current))


_MARKDOWN_SYNTAX = re.compile(
    r"^(?:#{1,6}|[-*+>|]|\d+[.)]|`{3,}\w*|~{3,}\w*|-{3,}|\*{3,}|_{3,}|=+|\|?(?::?-+:?\|)+:?-*:?)$"
)


def keep_markdown_word(word: str) -> bool:
    """Drop words that are only Markdown syntax (heading marks, bullets, fences, rules)."""
    return _MARKDOWN_SYNTAX.match(word) is None
