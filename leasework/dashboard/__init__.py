"""The dashboard: the same picture as `leasework status` in a browser, a page per run, every run
filtered and paged, kinds, schedules and connections, `/metrics` (Prometheus) and `/healthz`;
with actions enabled, cancel, retry, delete, pause, resume and a kind's limits as POST forms with a CSRF token.

`leasework dashboard` serves it (`Dashboard`); `wsgi_app()` returns it as a WSGI application to
mount inside your own web app, behind your own authentication, under any path prefix."""

from __future__ import annotations

from .server import Dashboard
from .web import DashboardApp, wsgi_app

__all__ = ["Dashboard", "DashboardApp", "wsgi_app"]
