"""Dashboard edges of issue 18: the rebinding guard compares parsed addresses, a bind beyond
loopback needs a token, every response (the standard library's own errors too) carries the
security headers, a request has a whole deadline and connections are capped."""

from __future__ import annotations

import base64
import socket
import time
from typing import Any

import pytest

from leasework.dashboard import server
from leasework.dashboard.server import SECURITY_HEADERS, host_allowed, is_loopback
from leasework.errors import ConfigError

from ..conftest import fast_config
from ..db.dashboard_helpers import request, running_dashboard

TOKEN = "t0ken-that-is-long-enough"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("0:0:0:0:0:0:0:1", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("::ffff:10.0.0.1", False),
        ("192.168.1.10", False),
    ],
)
def test_loopback_is_decided_on_the_parsed_address(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("bind", ["::ffff:127.0.0.1", "0:0:0:0:0:0:0:1", "::1", "127.0.0.1"])
def test_the_rebinding_guard_holds_for_every_spelling_of_loopback(bind: str) -> None:
    allowed = server._allowed_hosts(bind, 8080, ["dash.internal"])
    assert allowed is not None
    for evil in ("evil.com", "evil.com:8080", "localhost.evil.com", "127.0.0.1.evil.com",
                 "localhost:80", "[::1]:1", "user@localhost", "", "10.0.0.1"):  # fmt: skip
        assert not host_allowed(evil, allowed, 8080), (bind, evil)
    for good in ("localhost", "LOCALHOST:8080", "127.0.0.1:8080", "[::1]:8080", "[::1]",
                 "[0:0:0:0:0:0:0:1]:8080", "dash.internal", "localhost."):  # fmt: skip
        assert host_allowed(good, allowed, 8080), (bind, good)


def test_a_dashboard_bound_on_a_mapped_address_refuses_a_foreign_host(dsn: str) -> None:
    try:
        d_cm = running_dashboard(fast_config(dsn), host="::ffff:127.0.0.1")
        d = d_cm.__enter__()
    except ConfigError as exc:  # no IPv6 on this host
        pytest.skip(str(exc))
    try:
        url = f"http://127.0.0.1:{d.port}/healthz"
        assert request(url, headers={"Host": "evil.com"}).status == 421
        assert request(url).status == 200
    finally:
        d_cm.__exit__(None, None, None)


def test_beyond_loopback_a_token_is_required(dsn: str, cli: Any) -> None:
    with pytest.raises(ConfigError, match=r"beyond loopback.*token"):
        running_dashboard(fast_config(dsn), host="0.0.0.0").__enter__()
    result = cli("dashboard", "--host", "0.0.0.0", "--port", "0", timeout=20)
    assert result.returncode == 2
    assert "warning: the dashboard listens on 0.0.0.0, beyond loopback" in result.stderr
    assert "give a token" in result.stderr
    with running_dashboard(fast_config(dsn), host="0.0.0.0", token=TOKEN) as d:
        url = f"http://127.0.0.1:{d.port}/healthz"
        denied = request(url, headers={"Host": "evil.com"})
        assert denied.status == 401 and "WWW-Authenticate" in denied.headers
        assert request(url, headers={"Authorization": "Bearer wrong"}).status == 401
        assert request(url, headers={"Authorization": f"Bearer {TOKEN}"}).status == 200
        basic = base64.b64encode(f"me:{TOKEN}".encode()).decode()
        assert request(url, headers={"Authorization": f"Basic {basic}"}).status == 200


def _raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"BLAH\r\n\r\n", b"400"),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"414"),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n", b"431"),
        (b"FROB / HTTP/1.1\r\nHost: localhost\r\n\r\n", b"501"),
        (b"GET / HTTP/9.9\r\n\r\n", b"505"),
    ],
)
def test_the_servers_own_errors_carry_the_security_headers(
    dsn: str, data: bytes, status: bytes
) -> None:
    with running_dashboard(fast_config(dsn)) as d:
        answer = _raw(d.port, data)
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    assert head.split(" ")[1].encode() == status, head
    for name, value in SECURITY_HEADERS.items():
        assert f"{name}: {value}" in head, (name, head)


def test_a_trickling_request_is_cut_at_the_deadline(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "REQUEST_DEADLINE", 1.5)
    with running_dashboard(fast_config(dsn)) as d:
        s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
        start = time.monotonic()
        closed_after = None
        try:
            for ch in b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                s.sendall(bytes([ch]))
                time.sleep(0.2)  # each byte well within the per-read timeout
                if time.monotonic() - start > 6:
                    break
        except OSError:
            closed_after = time.monotonic() - start
        if closed_after is None:
            s.settimeout(5)
            try:
                data = s.recv(100)
            except OSError:
                data = b""
            assert data == b"", data
            closed_after = time.monotonic() - start
        s.close()
        assert closed_after < 6


def test_connections_are_capped(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "MAX_CONNECTIONS", 3)
    with running_dashboard(fast_config(dsn)) as d:
        held = [socket.create_connection(("127.0.0.1", d.port), timeout=10) for _ in range(3)]
        for s in held:
            s.sendall(b"G")  # a request begun, never finished
        time.sleep(0.3)
        extra = _raw(d.port, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n", timeout=5)
        assert extra.startswith(b"HTTP/1.1 503"), extra[:100]
        assert b"X-Frame-Options: DENY" in extra
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if request(f"{d.url}healthz").status == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("slots were not given back")


# -- framing and NUL (issue 34) ------------------------------------------------------------------

NEXT = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"


@pytest.mark.parametrize(
    "lengths",
    [
        [b"0", str(len(NEXT)).encode()],  # conflicting: the smuggling case
        [str(len(NEXT)).encode(), b"0"],
        [str(len(NEXT)).encode()] * 2,  # equal: still two framings to trust
        [b"\xb2"],  # `²` in latin-1: a digit to str.isdigit, not to int()
        [b"1\xb9"],
        [b"+5"],
        [b"-1"],
        [b"1_0"],
        [b"0x10"],
        [b""],
    ],
    ids=lambda v: "+".join(x.decode("latin-1") for x in v) or "empty",
)
def test_doubtful_content_lengths_get_400_and_the_body_is_never_a_request(
    dsn: str, capfd: pytest.CaptureFixture[str], lengths: list[bytes]
) -> None:
    head = b"POST /healthz HTTP/1.1\r\nHost: localhost\r\n"
    head += b"".join(b"Content-Length: " + n + b"\r\n" for n in lengths)
    with running_dashboard(fast_config(dsn)) as d:
        answer = _raw(d.port, head + b"\r\n" + NEXT)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the body was not served as a request
    assert b"Connection: close" in answer and b"Content-Length" in answer.split(b"\r\n\r\n")[1]
    for name, value in SECURITY_HEADERS.items():
        assert f"{name}: {value}".encode() in answer
    assert "Traceback" not in capfd.readouterr().err


def test_one_plain_content_length_still_frames_the_next_request(dsn: str) -> None:
    """The control: one honest length, and the bytes after it are the next request on the same
    connection (a body the application leaves unread closes it instead)."""
    first = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with running_dashboard(fast_config(dsn)) as d:
        answer = _raw(d.port, first + last)
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer


@pytest.mark.parametrize(
    "target",
    ["/runs?kind=%00", "/runs?status=failed&kind=a%00b", "/runs?%00=1", "/runs/%00", "/%00",
     "/kinds?x=%00", "/healthz?kind=%00"],
)  # fmt: skip
def test_a_nul_in_the_path_or_query_is_400(conn: Any, dsn: str, target: str) -> None:
    with running_dashboard(fast_config(dsn)) as d:
        resp = request(f"{d.url.rstrip('/')}{target}")
    assert resp.status == 400, (target, resp.status, resp.text[:300])
    assert "NUL" in resp.text


def test_a_nul_in_an_actions_form_is_400_and_changes_nothing(conn: Any, dsn: str) -> None:
    from leasework import App

    from ..db.dashboard_helpers import Client

    app = App()
    app.task("mail")(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "mail")
    with running_dashboard(fast_config(dsn), actions=True) as d:
        c = Client(d.url)
        token = c.token(f"/runs/{run_id}")
        resp = c.post("/kinds/pause", {"csrf": token, "kind": "mail\x00"})
        assert resp.status == 400 and "NUL" in resp.text, resp.text[:300]
        assert conn.execute("SELECT count(*) FROM leasework.paused_kinds").fetchone() == (0,)
        assert c.post("/kinds/pause", {"csrf": token, "kind": "mail"}).status == 303  # control
