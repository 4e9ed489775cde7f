"""Configuration: one TOML file, overridden by LEASEWORK_* environment variables, overridden by
flags. Read and validated here, once, then passed explicitly; there are no global settings.

Every default equals the seed's figure. Unknown keys, wrong types and impossible values are
refused at start-up with the key's name and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import stat
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import MAX_RETRY_AFTER, ConfigError

ENV_PREFIX = "LEASEWORK_"


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: from `lo` to `hi`, both included (`lo` excluded when
    `above`); for a list, each item, and `items` is how many there may be. Attached to the field
    (metadata "range") and checked by one validator, `check_range`; shown in the reference."""

    lo: float
    hi: float
    above: bool = False
    items: tuple[int, int] | None = None

    def holds(self, value: float) -> bool:
        # nan fails both comparisons; an int too large for a float compares exactly
        return (self.lo < value if self.above else self.lo <= value) and value <= self.hi

    def describe(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        text = f"> {lo} and <= {hi}" if self.above else f"{lo} to {hi}"
        if self.items is not None:
            text = f"{self.items[0]}-{self.items[1]} items, each {text}"
        return text


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _doc(text: str, default: str | None = None, *, range: Range | None = None) -> dict[str, Any]:
    """A field's line in the reference; `default` describes a default derived from others;
    `range` the values it accepts."""
    meta: dict[str, Any] = {"doc": text}
    if default is not None:
        meta["default"] = default
    if range is not None:
        meta["range"] = range
    return meta


DAY = 86400.0
_SECONDS = Range(0, 30 * DAY, above=True)  # a positive duration of at most 30 days
_RETENTION = Range(1, 10 * 365 * DAY)


@dataclass(frozen=True)
class Config:
    dsn: str | None = field(
        default=None,
        metadata=_doc("libpq connection string or URL; else DATABASE_URL, else libpq defaults"),
    )
    pooler: str = field(
        default="auto",
        metadata=_doc(
            "auto, on or off: whether dsn goes through a pooler in transaction mode (PgBouncer): "
            "then no prepared statement, no session state, and wake-up by NOTIFY only over "
            "listen_dsn; auto detects it on each connection"
        ),
    )
    listen_dsn: str | None = field(
        default=None,
        metadata=_doc(
            "a direct (unpooled) connection string for LISTEN when dsn goes through a pooler: "
            "the supervisor holds one per host and relays wake-ups to its children (a "
            "standalone worker holds its own); unset: idle workers behind a pooler poll every "
            "poll_interval"
        ),
    )
    app: str | None = field(default=None, metadata=_doc("MODULE:ATTR of the user's App"))
    poll_interval: float = field(
        default=2.0,
        metadata=_doc("seconds an idle worker waits between polls", range=Range(0.01, 3600)),
    )
    lease: float = field(
        default=120.0, metadata=_doc("lease length in seconds (database time)", range=Range(1, DAY))
    )
    renew_interval: float | None = field(
        default=None,
        metadata=_doc(
            "renew the lease after this many seconds; unset: a third of the lease",
            "lease / 3",
            range=Range(0.01, DAY),
        ),
    )
    control_interval: float | None = field(
        default=None,
        metadata=_doc(
            "seconds between control queries (lost / cancel requested); unset: min(2, lease / 6)",
            "min(2, lease / 6)",
            range=Range(0.01, 3600),
        ),
    )
    abort_grace: float = field(
        default=5.0,
        metadata=_doc(
            "seconds a handler gets to return once its run is cancelled, timed out, lost or shut "
            "down, before its process is killed",
            range=Range(0.1, 3600),
        ),
    )
    heartbeat_interval: float = field(
        default=15.0, metadata=_doc("seconds between worker heartbeats", range=Range(0.1, 3600))
    )
    pool_size: int = field(
        default=4,
        metadata=_doc(
            "connections per worker process at most besides its lease keeper's: the control "
            "connection (claims, outcomes, stages) and up to pool_size - 1 opened for handlers "
            "when they ask",
            range=Range(2, 100),
        ),
    )
    max_attempts: int = field(
        default=3,
        metadata=_doc("attempts per run unless the task says otherwise", range=Range(1, 1000)),
    )
    backoff: tuple[float, ...] = field(
        default=(5.0, 30.0, 120.0),
        metadata=_doc(
            "retry delays in seconds by attempt; the last repeats",
            range=Range(0, MAX_RETRY_AFTER, items=(1, 100)),
        ),
    )
    backoff_jitter: float = field(
        default=0.2,
        metadata=_doc(
            "each delay is multiplied by uniform(1 - jitter, 1 + jitter)", range=Range(0, 0.99)
        ),
    )
    payload_max_bytes: int = field(
        default=1 << 20,
        metadata=_doc("largest accepted payload, in bytes", range=Range(64, 64 << 20)),
    )
    result_max_bytes: int = field(
        default=1 << 20,
        metadata=_doc(
            "largest result a handler may return, in bytes (a larger one fails the attempt)",
            range=Range(64, 64 << 20),
        ),
    )
    runs_limit: int = field(
        default=10,
        metadata=_doc("runs the `runs` stage executes per poll at most", range=Range(1, 1000)),
    )
    settle_limit: int = field(
        default=100,
        metadata=_doc("expired or waiting runs settled per poll at most", range=Range(1, 100_000)),
    )
    schedule_limit: int = field(
        default=10,
        metadata=_doc(
            "due connections and due periodic tasks each enqueued per poll at most",
            range=Range(1, 1000),
        ),
    )
    sync_batch: int = field(
        default=200,
        metadata=_doc(
            "records a sync publishes (or a purge deletes) per fenced transaction",
            range=Range(1, 100_000),
        ),
    )
    sync_timeout: float = field(
        default=3600.0,
        metadata=_doc(
            "seconds a sync or purge attempt may run before it is aborted and retried",
            range=_SECONDS,
        ),
    )
    processes: int = field(
        default=2, metadata=_doc("worker processes the supervisor forks", range=Range(1, 1024))
    )
    graceful_timeout: float = field(
        default=30.0,
        metadata=_doc("seconds a stopping worker lets its current job finish", range=Range(0, DAY)),
    )
    # -- the supervisor (supervisor/parent.py; decisions in supervisor/policy.py) ------------
    max_jobs_per_child: int = field(
        default=0,
        metadata=_doc(
            "restart a child after this many jobs (leaky user code); 0: never",
            range=Range(0, 1_000_000_000),
        ),
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
            range=Range(0, DAY),
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
            "kill a child unresponsive this many s (stopped, or a C call holding the GIL); 0: never",
            range=Range(0, DAY),
        ),
    )
    restart_backoff: float = field(
        default=0.1,
        metadata=_doc(
            "first restart delay in s after a crash; doubles per crash", range=Range(0.001, 3600)
        ),
    )
    restart_backoff_max: float = field(
        default=30.0, metadata=_doc("longest restart delay in seconds", range=Range(0.001, DAY))
    )
    restart_reset_after: float = field(
        default=30.0,
        metadata=_doc(
            "a child up this many seconds clears its slot's crash streak", range=Range(0, DAY)
        ),
    )
    # -- ingest, expand, maintenance (stages/ingest.py, expand.py, maintenance.py) ------------
    file_store: str = field(
        default=".leasework/files",
        metadata=_doc("directory of the local file store (shared by every worker that ingests)"),
    )
    ingest_limit: int = field(
        default=1, metadata=_doc("ingest runs executed per poll at most", range=Range(1, 100))
    )
    ingest_batch: int = field(
        default=200,
        metadata=_doc("chunks embedded and upserted per checkpoint", range=Range(1, 10_000)),
    )
    ingest_chunk_chars: int = field(
        default=1000,
        metadata=_doc(
            "longest chunk, in characters (chunks break between words)", range=Range(16, 1_000_000)
        ),
    )
    ingest_max_bytes: int = field(
        default=512 << 20,
        metadata=_doc("a file larger than this many bytes fails to index", range=Range(1, 1 << 40)),
    )
    ingest_max_pages: int = field(
        default=5000,
        metadata=_doc(
            "pages indexed per document at most; the rest is truncated", range=Range(1, 10_000_000)
        ),
    )
    ingest_max_chunks: int = field(
        default=200_000,
        metadata=_doc(
            "chunks indexed per document at most; the rest is truncated",
            range=Range(1, 100_000_000),
        ),
    )
    embedder: str | None = field(
        default=None,
        metadata=_doc("MODULE:ATTR of a callable texts -> vectors; default: feature hashing"),
    )
    embedding_dim: int = field(
        default=256,
        metadata=_doc("dimensions of the built-in feature-hashing embedder", range=Range(1, 16384)),
    )
    expand_limit: int = field(
        default=2, metadata=_doc("uploads expanded per poll at most", range=Range(1, 100))
    )
    expand_reclaim: float = field(
        default=900.0,
        metadata=_doc(
            "seconds after which an upload stuck in processing is claimed again",
            range=Range(1, 30 * DAY),
        ),
    )
    expand_max_attempts: int = field(
        default=3,
        metadata=_doc("expansions of one upload before it is marked failed", range=Range(1, 1000)),
    )
    archive_max_members: int = field(
        default=10_000,
        metadata=_doc(
            "an archive with more members than this is refused", range=Range(1, 10_000_000)
        ),
    )
    archive_max_bytes: int = field(
        default=2 << 30,
        metadata=_doc(
            "an archive whose members total more bytes is refused", range=Range(1, 1 << 40)
        ),
    )
    archive_max_ratio: float = field(
        default=100.0,
        metadata=_doc(
            "an archive or member compressed more than this many times is refused",
            range=Range(1, 1_000_000, above=True),
        ),
    )
    maintenance_limit: int = field(
        default=1000,
        metadata=_doc(
            "rows each maintenance handler deletes per poll at most", range=Range(1, 1_000_000)
        ),
    )
    prune_interval: float = field(
        default=3600.0,
        metadata=_doc(
            "seconds between prunes of finished runs and uploads", range=Range(1, 30 * DAY)
        ),
    )
    workers_prune_interval: float = field(
        default=86400.0,
        metadata=_doc("seconds between prunes of stopped worker rows", range=Range(1, 30 * DAY)),
    )
    retention_succeeded: float = field(
        default=7 * 86400.0, metadata=_doc("seconds a succeeded run is kept", range=_RETENTION)
    )
    retention_partial: float = field(
        default=30 * 86400.0, metadata=_doc("seconds a partial run is kept", range=_RETENTION)
    )
    retention_failed: float = field(
        default=30 * 86400.0, metadata=_doc("seconds a failed run is kept", range=_RETENTION)
    )
    retention_cancelled: float = field(
        default=7 * 86400.0, metadata=_doc("seconds a cancelled run is kept", range=_RETENTION)
    )
    retention_workers: float = field(
        default=86400.0,
        metadata=_doc("seconds a stopped (or long silent) worker row is kept", range=_RETENTION),
    )
    retention_uploads: float = field(
        default=30 * 86400.0,
        metadata=_doc("seconds a finished upload row and its archive are kept", range=_RETENTION),
    )
    retention_tombstones: float = field(
        default=30 * 86400.0,
        metadata=_doc("seconds a tombstoned record (deleted upstream) is kept", range=_RETENTION),
    )
    reconcile_interval: float = field(
        default=60.0,
        metadata=_doc(
            "seconds between checks for files left `indexing` by an ended ingest run",
            range=Range(1, DAY),
        ),
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
_POOLER = ("auto", "on", "off")


def _coerce(name: str, value: Any, where: str) -> Any:
    """One raw value (TOML value, env string or flag) as the field's type, within its range."""
    out = _convert(name, value, where)
    check_range(name, out, where)
    return out


def _convert(name: str, value: Any, where: str) -> Any:
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
    except (TypeError, ValueError, OverflowError):
        pass
    expected = {
        "float": "a number",
        "float | None": "a number",
        "int": "an integer",
        "tuple[float, ...]": "a non-empty list of numbers",
        "bool": "true or false",
    }.get(str(kind), "a string")
    raise ConfigError(f"{where}: {name} must be {expected}, got {_short(value)}")


def check_range(name: str, value: Any, where: str = "config") -> None:
    """The one check of every numeric setting against the Range attached to its field: one
    line naming the key, where it came from and what would be valid."""
    bound: Range | None = FIELDS[name].metadata.get("range")
    if bound is None or value is None:
        return
    items = value if isinstance(value, tuple) else (value,)
    ok = all(bound.holds(x) for x in items)
    if bound.items is not None and not bound.items[0] <= len(items) <= bound.items[1]:
        ok = False
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise ConfigError(f"{where}: {name} must be {bound.describe()}, got {_short(shown)}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate(cfg: Config) -> Config:
    """Every setting within its range (check_range), then the combinations that are impossible,
    naming the key."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"config: {key} {why}")

    for name in FIELDS:
        check_range(name, getattr(cfg, name))
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
    if not cfg.file_store:
        raise bad("file_store", "must be a directory path, got an empty string")
    if cfg.embedder is not None and ":" not in cfg.embedder:
        raise bad("embedder", f"must look like MODULE:ATTR, got {_short(cfg.embedder)}")
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
    if cfg.restart_backoff_max < cfg.restart_backoff:
        raise bad(
            "restart_backoff_max",
            f"must be >= restart_backoff ({cfg.restart_backoff:g} s), got {cfg.restart_backoff_max:g}",
        )
    if cfg.pooler not in _POOLER:
        raise bad("pooler", f"must be one of {', '.join(_POOLER)}, got {_short(cfg.pooler)}")
    if cfg.log_level.lower() not in _LOG_LEVELS:
        raise bad(
            "log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {_short(cfg.log_level)}"
        )
    if cfg.log_format.lower() not in _LOG_FORMATS:
        raise bad(
            "log_format", f"must be one of {', '.join(_LOG_FORMATS)}, got {_short(cfg.log_format)}"
        )
    return cfg


CONFIG_MAX_BYTES = 1 << 20  # a config file is a few KiB; anything this large is a mistake
# LEASEWORK_* variables that are not settings (the config file's path, the test suite's, the
# demo's and the benchmarks'): never warned about.
_OTHER_VARS = frozenset(
    {
        "CONFIG",
        "TEST_DSN",
        "DEMO_EMBEDDED",
        "CHAOS_EXAMPLES",
        "CHAOS_FAST_EXAMPLES",
        "CHROMIUM",
        "BENCH_RESULTS",
        "DASHBOARD_TOKEN",
    }
)


def _stderr_warning(message: str) -> None:
    print(f"leasework: warning: {message}", file=sys.stderr)


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML file at `path`: a regular file of at most CONFIG_MAX_BYTES, UTF-8 (a byte-order
    mark is accepted). Opened without blocking, so a FIFO or a device is refused, not waited on."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file {where} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {where} cannot be read: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a device",
                 stat.S_ISBLK: "a device", stat.S_ISSOCK: "a socket"}  # fmt: skip
        what = next((text for test, text in kinds.items() if test(mode)), "not a regular file")
        raise ConfigError(f"config file {where} is {what}: give a regular TOML file")
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(CONFIG_MAX_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"config file {where} cannot be read: {exc.strerror}") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise ConfigError(
            f"config file {where} is over {CONFIG_MAX_BYTES} bytes: a config file is a few KiB"
        )
    try:
        return tomllib.loads(data.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {exc}") from None


def misspelt(env: Mapping[str, str]) -> list[str]:
    """A warning for each LEASEWORK_* variable that is no setting but looks like one."""
    out = []
    names = {name.upper() for name in FIELDS}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :]
        if rest in names or rest in _OTHER_VARS:
            continue
        close = difflib.get_close_matches(rest, sorted(names | _OTHER_VARS), n=1, cutoff=0.75)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        shown = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in var[:80])
        out.append(f"{shown} is not a leasework setting and is ignored{hint}")
    return out


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Config:
    """File, then environment, then flags (None values in `overrides` are ignored). Warnings
    (a misspelt LEASEWORK_* variable) go to `warn`, else one line each on stderr; pass
    `warn=lambda m: None` to silence them."""
    warn = _stderr_warning if warn is None else warn
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    if path is not None:
        where = str(path)
        raw = read_file(path)
        for key, value in raw.items():
            if key not in FIELDS:
                raise ConfigError(f"{where}: unknown key {_short(key)}{did_you_mean(key)}")
            values[key] = _coerce(key, value, where)
    for message in misspelt(env):
        warn(message)
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
            raise ConfigError(f"unknown setting {_short(key)}")
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
    rows = ["| key | default | range | environment | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        doc = f.metadata.get("doc", "").replace("|", "\\|")
        default = f.metadata.get("default") or toml_value(f.default)
        bound = f.metadata.get("range")
        shown = bound.describe().replace("|", "\\|") if bound is not None else ""
        rows.append(
            f"| `{f.name}` | `{default}` | {shown} | `{ENV_PREFIX}{f.name.upper()}` | {doc} |"
        )
    return "\n".join(rows) + "\n"
