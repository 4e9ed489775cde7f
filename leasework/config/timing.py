"""The timings of a lease: how often it is renewed and its run's state read, and when the watchdog
and the dead man's switch kill its holder; derived from the settings, scaled to a run's lease."""

from __future__ import annotations

from dataclasses import dataclass

from .settings import Config


@dataclass(frozen=True)
class LeaseTiming:
    """How a lease is kept: renewed every `renew`, its run's state read every `control`, and the
    watchdog's `margin` (a child whose lease went unrenewed for `lease - margin` is killed).
    Built by `lease_timing` alone: from the settings `renew_interval`, `control_interval` and
    `watchdog_margin`, scaled to a run's own lease."""

    lease: float
    renew: float
    control: float
    margin: float

    @property
    def unrenewed_max(self) -> float:
        """How long the lease may go unrenewed before the watchdog kills its holder."""
        return self.lease - self.margin

    @property
    def kill_after(self) -> float:
        """How long after its last renewal the dead man's switch kills the holder: half the
        margin after the parent's watchdog would have (the parent records the outcome)."""
        return self.lease - self.margin / 2


def lease_timing(config: Config, lease_seconds: float | None = None) -> LeaseTiming:
    """The timings of a run with this lease (None: the worker's own, at `config.lease`). Derived
    from the lease unless set: renew at a third, control every 2 s at most, the watchdog's margin
    a sixth (the seed's 40 s, 2 s and 20 s for a 120 s lease); a run with another lease scales
    them to it (a 12 s lease renews every 4 s), its state read at least twice per renewal."""
    lease = config.lease
    renew = lease / 3 if config.renew_interval is None else config.renew_interval
    control = config.control_interval
    if control is None:
        control = min(2.0, lease / 6, renew / 2)
    margin = lease / 6 if config.watchdog_margin is None else config.watchdog_margin
    if lease_seconds is None:
        return LeaseTiming(lease, renew, control, margin)
    scaled = renew * lease_seconds / lease
    return LeaseTiming(
        lease_seconds, scaled, min(control, scaled / 2), margin * lease_seconds / lease
    )
