"""Every reader shows what an older row holds escaped: labels, errors, payloads, worker and
schedule names holding C0 and C1 controls, DEL, bidi controls and line separators (written
before leasework refused them, or by the owner) reach no terminal and no page raw. Text outputs
show them as `\\x9b`, `\\u202e`; `--json` outputs as `\\u` escapes, the same JSON values."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from leasework.cli import main
from leasework.text import UNSAFE

from ..conftest import fast_config
from ..db.dashboard_helpers import request, running_dashboard

Conn = psycopg.Connection[Any]

# One of each class: CSI (C1), RLO and LRI (bidi), ALM, the separators, DEL, ESC.
HOSTILE = "a\x9b2J\u202egnp.exe\u2028b\u2029c\u061cd\u2066e\x7ff\x1b[31mg"
RAW = frozenset(UNSAFE - {0x09, 0x0A})  # tab and newline are layout in every output

ROWS = [
    'INSERT INTO leasework.runs (kind, key, tenant, "group", payload) VALUES'
    " ('echo', %(v)s, %(v)s, %(v)s, %(payload)s)",
    "INSERT INTO leasework.runs (kind, key, status, lease_owner, lease_expires_at, lease_worker,"
    " started_at, attempts) VALUES ('echo', 'k2', 'running', gen_random_uuid(),"
    " now() + interval '1 hour', %(v)s, now(), 1)",
    "INSERT INTO leasework.runs (kind, status, finished_at, error, attempts, result, history)"
    " VALUES ('echo', 'failed', now(), %(v)s, 1, %(payload)s, %(history)s)",
    "INSERT INTO leasework.runs (kind, status, finished_at, error, attempts)"
    " VALUES (%(v)s, 'failed', now(), 'from an older version', 1)",
    "INSERT INTO leasework.workers (id, host, pid, started_at, heartbeat_at)"
    " VALUES (%(v)s, %(v)s, 1, now(), now())",
    "INSERT INTO leasework.tenants (name) VALUES (%(v)s) ON CONFLICT DO NOTHING",
    "INSERT INTO leasework.schedules (name, kind, every_seconds, next_run_at)"
    " VALUES (%(v)s, 'echo', 60, now())",
    "INSERT INTO leasework.connections (workspace, provider) VALUES (%(v)s, %(v)s)",
]


@pytest.fixture
def hostile(conn: Conn) -> list[int]:
    params = {
        "v": HOSTILE,
        "payload": Jsonb({"note": HOSTILE, HOSTILE: [HOSTILE]}),
        "history": Jsonb(
            [
                {
                    "attempt": 1,
                    "outcome": "failed",
                    "worker": HOSTILE,
                    "error": HOSTILE,
                    "started_at": "2024-01-01T00:00:00+00:00",
                    "ended_at": "2024-01-01T00:00:01+00:00",
                }
            ]
        ),
    }
    for statement in ROWS:
        conn.execute(statement, params)
    return [r[0] for r in conn.execute("SELECT id FROM leasework.runs ORDER BY id").fetchall()]


def raw(text: str) -> list[str]:
    """The unsafe characters `text` holds raw."""
    return sorted({f"U+{ord(c):04X}" for c in text if ord(c) in RAW})


def test_every_cli_reader_shows_them_escaped(
    dsn: str, hostile: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    commands = [
        ["status"], ["runs"], ["tenants"], ["schedules"], ["connections", "list"],
        *(["show", str(i)] for i in hostile),
    ]  # fmt: skip
    for command in commands:
        for json_out in (False, True):
            args = [*command, "--dsn", dsn, *(["--json"] if json_out else [])]
            assert main(args) == 0, args
            out = capsys.readouterr().out
            assert raw(out) == [], (args, raw(out))
            if json_out:
                json.loads(out)  # still JSON
            elif command[0] != "connections":  # its table shows no workspace
                assert "\\x9b2J\\u202egnp.exe\\u2028b" in out, (args, out)
    # The escapes are JSON's own: the values read back are the rows' values.
    assert main(["runs", "--json", "--dsn", dsn]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert HOSTILE in {r["key"] for r in runs} and HOSTILE in {r["kind"] for r in runs}
    assert main(["show", str(hostile[0]), "--json", "--dsn", dsn]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tenant"] == HOSTILE and shown["payload"] == {"note": HOSTILE, HOSTILE: [HOSTILE]}


def test_every_dashboard_page_shows_them_escaped(dsn: str, hostile: list[int]) -> None:
    pages = ["", "runs", "runs?status=failed", "kinds", "schedules", "connections", "metrics",
             *(f"runs/{i}" for i in hostile)]  # fmt: skip
    with running_dashboard(fast_config(dsn)) as d:
        for page in pages:
            resp = request(f"{d.url}{page}")
            assert resp.status == 200, (page, resp.text[:300])
            assert raw(resp.text) == [], (page, raw(resp.text))
        for page in ["runs", f"runs/{hostile[0]}", f"runs/{hostile[2]}"]:
            assert "\\x9b2J\\u202egnp.exe\\u2028b" in request(f"{d.url}{page}").text, page
