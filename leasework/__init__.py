"""leasework: leased background jobs in Postgres, for Python."""

from __future__ import annotations

from . import operations
from .app import App, Enqueued, Task
from .client import Client, KindDefaults
from .config import Config
from .errors import (
    Aborted,
    ConfigError,
    Fail,
    LeaseLost,
    LeaseworkError,
    Partial,
    PayloadError,
    Retry,
    RunCancelled,
    RunFailed,
    RunPartial,
    SchemaMissing,
    Snooze,
    StateConflict,
    UnknownKind,
    WaitTimeout,
    WrongConnection,
)
from .handles import AsyncTaskRun, TaskHandle, TaskRun
from .tasks import After
from .workers.acontext import AsyncContext
from .workers.context import Context
from .workers.worker import Worker

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "After",
    "App",
    "AsyncContext",
    "AsyncTaskRun",
    "Client",
    "Config",
    "ConfigError",
    "Context",
    "Enqueued",
    "Fail",
    "KindDefaults",
    "LeaseLost",
    "LeaseworkError",
    "Partial",
    "PayloadError",
    "Retry",
    "RunCancelled",
    "RunFailed",
    "RunPartial",
    "SchemaMissing",
    "Snooze",
    "StateConflict",
    "Task",
    "TaskHandle",
    "TaskRun",
    "UnknownKind",
    "WaitTimeout",
    "Worker",
    "WrongConnection",
    "__version__",
    "operations",
]
