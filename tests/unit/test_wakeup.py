"""The wake-up relay's pipe writes (supervisor/wakeup.py): whole lines in pieces a pipe takes
whole, never a half line; a full pipe or a gone child drops the rest without raising."""

from __future__ import annotations

import os
import select

from leasework.supervisor import wakeup


def _drain(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_lines_arrive_whole_and_a_full_pipe_drops_whole_pieces() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        lines = [f"kind_{i:05d}".encode() + b"\n" for i in range(20_000)]
        wakeup.send(w, b"".join(lines))  # far more than a pipe holds
        got = _drain(r)
        assert got and got.endswith(b"\n")
        assert got.splitlines(keepends=True) == lines[: len(got.splitlines())]
        assert len(got) <= 20_000 * len(lines[0])
        wakeup.send(w, b"job\n")  # room again
        assert _drain(r) == b"job\n"
    finally:
        os.close(r)
        os.close(w)


def test_a_gone_child_is_ignored() -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        wakeup.send(w, b"job\n")  # EPIPE (SIGPIPE is ignored by Python)
    finally:
        os.close(w)


def test_pieces_fit_pipe_buf() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        line = b"x" * 100 + b"\n"
        wakeup.send(w, line * 30)
        assert _drain(r) == line * 30
        assert select.PIPE_BUF >= 512
    finally:
        os.close(r)
        os.close(w)
