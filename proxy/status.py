"""What a node's ``GET /status`` serves, and the fleet view assembled from them: typed values.

One place turns them into JSON and back (``to_json`` / ``from_json``); the
node, the admin client, the local launcher, the drills and the CLI all use
these types instead of guessing the shape of a dict.

``NodeStatus`` keeps apart two things that look alike:
``draining`` is whether *this node's data path* is draining, while
``draining_nodes`` is the fleet's committed list of draining members.
``epoch``/``assignment`` are what this node advertises right now (its
serving map, degraded mode included); ``committed_epoch``/
``committed_assignment`` are the Raft-committed table (a node without a fleet
has none).

``FleetView`` is one picture of a fleet from the statuses of its nodes: the
authoritative table is the Raft leader's (highest term wins if two claim it),
else the highest epoch any node reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # only for annotations: the status types themselves need nothing of membership
    from membership.serving import ServingMap
    from membership.status import MemberStatus
    from proxy.datapath import DataPathStatus


class StatusError(ValueError):
    """A ``/status`` document that does not have the expected shape."""


def _ints(value: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _strs(value: Iterable[Any]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _str_map(value: Mapping[Any, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in sorted((value or {}).items(), key=lambda kv: _key(kv[0]))}


def _key(k: Any) -> tuple[int, Any]:
    """Sort broker ids numerically, anything else after them as text."""
    try:
        return (0, int(k))
    except (TypeError, ValueError):
        return (1, str(k))


@attrs.frozen
class BrokerRow:
    """An upstream broker as a node knows it, and where this node advertises it."""

    id: int
    host: str
    port: int
    rack: str | None = None
    advertised: str | None = None  # host:port, None until its listener is bound here

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BrokerRow:
        return cls(id=int(d["id"]), host=str(d["host"]), port=int(d["port"]), rack=d.get("rack"),
                   advertised=d.get("advertised"))


@attrs.frozen
class MemberRow:
    """A fleet member as the committed state records it."""

    host: str
    bootstrap_port: int
    rack: str | None = None
    up: bool = False
    draining: bool = False

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MemberRow:
        return cls(host=str(d["host"]), bootstrap_port=int(d["bootstrap_port"]), rack=d.get("rack"),
                   up=bool(d.get("up")), draining=bool(d.get("draining")))


@attrs.frozen
class WorkerRow:
    """A data-path worker process of a node (proxy.supervisor); a single-process node lists none."""

    index: int
    pid: int | None
    ready: bool  # serving: listeners bound, its first map applied
    restarts: int = 0
    connections: int | None = None  # None: it did not answer
    epoch: int | None = None  # of the newest map it acknowledged
    version: int | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WorkerRow:
        return cls(**{a.name: d[a.name] for a in attrs.fields(cls) if a.name in d})


@attrs.frozen
class NodeStatus:
    """One node's ``/status`` (see the module doc for the fields that look alike)."""

    node: str
    pid: int
    ready: bool
    bootstrap: str
    listeners: tuple[int, ...] = attrs.field(converter=_ints)
    unbound: tuple[int, ...] = attrs.field(converter=_ints)
    standing_in: tuple[str, ...] = attrs.field(converter=_strs)
    connections: int
    draining: bool
    brokers: tuple[BrokerRow, ...]
    epoch: int
    assignment: dict[str, str] = attrs.field(converter=_str_map)
    role: str
    term: int
    leader: str | None
    has_quorum: bool
    admin_endpoints: dict[str, str] = attrs.field(converter=_str_map)
    # ---- a member of a fleet only (a node without one leaves the defaults)
    degraded: bool = False
    committed_epoch: int | None = None
    committed_assignment: dict[str, str] | None = None
    members: dict[str, MemberRow] = attrs.field(factory=dict)
    draining_nodes: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    peers: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # heartbeat view, membership's shape
    effective: dict[str, Any] | None = None  # the member's serving map, membership's shape
    events: tuple[dict[str, Any], ...] = ()  # membership events: t (monotonic), ts_ns (wall), event, ...
    now: float | None = None  # the member's monotonic clock when this was taken
    # State formats (membership.formats): the fleet's committed one, this node's range, each member's.
    state_format: int | None = None
    supported_formats: str | None = None
    member_formats: dict[str, str] = attrs.field(factory=dict)
    # ---- a node running data-path worker processes only: epoch/assignment above are then
    # the newest map every ready worker acknowledged
    workers: tuple[WorkerRow, ...] = ()
    # ---- a node with floating addresses only (proxy.addresses): held (node -> address), fenced
    floating: dict[str, Any] | None = None
    # Of ``connections``, those draining (closing at their first idle moment: their identity
    # moved, or the node drains), not closed yet; 0 once a move or a drain is over.
    moving: int = 0

    @property
    def in_fleet(self) -> bool:
        return self.committed_epoch is not None

    def identities(self) -> tuple[int, ...]:
        """Broker identities this node advertises itself for right now."""
        return tuple(sorted(int(b) for b, owner in self.assignment.items() if owner == self.node))

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        d["listeners"], d["unbound"] = list(self.listeners), list(self.unbound)
        d["standing_in"], d["draining_nodes"] = list(self.standing_in), list(self.draining_nodes)
        d["brokers"] = [b.to_json() for b in self.brokers]
        d["members"] = {k: m.to_json() for k, m in self.members.items()}
        d["events"] = list(self.events)
        d["workers"] = [w.to_json() for w in self.workers]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeStatus:
        try:
            fields = dict(d)
            fields["brokers"] = tuple(BrokerRow.from_json(b) for b in d.get("brokers") or ())
            fields["members"] = {str(k): MemberRow.from_json(m) for k, m in (d.get("members") or {}).items()}
            fields["events"] = tuple(e for e in d.get("events") or () if isinstance(e, Mapping))
            fields["workers"] = tuple(WorkerRow.from_json(w) for w in d.get("workers") or ())
            known = {a.name for a in attrs.fields(cls)}
            return cls(**{k: v for k, v in fields.items() if k in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise StatusError(f"not a node status: {exc!r}") from None


def node_status(datapath: DataPathStatus, serving: ServingMap, member: MemberStatus | None, *, pid: int,
                ready: bool, admin_endpoints: Mapping[str, str], workers: tuple[WorkerRow, ...] = ()) -> NodeStatus:
    """A node's status from its parts: the data path, the map it serves, its fleet member (if any).

    ``epoch``/``assignment`` come from the serving map (what clients are told now);
    without a fleet the node is its own leader, ``standalone``."""
    common = dict(
        node=datapath.node, pid=pid, ready=ready and not datapath.unbound, bootstrap=datapath.bootstrap,
        listeners=datapath.listeners, unbound=datapath.unbound, standing_in=datapath.standing_in,
        connections=datapath.connections, draining=datapath.draining, brokers=datapath.brokers,
        epoch=serving.epoch, assignment={str(b): p for b, p in serving.owners}, admin_endpoints=admin_endpoints,
        workers=workers, floating=datapath.floating, moving=datapath.moving)
    if member is None:
        return NodeStatus(role="standalone", term=0, leader=datapath.node, has_quorum=True, **common)
    m = member.to_json()  # the member's own wire form: one definition of its fields
    return NodeStatus(
        role=m["role"], term=m["term"], leader=m["leader"], has_quorum=m["has_quorum"], degraded=m["degraded"],
        committed_epoch=m["epoch"], committed_assignment=m["assignment"],
        members={k: MemberRow.from_json(v) for k, v in m["members"].items()}, draining_nodes=m["draining"],
        peers=m["peers"], effective=m["effective"], events=tuple(m["events"]), now=m["now"],
        state_format=m["state_format"], supported_formats=m["supported_formats"], member_formats=m["member_formats"],
        **common)


@attrs.frozen
class NodeRow:
    """One node in a :class:`FleetView`."""

    id: str
    address: str
    alive: bool  # its admin endpoint answered
    pid: int | None = None
    process: bool | None = None  # its process exists (None: not a process we started)
    role: str = "unreachable"
    term: int | None = None
    epoch: int | None = None
    has_quorum: bool | None = None
    up: bool | None = None  # the fleet's committed view
    draining: bool | None = None
    identities: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    standing_in: tuple[str, ...] = attrs.field(default=(), converter=_strs)

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["identities"], d["standing_in"] = list(self.identities), list(self.standing_in)
        return d


@attrs.frozen
class NodeEndpoint:
    """What the caller knows of a node before asking it anything."""

    id: str
    address: str
    pid: int | None = None
    process: bool | None = None


@attrs.frozen
class FleetView:
    """One picture of the fleet (see the module doc for whose table it shows)."""

    epoch: int | None
    leader: str | None
    assignment: dict[str, str] = attrs.field(converter=_str_map)
    nodes: tuple[NodeRow, ...]
    brokers: tuple[BrokerRow, ...]
    bootstrap: tuple[str, ...] = attrs.field(converter=_strs)
    members: dict[str, MemberRow] = attrs.field(factory=dict)
    state_format: int | None = None  # the fleet's committed state format (membership.formats)
    member_formats: dict[str, str] = attrs.field(factory=dict)  # each member's advertised range

    @classmethod
    def build(cls, endpoints: Iterable[NodeEndpoint], statuses: Mapping[str, NodeStatus | None],
              bootstrap: Iterable[str]) -> FleetView:
        answering = [s for s in statuses.values() if s is not None]
        leaders = [s for s in answering if s.role == "leader"]
        source = (max(leaders, key=lambda s: s.term) if leaders
                  else max(answering, key=lambda s: s.epoch) if answering else None)
        assignment = dict(source.assignment) if source else {}
        members = dict(source.members) if source else {}
        nodes = []
        for e in endpoints:
            s = statuses.get(e.id)
            m = members.get(e.id)
            nodes.append(NodeRow(
                id=e.id, address=e.address, alive=s is not None, pid=e.pid, process=e.process,
                role=s.role if s else "unreachable", term=s.term if s else None,
                epoch=s.epoch if s else None, has_quorum=s.has_quorum if s else None,
                up=m.up if m else None, draining=m.draining if m else None,
                identities=sorted(int(b) for b, owner in assignment.items() if owner == e.id),
                standing_in=s.standing_in if s else ()))
        return cls(epoch=source.epoch if source else None, leader=source.leader if source else None,
                   assignment=assignment, nodes=tuple(nodes), brokers=source.brokers if source else (),
                   bootstrap=tuple(bootstrap), members=members,
                   state_format=source.state_format if source else None,
                   member_formats=dict(source.member_formats) if source else {})

    def node(self, node_id: str) -> NodeRow | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def alive_ids(self) -> list[str]:
        return sorted(n.id for n in self.nodes if n.alive)

    def loads(self, *, exclude: Iterable[str] = ()) -> dict[str, int]:
        """Identities per live, non-draining node (``exclude`` left out)."""
        skip = set(exclude)
        return {n.id: len(n.identities) for n in self.nodes if n.alive and not n.draining and n.id not in skip}

    def health_problems(self, *, allow_dead: bool = False) -> list[str]:
        """Empty when: a leader, every broker on a live node, one epoch among live nodes.
        ``allow_dead``: unreachable nodes are fine as long as they own nothing."""
        problems = []
        if not self.leader:
            problems.append("no Raft leader")
        alive = {n.id for n in self.nodes if n.alive}
        if not allow_dead:
            problems += [f"node {n.id} unreachable" for n in self.nodes if not n.alive]
        broker_ids = sorted({b.id for b in self.brokers})
        if not broker_ids:
            problems.append("no upstream brokers known")
        for b in broker_ids:
            owner = self.assignment.get(str(b))
            if owner is None:
                problems.append(f"broker {b} unassigned")
            elif owner not in alive:
                problems.append(f"broker {b} assigned to unreachable node {owner}")
        epochs = sorted({n.epoch for n in self.nodes if n.alive and n.epoch is not None})
        if len(epochs) > 1:
            problems.append(f"nodes disagree on the epoch: {epochs}")
        return problems

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "leader": self.leader, "assignment": dict(self.assignment),
                "nodes": [n.to_json() for n in self.nodes], "brokers": [b.to_json() for b in self.brokers],
                "bootstrap": list(self.bootstrap), "members": {k: m.to_json() for k, m in self.members.items()},
                "state_format": self.state_format, "member_formats": dict(self.member_formats)}
