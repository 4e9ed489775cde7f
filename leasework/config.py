"""Configuration: one TOML file, overridden by LEASEWORK_* environment variables, overridden by
flags. Read and validated here, once, then passed explicitly; there are no global settings.

Every default equals the seed's figure. Unknown keys, wrong types and impossible values are
refused at start-up with the key's name and where it came from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

ENV_PREFIX = "LEASEWORK_"


def _doc(text: str, default: str | None = None) -> dict[str, str]:
    """A field's line in the reference; `default` describes a default derived from others."""
    return {"doc": text} if default is None else {"doc": text, "default": default}


@dataclass(frozen=True)
class Config:
    dsn: str | None = field(
        default=None,
        metadata=_doc("libpq connection string or URL; else DATABASE_URL, else libpq defaults"),
    )
    app: str | None = field(default=None, metadata=_doc("MODULE:ATTR of the user's App"))
    poll_interval: float = field(
        default=2.0, metadata=_doc("seconds an idle worker waits between polls")
    )
    lease: float = field(default=120.0, metadata=_doc("lease length in seconds (database time)"))
    renew_interval: float | None = field(
        default=None,
        metadata=_doc(
            "renew the lease after this many seconds; unset: a third of the lease", "lease / 3"
        ),
    )
    control_interval: float | None = field(
        default=None,
        metadata=_doc(
            "seconds between control queries (lost / cancel requested); unset: min(2, lease / 6)",
            "min(2, lease / 6)",
        ),
    )
    abort_grace: float = field(
        default=5.0,
        metadata=_doc(
            "seconds a handler gets to return once its run is cancelled, timed out, lost or shut "
            "down, before its process is killed"
        ),
    )
    heartbeat_interval: float = field(
        default=15.0, metadata=_doc("seconds between worker heartbeats")
    )
    pool_size: int = field(
        default=4,
        metadata=_doc(
            "connections per worker process for claims and handlers, one reserved for claims "
            "and outcomes; its lease keeper holds one more of its own"
        ),
    )
    max_attempts: int = field(
        default=3, metadata=_doc("attempts per run unless the task says otherwise")
    )
    backoff: tuple[float, ...] = field(
        default=(5.0, 30.0, 120.0),
        metadata=_doc("retry delays in seconds by attempt; the last repeats"),
    )
    backoff_jitter: float = field(
        default=0.2, metadata=_doc("each delay is multiplied by uniform(1 - jitter, 1 + jitter)")
    )
    payload_max_bytes: int = field(
        default=1 << 20, metadata=_doc("largest accepted payload, in bytes")
    )
    runs_limit: int = field(
        default=10, metadata=_doc("runs the `runs` stage executes per poll at most")
    )
    settle_limit: int = field(
        default=100, metadata=_doc("expired or waiting runs settled per poll at most")
    )
    schedule_limit: int = field(
        default=10,
        metadata=_doc("due connections and due periodic tasks each enqueued per poll at most"),
    )
    sync_batch: int = field(
        default=200,
        metadata=_doc("records a sync publishes (or a purge deletes) per fenced transaction"),
    )
    sync_timeout: float = field(
        default=3600.0,
        metadata=_doc("seconds a sync or purge attempt may run before it is aborted and retried"),
    )
    processes: int = field(default=2, metadata=_doc("worker processes the supervisor forks"))
    graceful_timeout: float = field(
        default=30.0, metadata=_doc("seconds a stopping worker lets its current job finish")
    )
    # -- the supervisor (supervisor/parent.py; decisions in supervisor/policy.py) ------------
    max_jobs_per_child: int = field(
        default=0,
        metadata=_doc("restart a child after this many jobs (leaky user code); 0: never"),
    )
    watchdog: bool = field(
        default=True,
        metadata=_doc("kill a child that holds a lease it stopped renewing, or went silent"),
    )
    watchdog_margin: float | None = field(
        default=None,
        metadata=_doc(
            "kill a child whose lease was not renewed for lease minus this many s; unset: lease / 6",
            "lease / 6",
        ),
    )
    deadman: bool = field(
        default=True,
        metadata=_doc(
            "a kernel timer kills a worker process before a lease it could not renew expires "
            "(even when nothing in it can run); off only to debug a paused worker"
        ),
    )
    hang_timeout: float = field(
        default=120.0,
        metadata=_doc(
            "kill a child unresponsive this many s (stopped, or a C call holding the GIL); 0: never"
        ),
    )
    restart_backoff: float = field(
        default=0.1, metadata=_doc("first restart delay in s after a crash; doubles per crash")
    )
    restart_backoff_max: float = field(
        default=30.0, metadata=_doc("longest restart delay in seconds")
    )
    restart_reset_after: float = field(
        default=30.0,
        metadata=_doc("a child up this many seconds clears its slot's crash streak"),
    )
    # -- ingest, expand, maintenance (stages/ingest.py, expand.py, maintenance.py) ------------
    file_store: str = field(
        default=".leasework/files",
        metadata=_doc("directory of the local file store (shared by every worker that ingests)"),
    )
    ingest_limit: int = field(default=1, metadata=_doc("ingest runs executed per poll at most"))
    ingest_batch: int = field(
        default=200, metadata=_doc("chunks embedded and upserted per checkpoint")
    )
    ingest_chunk_chars: int = field(
        default=1000, metadata=_doc("longest chunk, in characters (chunks break between words)")
    )
    ingest_max_bytes: int = field(
        default=512 << 20, metadata=_doc("a file larger than this many bytes fails to index")
    )
    ingest_max_pages: int = field(
        default=5000, metadata=_doc("pages indexed per document at most; the rest is truncated")
    )
    ingest_max_chunks: int = field(
        default=200_000, metadata=_doc("chunks indexed per document at most; the rest is truncated")
    )
    embedder: str | None = field(
        default=None,
        metadata=_doc("MODULE:ATTR of a callable texts -> vectors; default: feature hashing"),
    )
    embedding_dim: int = field(
        default=256, metadata=_doc("dimensions of the built-in feature-hashing embedder")
    )
    expand_limit: int = field(default=2, metadata=_doc("uploads expanded per poll at most"))
    expand_reclaim: float = field(
        default=900.0,
        metadata=_doc("seconds after which an upload stuck in processing is claimed again"),
    )
    expand_max_attempts: int = field(
        default=3, metadata=_doc("expansions of one upload before it is marked failed")
    )
    archive_max_members: int = field(
        default=10_000, metadata=_doc("an archive with more members than this is refused")
    )
    archive_max_bytes: int = field(
        default=2 << 30, metadata=_doc("an archive whose members total more bytes is refused")
    )
    archive_max_ratio: float = field(
        default=100.0,
        metadata=_doc("an archive or member compressed more than this many times is refused"),
    )
    maintenance_limit: int = field(
        default=1000, metadata=_doc("rows each maintenance handler deletes per poll at most")
    )
    prune_interval: float = field(
        default=3600.0, metadata=_doc("seconds between prunes of finished runs and uploads")
    )
    workers_prune_interval: float = field(
        default=86400.0, metadata=_doc("seconds between prunes of stopped worker rows")
    )
    retention_succeeded: float = field(
        default=7 * 86400.0, metadata=_doc("seconds a succeeded run is kept")
    )
    retention_partial: float = field(
        default=30 * 86400.0, metadata=_doc("seconds a partial run is kept")
    )
    retention_failed: float = field(
        default=30 * 86400.0, metadata=_doc("seconds a failed run is kept")
    )
    retention_cancelled: float = field(
        default=7 * 86400.0, metadata=_doc("seconds a cancelled run is kept")
    )
    retention_workers: float = field(
        default=86400.0,
        metadata=_doc("seconds a stopped (or long silent) worker row is kept"),
    )
    retention_uploads: float = field(
        default=30 * 86400.0,
        metadata=_doc("seconds a finished upload row and its archive are kept"),
    )
    retention_tombstones: float = field(
        default=30 * 86400.0,
        metadata=_doc("seconds a tombstoned record (deleted upstream) is kept"),
    )
    reconcile_interval: float = field(
        default=60.0,
        metadata=_doc("seconds between checks for files left `indexing` by an ended ingest run"),
    )
    log_level: str = field(default="info", metadata=_doc("debug, info, warning or error"))
    log_format: str = field(
        default="auto",
        metadata=_doc("json, text, or auto: text on a terminal, JSON lines otherwise"),
    )

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    # The timings derived from the lease unless set: renew at a third, control every 2 s at most,
    # the watchdog's margin a sixth (the seed's 40 s, 2 s and 20 s for a 120 s lease).

    @property
    def renew_every(self) -> float:
        return self.lease / 3 if self.renew_interval is None else self.renew_interval

    @property
    def control_every(self) -> float:
        if self.control_interval is not None:
            return self.control_interval
        return min(2.0, self.lease / 6, self.renew_every / 2)

    @property
    def kill_margin(self) -> float:
        return self.lease / 6 if self.watchdog_margin is None else self.watchdog_margin


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}
_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "text")


def _coerce(name: str, value: Any, where: str) -> Any:
    """Convert one raw value (TOML value or env string) to the field's type, or refuse it."""
    kind = FIELDS[name].type
    from_env = isinstance(value, str) and where.startswith("env")
    try:
        if kind in ("str | None", "str"):
            if not isinstance(value, str):
                raise TypeError
            return value
        if kind == "bool":
            if from_env and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if from_env and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind in ("float", "float | None"):
            if isinstance(value, bool):
                raise TypeError
            number = float(value) if from_env else value
            if not isinstance(number, int | float) or not math.isfinite(number):
                raise TypeError
            return float(number)
        if kind == "int":
            if isinstance(value, bool):
                raise TypeError
            number = int(value) if from_env else value
            if not isinstance(number, int):
                raise TypeError
            return number
        if kind == "tuple[float, ...]":
            items = value.split(",") if from_env else value
            if not isinstance(items, list | tuple) or not items:
                raise TypeError
            out = tuple(float(x) if from_env else x for x in items)
            if any(isinstance(x, bool) or not isinstance(x, int | float) for x in out):
                raise TypeError
            return tuple(float(x) for x in out)
    except (TypeError, ValueError):
        pass
    expected = {
        "float": "a number",
        "float | None": "a number",
        "int": "an integer",
        "tuple[float, ...]": "a non-empty list of numbers",
        "bool": "true or false",
    }.get(str(kind), "a string")
    raise ConfigError(f"{where}: {name} must be {expected}, got {value!r}")


def validate(cfg: Config) -> Config:
    """Refuse impossible combinations, naming the key."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"config: {key} {why}")

    for key in (
        "poll_interval",
        "sync_timeout",
        "lease",
        "renew_interval",
        "control_interval",
        "heartbeat_interval",
        "abort_grace",
    ):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise bad(key, f"must be > 0 seconds, got {value}")
    if cfg.graceful_timeout < 0:
        raise bad("graceful_timeout", f"must be >= 0 seconds, got {cfg.graceful_timeout}")
    if cfg.renew_every >= cfg.lease / 2:
        raise bad(
            "renew_interval",
            f"must be shorter than half the lease ({cfg.lease / 2:g} s), got {cfg.renew_every:g}",
        )
    if cfg.control_every >= cfg.renew_every:
        raise bad(
            "control_interval",
            f"must be shorter than renew_interval ({cfg.renew_every:g} s), got {cfg.control_every:g}",
        )
    for key in (
        "pool_size",
        "max_attempts",
        "payload_max_bytes",
        "runs_limit",
        "settle_limit",
        "schedule_limit",
        "sync_batch",
        "processes",
    ):
        if getattr(cfg, key) < 1:
            raise bad(key, f"must be a positive integer, got {getattr(cfg, key)}")
    if cfg.pool_size < 2:
        raise bad(
            "pool_size", f"must be at least 2 (one is reserved for renewal), got {cfg.pool_size}"
        )
    if any(d < 0 for d in cfg.backoff):
        raise bad("backoff", f"delays must be >= 0 seconds, got {list(cfg.backoff)}")
    if not 0 <= cfg.backoff_jitter < 1:
        raise bad("backoff_jitter", f"must be in [0, 1), got {cfg.backoff_jitter}")
    _validate_ingest(cfg, bad)
    _validate_supervisor(cfg, bad)
    if cfg.log_level.lower() not in _LOG_LEVELS:
        raise bad("log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {cfg.log_level!r}")
    if cfg.log_format.lower() not in _LOG_FORMATS:
        raise bad("log_format", f"must be one of {', '.join(_LOG_FORMATS)}, got {cfg.log_format!r}")
    return cfg


def _validate_ingest(cfg: Config, bad: Any) -> None:
    """The ingest, expand and maintenance knobs (see stages/ingest.py and its siblings)."""
    for key in (
        "ingest_limit",
        "ingest_batch",
        "ingest_max_bytes",
        "ingest_max_pages",
        "ingest_max_chunks",
        "embedding_dim",
        "expand_limit",
        "expand_max_attempts",
        "archive_max_members",
        "archive_max_bytes",
        "maintenance_limit",
    ):
        if getattr(cfg, key) < 1:
            raise bad(key, f"must be a positive integer, got {getattr(cfg, key)}")
    if cfg.ingest_chunk_chars < 16:
        raise bad("ingest_chunk_chars", f"must be at least 16, got {cfg.ingest_chunk_chars}")
    if cfg.archive_max_ratio <= 1:
        raise bad("archive_max_ratio", f"must be > 1, got {cfg.archive_max_ratio}")
    for key in (
        "expand_reclaim",
        "prune_interval",
        "workers_prune_interval",
        "retention_succeeded",
        "retention_partial",
        "retention_failed",
        "retention_cancelled",
        "retention_workers",
        "retention_uploads",
        "retention_tombstones",
        "reconcile_interval",
    ):
        if getattr(cfg, key) <= 0:
            raise bad(key, f"must be > 0 seconds, got {getattr(cfg, key)}")
    if not cfg.file_store:
        raise bad("file_store", "must be a directory path, got an empty string")
    if cfg.embedder is not None and ":" not in cfg.embedder:
        raise bad("embedder", f"must look like MODULE:ATTR, got {cfg.embedder!r}")


def _validate_supervisor(cfg: Config, bad: Any) -> None:
    """The supervisor's knobs (see supervisor/policy.py)."""
    if cfg.max_jobs_per_child < 0:
        raise bad("max_jobs_per_child", f"must be >= 0 (0: never), got {cfg.max_jobs_per_child}")
    if not 0 <= cfg.kill_margin < cfg.lease - cfg.renew_every:
        raise bad(
            "watchdog_margin",
            f"must be >= 0 and below lease - renew_interval ({cfg.lease - cfg.renew_every:g} s), "
            f"or healthy children would be killed; got {cfg.kill_margin:g}",
        )
    if cfg.hang_timeout != 0 and cfg.hang_timeout <= 2 * cfg.poll_interval:
        raise bad(
            "hang_timeout",
            f"must be 0 (off) or more than two poll intervals ({2 * cfg.poll_interval:g} s), "
            f"got {cfg.hang_timeout:g}",
        )
    if cfg.restart_backoff <= 0:
        raise bad("restart_backoff", f"must be > 0 seconds, got {cfg.restart_backoff:g}")
    if cfg.restart_backoff_max < cfg.restart_backoff:
        raise bad(
            "restart_backoff_max",
            f"must be >= restart_backoff ({cfg.restart_backoff:g} s), got {cfg.restart_backoff_max:g}",
        )
    if cfg.restart_reset_after < 0:
        raise bad("restart_reset_after", f"must be >= 0 seconds, got {cfg.restart_reset_after:g}")


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """File, then environment, then flags (None values in `overrides` are ignored)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    if path is not None:
        where = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {where} not found") from None
        except OSError as exc:
            raise ConfigError(f"config file {where} cannot be read: {exc.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {where} is not valid TOML: {exc}") from None
        for key, value in raw.items():
            if key not in FIELDS:
                raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key)}")
            values[key] = _coerce(key, value, where)
    for name in FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in env and env[var] != "":
            values[name] = _coerce(name, env[var], f"env {var}")
    if "dsn" not in values and env.get("DATABASE_URL"):
        values["dsn"] = env["DATABASE_URL"]
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    return validate(Config(**values))


def did_you_mean(key: str) -> str:
    """`; did you mean `lease`?` for a misspelt key, else where the keys are listed."""
    import difflib

    close = difflib.get_close_matches(key.lower(), list(FIELDS), n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    return " (`leasework config --reference` lists every key)"


def toml_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def reference() -> str:
    """The configuration reference as a Markdown table, generated from the field definitions:
    `leasework config --reference` prints it, and the README's copy is checked against it."""
    rows = ["| key | default | environment | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        doc = f.metadata.get("doc", "").replace("|", "\\|")
        default = f.metadata.get("default") or toml_value(f.default)
        rows.append(f"| `{f.name}` | `{default}` | `{ENV_PREFIX}{f.name.upper()}` | {doc} |")
    return "\n".join(rows) + "\n"
