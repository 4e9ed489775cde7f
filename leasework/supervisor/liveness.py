"""The liveness pipe between a child and its parent: one JSON line per beat (time, the run being
executed from its claim on: id, owner, lease, last renewal, timeout, abort reason; jobs done), or
one line carrying a boot error; and the child's board, the same beat in memory shared with the
parent (Board), where a change is written at once and read at the parent's next pass.

The parent decodes with the standard library; the child encodes with orjson (leasework's JSON
library, loaded by its worker anyway): a busy child sends a beat per run, and the standard
encoder cost it 3.6 µs a beat against orjson's 0.2. The child never blocks on the pipe (a full
pipe drops a beat); lines are far below PIPE_BUF, so each write is atomic. Never touches the
database.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

# A beat at most this often unless something changed (a new run, a renewal): ctx.check() may be
# called in a tight loop and the parent only needs a fresh reading per watchdog tick.
MIN_BEAT_GAP = 0.25
# A change (a claim, a finish) goes out at once, unless a beat went out less than this ago: then at
# the end of this gap (child.BeatSender). A child finishing thousands of runs a second sends at
# most 1/CHANGE_GAP beats a second; the parent's watchdog acts on seconds.
CHANGE_GAP = 0.05
_MAX_ERROR = 1000


@dataclass(frozen=True)
class Beat:
    t: float  # monotonic time the child sent it (CLOCK_MONOTONIC is system-wide on Linux)
    run_id: int | None
    renewed: float | None
    lease: float | None
    jobs: int
    owner: str | None = None  # the claim's owner token (hex): the parent's writes are owner-scoped
    attempt: int | None = None
    timeout_at: float | None = None  # when the attempt times out (monotonic)
    abort: str | None = None  # why the run must stop: cancelled, timeout, lost, shutdown
    abort_at: float | None = None  # since when (the grace runs from here)
    runs: int | None = None  # runs executing when more than one (async handlers)


_OPTIONAL = (
    ("owner", str),
    ("attempt", int),
    ("timeout_at", float),
    ("abort", str),
    ("abort_at", float),
    ("runs", int),
)


def encode_beat(beat: Beat) -> bytes:
    return beat_line(
        beat.t,
        beat.run_id,
        beat.renewed,
        beat.lease,
        beat.jobs,
        owner=beat.owner,
        attempt=beat.attempt,
        timeout_at=beat.timeout_at,
        abort=beat.abort,
        abort_at=beat.abort_at,
        runs=beat.runs,
    )


def beat_line(
    t: float,
    run_id: int | None,
    renewed: float | None,
    lease: float | None,
    jobs: int,
    *,
    owner: str | None = None,
    attempt: int | None = None,
    timeout_at: float | None = None,
    abort: str | None = None,
    abort_at: float | None = None,
    runs: int | None = None,
) -> bytes:
    """A beat's line from its fields (Beat's, in its order), as `encode_beat` writes it: the
    child's form, which builds no Beat (a frozen dataclass of eleven fields cost more than the
    encoding, at a beat per run of a batch)."""
    doc: dict[str, Any] = {"t": t, "run": run_id, "renewed": renewed, "lease": lease, "jobs": jobs}
    if owner is not None:
        doc["owner"] = owner
    if attempt is not None:
        doc["attempt"] = attempt
    if timeout_at is not None:
        doc["timeout_at"] = timeout_at
    if abort is not None:
        doc["abort"] = abort
    if abort_at is not None:
        doc["abort_at"] = abort_at
    if runs is not None:
        doc["runs"] = runs
    return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)


# How a boot error's line starts (encode_error), and a beat's never does: the parent decodes
# only the last beat of what it reads, and an error line wherever it stands.
ERROR_PREFIX = b'{"error":'


def encode_error(message: str) -> bytes:
    first = (message.strip().splitlines() or [""])[0][:_MAX_ERROR]
    return json.dumps({"error": first}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Beat | str | None:
    """A Beat, a boot-error message, or None for a line that is not ours."""
    try:
        doc: Any = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("error"), str):
        return str(doc["error"])
    try:
        optional: dict[str, Any] = {
            name: None if doc.get(name) is None else kind(doc[name]) for name, kind in _OPTIONAL
        }
        return Beat(
            t=float(doc["t"]),
            run_id=None if doc.get("run") is None else int(doc["run"]),
            renewed=None if doc.get("renewed") is None else float(doc["renewed"]),
            lease=None if doc.get("lease") is None else float(doc["lease"]),
            jobs=int(doc.get("jobs", 0)),
            **optional,
        )
    except (KeyError, TypeError, ValueError):
        return None


def latest(lines: list[bytes]) -> tuple[Beat | None, str | None]:
    """The last beat among `lines` and the last boot error. A beat is the child's whole state,
    so only the last one counts: the lines are decoded from the end until a beat is found (a busy
    child sends one per run, and decoding each cost the parent more than the child's write), and
    before it only an error's (ERROR_PREFIX)."""
    beat: Beat | None = None
    error: str | None = None
    for line in reversed(lines):
        if beat is not None and not line.startswith(ERROR_PREFIX):
            continue
        msg = decode(line)
        if isinstance(msg, Beat):
            beat = beat or msg
        elif isinstance(msg, str):
            error = error or msg
    return beat, error


class LineBuffer:
    """Parent side: accumulates bytes read from one child's pipe and yields whole lines."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        if len(self._buf) > 65536:  # a child writing garbage must not grow the parent
            self._buf.clear()
        return [bytes(line) for line in lines if line]


def write_nowait(fd: int, data: bytes) -> bool:
    """Write without blocking. False if the pipe is full (the beat is dropped). Raises
    BrokenPipeError when nobody reads any more: the parent is gone."""
    try:
        os.write(fd, data)
    except BlockingIOError:
        return False
    return True


# A board's record: seq, t, run, renewed, lease, jobs, owner (16 bytes), attempt, timeout_at,
# abort_at, runs, abort (UTF-8, NUL-padded), then the CRC-32 of all of it. None is NaN for a time,
# 0 for a count or an id (run ids, attempts and runs start at 1), 16 zero bytes for an owner.
_RECORD = struct.Struct("<QdqddQ16sqddq16s")
_CRC = struct.Struct("<I")
_NO_OWNER = bytes(16)


def _time(x: float | None) -> float:
    return math.nan if x is None else x


def _maybe(x: float) -> float | None:
    return None if math.isnan(x) else x


class Board:
    """One child's latest beat in a page of memory shared with its parent (an anonymous shared
    mapping made before fork). The child writes a change there at once: a store, no system call
    and no wake-up of the parent, which reads it at its next pass (and after the child's exit).
    So a new run need not go out on the pipe at once for the parent to know which run to kill
    the child for when its handler then holds the GIL for ever: the board has it already. The
    pipe still carries beats (coalesced, child.BeatSender), which wake the parent, and boot
    errors.

    Each record carries a sequence number (the parent sees whether anything was written since
    its last reading) and its CRC-32: a reading torn by a write in progress fails the check and is
    read again, or left for the next pass. Nothing here blocks or takes a lock."""

    SIZE = _RECORD.size + _CRC.size

    def __init__(self) -> None:
        self._mm = mmap.mmap(-1, mmap.PAGESIZE)
        self._seq = 0

    def write(
        self,
        t: float,
        run_id: int | None,
        renewed: float | None,
        lease: float | None,
        jobs: int,
        *,
        owner: bytes | None = None,
        attempt: int | None = None,
        timeout_at: float | None = None,
        abort: str | None = None,
        abort_at: float | None = None,
        runs: int | None = None,
    ) -> None:
        """The child's side: `owner` is the claim's token as its 16 bytes (uuid.UUID.bytes)."""
        self._seq += 1
        body = _RECORD.pack(
            self._seq,
            t,
            run_id or 0,
            _time(renewed),
            _time(lease),
            max(0, jobs),
            owner or _NO_OWNER,
            attempt or 0,
            _time(timeout_at),
            _time(abort_at),
            runs or 0,
            (abort or "").encode()[:16],
        )
        self._mm[: self.SIZE] = body + _CRC.pack(zlib.crc32(body))

    def read(self, tries: int = 3) -> tuple[int, Beat] | None:
        """The parent's side: (seq, beat) of the latest record; None before the first one, or when
        every reading was torn by a write in progress."""
        for _ in range(tries):
            data = self._mm[: self.SIZE]
            body = data[: _RECORD.size]
            if _CRC.unpack_from(data, _RECORD.size)[0] != zlib.crc32(body):
                continue
            (seq, t, run_id, renewed, lease, jobs, owner, attempt, timeout_at, abort_at, runs,
             abort) = _RECORD.unpack(body)  # fmt: skip
            if seq == 0:
                return None
            return seq, Beat(
                t=t,
                run_id=run_id or None,
                renewed=_maybe(renewed),
                lease=_maybe(lease),
                jobs=jobs,
                owner=None if owner == _NO_OWNER else owner.hex(),
                attempt=attempt or None,
                timeout_at=_maybe(timeout_at),
                abort=abort.rstrip(b"\0").decode(errors="replace") or None,
                abort_at=_maybe(abort_at),
                runs=runs or None,
            )
        return None

    def close(self) -> None:
        self._mm.close()
