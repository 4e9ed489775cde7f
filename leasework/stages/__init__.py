"""The job families, one module each, and the fixed order a poll walks them in.

A stage has a name, a per-poll limit and one method doing one bounded step that returns how many
items it handled. Adding a job family is one file, its queries, and one line in `default_stages`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..workers.stage import Stage

if TYPE_CHECKING:
    from ..app import App
    from ..config import Config


def default_stages(app: App, config: Config) -> list[Stage]:
    """The poll order: schedule, runs, ingest, expand, maintenance (those that exist)."""
    from .runs import RunsStage
    from .schedule import ScheduleStage

    stages: list[Stage] = []
    # 1. schedule: enqueue due connection syncs and periodic tasks
    stages.append(ScheduleStage(app, limit=config.schedule_limit))
    stages.append(RunsStage(app, limit=config.runs_limit, settle_limit=config.settle_limit))
    # 3. ingest, 4. expand, 5. maintenance
    from .expand import ExpandStage
    from .ingest import IngestStage
    from .maintenance import MaintenanceStage

    stages.append(IngestStage(app, config))
    stages.append(ExpandStage(app, config))
    stages.append(MaintenanceStage(app, config))
    return stages
