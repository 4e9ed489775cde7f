"""A hypothesis fuzz per surface, with the invariants of issue 18: the enqueue API stores exactly
what it was given or refuses in one line writing nothing; the CLI keeps a payload exact or exits
2 in one line; an accepted config has every number inside its range; no dashboard URL gets a 5xx,
a traceback or a write. (tests/db/test_fuzz.py draws the older, wider shapes.)"""

from __future__ import annotations

import io
import json
import math
import socket
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import App, LeaseworkError, cli
from leasework import config as configmod

from ..conftest import fast_config
from ..db.dashboard_helpers import running_dashboard

FUZZ = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

numbers = (
    st.integers()
    | st.integers(min_value=2**62, max_value=2**80)
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -0.0])
)
strings = st.text(max_size=12) | st.sampled_from(["\\u0000", "\x00", "\x1b[2J", "\\\\u0000"])
payloads = st.recursive(
    st.none() | st.booleans() | numbers | strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=10,
)


def _counts(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM leasework.runs), (SELECT count(*) FROM leasework.tenants)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values, and numbers of the same value (-0.0 == 0 is fine)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        # jsonb keeps a float's shortest decimal form (2.981876771287887e16), which reads back
        # as the integer it spells: the same JSON number, the same float
        return isinstance(a, int | float) and isinstance(b, int | float) and float(a) == float(b)
    return bool(a == b)


@FUZZ
@given(
    payload=payloads,
    exclusive=st.booleans() | st.none() | st.integers() | st.text(max_size=3),
    delay=numbers,
    key=st.none() | strings,
)
def test_the_api_stores_exactly_what_it_was_given_or_nothing(
    conn: Any, payload: Any, exclusive: Any, delay: Any, key: Any
) -> None:
    app = App()
    app.task("job")(lambda ctx, p: None)
    before = _counts(conn)
    try:
        with conn.transaction():
            run_id = app.enqueue(conn, "job", payload, exclusive=exclusive, delay=delay, key=key)
    except LeaseworkError as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) < 1000
        assert _counts(conn) == before
        return
    stored, stored_exclusive = conn.execute(
        "SELECT payload, exclusive FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert _same(stored, {} if payload is None else payload), (stored, payload)
    assert stored_exclusive is exclusive
    assert 0 <= delay <= 365 * 86400
    conn.execute("TRUNCATE leasework.runs, leasework.tenants")


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "secfuzzapp.py").write_text(
        "from leasework import App\napp = App()\napp.task('job')(lambda ctx, p: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "secfuzzapp:app"


json_texts = payloads.map(lambda p: json.dumps(p)) | st.sampled_from(
    ['{"x": 123456789012345678901234567890}', "[NaN]", "-Infinity", '"\\u0000"', "1e999"]
)


@FUZZ
@given(
    payload=json_texts,
    extra=st.lists(
        st.sampled_from(["--delay", "--priority", "--max-attempts", "--key", "--exclusive"])
        | st.sampled_from(["1e12", "nan", "-1", "3000000000", "x\x1b[2J", "10" * 200]),
        max_size=4,
    ),
)
def test_the_cli_keeps_a_payload_exact_or_exits_2(
    conn: Any, dsn: str, app_module: str, payload: str, extra: list[str]
) -> None:
    before = _counts(conn)
    out, err = io.StringIO(), io.StringIO()
    argv = ["enqueue", "--dsn", dsn, "--app", app_module, "job", "--payload", payload, *extra]
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(argv)
    if code == 0:
        run_id = int(out.getvalue())
        stored = conn.execute(
            "SELECT payload FROM leasework.runs WHERE id = %s", (run_id,)
        ).fetchone()[0]
        given = json.loads(payload)  # null is "no payload", stored as {} (documented)
        assert _same(stored, {} if given is None else given), (stored, payload)
        conn.execute("TRUNCATE leasework.runs, leasework.tenants")
        return
    lines = err.getvalue().strip().splitlines()
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith("leasework: ") and len(lines[0]) < 600
    assert "Traceback" not in err.getvalue() and "\x1b" not in err.getvalue()
    assert _counts(conn) == before


@FUZZ
@given(
    env=st.dictionaries(
        st.sampled_from(["LEASEWORK_" + k.upper() for k in sorted(configmod.FIELDS)])
        | st.text(alphabet="LEASWORK_PC", min_size=10, max_size=20),
        st.sampled_from(["1e308", "nan", "inf", "-1", "0", "1e-9", "3000000000", "1,2,nan"])
        | st.text(max_size=8).filter(lambda s: "\x00" not in s),
        max_size=4,
    )
)
def test_an_accepted_config_is_inside_every_range(env: dict[str, str]) -> None:
    warnings: list[str] = []
    try:
        cfg = configmod.load(env=env, warn=warnings.append)
    except LeaseworkError as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) < 1000
        return
    for name, f in configmod.FIELDS.items():
        bound = f.metadata.get("range")
        value = getattr(cfg, name)
        if bound is None or value is None:
            continue
        for item in value if isinstance(value, tuple) else (value,):
            assert math.isfinite(item) and bound.holds(item), (name, value)
    assert all("\n" not in w for w in warnings)


@pytest.fixture(scope="module")
def fuzz_dashboard(dsn: str) -> Any:
    with running_dashboard(fast_config(dsn)) as d:
        yield d


path_chars = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n "),
    max_size=40,
)
paths = (
    st.sampled_from(["/", "/runs/", "/runs/1", "/metrics", "/healthz", "/static/"]) | st.just("")
).flatmap(lambda base: path_chars.map(lambda tail: base + tail))


@FUZZ
@given(
    path=paths,
    method=st.sampled_from(["GET", "HEAD", "POST", "GET", "OPTIONS"]),
    host=st.sampled_from(["localhost", "evil.com", "[::1]", "127.0.0.1:1", ""]),
)
def test_no_dashboard_url_gets_a_5xx_or_writes(
    conn: Any, fuzz_dashboard: Any, path: str, method: str, host: str
) -> None:
    before = _counts(conn)
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode(
            "utf-8", "surrogateescape"
        )
    )
    with socket.create_connection(("127.0.0.1", fuzz_dashboard.port), timeout=20) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line = data.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1."), data[:200]
    code = int(status_line.split()[1])
    assert code < 500 or code == 503, (path, data[:300])  # 503: the database is busy, not a bug
    assert b"Traceback" not in data
    assert b"X-Frame-Options: DENY" in data
    assert _counts(conn) == before
