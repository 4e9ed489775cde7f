"""Installs (or upgrades) the leasework schema through `manage.py migrate`: leasework's own
versioned migrations, applied by leasework.db.migrate. A leasework release that adds a schema
migration adds a Django migration here that calls the same function."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def forward(apps: Any, schema_editor: Any) -> None:
    from leasework.contrib.django import migrate_schema

    migrate_schema(schema_editor.connection)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(forward, migrations.RunPython.noop, elidable=False)]
