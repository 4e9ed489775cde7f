"""What a connector is: `extract(ctx, connection)` yields tables, each a name and an iterable of
rows (mappings with an `id`). Connectors read upstream; they never write to the database, the
sync stage publishes what they yield."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..errors import LeaseworkError

if TYPE_CHECKING:
    from ..workers.context import Context

Row = Mapping[str, Any]


class TableError(LeaseworkError):
    """A table the connector could not read (raised while iterating its rows, or set as
    `Table.error`). The other tables are still published; the table itself tombstones nothing.

    retryable=True: the run is retried (one endpoint briefly unavailable); False: the run is
    sealed `partial` (an endpoint that is permanently broken)."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Table:
    """One upstream table. `rows` is iterated once, lazily, in bounded batches."""

    name: str
    rows: Iterable[Row] = ()
    error: TableError | None = None


@dataclass(frozen=True)
class Connection:
    """A connection row, as the connector sees it."""

    id: int
    workspace: str
    provider: str
    status: str
    config: dict[str, Any] = field(default_factory=dict)
    sync_interval: float | None = None
    next_run_at: datetime | None = None
    created_at: datetime | None = None


Extract = Callable[["Context", Connection], Iterable[Table]]
CheckConfig = Callable[[Mapping[str, Any]], None]


@dataclass(frozen=True)
class Connector:
    """A registered provider: its `extract` and an optional check of a connection's config,
    run when the connection is made (raise ConfigError to refuse it)."""

    provider: str
    extract: Extract
    check_config: CheckConfig | None = None
    # True when `extract` yields every table the upstream has: a table with live records that
    # a finished extraction did not yield was removed upstream, and its rows are tombstoned.
    complete: bool = False


__all__ = [
    "CheckConfig",
    "Connection",
    "Connector",
    "Extract",
    "Row",
    "Table",
    "TableError",
]
