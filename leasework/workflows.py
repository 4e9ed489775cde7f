"""Workflows (docs/workflows.md): a graph of runs enqueued in one transaction (`Workflow`:
chains, groups, joins, nodes named), and batches (`Batch`: a set of runs with one callback run
when all have ended, which runs may join while it is open). Built on `Client.enqueue` with
`after` and on leasework.join_batch; the deps stage decides what waits (stages/deps.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Unpack

import psycopg

from .client import Client, async_connection, sync_connection
from .errors import ConfigError
from .queries import load
from .tasks import After, EnqueueOptions, check_policy

Q = load("leasework", "runs.sql")
Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]

__all__ = ["Batch", "Group", "Node", "Workflow"]


@dataclass(frozen=True)
class Node:
    """One run of a workflow, not yet enqueued: its name and place in the workflow."""

    name: str
    index: int


class Group(tuple[Node, ...]):
    """Nodes added together (a fan-out); `after=group` waits for every one of them (a join)."""


Parent = Node | Group | int  # a node of this workflow, a group, or the id of an existing run
# A parent, or a parent with a policy of its own: After(node, on_failure="run").
Dep = Parent | After[Parent]


@dataclass
class _Spec:
    kind: str
    payload: Any
    after: list[Dep]
    options: dict[str, Any]


@dataclass
class Workflow:
    """A graph of runs enqueued together: `add` a run (after others: nodes, groups, or ids of
    runs that exist), `group` runs side by side, `chain` runs one after another; `enqueue(conn)`
    enqueues them all in one transaction, in the order added (a node can only wait for nodes
    added before it: no cycle), and returns {name: run id}. Unnamed nodes are named
    `kind#n` (n: the order added)."""

    client: Client
    _specs: list[_Spec] = field(default_factory=list)
    _names: dict[str, int] = field(default_factory=dict)

    def add(
        self,
        kind: str,
        payload: Any = None,
        *,
        name: str | None = None,
        after: Dep | Iterable[Dep] | None = None,
        **options: Any,
    ) -> Node:
        """A run of `kind`, waiting for `after` (policy: `on_parent_failure`, "cancel" by
        default, or a parent's own, `After(node, on_failure="run")`); the options of
        `Client.enqueue` but key, exclusive and the windows."""
        parents = self._parents(after)
        self.client.defaults(kind)  # a kind refused here is refused before anything is sent
        index = len(self._specs)
        node = Node(self._name(name, kind, index), index)
        self._specs.append(_Spec(kind, payload, parents, dict(options)))
        self._names[node.name] = index
        return node

    def group(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        name: str | None = None,
        after: Dep | Iterable[Dep] | None = None,
        **options: Any,
    ) -> Group:
        """Runs side by side (a fan-out), each (kind, payload), each after `after`; named
        `name[i]` when `name` is given."""
        nodes = []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ConfigError(f"group items must be (kind, payload) pairs, got {item!r}")
            kind, payload = item
            label = f"{name}[{i}]" if name is not None else None
            nodes.append(self.add(kind, payload, name=label, after=after, **options))
        return Group(nodes)

    def chain(self, *items: tuple[str, Any], after: Dep | Iterable[Dep] | None = None) -> Group:
        """Runs one after another (a -> b -> c), each (kind, payload), the first after `after`."""
        nodes: list[Node] = []
        for kind, payload in items:
            nodes.append(self.add(kind, payload, after=nodes[-1] if nodes else after))
        return Group(nodes)

    def enqueue(self, conn: Conn) -> dict[str, int]:
        """Enqueue every node in one transaction on `conn` (inside the caller's, if one is
        open); {name: run id}."""
        c = sync_connection(conn, "enqueue")
        ids: list[int] = []
        with c.transaction():
            for spec in self._specs:
                ids.append(self.client.enqueue(c, spec.kind, spec.payload, **self._opts(spec, ids)))
        return {name: ids[i] for name, i in self._names.items()}

    async def enqueue_async(self, conn: AConn) -> dict[str, int]:
        """`enqueue` on a psycopg AsyncConnection."""
        c = async_connection(conn, "enqueue_async")
        ids: list[int] = []
        async with c.transaction():
            for spec in self._specs:
                ids.append(
                    await self.client.enqueue_async(
                        c, spec.kind, spec.payload, **self._opts(spec, ids)
                    )
                )
        return {name: ids[i] for name, i in self._names.items()}

    def _opts(self, spec: _Spec, ids: list[int]) -> EnqueueOptions:
        opts: dict[str, Any] = dict(spec.options)
        if spec.after:
            parents: list[int | After[int]] = []
            for dep in spec.after:
                target, policy = (
                    (dep.parent, dep.on_failure) if isinstance(dep, After) else (dep, None)
                )
                if isinstance(target, Node):
                    found = [ids[target.index]]
                elif isinstance(target, Group):
                    found = [ids[n.index] for n in target]
                else:
                    found = [target]
                parents.extend(found if policy is None else [After(i, policy) for i in found])
            opts["after"] = parents
        return opts  # type: ignore[return-value]

    def _name(self, name: str | None, kind: str, index: int) -> str:
        if name is None:
            name = f"{kind}#{index}"
        elif not isinstance(name, str) or not name:
            raise ConfigError(f"a node's name must be a non-empty string, got {name!r}")
        if name in self._names:
            raise ConfigError(f"two nodes are named {name!r}: give each node its own name")
        return name

    def _parents(self, after: Dep | Iterable[Dep] | None) -> list[Dep]:
        if after is None:
            return []
        given: list[Any] = (
            [after] if isinstance(after, Node | Group | int | After) else list(after)
        )
        return [
            After(self._target(dep.parent), check_policy(dep))
            if isinstance(dep, After)
            else self._target(dep)
            for dep in given
        ]

    def _target(self, p: object) -> Parent:
        """`p` checked: a node or a group of this workflow, or a run id."""
        if isinstance(p, Group):
            for n in p:
                self._own(n)
            return p
        if isinstance(p, Node):
            self._own(p)
            return p
        if isinstance(p, int) and not isinstance(p, bool) and p > 0:
            return p
        raise ConfigError(
            "after takes nodes or groups of this workflow, or run ids, each maybe with a policy "
            f"of its own (After(node, on_failure='run')), got {p!r}"
        )

    def _own(self, node: Node) -> None:
        if self._names.get(node.name) != node.index:
            raise ConfigError(f"node {node.name!r} is not a node of this workflow")


@dataclass
class Batch:
    """A set of runs with one callback run, enqueued once they have all ended (whatever their
    outcome); the callback's `ctx.parents().counts` says how many ended in each status.

    `add` enqueues a member. `close` enqueues the callback after the members added so far. In a
    handler, `open(conn, opened_by=ctx.run_id)` enqueues the callback at once, waiting for the
    handler's run too, and each `add` joins the batch then: the batch stays open until that
    handler's run ends. A batch is open while its callback waits (`blocked`): until every member
    and the run that opened it have ended. A run joins only an open batch, so a member's handler
    may add the pages it discovers (`app.batch_of(batch_id).add(...)`): its own run keeps the
    batch open until it ends."""

    client: Client
    kind: str
    payload: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    id: int | None = None  # the callback's run id, once enqueued
    members: list[int] = field(default_factory=list)  # added through this object

    def open(self, conn: Conn, *, opened_by: int) -> Batch:
        """Enqueue the callback now, waiting for run `opened_by` (the handler's own run,
        `ctx.run_id`) and for every member added after it."""
        if self.id is not None:
            raise ConfigError(f"batch {self.id} is open already")
        c = sync_connection(conn, "open")
        with c.transaction():
            self.id = self.client.enqueue(
                c, self.kind, self.payload, after=[opened_by], on_parent_failure="run",
                **self.options,
            )
            for member in self.members:
                c.execute(Q["join_batch"], {"batch": self.id, "run": member})
        return self

    def add(
        self, conn: Conn, kind: str, payload: Any = None, **options: Unpack[EnqueueOptions]
    ) -> int:
        """Enqueue a member (no `after`: a member waits for nothing); it joins the batch at once
        if the callback is enqueued (refused when the batch is closed: its callback no longer
        waits), else when `close` enqueues it."""
        if "after" in options:
            raise ConfigError("a batch member cannot wait for other runs (after): add it alone")
        c = sync_connection(conn, "add")
        with c.transaction():
            run_id = self.client.enqueue(c, kind, payload, **options)
            if self.id is not None:
                c.execute(Q["join_batch"], {"batch": self.id, "run": run_id})
        self.members.append(run_id)
        return run_id

    def close(self, conn: Conn) -> int:
        """Enqueue the callback after the members added so far (at once, with counts of zero,
        when there are none); the callback's id. A batch opened with `open` needs no close."""
        if self.id is None:
            c = sync_connection(conn, "close")
            self.id = self.client.enqueue(
                c, self.kind, self.payload, after=list(self.members), on_parent_failure="batch",
                **self.options,
            )
        return self.id

    async def open_async(self, conn: AConn, *, opened_by: int) -> Batch:
        """`open` on a psycopg AsyncConnection."""
        if self.id is not None:
            raise ConfigError(f"batch {self.id} is open already")
        c = async_connection(conn, "open_async")
        async with c.transaction():
            self.id = await self.client.enqueue_async(
                c, self.kind, self.payload, after=[opened_by], on_parent_failure="run",
                **self.options,
            )
            for member in self.members:
                await c.execute(Q["join_batch"], {"batch": self.id, "run": member})
        return self

    async def add_async(
        self, conn: AConn, kind: str, payload: Any = None, **options: Unpack[EnqueueOptions]
    ) -> int:
        """`add` on a psycopg AsyncConnection."""
        if "after" in options:
            raise ConfigError("a batch member cannot wait for other runs (after): add it alone")
        c = async_connection(conn, "add_async")
        async with c.transaction():
            run_id = await self.client.enqueue_async(c, kind, payload, **options)
            if self.id is not None:
                await c.execute(Q["join_batch"], {"batch": self.id, "run": run_id})
        self.members.append(run_id)
        return run_id

    async def close_async(self, conn: AConn) -> int:
        """`close` on a psycopg AsyncConnection."""
        if self.id is None:
            c = async_connection(conn, "close_async")
            self.id = await self.client.enqueue_async(
                c, self.kind, self.payload, after=list(self.members), on_parent_failure="batch",
                **self.options,
            )
        return self.id


def batch_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A callback's enqueue options: those of Client.enqueue but after and on_parent_failure,
    which the batch sets."""
    for name in ("after", "on_parent_failure", "key", "exclusive"):
        if name in options:
            raise ConfigError(f"a batch's callback takes no {name}: the batch sets what it waits for")
    return dict(options)
