"""Files of issue 18: the size cap is checked before anything is copied, special files are
refused with their real reason, project names are printable, `a:notes.txt` is a plain member
name, and error lines stay short. Issue 34: member names take the rule of labels, are at most
1,024 characters, hold no path that is absolute or climbs once normalized (NFKC), and no two
differ only in case or Unicode form."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from leasework.config import Config
from leasework.documents.expand import ArchiveCaps, ArchiveRejected, plan


def stored_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def files_rows(conn: Any) -> int:
    return int(conn.execute("SELECT count(*) FROM leasework.files").fetchone()[0]) + int(
        conn.execute("SELECT count(*) FROM leasework.uploads").fetchone()[0]
    )


def test_the_size_cap_is_checked_before_copying(conn: Any, cli: Any, tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as fh:
        fh.truncate(50 << 20)  # 50 MB, sparse
    store = tmp_path / "store"
    env = {"LEASEWORK_INGEST_MAX_BYTES": "1000", "LEASEWORK_FILE_STORE": str(store)}
    result = cli("ingest", str(big), "--project", "p", env=env)
    assert result.returncode == 2, result.stderr
    assert "is 52428800 bytes, over ingest_max_bytes (1000 bytes)" in result.stderr
    env = {"LEASEWORK_ARCHIVE_MAX_BYTES": "1000", "LEASEWORK_FILE_STORE": str(store)}
    result = cli("upload", str(big), "--project", "p", env=env)
    assert result.returncode == 2 and "over archive_max_bytes" in result.stderr
    assert stored_bytes(store) == 0 if store.exists() else True
    assert files_rows(conn) == 0


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: "/dev/zero", "is a device, not a regular file"),
        (lambda d: str(d), "is a directory, not a file"),
        (lambda d: (os.mkfifo(d / "fifo"), str(d / "fifo"))[1], "is a FIFO, not a regular file"),
        (lambda d: str(d / "absent.txt"), "no such file"),
    ],
)
def test_special_files_are_refused_with_their_real_reason(
    conn: Any, cli: Any, tmp_path: Path, make: Any, reason: str
) -> None:
    path = make(tmp_path)
    result = cli(
        "ingest", path, "--project", "p", env={"LEASEWORK_FILE_STORE": str(tmp_path / "s")}
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and reason in lines[0], result.stderr
    assert files_rows(conn) == 0


@pytest.mark.parametrize("project", ["a\nb", "a\x1b[2Jb", "tab\there", "\x7f"])
def test_project_names_refuse_control_characters(
    conn: Any, cli: Any, tmp_path: Path, project: str
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    result = cli("ingest", str(doc), "--project", project,
                 env={"LEASEWORK_FILE_STORE": str(tmp_path / "s")})  # fmt: skip
    assert result.returncode == 2 and "contains control characters" in result.stderr
    assert "\x1b" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert files_rows(conn) == 0


def test_error_lines_are_truncated(conn: Any, cli: Any, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    result = cli("ingest", str(doc), "--project", "p" * 100_000,
                 env={"LEASEWORK_FILE_STORE": str(tmp_path / "s")})  # fmt: skip
    assert result.returncode == 2 and len(result.stderr) < 600, len(result.stderr)


def _infos(*names: str) -> list[zipfile.ZipInfo]:
    infos = []
    for name in names:
        info = zipfile.ZipInfo(name)
        info.file_size = info.compress_size = 10
        infos.append(info)
    return infos


def test_a_colon_in_a_member_name_is_not_a_drive() -> None:
    caps = ArchiveCaps.from_config(Config())
    members, skipped = plan(_infos("a:notes.txt", "docs/b:c.md"), caps)
    assert [m.path for m in members] == ["a:notes.txt", "docs/b:c.md"] and not skipped
    for absolute in ("C:\\windows\\x.txt", "c:/x.txt", "/etc/passwd", "\\\\server\\x"):
        with pytest.raises(ArchiveRejected, match="absolute"):
            plan(_infos(absolute), caps)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a\x1b[2J.txt", "contains control characters (U+001B;"),
        ("a\x7f.txt", "contains control characters (U+007F;"),
        ("a\x9b2J.txt", "contains control characters (U+009B;"),
        ("\u202etxt.exe", "contains control characters (U+202E;"),
        ("a\u2066b.txt", "contains control characters (U+2066;"),
        ("line\u2028break.txt", "contains control characters (U+2028;"),
        ("\u2025/x.txt", "contains '..' once Unicode-normalized (NFKC)"),
        ("docs/\ufe52\ufe52/x.txt", "contains '..' once Unicode-normalized (NFKC)"),
        ("\uff0fetc\uff0fpasswd.txt", "is an absolute path once Unicode-normalized (NFKC)"),
        ("a" * 1021 + ".txt", "is 1025 characters long, over the limit of 1024"),
        ("a" * 60_000 + ".txt", "is 60004 characters long, over the limit of 1024"),
    ],
)
def test_member_names_take_the_rule_of_labels_and_no_lookalike_path(
    name: str, reason: str
) -> None:
    caps = ArchiveCaps.from_config(Config())
    with pytest.raises(ArchiveRejected) as caught:
        plan(_infos("ok.txt", name), caps)
    message = str(caught.value)
    assert reason in message and len(message) < 300, message
    assert message.isprintable(), message  # the name is shown escaped


@pytest.mark.parametrize(
    "names",
    [
        ("A.txt", "a.txt"),
        ("docs/Read.md", "DOCS/read.md"),
        ("\ufb01le.txt", "file.txt"),  # the fi ligature, one file once normalized
        ("stra\xdfe.txt", "STRASSE.txt"),
        ("\uff41.txt", "a.txt"),  # fullwidth a
    ],
)
def test_members_differing_only_in_case_or_unicode_form_are_refused(
    names: tuple[str, str],
) -> None:
    caps = ArchiveCaps.from_config(Config())
    with pytest.raises(ArchiveRejected, match="differ only in case or Unicode form"):
        plan(_infos(*names), caps)
    with pytest.raises(ArchiveRejected, match="appears twice"):
        plan(_infos(names[0], names[0]), caps)


def test_unicode_member_names_that_are_safe_are_kept() -> None:
    caps = ArchiveCaps.from_config(Config())
    names = ("\u65e5\u672c\u8a9e.txt", "\uff46\uff55\uff4c\uff4c.txt", "caf\xe9.md",
             "a" * 1020 + ".txt", "\u2024hidden.txt", "nbsp\xa0name.txt")  # fmt: skip
    members, skipped = plan(_infos(*names), caps)
    assert [m.path for m in members] == list(names) and not skipped
