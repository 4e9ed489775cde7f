"""Two hosts against one Postgres: two supervisors (two children each), each in its own network
namespace, reach a private cluster listening on the machine's side of their veth pairs (see
netns.py). Host A's link is cut (its veth brought down: connections hang, nothing is reset);
every run A held must move to host B once its lease has expired in database time, never before
(no overlap), and soon after; then the link heals, and A must commit nothing with a token it
held before the cut: no stale effect (the oracle and the effects' writing host) and no stale
lease write (the transition log, which records the writing host of every change). A then works
again with fresh claims, and no run is lost.

Skipped, with the reason, where network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.faults import netns
from tests.faults.harness import ChaosRun, Fault
from tests.faults.netns import Host
from tests.pgcluster import private_cluster
from tests.process.conftest import Supervised

# How late after the lease a run may move: the reclaiming poll (poll_interval), the claim itself,
# and B's children finishing the runs they hold, which on a busy machine can take seconds. The
# lease was renewed before the cut, so it expires at most `lease` after it. Generous on purpose:
# what must hold exactly is that a run never moves before A's lease on it expired.
MOVE_SLACK = 4.0
# Statements already delivered to the server when the link went down may still commit.
IN_FLIGHT = 0.5


class HostsRun(ChaosRun):
    """A ChaosRun whose supervisors run on hosts; `check` adds the host cut's invariants."""

    cut_host: Host | None = None
    other_host: Host | None = None
    cut_at: float | None = None
    healed_at: float | None = None
    moves: list[tuple[int, float]]

    def start_on(self, host: Host, options: str = "") -> Supervised:
        """A supervisor on `host`; `options`: libpq parameters added to its DSN."""
        home = self.tmp / host.name
        home.mkdir(exist_ok=True)
        dsn = f"postgresql://postgres@{host.server_addr}:{self.cluster.port}/postgres"
        return self.start(dsn=f"{dsn}?{options}" if options else dsn, wrap=host.wrap, tmp=home)

    def db_now(self) -> float:
        return float(self.query("SELECT extract(epoch FROM clock_timestamp())")[0][0])

    def held_by(self, host: Host) -> list[tuple[int, str]]:
        """(run, owner token) of the running runs whose token was claimed from `host`."""
        rows = self.query(
            "SELECT r.id, r.lease_owner::text FROM leasework.runs r"
            " WHERE r.status = 'running' AND EXISTS ("
            " SELECT 1 FROM public.chaos_transitions t WHERE t.run_id = r.id"
            " AND t.new_owner = r.lease_owner AND t.client = %s::inet)",
            (host.addr,),
        )
        return [(r[0], r[1]) for r in rows]

    def committed_from(self, host: Host, since: float) -> int:
        return int(
            self.query(
                "SELECT count(*) FROM public.chaos_effects WHERE client = %s::inet"
                " AND at > to_timestamp(%s)",
                (host.addr, since),
            )[0][0]
        )

    def cut(self, host: Host, other: Host) -> Fault:
        self.cut_host, self.other_host = host, other
        self.cut_at = self.db_now()
        host.cut()
        fault = Fault("cut_host_link", self.cut_at)
        self.faults.append(fault)
        return fault

    def heal(self, fault: Fault) -> None:
        assert self.cut_host is not None
        self.healed_at = fault.healed = self.db_now()
        self.cut_host.heal()

    def check(self, *, control: bool = False) -> list[str]:
        v = super().check(control=control)
        if self.cut_host is None or self.cut_at is None:
            return v
        a, b = self.cut_host, self.other_host
        assert b is not None
        cut, healed = self.cut_at, self.healed_at or float("inf")
        lease = float(self.cfg["lease"])
        # Every token host A claimed before the heal (nothing of A's reaches the server between
        # the cut and the heal, so these are the tokens A held at or before the cut).
        claims = """
            SELECT seq, run_id, new_owner AS owner FROM public.chaos_transitions
             WHERE client = %(a)s::inet AND new_status = 'running'
               AND new_owner IS DISTINCT FROM old_owner AND at < to_timestamp(%(healed)s)"""
        args = {"a": a.addr, "b": b.addr, "cut": cut, "healed": healed}
        stale = [r[0] for r in self.query(f"SELECT owner FROM ({claims}) c", args)]
        # Each run A held at the cut: the change that ended A's hold came after the cut, and it
        # must be host B's claim, after the last lease A's token had (no overlap: the two hosts
        # never both held it), and soon after the cut.
        self.moves = []
        for run_id, owner, at, client, status, expires in self.query(
            f"""SELECT c.run_id, c.owner::text, extract(epoch FROM e.at), host(e.client),
                       e.new_status,
                       (SELECT extract(epoch FROM max(y.new_expires))
                          FROM public.chaos_transitions y
                         WHERE y.run_id = c.run_id AND y.new_owner = c.owner
                           AND y.seq >= c.seq AND y.seq < e.seq)
                  FROM ({claims}) c
                  LEFT JOIN LATERAL (
                       SELECT x.seq, x.at, x.client, x.new_status
                         FROM public.chaos_transitions x
                        WHERE x.run_id = c.run_id AND x.seq > c.seq
                          AND (x.new_owner IS DISTINCT FROM c.owner OR x.new_status <> 'running')
                        ORDER BY x.seq LIMIT 1) e ON true
                 WHERE e.at IS NULL OR e.at > to_timestamp(%(cut)s)""",
            args,
        ):
            if at is None:
                v.append(f"run {run_id} still held by cut host A's token {owner}")
                continue
            took = float(at) - cut
            self.moves.append((run_id, took))
            if status != "running" or client != b.addr:
                v.append(f"run {run_id} left A's token {owner} by {status} from {client}, not B")
                continue
            if expires is not None and float(at) <= float(expires):
                v.append(
                    f"run {run_id} claimed by host B {float(expires) - float(at):.2f} s before"
                    f" A's lease (token {owner}) expired"
                )
            if took > lease + MOVE_SLACK:
                v.append(f"run {run_id} moved to host B {took:.2f} s after the cut (lease {lease})")
        # Nothing of A's committed while its link was down (the cut was real).
        v += [
            f"host A committed {r[0]} of run {r[1]} at {r[2]} while cut off"
            for r in self.query(
                """SELECT 'an effect', run_id, at FROM public.chaos_effects
                    WHERE client = %(a)s::inet AND at > to_timestamp(%(cut)s) + %(slack)s
                      AND at < to_timestamp(%(healed)s)
                   UNION ALL
                   SELECT 'a ' || new_status || ' transition', run_id, at
                     FROM public.chaos_transitions
                    WHERE client = %(a)s::inet AND at > to_timestamp(%(cut)s) + %(slack)s
                      AND at < to_timestamp(%(healed)s)""",
                {**args, "slack": f"{IN_FLIGHT} seconds"},
            )
        ]
        # After the heal, nothing written by A with a token from before the cut: no stale effect,
        # no stale lease write (renewal, checkpoint, finish, release of a run the token held).
        v += [
            f"host A wrote {r[0]} of run {r[1]} with its pre-cut token {r[2]} after the heal"
            for r in self.query(
                """SELECT 'an effect', run_id, owner FROM public.chaos_effects
                    WHERE client = %(a)s::inet AND at >= to_timestamp(%(healed)s)
                      AND owner = ANY(%(stale)s)
                   UNION ALL
                   SELECT 'a ' || new_status || ' transition', run_id,
                          CASE WHEN new_owner = ANY(%(stale)s) THEN new_owner ELSE old_owner END
                     FROM public.chaos_transitions
                    WHERE client = %(a)s::inet AND at >= to_timestamp(%(healed)s)
                      AND ((old_owner = ANY(%(stale)s) AND old_status = 'running')
                           OR new_owner = ANY(%(stale)s))""",
                {**args, "stale": stale},
            )
        ]
        return v

    def recovery_times(self) -> list[float]:
        """The cut: how long after it each run host A held ran on host B."""
        return [took for _, took in getattr(self, "moves", [])] or super().recovery_times()


@pytest.fixture
def two_hosts(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[HostsRun, Host, Host]]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with (
        netns.hosts(2) as (a, b),
        private_cluster(
            "leasework-hosts-", listen=[a.server_addr, b.server_addr], hba=[a.subnet, b.subnet]
        ) as cluster,
    ):
        seed = random.randrange(1 << 32)
        print(f"chaos seed {seed}; host A {a.name} {a.addr}, host B {b.name} {b.addr}")
        run = HostsRun(cluster, tmp_path, request.node.name, {"processes": 2}, random.Random(seed))
        try:
            yield run, a, b
        finally:
            for host in (a, b):  # so the supervisors can stop cleanly
                host.heal()
            run.stop()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param("", id="plain-dsn"),
        pytest.param("tcp_user_timeout=1000", id="tcp_user_timeout"),
    ],
)
def test_cutting_a_hosts_link_moves_its_runs_to_the_other_host(
    two_hosts: tuple[HostsRun, Host, Host], options: str
) -> None:
    """The runs the cut host held move to the other host once their leases expire (never
    before), the cut host commits nothing with the tokens it held, and no run is lost; then the
    cut host works again. How the cut host's jobs stop is not checked here: its watchdog stops
    them (its supervisor never hangs on its own connection), or, with tcp_user_timeout in the
    DSN, a job may fail on its own connection first (test_faults.py checks the watchdog)."""
    run, a, b = two_hosts
    lease = float(run.cfg["lease"])
    run.start_on(a, options)
    run.start_on(b, options)
    # One run per child, each longer than the time to the cut, shorter than the lease: at the
    # cut both hosts hold runs, and B's children are usually free again before A's leases expire.
    run.enqueue(4, steps=8, sleep=(0.3, 0.35))
    wait_for(
        lambda: run.held_by(a) and run.committed_from(a, run.started - 1) > 0,
        timeout=30,
        interval=0.05,
    )
    fault = run.cut(a, b)
    held = run.held_by(a)
    assert held, "host A held no run at the cut"
    try:
        # Every run A held moves to B; when, and that it never overlapped A's lease, is checked
        # over the history in `check` (database time).
        wait_for(lambda: not run.held_by(a), timeout=6 * lease, interval=0.05)
    finally:
        run.heal(fault)
    print(f"host A held runs {sorted(r for r, _ in held)} at the cut")
    # A works again, with fresh tokens (enqueue more while B alone drains the queue).
    assert run.healed_at is not None
    healed = run.healed_at

    def a_is_back() -> bool:
        run.ensure_work(4)
        return run.committed_from(a, healed) > 0

    wait_for(a_is_back, timeout=60, interval=0.2)
    line = run.finish()
    assert {r for r, _ in run.moves} >= {r for r, _ in held}, line
    print("moves after the cut: " + ", ".join(f"run {r} {t:.2f} s" for r, t in run.moves))
