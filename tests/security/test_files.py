"""Files of issue 18: the size cap is checked before anything is copied, special files are
refused with their real reason, project names are printable, `a:notes.txt` is a plain member
name, and error lines stay short."""

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
