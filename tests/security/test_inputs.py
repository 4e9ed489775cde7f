"""Every reproduction of issue 18 on the inputs: numbers out of range, payloads that would change
silently, DSN secrets, terminal escapes and config files that are not files. Each one is one
line on stderr naming what was wrong and what would be valid, exit 2, nothing written."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from leasework import App
from leasework.cli import config_sections
from leasework.config import load
from leasework.errors import ConfigError, PayloadError, ResultError
from leasework.leases import lease

from ..conftest import fast_config


def one_line_exit_2(result: Any, needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("leasework: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr and not result.stdout


def count(conn: Any) -> int:
    return int(conn.execute("SELECT count(*) FROM leasework.runs").fetchone()[0])


# -- numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--delay", "1e12"], "delay must be a number of seconds from 0 to 31536000"),
        (["--delay", "1e13"], "delay must be"),
        (["--delay", "1" + "0" * 400], "delay must be"),
        (["--delay", "nan"], "delay must be"),
        (["--delay", "inf"], "delay must be"),
        (["--delay", "-1"], "delay must be"),
        (["--max-attempts", "3000000000"], "max_attempts must be an integer from 1 to 1000"),
        (["--priority", "9999999999"], "priority must be a 32-bit integer"),
        (["--payload", '{"x": 123456789012345678901234567890}'], "outside the 64-bit range"),
        (["--payload", '{"nan": NaN}'], "NaN is not JSON"),
        (["--payload", '{"x": Infinity}'], "Infinity is not JSON"),
        (["--payload", '{"x": 1e400}'], "NaN or infinite"),
        (["--payload", '"\\u0000"'], "NUL character"),
        (["--payload", "[" * 100_000], "--payload"),
        (["--key", "x" * 100_000], "key must be"),
        (["--tenant", "a\x1b[2Jb"], "contains control characters"),
    ],
)
def test_enqueue_refuses_in_one_line(conn: Any, cli: Any, args: list[str], needle: str) -> None:
    result = cli("enqueue", "echo", "--app", "secapp:app", *args)
    one_line_exit_2(result, needle)
    assert len(result.stderr) < 600  # the input is not echoed whole
    assert "\x1b" not in result.stderr
    assert count(conn) == 0


def test_enqueue_refuses_a_reserved_key_in_one_line(conn: Any, cli: Any) -> None:
    """Keys under "leasework:" are the families' (a connection's, a file's): refused, exit 2."""
    result = cli("enqueue", "echo", "--app", "secapp:app", "--key", "leasework:connection:1")
    one_line_exit_2(result, "keys starting with 'leasework:' are reserved")
    assert count(conn) == 0


def test_big_integers_up_to_64_bits_are_kept_exact(conn: Any, cli: Any) -> None:
    payload = '{"max": 18446744073709551615, "min": -9223372036854775808, "text": "\\\\u0000"}'
    result = cli("enqueue", "echo", "--app", "secapp:app", "--payload", payload)
    assert result.returncode == 0, result.stderr
    row = conn.execute("SELECT payload FROM leasework.runs").fetchone()[0]
    assert row == {"max": 2**64 - 1, "min": -(2**63), "text": "\\u0000"}


@pytest.mark.parametrize(
    ("setting", "value", "needle"),
    [
        ("LEASEWORK_LEASE", "1e308", "lease must be 1 to 86400"),
        ("LEASEWORK_EXPAND_RECLAIM", "1e300", "expand_reclaim must be"),
        ("LEASEWORK_MAX_ATTEMPTS", "3000000000", "max_attempts must be 1 to 1000"),
        ("LEASEWORK_EMBEDDING_DIM", "1000000000", "embedding_dim must be 1 to 16384"),
        ("LEASEWORK_POOL_SIZE", "100000", "pool_size must be 2 to 100"),
        ("LEASEWORK_POLL_INTERVAL", "1e-9", "poll_interval must be 0.01 to 3600"),
        ("LEASEWORK_BACKOFF", "nan", "backoff must be"),
        ("LEASEWORK_BACKOFF", "1,inf", "backoff must be"),
        ("LEASEWORK_BACKOFF", "1e300", "backoff must be 1-100 items, each 0 to 2592000"),
        ("LEASEWORK_PROCESSES", "100000", "processes must be 1 to 1024"),
    ],
)
def test_settings_out_of_range_exit_2(cli: Any, setting: str, value: str, needle: str) -> None:
    one_line_exit_2(cli("config", env={setting: value}), needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("lease = 1e308\n", "lease must be"),
        ("backoff = [nan]\n", "backoff must be"),
        ("backoff = [inf]\n", "backoff must be"),
        ("backoff = [1e300]\n", "backoff must be"),
        ("max_attempts = 3000000000\n", "max_attempts must be"),
        ("embedding_dim = 1e9\n", "embedding_dim must be an integer"),
        ("pool_size = 100000\n", "pool_size must be"),
        ("poll_interval = 1e-9\n", "poll_interval must be"),
        ("processs = 3\n", "did you mean .processes."),
    ],
)
def test_config_file_values_out_of_range_name_key_and_file(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = tmp_path / "lw.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as err:
        # As the CLI reads it: the families' sections (embedding_dim is the documents') are
        # known, declared by the built-in app, not left to whichever test imported them first.
        load(path, env={}, prepare=config_sections)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_every_numeric_setting_has_a_range() -> None:
    from leasework.config import FIELDS

    for name, f in FIELDS.items():
        if f.type in ("int", "float", "float | None", "tuple[float, ...]"):
            assert "range" in f.metadata, f"{name} has no range"


def test_misspelt_variables_get_a_did_you_mean(cli: Any) -> None:
    result = cli("config", env={"LEASEWORK_PROCESES": "8"})
    assert result.returncode == 0
    assert (
        "leasework: warning: LEASEWORK_PROCESES is not a leasework setting and is ignored; "
        "did you mean LEASEWORK_PROCESSES?" in result.stderr
    )
    warnings: list[str] = []
    load(env={"LEASEWORK_LEASEE": "3", "LEASEWORK_TEST_DSN": "x"}, warn=warnings.append)
    assert warnings == [
        "LEASEWORK_LEASEE is not a leasework setting and is ignored; did you mean LEASEWORK_LEASE?"
    ]


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("LEASEWORK_PROCESSES", "\u0661\u0662"),  # Arabic-Indic 12, which int() reads
        ("LEASEWORK_PROCESSES", "1_0"),  # 10 to int()
        ("LEASEWORK_PROCESSES", "\uff18"),  # a fullwidth 8
        ("LEASEWORK_LEASE", "\u0663\u0660"),
        ("LEASEWORK_LEASE", "3_0.5"),
        ("LEASEWORK_BACKOFF", "1,2_0"),
        ("LEASEWORK_BACKOFF", "1,\u0662"),
    ],
)
def test_environment_numbers_are_ascii_digits(cli: Any, setting: str, value: str) -> None:
    result = cli("config", env={setting: value})
    one_line_exit_2(result, "in ASCII digits (like ")
    assert setting in result.stderr


def test_a_pool_spec_counts_in_ascii_digits(cli: Any) -> None:
    one_line_exit_2(
        cli("config", env={"LEASEWORK_POOLS": "io:\u0662:fetch"}),
        "processes must be an integer",
    )
    assert cli("config", env={"LEASEWORK_POOLS": "io:2:fetch"}).returncode == 0


# -- the config file --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "lease = " + "[" * 5000 + "1" + "]" * 5000 + "\n",
        "app = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n",
        "backoff = " + "[" * 100_000 + "\n",
    ],
    ids=["arrays", "inline-tables", "unclosed"],
)
def test_a_deeply_nested_config_file_is_refused_in_one_line(
    tmp_path: Path, cli: Any, text: str
) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(text)
    one_line_exit_2(cli("config", "--config", str(path)), "nests arrays or inline tables")
    with pytest.raises(ConfigError, match="too deeply"):
        load(path, env={})


def test_config_shows_control_characters_escaped_as_valid_toml(tmp_path: Path, cli: Any) -> None:
    """ESC, a C1 CSI, a bidi override and a line separator in a DSN and in the app's name: the
    printout is TOML that reads back to the same (redacted) values, with none of them raw."""
    import tomllib

    dsn = "host=h application_name=a\x1b[2Jb\u009b2J\u202egnp\u2028x password=Sec\x1bret"
    result = cli("config", with_dsn=False, env={"LEASEWORK_DSN": dsn, "LEASEWORK_APP": 'a"\x1b'})
    assert result.returncode == 0, result.stderr
    for raw in ("\x1b", "\u009b", "\u202e", "\u2028", "Sec"):
        assert raw not in result.stdout
    assert "\\u001B[2J" in result.stdout
    printed = tomllib.loads(result.stdout)
    assert (
        printed["dsn"] == "host=h application_name=a\x1b[2Jb\u009b2J\u202egnp\u2028x password=***"
    )
    assert printed["app"] == 'a"\x1b'


def test_config_file_must_be_a_small_regular_file(tmp_path: Path, cli: Any) -> None:
    one_line_exit_2(cli("config", env={"LEASEWORK_CONFIG": "/dev/zero"}), "is a device")
    one_line_exit_2(cli("config", env={"LEASEWORK_CONFIG": "/dev/urandom"}), "is a device")
    one_line_exit_2(cli("config", "--config", str(tmp_path)), "is a directory")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    one_line_exit_2(cli("config", "--config", str(fifo), timeout=10), "is a FIFO")
    big = tmp_path / "big.toml"
    with big.open("wb") as fh:
        fh.truncate(50 << 20)  # sparse
    one_line_exit_2(cli("config", "--config", str(big)), "is over 1048576 bytes")


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbfmax_attempts = 7\n")
    assert load(path, env={}).max_attempts == 7


# -- payloads and results ------------------------------------------------------------------------


def _app() -> App:
    app = App()

    @app.task("echo")
    def echo(ctx: Any, payload: Any) -> Any:
        return payload

    return app


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"nan": math.nan}, "NaN or infinite"),
        ({"x": [1.0, math.inf]}, "NaN or infinite"),
        ({"x": -math.inf}, "NaN or infinite"),
        ({"x": 123456789012345678901234567890}, "outside the 64-bit range"),
        ({"x": "a\x00b"}, "NUL character"),
    ],
)
def test_the_api_refuses_payloads_it_would_change(conn: Any, payload: Any, needle: str) -> None:
    with pytest.raises(PayloadError, match=needle):
        _app().enqueue(conn, "echo", payload)
    assert count(conn) == 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"exclusive": "no"}, "exclusive must be true or false"),
        ({"exclusive": 1}, "exclusive must be true or false"),
        ({"delay": 1e10}, "delay must be"),
        ({"delay": 10**400}, "delay must be"),
        ({"delay": math.nan}, "delay must be"),
    ],
)
def test_the_api_type_checks_its_arguments(conn: Any, kwargs: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _app().enqueue(conn, "echo", {}, **kwargs)
    assert count(conn) == 0


def test_enqueue_many_keys_must_be_a_list(conn: Any) -> None:
    with pytest.raises(ConfigError, match="keys must be a list"):
        _app().enqueue_many(conn, "echo", [{}, {}], keys="ab")  # type: ignore[arg-type]
    assert count(conn) == 0


def test_the_text_backslash_u0000_is_accepted(conn: Any) -> None:
    run_id = _app().enqueue(conn, "echo", {"t": "\\u0000", "u": "\\\\u0000"})
    got = conn.execute("SELECT payload FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert got == ({"t": "\\u0000", "u": "\\\\u0000"},)


def test_results_are_capped_like_payloads(conn: Any, make_worker: Any) -> None:
    app = App()

    @app.task("big", max_attempts=1)
    def big(ctx: Any, payload: Any) -> Any:
        return {"blob": "x" * 5000}

    run_id = app.enqueue(conn, "big", {})
    make_worker(app, result_max_bytes=1024).poll()
    status, result, error = conn.execute(
        "SELECT status, result, error FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert (status, result) == ("failed", None)
    assert "over the cap of 1024 bytes" in error
    with pytest.raises(ResultError, match="NaN"):
        lease.encode_result({"x": math.nan})


# -- secrets ---------------------------------------------------------------------------------


SECRET_DSNS = [
    "postgresql://postgres:Pa@ssSecretHalf@127.0.0.1/db",
    "host=127.0.0.1 password=Top\\ SecretHalf user",
    "host=127.0.0.1 password=Top SecretHalf",
    "postgresql://postgres:Top SecretHalf@127.0.0.1/db",
    "postgresql://postgres:%ZZSecretHalf@127.0.0.1/db",
]


@pytest.mark.parametrize("dsn", SECRET_DSNS)
def test_a_malformed_dsn_never_prints_its_secret(cli: Any, dsn: str) -> None:
    for args in (["status", "--dsn", dsn], ["migrate"], ["config"]):
        env = {} if "--dsn" in args else {"LEASEWORK_DSN": dsn}
        result = cli(*args, with_dsn=False, env=env)
        assert "SecretHalf" not in result.stderr + result.stdout, (args, result)
        assert "Traceback" not in result.stderr
        if args[0] != "config":
            assert result.returncode == 2 and "the DSN is malformed" in result.stderr


def test_config_prints_a_password_with_an_escaped_space_hidden(cli: Any) -> None:
    result = cli("config", with_dsn=False, env={"LEASEWORK_DSN": "host=h password=Top\\ Secret"})
    assert result.returncode == 0
    assert 'dsn = "host=h password=***"' in result.stdout
    assert "Secret" not in result.stdout


def test_a_password_on_the_command_line_is_warned_about(cli: Any, dsn: str) -> None:
    from psycopg.conninfo import make_conninfo

    with_password = make_conninfo(dsn, password="s3cretpw")
    result = cli("config", "--dsn", with_password, with_dsn=False)
    assert result.returncode == 0
    assert result.stderr.startswith("leasework: warning: --dsn carries a password")
    assert "LEASEWORK_DSN" in result.stderr and ".pgpass" in result.stderr
    assert "s3cretpw" not in result.stderr + result.stdout
    assert "warning" not in cli("config", "--dsn", dsn, with_dsn=False).stderr


def test_the_dashboard_never_shows_a_malformed_dsns_secret(conn: Any) -> None:
    from ..db.dashboard_helpers import request, running_dashboard

    for dsn in SECRET_DSNS:
        with running_dashboard(fast_config(dsn)) as d:
            for path in ("healthz", ""):
                resp = request(f"{d.url}{path}")
                assert resp.status == 503
                assert "SecretHalf" not in resp.text and "the DSN is malformed" in resp.text


# -- terminal escapes --------------------------------------------------------------------------


def test_status_escapes_a_handlers_terminal_sequences(conn: Any, cli: Any) -> None:
    assert cli("enqueue", "hostile", "--app", "secapp:app").returncode == 0
    assert cli("worker", "--once", "--app", "secapp:app").returncode == 0
    assert conn.execute("SELECT status FROM leasework.runs").fetchone() == ("failed",)
    result = cli("status")
    assert result.returncode == 0
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b]0;PWNED\\x07" in result.stdout


def test_error_lines_escape_and_truncate(cli: Any) -> None:
    result = cli("cancel", "x\x1b[2J" + "y" * 100_000)
    assert result.returncode == 2 and "\x1b" not in result.stderr
    assert len(result.stderr) < 600


def test_ids_are_64_bit(cli: Any) -> None:
    one_line_exit_2(cli("cancel", str(10**30)), "below 2**63")
    one_line_exit_2(cli("connections", "sync", str(2**63)), "below 2**63")
