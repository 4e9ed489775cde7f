"""Property tests of dependencies (docs/workflows.md) on random graphs with random outcomes
and cancels, against the real statements: every run starts only after all its parents ended,
never runs when a parent failed or was cancelled under the cancel policy, every run ends, and
every batch's callback runs exactly once, after all its members. Each edge's policy is the run's
(`on_parent_failure`) or its own (`After(parent, on_failure)`), drawn at random: a run under
"cancel" on a parent that ended failed or cancelled never runs; a run whose every such parent is
under "run" runs once all its parents ended (unless it was cancelled itself)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import After, Client
from leasework.leases import lease
from leasework.stages import deps
from tests.conftest import truncate_all

Conn = psycopg.Connection[Any]
ENDED = ("succeeded", "partial", "failed", "cancelled")


@dataclass(frozen=True)
class Node:
    parents: tuple[int, ...]
    policy: str  # cancel | run: the run's own (on_parent_failure)
    outcome: str  # succeeded | partial | failed
    late: bool  # enqueued after the others started, not with them
    edges: tuple[str, ...] = ()  # per parent: "" (the run's policy), or its own, cancel | run

    def edge_policy(self, parent: int) -> str:
        """The policy of the edge to node `parent`: its own, else the run's."""
        own = self.edges[self.parents.index(parent)]
        return own or self.policy

    def after(self, ids: dict[int, int]) -> list[Any]:
        """`after` as enqueued: a parent with a policy of its own in an After."""
        return [
            After(ids[p], own) if own else ids[p]  # type: ignore[arg-type]
            for p, own in zip(self.parents, self.edges, strict=True)
        ]


@st.composite
def graphs(draw: st.DrawFn) -> tuple[list[Node], list[int], list[int]]:
    n = draw(st.integers(2, 9))
    nodes = []
    for i in range(n):
        parents = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))) if i else ()
        nodes.append(
            Node(
                parents,
                draw(st.sampled_from(["cancel", "run"])),
                draw(st.sampled_from(["succeeded", "succeeded", "partial", "failed"])),
                draw(st.booleans()) if i else False,
                tuple(draw(st.sampled_from(["", "", "cancel", "run"])) for _ in parents),
            )
        )
    cancels = draw(st.lists(st.integers(0, n - 1), max_size=2))
    members = sorted(draw(st.sets(st.integers(0, n - 1), max_size=4)))
    return nodes, cancels, members


def kind_of(conn: Conn, run_id: int) -> str:
    row = conn.execute("SELECT kind FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(graph=graphs(), order=st.randoms(use_true_random=False))
def test_random_graphs_keep_the_rules(conn: Conn, graph: Any, order: Any) -> None:
    truncate_all(conn)
    nodes, cancels, members = graph
    client = Client()
    ids: dict[int, int] = {}
    # the graph, in one transaction but the late nodes
    with conn.transaction():
        for i, node in enumerate(nodes):
            if not node.late and all(p in ids for p in node.parents):
                ids[i] = client.enqueue(
                    conn, f"n{i}", {}, after=node.after(ids) or None,
                    on_parent_failure=node.policy if node.parents else None,
                )
    # a batch over some of the nodes enqueued so far: the callback after them, policy batch
    batch_members = [ids[m] for m in members if m in ids]
    callback = client.enqueue(conn, "callback", {}, after=batch_members, on_parent_failure="batch")
    started: dict[int, list[tuple[int, str]]] = {}
    pending_cancels = list(cancels)
    for _ in range(400):
        # a late node is enqueued once all its parents are (in whatever state they are)
        for i, node in enumerate(nodes):
            if i not in ids and all(p in ids for p in node.parents):
                ids[i] = client.enqueue(
                    conn, f"n{i}", {}, after=node.after(ids) or None,
                    on_parent_failure=node.policy if node.parents else None,
                )
                break
        if pending_cancels and order.random() < 0.3:
            target = pending_cancels.pop()
            if target in ids:
                client.cancel(conn, ids[target])
        index = {run_id: i for i, run_id in ids.items()}
        kinds = [f"n{i}" for i in range(len(nodes))] + ["callback"]
        claims = lease.claim_runs(conn, kinds, worker="prop", lease=30.0)
        if claims:
            c = claims[0]
            assert c.id not in started, f"run {c.id} started twice"
            parents = conn.execute(
                "SELECT d.parent, p.status, d.anyway FROM leasework.run_deps d"
                " JOIN leasework.runs p ON p.id = d.parent WHERE d.child = %s",
                (c.id,),
            ).fetchall()
            started[c.id] = [(p, s) for p, s, _ in parents]
            kind = kind_of(conn, c.id)
            node = None if kind == "callback" else nodes[int(kind[1:])]
            for p, s, anyway in parents:
                assert s in ENDED, f"run {c.id} started while parent {p} was {s}"
                # the policy the graph gave this edge, not only the one the table holds
                policy = "run" if node is None else node.edge_policy(index[p])
                assert anyway == (policy == "run"), (c.id, p, policy, anyway)
                assert policy == "run" or s not in ("failed", "cancelled"), (
                    f"run {c.id} started after parent {p} ended {s} under the cancel policy"
                )
            outcome = "succeeded" if node is None else node.outcome
            assert lease.finish(conn, c, outcome)  # type: ignore[arg-type]
            continue
        if deps.settle(conn, 3):
            continue
        if len(ids) == len(nodes) and not pending_cancels:
            break
    rows = conn.execute("SELECT id, status FROM leasework.runs").fetchall()
    assert all(s in ENDED for _, s in rows), rows
    # the callback ran exactly once, after every member
    assert callback in started
    assert {p for p, _ in started[callback]} == set(batch_members)
    # a run that nobody cancelled, each of whose parents ended well or is under "run", ran; one
    # with a parent that ended failed or cancelled under "cancel" did not
    status = dict(rows)
    for i, node in enumerate(nodes):
        edge_ends = [(status[ids[p]], node.edge_policy(p)) for p in node.parents]
        blocked_by = [
            s for s, policy in edge_ends if s in ("failed", "cancelled") and policy == "cancel"
        ]
        if blocked_by:
            assert ids[i] not in started, (i, node, edge_ends)
            assert status[ids[i]] == "cancelled", (i, node, edge_ends)
        elif i not in cancels:
            assert ids[i] in started, (i, node, edge_ends)
