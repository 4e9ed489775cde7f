"""Keys: one active run per key in its tenant (runs without a tenant: a namespace of their own);
an exclusive run waits until its key is idle, then is promoted; a key is free again once its run
ends; keys under "leasework:" are the families'."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import Enqueued
from leasework.errors import ConfigError
from leasework.leases import lease

from ...conftest import get_run
from ..checks import (
    TENANTS,
    claim_one,
    make_app,
    promotion_skips_an_open_enqueue_of_its_tenants_key,
    waiting_run_waits_for_its_key,
    waiting_run_waits_only_for_its_tenants_key,
)

Conn = psycopg.Connection[Any]


@pytest.mark.parametrize("tenant", TENANTS)
def test_waiting_exclusive_run_is_promoted_only_when_its_key_is_idle(
    conn: Conn, tenant: str | None
) -> None:
    waiting_run_waits_for_its_key(conn, tenant=tenant)


def test_exclusive_run_on_an_idle_key_is_queued_at_once(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "other", key="k", exclusive=True)
    assert get_run(conn, run_id)["status"] == "queued"


def test_key_is_free_again_after_the_run_ends(conn: Conn) -> None:
    app = make_app()
    first = app.enqueue(conn, "job", key="k")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.finish(conn, claim, "failed", error="x")
    second = app.enqueue(conn, "job", key="k")
    assert second != first


def test_a_key_is_its_tenants(conn: Conn) -> None:
    """Tenant B's enqueue of the key tenant A holds makes B's own run; the same tenant twice
    gets one run; runs without a tenant are a namespace of their own; and so for a keyed
    enqueue_many and the SQL function."""
    app = make_app()
    a = app.enqueue(conn, "job", key="report:weekly", tenant="a")
    b = app.enqueue(conn, "job", key="report:weekly", tenant="b")
    assert b != a, "tenant b's enqueue returned tenant a's run"
    assert app.enqueue_run(conn, "job", key="report:weekly", tenant="b") == Enqueued(b, True)
    assert app.enqueue(conn, "job", key="report:weekly", tenant="a") == a
    none = app.enqueue(conn, "job", key="report:weekly")
    assert none not in (a, b), "an untenanted enqueue returned a tenant's run"
    assert app.enqueue(conn, "job", key="report:weekly") == none
    sql_c = conn.execute(
        "SELECT leasework.enqueue('job', key => 'report:weekly', tenant => 'c')"
    ).fetchone()
    sql_a = conn.execute(
        "SELECT leasework.enqueue('job', key => 'report:weekly', tenant => 'a')"
    ).fetchone()
    assert sql_c is not None and sql_c[0] not in (a, b, none) and sql_a == (a,)
    # enqueue_many: a row is skipped only for its own tenant's active run of the key.
    many_d = app.enqueue_many(conn, "job", [{}, {}], keys=["report:weekly", "x"], tenant="d")
    assert len(many_d) == 2
    assert app.enqueue_many(conn, "job", [{}], keys=["report:weekly"], tenant="a") == []
    assert app.enqueue_many(conn, "job", [{}], keys=["report:weekly"]) == []
    rows = conn.execute(
        "SELECT tenant, count(*) FROM leasework.runs WHERE key = 'report:weekly'"
        " GROUP BY tenant ORDER BY tenant NULLS FIRST"
    ).fetchall()
    assert rows == [(None, 1), ("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_an_exclusive_run_waits_only_for_its_tenants_key(conn: Conn) -> None:
    waiting_run_waits_only_for_its_tenants_key(conn)


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
def test_the_promotion_skips_an_open_enqueue_of_its_tenants_key(
    conn: Conn, dsn: str, many: bool
) -> None:
    promotion_skips_an_open_enqueue_of_its_tenants_key(conn, dsn, many=many)


def test_a_reserved_key_is_refused_by_the_public_enqueue(conn: Conn) -> None:
    """Keys under "leasework:" are the families': every public enqueue refuses one, naming the
    prefix, before anything is sent; Family.enqueue may use one."""
    app = make_app()
    key = "leasework:connection:1"
    refusals = [
        lambda: app.enqueue(conn, "job", key=key),
        lambda: app.enqueue_run(conn, "job", key=key, tenant="t"),
        lambda: app.enqueue_many(conn, "job", [{}], keys=[key]),
    ]
    for refused in refusals:
        with pytest.raises(ConfigError, match="keys starting with 'leasework:' are reserved"):
            refused()
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)
    # A prefix that only looks alike is a key like any other.
    assert app.enqueue(conn, "job", key="leasework-connection:1") > 0
    assert app.enqueue(conn, "job", key="Leasework:connection:1") > 0
    assert app.enqueue_reserved(conn, "job", key=key) > 0
