"""The lease rules, statement by statement, on real Postgres, one file per rule. Time moves by
shifting the database clock or the lease columns, never by sleeping."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest


@pytest.fixture
def other(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A second connection (autocommit), for what another worker sees."""
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c
