"""The dashboard's settings, a section of the configuration (keys stay flat: `dashboard_actions`,
LEASEWORK_DASHBOARD_ACTIONS)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import doc, section


@section("The dashboard", order=70)
@dataclass(frozen=True)
class DashboardSettings:
    dashboard_actions: bool = field(
        default=False,
        metadata=doc(
            "the dashboard offers cancel, retry, delete, pause, resume and a kind's limits (POST "
            "forms with a CSRF token); off: read-only (`leasework dashboard --actions` turns it on)"
        ),
    )
