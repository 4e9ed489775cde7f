"""The `files` connector: a directory of `.jsonl` and `.csv` files, one file per table (the file's
stem is the table name), one row per line, an `id` column. A real upstream that changes, for
users and tests alike. Reads files lazily, line by line; never loads a whole file."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import ConfigError, LeaseworkError
from .connectors import Connection, Connector, Row, Table, TableError

if TYPE_CHECKING:
    from ..workers.context import Context

SUFFIXES = (".jsonl", ".csv")


def check_config(config: Mapping[str, Any]) -> None:
    path = config.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(
            'files connector: config needs "path", the directory of .jsonl/.csv files, '
            f"got {dict(config)!r}"
        )


def directory(connection: Connection) -> Path:
    check_config(connection.config)
    return Path(os.path.expanduser(str(connection.config["path"])))


def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
    root = directory(connection)
    if not root.is_dir():
        # Not a per-table error: nothing was read, so the whole run is retried (a mount that is
        # briefly away) and fails once its attempts are spent.
        raise LeaseworkError(f"files connector: {root} is not a directory")
    files = sorted(p for p in root.iterdir() if p.suffix in SUFFIXES and p.is_file())
    seen: dict[str, Path] = {}
    for path in files:
        ctx.check()
        name = path.stem
        if name in seen:
            yield Table(
                name,
                error=TableError(
                    f"table {name!r} has two files: {seen[name].name} and {path.name}",
                    retryable=False,
                ),
            )
            continue
        seen[name] = path
        yield Table(name, _jsonl_rows(path) if path.suffix == ".jsonl" else _csv_rows(path))


def _jsonl_rows(path: Path) -> Iterator[Row]:
    try:
        with path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise TableError(
                        f"{path.name} line {lineno}: not JSON: {exc}", retryable=False
                    ) from None
                if not isinstance(row, dict):
                    raise TableError(
                        f"{path.name} line {lineno}: a row must be a JSON object", retryable=False
                    )
                yield row
    except OSError as exc:
        raise TableError(f"{path.name}: {exc.strerror or exc}", retryable=True) from None


def _csv_rows(path: Path) -> Iterator[Row]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                return
            if "id" not in reader.fieldnames:
                raise TableError(f"{path.name}: no `id` column", retryable=False)
            yield from reader
    except (csv.Error, UnicodeDecodeError) as exc:
        raise TableError(f"{path.name}: not readable CSV: {exc}", retryable=False) from None
    except OSError as exc:
        raise TableError(f"{path.name}: {exc.strerror or exc}", retryable=True) from None


# A directory lists every table it has: a removed file is a removed table.
files_connector = Connector("files", extract, check_config, complete=True)
