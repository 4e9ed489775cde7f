"""`leasework dashboard`: a read-only web page of the same picture as `leasework status`, a run's
page, `/metrics` (Prometheus) and `/healthz`. Never writes to the database."""

from __future__ import annotations

from .server import Dashboard

__all__ = ["Dashboard"]
