"""The pools grammar: `[[pools]]` tables in the file, NAME:PROCESSES:KIND,KIND specs in the
environment and `--pool`, read into `Pool`s with one line naming the pool for any mistake."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .fields import Range, env_number, short
from .settings import EVERY_OTHER, POOL_KEYS, Pool

_POOL_PROCESSES = Range(1, 1024)
_CONCURRENCY = Range(1, 1000)


def parse_pools(value: Any, where: str) -> tuple[Pool, ...]:
    """`pools` from TOML (a list of tables), or from the environment or --pool (NAME:PROCESSES:
    KIND,KIND specs, `;`-separated or a list). One line naming the pool for any mistake: an
    unknown key, a pool naming no kind, processes below 1, two pools claiming one kind, two
    "everything else" pools, a repeated name."""
    if isinstance(value, str):
        value = [part for part in value.split(";") if part.strip()]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: pools must be a list of [[pools]] tables, got {short(value)}")
    pools: list[Pool] = []
    for i, item in enumerate(value):
        label = f"{where}: pools[{i}]"
        if isinstance(item, str):
            item = _pool_spec(item, label)
        if not isinstance(item, dict):
            raise ConfigError(
                f"{label} must be a table (name, processes, kinds), got {short(item)}"
            )
        for key in item:
            if key not in POOL_KEYS:
                raise ConfigError(
                    f"{label}: unknown key {short(key)}; a pool has {', '.join(POOL_KEYS)}"
                )
        name = item.get("name")
        if not isinstance(name, str) or not name.strip() or not name.isprintable():
            raise ConfigError(f"{label}: name must be a non-empty string, got {short(name)}")
        label = f"{where}: pool {short(name)}"
        processes = item.get("processes")
        if isinstance(processes, bool) or not isinstance(processes, int):
            raise ConfigError(f"{label}: processes must be an integer, got {short(processes)}")
        if not _POOL_PROCESSES.holds(processes):
            raise ConfigError(
                f"{label}: processes must be {_POOL_PROCESSES.describe()}, got {processes}"
            )
        kinds = item.get("kinds", EVERY_OTHER)
        if kinds == [EVERY_OTHER]:
            kinds = EVERY_OTHER
        if kinds != EVERY_OTHER:
            if not isinstance(kinds, list | tuple) or not all(
                isinstance(k, str) and k.strip() and k != EVERY_OTHER for k in kinds
            ):
                raise ConfigError(
                    f"{label}: kinds must be a list of kind names, or {EVERY_OTHER!r} for every "
                    f"kind no other pool names, got {short(kinds)}"
                )
            if not kinds:
                raise ConfigError(
                    f"{label} names no kind: list its kinds, or {EVERY_OTHER!r} for every kind "
                    "no other pool names"
                )
        concurrency = item.get("concurrency")
        if concurrency is not None and (
            isinstance(concurrency, bool)
            or not isinstance(concurrency, int)
            or not _CONCURRENCY.holds(concurrency)
        ):
            raise ConfigError(
                f"{label}: concurrency must be an integer {_CONCURRENCY.describe()}, "
                f"got {short(concurrency)}"
            )
        pools.append(
            Pool(
                name,
                processes,
                None if kinds == EVERY_OTHER else tuple(dict.fromkeys(kinds)),
                concurrency,
            )
        )
    seen: dict[str, str] = {}
    names: set[str] = set()
    rest: str | None = None
    for p in pools:
        if p.name in names:
            raise ConfigError(f"{where}: two pools are named {short(p.name)}")
        names.add(p.name)
        if p.kinds is None:
            if rest is not None:
                raise ConfigError(
                    f"{where}: pools {short(rest)} and {short(p.name)} both take every other "
                    "kind; at most one pool may omit its kinds"
                )
            rest = p.name
            continue
        for k in p.kinds:
            if k in seen:
                raise ConfigError(
                    f"{where}: pools {short(seen[k])} and {short(p.name)} both claim kind "
                    f"{short(k)}; a kind belongs to one pool per host"
                )
            seen[k] = p.name
    return tuple(pools)


def _pool_spec(text: str, label: str) -> dict[str, Any]:
    """NAME:PROCESSES:KIND,KIND (or NAME:PROCESSES:*) as a [[pools]] table; PROCESSESxN sets the
    pool's concurrency (async runs per child) too: `io:2x20:fetch`."""
    parts = text.strip().split(":", 2)
    if len(parts) != 3:  # kinds left off: `*` says "every other kind", never a guess
        raise ConfigError(
            f"{label} must look like NAME:PROCESSES:KIND,KIND (or NAME:PROCESSES:* for every "
            f"other kind; NAME:PROCESSESxCONCURRENCY:... for async runs per child), got "
            f"{short(text)}"
        )
    size, _, each = parts[1].partition("x")
    table: dict[str, Any] = {"name": parts[0], "processes": _integer(size)}
    if each:
        table["concurrency"] = _integer(each)
    kinds = parts[2].strip()
    table["kinds"] = (
        EVERY_OTHER if kinds == EVERY_OTHER else [k.strip() for k in kinds.split(",") if k.strip()]
    )
    return table


def _integer(text: str) -> Any:
    """An integer written in a spec (ASCII digits), or the text as it was (the table's check
    names it)."""
    try:
        return env_number(text, integer=True)
    except ValueError:
        return text
