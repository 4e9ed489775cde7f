"""The loader: one TOML file, overridden by LEASEWORK_* environment variables, overridden by
flags, read once and validated, naming the key and where it came from for any refusal. Knows the
engine's keys and those of the sections it is handed; registers nothing."""

from __future__ import annotations

import dataclasses
import difflib
import os
import stat
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import ConfigError
from .convert import check_range, coerce
from .fields import ENV_PREFIX, did_you_mean, short
from .sections import all_keys, catalogue
from .settings import FIELDS, Config, section_fields
from .timing import lease_timing

_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "text")
_POOLER = ("auto", "on", "off")


def validate(cfg: Config) -> Config:
    """Every setting within its range (check_range), then the combinations that are impossible,
    naming the key."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"config: {key} {why}")

    for name in FIELDS:
        check_range(name, getattr(cfg, name))
    for cls in cfg.sections:
        settings: Any = cfg.section(cls)
        for f in dataclasses.fields(cls):
            check_range(f.name, getattr(settings, f.name), sections=(cls,))
        check = getattr(settings, "check", None)
        if check is not None:
            check()
    timing = lease_timing(cfg)
    if timing.renew >= cfg.lease / 2:
        raise bad(
            "renew_interval",
            f"must be shorter than half the lease ({cfg.lease / 2:g} s), got {timing.renew:g}",
        )
    if timing.control >= timing.renew:
        raise bad(
            "control_interval",
            f"must be shorter than renew_interval ({timing.renew:g} s), got {timing.control:g}",
        )
    if not 0 <= timing.margin < cfg.lease - timing.renew:
        raise bad(
            "watchdog_margin",
            f"must be >= 0 and below lease - renew_interval ({cfg.lease - timing.renew:g} s), "
            f"or healthy children would be killed; got {timing.margin:g}",
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
        raise bad("pooler", f"must be one of {', '.join(_POOLER)}, got {short(cfg.pooler)}")
    if cfg.log_level.lower() not in _LOG_LEVELS:
        raise bad(
            "log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {short(cfg.log_level)}"
        )
    if cfg.log_format.lower() not in _LOG_FORMATS:
        raise bad(
            "log_format", f"must be one of {', '.join(_LOG_FORMATS)}, got {short(cfg.log_format)}"
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
    except RecursionError:  # the parser recurses once per level of nested arrays or tables
        raise ConfigError(
            f"config file {where} nests arrays or inline tables too deeply: its keys are flat "
            "(`pools`, a list of tables, is the deepest value)"
        ) from None


def misspelt(env: Mapping[str, str], sections: Iterable[type] = ()) -> list[str]:
    """A warning for each LEASEWORK_* variable that is no setting (of the engine or `sections`)
    but looks like one."""
    out = []
    names = {name.upper() for name in all_keys(sections)}
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
    prepare: Callable[[str | None], Iterable[type] | None] | None = None,
    sections: Iterable[type] = (),
) -> Config:
    """File, then environment, then flags (None values in `overrides` are ignored). Warnings
    (a misspelt LEASEWORK_* variable) go to `warn`, else one line each on stderr; pass
    `warn=lambda m: None` to silence them. A key is known if the engine or one of the sections
    has it: `sections`, and those `prepare(app)` returns, called with the app named by the
    flags, the environment or the file before any key is checked (the CLI returns the built-in
    families' and those the named app declares). The Config keeps them (`Config.sections`)."""
    warn = _stderr_warning if warn is None else warn
    env = os.environ if env is None else env
    overrides = overrides or {}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    raw = read_file(path) if path is not None else {}
    declared = list(sections)
    if prepare is not None:
        app = overrides.get("app") or env.get(ENV_PREFIX + "APP") or raw.get("app")
        declared.extend(prepare(app if isinstance(app, str) else None) or ())
    known = catalogue(declared)
    keys = all_keys(known)

    def coerced(key: str, value: Any, where: str) -> Any:
        return coerce(key, value, where, known)

    for key, value in raw.items():
        if key not in keys and isinstance(value, dict):
            inner = ", ".join(f"`{k} = ...`" for k in list(value)[:3])
            raise ConfigError(
                f"{path}: unknown table [{short(key)[1:-1]}]: the keys are flat, even where the "
                f"reference groups them; write {inner or 'its keys'} at the top level"
            )
        if key not in keys:
            raise ConfigError(f"{path}: unknown key {short(key)}{did_you_mean(key, keys)}")
        values[key] = coerced(key, value, str(path))
        origins[key] = f"{path}: {key}"
    for message in misspelt(env, known):
        warn(message)
    for name in keys:
        var = ENV_PREFIX + name.upper()
        if var in env and env[var] != "":
            values[name] = coerced(name, env[var], f"env {var}")
            origins[name] = var
    if "dsn" not in values and env.get("DATABASE_URL"):
        values["dsn"] = env["DATABASE_URL"]
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in keys:
            raise ConfigError(f"unknown setting {short(key)}{did_you_mean(key, keys)}")
        flag = "--pool" if key == "pools" else f"--{key.replace('_', '-')}"
        values[key] = coerced(key, value, flag)
        origins[key] = flag
    made = Config.make(sections=known, **values)
    return validate(dataclasses.replace(made, origins=tuple(sorted(origins.items()))))


def value(cfg: Config, key: str) -> Any:
    """One setting by its flat key, the engine's or one of the config's sections' (KeyError)."""
    if key in FIELDS:
        return getattr(cfg, key)
    owner = next((c for c in cfg.sections if key in section_fields((c,))), None)
    if owner is None:
        raise KeyError(key)
    return getattr(cfg.section(owner), key)
