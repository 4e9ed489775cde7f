"""The Django app: `INSTALLED_APPS = [..., "leasework.contrib.django"]`."""

from __future__ import annotations

from django.apps import AppConfig


class LeaseworkConfig(AppConfig):
    name = "leasework.contrib.django"
    label = "leasework"
    verbose_name = "leasework"
