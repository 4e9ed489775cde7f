"""`manage.py leasework COMMAND ...`: the leasework CLI with --dsn and --app taken from the
LEASEWORK setting (and Django's DATABASES), Django already set up for the handlers."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from leasework import cli
from leasework.contrib import django as lw_django
from leasework.errors import ConfigError


class Command(BaseCommand):
    help = "Run a leasework command (supervise, worker, status, ...) on Django's database"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER, help="leasework's own arguments")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            argv = ["--dsn", lw_django.dsn()]
            if lw_django.setting().get("APP"):
                argv += ["--app", str(lw_django.setting()["APP"])]
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
        code = cli.main([*argv, *args])
        if code:
            raise SystemExit(code)
