"""Deterministic chunking (hypothesis): the same text gives the same chunks however it is cut
into pieces; the counting pass and the embedding pass agree; chunks respect their bounds."""

from __future__ import annotations

import io
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leasework.documents.chunking import chunks, keep_markdown_word
from leasework.documents.embed import HashingEmbedder
from leasework.documents.expand import ArchiveCaps, ArchiveRejected, plan
from leasework.documents.extract import PageStats, pages
from leasework.documents.ingest import Caps, count_chunks, open_chunks
from leasework.documents.store import LocalStore, StoreError, check_key

alphabet = st.sampled_from(list("abc xyz\n\t\f\x00é漢 .#-"))
texts = st.text(alphabet=alphabet, max_size=600)


def cut(text: str, sizes: list[int]) -> list[tuple[int, str]]:
    out, i = [], 0
    for n in sizes:
        out.append((1, text[i : i + n]))
        i += n
    out.append((1, text[i:]))
    return out


@given(texts, st.lists(st.integers(0, 50), max_size=20), st.integers(16, 80))
def test_chunks_do_not_depend_on_how_text_is_cut(text, sizes, max_chars):
    whole = list(chunks([(1, text)], max_chars))
    assert list(chunks(cut(text, sizes), max_chars)) == whole


@given(texts, st.integers(16, 80))
def test_chunks_are_bounded_ordered_and_lose_no_words(text, max_chars):
    out = list(chunks([(1, text)], max_chars))
    assert [c.index for c in out] == list(range(len(out)))
    assert all(0 < len(c.text) <= max_chars for c in out)
    joined = "".join(c.text.replace(" ", "") for c in out)
    assert joined == "".join(text.replace("\x00", " ").split())


@settings(max_examples=50, deadline=None)
@given(texts, st.integers(16, 80), st.integers(1, 40))
def test_count_pass_and_embed_pass_agree(tmp_path_factory, text, max_chars, max_chunks):
    store = LocalStore(tmp_path_factory.mktemp("s"))
    store.put("d/doc.txt", io.BytesIO(text.encode()))
    caps = Caps(
        batch=3, chunk_chars=max_chars, max_bytes=1 << 20, max_pages=5, max_chunks=max_chunks
    )
    count = count_chunks(store, "d/doc.txt", "text", caps)
    with open_chunks(store, "d/doc.txt", "text", caps, PageStats()) as it:
        listed = list(it)[: count.total]
    assert len(listed) == count.total <= max_chunks
    with open_chunks(store, "d/doc.txt", "text", caps, PageStats()) as it:
        assert list(it)[: count.total] == listed  # a second pass rebuilds the identical list


@given(st.binary(max_size=300), st.integers(1, 7))
def test_text_pages_do_not_depend_on_read_size(data, block):
    import leasework.documents.extract as ex

    def read(size: int) -> list[tuple[int, str]]:
        old = ex.READ_BLOCK
        ex.READ_BLOCK = size
        try:
            return list(pages(io.BytesIO(data), "text", max_pages=100, stats=PageStats()))
        finally:
            ex.READ_BLOCK = old

    def joined(ps: list[tuple[int, str]]) -> dict[int, str]:
        out: dict[int, str] = {}
        for p, t in ps:
            out[p] = out.get(p, "") + t
        return out

    assert joined(read(block)) == joined(read(64 * 1024))


def test_markdown_syntax_words_are_dropped():
    md = "# Title\n\n- item one\n- item two\n\n```python\ncode\n```\n---\n| a | b |\n|---|---|"
    out = [c.text for c in chunks([(1, md)], 200, keep=keep_markdown_word)]
    assert out == ["Title item one item two code a b"]


def test_hashing_embedder_is_deterministic_and_normalised():
    e = HashingEmbedder(64)
    a, b, empty = e(["steel beam footing", "steel beam footing", ""])
    assert a == b and len(a) == 64
    assert abs(sum(x * x for x in a) - 1.0) < 1e-9
    assert empty == [0.0] * 64


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a\\b", ""])
def test_store_keys_cannot_escape(tmp_path, key):
    with pytest.raises(StoreError):
        LocalStore(tmp_path).path(key)
    if key:
        with pytest.raises(StoreError):
            check_key(key)


def test_archive_plan_is_decided_from_the_directory_alone():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.md", "x")
        z.writestr("sub/b.txt", "y")
        z.writestr("c.bin", "z")
    infos = zipfile.ZipFile(buf).infolist()
    members, skipped = plan(infos, ArchiveCaps(10, 1000, 100))
    assert [m.path for m in members] == ["a.md", "sub/b.txt"]
    assert skipped == ["c.bin: unsupported type"]
    with pytest.raises(ArchiveRejected, match="archive_max_members"):
        plan(infos, ArchiveCaps(2, 1000, 100))


@given(st.integers(0, 10_000), st.integers(1, 5_000), st.booleans())
def test_maintenance_due_is_a_pure_period_check(elapsed, period, backlog):
    from datetime import UTC, datetime, timedelta

    from leasework.stages.maintenance import due

    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert due(None, False, period, now)
    assert due(now - timedelta(seconds=elapsed), backlog, period, now) == (
        backlog or elapsed >= period
    )
