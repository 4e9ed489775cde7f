"""Enqueue inside a Django transaction (the `django` extra: README "Installing"; Django's
psycopg 3 backend): add "leasework.contrib.django" to INSTALLED_APPS, and `manage.py migrate`
installs and upgrades the leasework schema; `manage.py leasework supervise` runs the leasework
CLI on the database and app named by the LEASEWORK setting:

    LEASEWORK = {"APP": "myproject.tasks:app", "DATABASE": "default"}   # both optional

`enqueue(app, connection, kind, payload)` writes the run on Django's own connection (a
DatabaseWrapper such as django.db.connection, or an alias), inside `transaction.atomic()` when
one is open, so the run commits and rolls back with the ORM's rows."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import psycopg

from ...app import App
from ...config import Config
from ...db import migrate as migrate_leasework
from ...errors import ConfigError

WANT = "a Django database connection (django.db.connection, connections[alias]) or an alias"


def _wrapper(connection: Any, via: str) -> Any:
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(connection, ConnectionProxy):  # django.db.connection: the default alias's
        connection = connections[connection._alias]
    if isinstance(connection, str):
        if connection not in connections:
            known = ", ".join(connections) or "none"
            raise TypeError(f"{via}: no Django database {connection!r}; DATABASES has {known}")
        connection = connections[connection]
    if not isinstance(connection, BaseDatabaseWrapper):
        cls = type(connection)
        raise TypeError(f"{via} needs {WANT}, got {cls.__module__}.{cls.__qualname__}")
    return connection


def connection(connection: Any = "default", *, via: str = "connection") -> psycopg.Connection[Any]:
    """The psycopg connection under a Django connection (opened if need be), in the transaction
    Django has open on it (transaction.atomic), else in autocommit as Django is. Raises
    TypeError for anything but a PostgreSQL connection on psycopg 3."""
    wrapper = _wrapper(connection, via)
    if wrapper.vendor != "postgresql":
        raise TypeError(f"{via} needs a PostgreSQL database, got Django's {wrapper.vendor} backend")
    wrapper.ensure_connection()
    raw = wrapper.connection
    if not isinstance(raw, psycopg.Connection):
        cls = type(raw)
        raise TypeError(
            f"{via} needs Django's PostgreSQL backend on psycopg 3 (pip install 'psycopg[binary]'"
            f"), got a {cls.__module__}.{cls.__qualname__} connection"
        )
    if wrapper.in_atomic_block:
        # Django opens its transaction lazily, at the first query: make sure the enqueue lands
        # in it (and not in a transaction of psycopg's own making that Django knows nothing of).
        with wrapper.cursor() as cur:
            cur.execute("SELECT 1")
    return raw


def enqueue(app: App, connection_: Any, kind: str, payload: Any = None, **options: Any) -> int:
    """App.enqueue on Django's connection: inside transaction.atomic() the run commits or rolls
    back with it. Takes App.enqueue's options (key, tenant, group, exclusive, priority, delay,
    max_attempts, unique_for, debounce, debounce_max, debounce_merge)."""
    return app.enqueue(connection(connection_, via="enqueue"), kind, payload, **options)


def enqueue_many(
    app: App, connection_: Any, kind: str, payloads: Iterable[Any], **options: Any
) -> list[int]:
    """App.enqueue_many on Django's connection."""
    return app.enqueue_many(connection(connection_, via="enqueue_many"), kind, payloads, **options)


def setting() -> dict[str, Any]:
    """settings.LEASEWORK, checked: a dict with at most APP, DATABASE and DSN."""
    from django.conf import settings

    value = getattr(settings, "LEASEWORK", {})
    if not isinstance(value, dict):
        raise ConfigError(f"settings.LEASEWORK must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - {"APP", "DATABASE", "DSN"})
    if unknown:
        raise ConfigError(
            f"settings.LEASEWORK: unknown key {unknown[0]!r}; keys: APP, DATABASE, DSN"
        )
    return value


def dsn(alias: str | None = None) -> str:
    """The DSN leasework uses under Django: LEASEWORK["DSN"], else the connection settings of
    LEASEWORK["DATABASE"] (default "default")."""
    from django.db import connections

    conf = setting()
    if conf.get("DSN"):
        return str(conf["DSN"])
    alias = alias or conf.get("DATABASE", "default")
    if alias not in connections:
        raise ConfigError(f"settings.LEASEWORK: DATABASE {alias!r} is not in DATABASES")
    params = connections[alias].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.pop("server_side_binding", None)
    params.pop("prepare_threshold", None)
    keep = {k: str(v) for k, v in params.items() if isinstance(v, str | int) and v != ""}
    return psycopg.conninfo.make_conninfo(**keep)


def app() -> App:
    """The App named by LEASEWORK["APP"] ("module:attr")."""
    target = setting().get("APP")
    if not target or ":" not in str(target):
        raise ConfigError(f'settings.LEASEWORK["APP"] must look like "module:attr", got {target!r}')
    module, _, attr = str(target).partition(":")
    found = getattr(importlib.import_module(module), attr)
    if not isinstance(found, App):
        raise ConfigError(f'settings.LEASEWORK["APP"] {target!r} is not a leasework App')
    return found


def migrate_schema(connection_: Any) -> None:
    """Bring the leasework schema up to date on a Django connection (the Django migrations of
    this app call it, inside the migration's transaction when there is one)."""
    migrate_leasework(connection(connection_, via="migrate_schema"))


__all__ = ["Config", "app", "connection", "dsn", "enqueue", "enqueue_many", "migrate_schema"]
