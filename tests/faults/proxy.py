"""A loopback TCP proxy in front of Postgres that can pass, delay or black-hole the traffic of one
worker process, to simulate a slow link or a network partition.

No hook in leasework is needed to single out a child: every leasework connection names its
worker in `application_name` (`leasework:<host>-<pid>-<suffix>[:control]`), which travels in
clear in the startup packet, so the proxy reads the pid from there and applies that pid's mode.
All children's DSNs point here; only the targeted one is disturbed.

`blackhole` is what a partition looks like to TCP: sockets stay open, nothing is delivered, and
what was sent (including a closing peer's EOF) is held and delivered when the link heals, as
TCP retransmission would. `hold` holds only what the server sends, from the first answer that
contains given bytes on (the client's statements still reach the server and commit; their
answers arrive when the mode ends): a claim answered late, picked out by its run's payload. A mode
can be limited to one of the process's connections by its role (`control`, `keeper`, `pool`).
Pure standard library, one thread per connection."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


@dataclass(frozen=True)
class Mode:
    kind: str = "pass"  # pass | delay | blackhole | hold
    delay: float = 0.0
    role: str | None = None  # only the connections of this role (None: all of the process's)
    after: bytes = b""  # hold: from the first answer containing these bytes on

    def holds(self, from_server: bool, armed: bool) -> bool:
        """Whether data in this direction is held rather than delivered (`armed`: the bytes that
        start a hold went by on this connection)."""
        return self.kind == "blackhole" or (self.kind == "hold" and from_server and armed)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during startup")
        buf += chunk
    return buf


def _startup_params(packet: bytes) -> dict[str, str]:
    fields = packet[8:].split(b"\0")
    out: dict[str, str] = {}
    for key, value in zip(fields[::2], fields[1::2], strict=False):
        if not key:
            break
        out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def pid_of(application_name: str) -> int | None:
    """`leasework:<host>-<pid>-<suffix>[:control]` -> pid."""
    if not application_name.startswith("leasework:"):
        return None
    worker = application_name.split(":")[1]
    parts = worker.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def role_of(application_name: str) -> str:
    """`leasework:<worker>:control` -> control, `...:keeper` -> keeper, `leasework:<worker>` (the
    job's pool) -> pool."""
    parts = application_name.split(":")
    return parts[2] if len(parts) > 2 else "pool"


class Proxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._modes: dict[int, Mode] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}?sslmode=disable"

    def set_mode(
        self, pid: int, kind: str, delay: float = 0.0, role: str | None = None, after: bytes = b""
    ) -> None:
        with self._lock:
            self._modes[pid] = Mode(kind, delay, role, after)

    def heal(self, pid: int) -> None:
        self.set_mode(pid, "pass")

    def mode(self, pid: int | None, role: str | None = None) -> Mode:
        if pid is None:
            return Mode()
        with self._lock:
            mode = self._modes.get(pid, Mode())
        if mode.role is not None and mode.role != role:
            return Mode()
        return mode

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            while True:  # answer SSL / GSS encryption requests ourselves: "no"
                head = _recv_exact(client, 8)
                length, code = struct.unpack("!ii", head)
                packet = head + _recv_exact(client, length - 8)
                if code in (SSL_REQUEST, GSSENC_REQUEST):
                    client.sendall(b"N")
                    continue
                break
            name = _startup_params(packet).get("application_name", "")
            upstream = socket.create_connection(self.upstream, timeout=10)
            upstream.settimeout(None)
            upstream.sendall(packet)
            self._pump(client, upstream, pid_of(name), role_of(name))
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def _pump(
        self, client: socket.socket, upstream: socket.socket, pid: int | None, role: str
    ) -> None:
        peer = {client: upstream, upstream: client}
        held: dict[socket.socket, list[bytes]] = {client: [], upstream: []}
        eof: set[socket.socket] = set()
        armed = False  # hold: the answer that starts it went by
        tail = b""  # the end of the last answer, should those bytes straddle two reads
        while not self._closed:
            mode = self.mode(pid, role)
            armed = armed and mode.kind == "hold"
            for src in (client, upstream):
                if not mode.holds(src is upstream, armed):  # healed: deliver what was held
                    for data in held[src]:
                        peer[src].sendall(data)
                    held[src].clear()
            if any(not mode.holds(s is upstream, armed) for s in eof):  # an end not held
                return
            readable = [s for s in (client, upstream) if s not in eof]
            ready, _, _ = select.select(readable, [], [], 0.05)
            for src in ready:
                data = src.recv(65536)
                if not data:
                    eof.add(src)
                    continue
                mode = self.mode(pid, role)
                if mode.kind == "hold" and src is upstream and not armed:
                    armed = mode.after in tail + data
                    tail = data[-len(mode.after) :] if mode.after else b""
                if mode.holds(src is upstream, armed):
                    held[src].append(data)
                    continue
                if mode.kind == "delay" and mode.delay > 0:
                    time.sleep(mode.delay)
                peer[src].sendall(data)
