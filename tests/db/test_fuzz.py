"""Hostile input, drawn by hypothesis: every enqueue, config load and CLI call either gives a
correct row / config, or one clear LeaseworkError line. Never a traceback, never a partial write."""

from __future__ import annotations

import io
import math
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import App, LeaseworkError, cli
from leasework import config as configmod

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
hostile_payloads = st.recursive(
    json_scalars | st.binary(max_size=5) | st.sets(st.integers(), max_size=2),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)
labels = st.none() | st.text(max_size=250) | st.integers() | st.binary(max_size=4)


def _count(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM leasework.runs), (SELECT count(*) FROM leasework.tenants)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@FUZZ
@given(
    kind=st.sampled_from(["job", "nosuch", ""]) | st.text(max_size=30),
    payload=hostile_payloads,
    key=labels,
    tenant=labels,
    group=labels,
    priority=st.integers() | st.floats() | st.booleans(),
    delay=st.floats() | st.integers(min_value=-5, max_value=10**6),
    max_attempts=st.none() | st.integers() | st.booleans(),
)
def test_enqueue_gives_a_row_or_one_clear_error(
    conn, kind, payload, key, tenant, group, priority, delay, max_attempts
):
    app = App(App().config.replace(payload_max_bytes=2048))
    app.task("job")(lambda ctx, p: None)
    before = _count(conn)
    try:
        with conn.transaction():
            run_id = app.enqueue(
                conn,
                kind,
                payload,
                key=key,
                tenant=tenant,
                group=group,
                priority=priority,
                delay=delay,
                max_attempts=max_attempts,
            )
    except LeaseworkError as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message
        assert _count(conn) == before, "a refused enqueue wrote something"
        return
    row = conn.execute(
        'SELECT kind, key, tenant, "group", priority, status FROM leasework.runs WHERE id = %s',
        (run_id,),
    ).fetchone()
    assert row is not None and row[0] == kind == "job"
    assert (row[1], row[2], row[3], row[4]) == (key, tenant, group, priority)
    assert row[5] == "queued"
    assert isinstance(delay, int | float) and math.isfinite(delay) and delay >= 0
    conn.execute("TRUNCATE leasework.runs, leasework.tenants")


config_values = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.lists(st.integers() | st.floats() | st.text(max_size=3), max_size=3)
)


@FUZZ
@given(
    raw=st.dictionaries(
        st.sampled_from(sorted(configmod.FIELDS)) | st.text(max_size=10), config_values, max_size=4
    ),
    env=st.dictionaries(
        st.sampled_from(["LEASEWORK_" + k.upper() for k in sorted(configmod.FIELDS)]),
        st.text(max_size=12).filter(lambda s: "\x00" not in s),
        max_size=3,
    ),
)
def test_config_gives_a_config_or_one_clear_error(tmp_path_factory, raw, env):
    import tomllib

    path = tmp_path_factory.mktemp("cfg") / "leasework.toml"
    lines = []
    for key, value in raw.items():
        if value is None:
            continue
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    text = "\n".join(lines) + "\n"
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return  # not a TOML document we managed to write; the loader's own error is tested elsewhere
    path.write_text(text, encoding="utf-8")
    try:
        cfg = configmod.load(path, env=env)
    except LeaseworkError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    timing = configmod.lease_timing(cfg)
    assert timing.renew < cfg.lease / 2
    assert timing.control < timing.renew


def _toml_key(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _toml_key(value)
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


@pytest.fixture
def app_module(tmp_path, monkeypatch):
    (tmp_path / "fuzzapp.py").write_text(
        "from leasework import App\napp = App()\napp.task('job')(lambda ctx, p: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fuzzapp:app"


@FUZZ
@given(
    args=st.lists(
        st.sampled_from(
            [
                "job",
                "nosuch",
                "--payload",
                "--key",
                "--tenant",
                "--delay",
                "--priority",
                "--max-attempts",
                "--exclusive",
                "--group",
                "{}",
                "[1]",
                "{bad",
                "-1",
                "nan",
                "99999999999999999999",
                "x" * 300,
                "\x01",
                "--nope",
            ]
        )
        | st.text(max_size=12).filter(lambda s: "\x00" not in s),
        max_size=6,
    )
)
def test_cli_enqueue_exits_cleanly(conn, dsn, app_module, args):
    before = _count(conn)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(["enqueue", "--dsn", dsn, "--app", app_module, *args])
    assert code in (0, 1, 2)
    if code == 0:
        assert out.getvalue().strip().isdigit()
        conn.execute("TRUNCATE leasework.runs, leasework.tenants")
    else:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("leasework: "), err.getvalue()
        assert "Traceback" not in err.getvalue()
        assert _count(conn) == before
    sys.stdout.flush()
