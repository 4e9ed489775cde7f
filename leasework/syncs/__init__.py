"""The connection-sync family: connections to upstream providers, synced on a schedule by the
`sync` kind and drained by the `purge` kind, both run by the engine's runs stage. Opt in with
`syncs = app.use(Syncs())`; `syncs` is then the family's API (connectors, connect, sync_now,
disconnect, reconnect, delete_connection). Nothing in the engine imports this package."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from .. import log
from ..app import App, Family
from ..config import Config
from ..errors import ConfigError
from ..stages.maintenance import Pruner
from ..stages.maintenance import settings as maintenance
from ..tasks import check_label
from ..workers.stage import Stage
from . import kinds
from .connectors import CheckConfig, Connection, Connector, Extract, Row, Table, TableError
from .kinds import SyncSettings
from .local_files import files_connector

Conn = psycopg.Connection[Any]

__all__ = ["Connection", "Connector", "Row", "SyncSettings", "Syncs", "Table", "TableError"]


def builtin_connectors() -> dict[str, Connector]:
    """The connectors every Syncs family starts with (`files`: CSV and JSON files on disk)."""
    return {files_connector.provider: files_connector}


class Syncs(Family):
    """The family: installed on one app with `app.use(Syncs())`."""

    name = "syncs"
    config_sections = (SyncSettings,)

    def __init__(self) -> None:
        self.connectors: dict[str, Connector] = builtin_connectors()
        self._kinds = kinds.ConnectionKinds(self)

    # -- the family's side of the app ---------------------------------------------------------

    def install(self, app: App) -> None:
        self._kinds = kinds.ConnectionKinds(self)
        for task in self._kinds.tasks():
            app.register(task)

    @property
    def settings(self) -> SyncSettings:
        return self.config.section(SyncSettings)

    def stages(self, config: Config) -> list[Stage]:
        return []  # its kinds run in the engine's runs stage

    def enqueue_due(self, conn: Conn, limit: int) -> int:
        """Enqueue a sync for each due active connection (bounded); returns how many were due.
        The no-backlog rule is in the statement (syncs.sql, advance_due_connections)."""
        with conn.transaction():
            rows = conn.execute(kinds.Q["advance_due_connections"], {"limit": limit}).fetchall()
            for connection_id, workspace, provider in rows:
                run_id = kinds.enqueue_sync(self, conn, connection_id, workspace, provider)
                log.event("sync_scheduled", connection_id=connection_id, run_id=run_id)
        return len(rows)

    def next_due(self, conn: Conn) -> float | None:
        """Seconds until the first active connection's sync is due; None: none is scheduled. A
        connection made or resumed meanwhile is seen at the schedule stage's next turn, at most
        idle_poll_max later (its first sync is enqueued at once and NOTIFYs)."""
        row = conn.execute(kinds.Q["next_due_connection"]).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def pruners(self) -> list[Pruner]:
        return [
            Pruner("prune_tombstones", lambda c: maintenance(c).prune_interval, self._prune_tombstones)
        ]

    def _prune_tombstones(self, conn: Conn, config: Config, limit: int) -> int:
        """Records tombstoned (gone upstream) longer ago than the retention."""
        params = {"retention": config.section(SyncSettings).retention_tombstones, "limit": limit}
        return len(conn.execute(kinds.Q["prune_tombstones"], params).fetchall())

    # -- the API ------------------------------------------------------------------------------

    def connector(
        self, provider: str, *, check_config: CheckConfig | None = None
    ) -> Callable[[Extract], Extract]:
        """Register `extract(ctx, connection)` as the connector of `provider`: it yields
        `Table(name, rows)`; a table it cannot read raises `TableError(retryable=...)`."""
        check_label("provider", provider)

        def register(fn: Extract) -> Extract:
            self.add_connector(Connector(provider, fn, check_config))
            return fn

        return register

    def add_connector(self, connector: Connector) -> None:
        """Register a connector; a provider can be registered once (built-ins may be replaced)."""
        known = self.connectors.get(connector.provider)
        if known is not None and known is not builtin_connectors().get(connector.provider):
            raise ConfigError(f"provider {connector.provider!r} is registered twice")
        self.connectors[connector.provider] = connector

    def connect(
        self,
        conn: Conn,
        *,
        workspace: str,
        provider: str,
        config: dict[str, Any] | None = None,
        every: float | None = None,
        sync: bool = True,
    ) -> int:
        """Make a connection and (unless sync=False) enqueue its first sync, in the caller's
        transaction. With `every` seconds the schedule stage syncs it again every period.
        Returns the connection id."""
        return kinds.connect(
            self,
            conn,
            workspace=workspace,
            provider=provider,
            config=config,
            every=every,
            sync=sync,
        )

    def sync_now(self, conn: Conn, connection_id: int) -> int:
        """Enqueue a sync of an active connection; returns the run id (an already queued or
        running sync's id if there is one)."""
        return kinds.sync_now(self, conn, connection_id)

    def disconnect(self, conn: Conn, connection_id: int) -> str:
        """Stop syncing a connection (it keeps its records)."""
        return kinds.disconnect(self, conn, connection_id)

    def reconnect(self, conn: Conn, connection_id: int) -> str:
        """Make a disconnected connection active again."""
        return kinds.reconnect(self, conn, connection_id)

    def delete_connection(self, conn: Conn, connection_id: int) -> int:
        """Delete a connection: `deleting` now, its records and row removed by a purge run that
        drains behind any running sync. Returns the purge run's id."""
        return kinds.delete_connection(self, conn, connection_id)
