"""Configuration of one fleet member, validated like ``SyncObjConf.validate``.

Defaults are tuned for a LAN/loopback fleet (DESIGN §9): a dead process is
seen within milliseconds (its Raft connections reset, then its heartbeat port
refuses a probe; at the latest at the next beat, 0.2 s), a frozen or partitioned one after
``suspect_timeout`` (0.6 s: three beats missed). Elections run on the leader's UDP beat
(membership.election): a dead leader is replaced at once, a silent one when
its beat is ``raft_min_timeout`` (0.3 s) overdue, the last follower asking at
``raft_max_timeout`` overdue; pysyncobj's own election timer is a backstop
(``raft_backstop_timeout``) and an idle leader sends append_entries only every
``append_entries_period`` (0.75 s).

Relationships enforced (each error names the field):

* ``password`` is required: pysyncobj sends pickles, so anyone who can reach
  an unauthenticated Raft port can run code in the proxy.
* ``raft_max_timeout > raft_min_timeout >= heartbeat_interval`` (one lost
  beat never starts an election).
* ``raft_backstop_timeout > 3 * append_entries_period`` (pysyncobj's rule for
  its election timeout) and ``> raft_max_timeout + heartbeat_interval`` (the
  beat decides first).
* ``connection_timeout >= raft_max_timeout`` and
  ``leader_fallback_timeout > 2 * append_entries_period``.
* ``heartbeat_interval >= autotick_period`` and
  ``suspect_timeout >= 3 * heartbeat_interval`` (two lost datagrams never
  make a node dead).
* ``quorum_lease >= 2 * raft_max_timeout``: an ordinary election never sends
  a node into degraded mode.
* ``commit_timeout > raft_max_timeout``.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from topology import PortScheme, ProxyId, ProxyNode, validate_addresses


class ConfigError(ValueError):
    """A membership configuration value is missing or inconsistent."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def unknown_key_message(key: str, known: Iterable[str], what: str = "key") -> str:
    """``unknown key; did you mean 'x'?`` naming the closest known key (difflib), else listing them."""
    names = sorted(known)
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1, cutoff=0.6)
    if close:
        return f"unknown {what}; did you mean '{close[0]}'?"
    return f"unknown {what} (known: {', '.join(names)})"


@attrs.frozen(slots=True)
class MemberSpec:
    """One fleet member: how clients see it (``node``) and where its Raft and
    heartbeat endpoints are. The heartbeat is UDP on ``raft_host`` at
    ``heartbeat_port`` (default: the Raft port number, UDP and TCP being
    separate port spaces). ``raft_host`` is what the other members dial;
    ``bind_host`` (default ``raft_host``) is what this member binds, such as
    0.0.0.0 behind NAT (then its datagrams' source is not checked)."""

    node: ProxyNode
    raft_host: str
    raft_port: int
    heartbeat_port: int | None = None
    bind_host: str | None = None

    @property
    def raft_bind_address(self) -> str:
        return f"{self.bind_host or self.raft_host}:{self.raft_port}"

    @property
    def heartbeat_bind(self) -> tuple[str, int]:
        return (self.bind_host or self.raft_host, self.heartbeat_address[1])

    @property
    def origin_ip(self) -> str | None:
        """The source address of this member's heartbeats: its bound IP; None when unknown
        (a wildcard or a name: the kernel picks the source)."""
        try:
            ip = ipaddress.ip_address(self.bind_host or self.raft_host)
        except ValueError:
            return None
        return None if ip.is_unspecified else str(ip)

    @property
    def id(self) -> ProxyId:
        return self.node.id

    @property
    def raft_address(self) -> str:
        return f"{self.raft_host}:{self.raft_port}"

    @property
    def heartbeat_address(self) -> tuple[str, int]:
        return (self.raft_host, self.raft_port if self.heartbeat_port is None else self.heartbeat_port)


def _members(value) -> tuple[MemberSpec, ...]:
    return tuple(value)


@attrs.frozen(slots=True)
class MemberConfig:
    node_id: ProxyId
    members: tuple[MemberSpec, ...] = attrs.field(converter=_members)
    password: str | None = None
    # Elections (membership.election): a follower asks for votes when the leader's beat
    # is raft_min_timeout overdue, the last one raft_max_timeout overdue.
    raft_min_timeout: float = 0.3
    raft_max_timeout: float = 0.6
    # An idle leader's append_entries (each is an encrypted message, an answer and a
    # wake-up on two nodes: most of an idle fleet's CPU when it was every 86 ms). Commands
    # and commits are sent at once whatever this is.
    append_entries_period: float = 0.75
    # The longest idle wait of the tick thread: it also wakes on socket events and
    # when a timer is due (Raft's, the heartbeat's), membership.raft.cap_poll_wait.
    autotick_period: float = 0.2
    connection_timeout: float = 1.0
    connection_retry_time: float = 0.25
    # A leader steps down when no majority answered its append_entries for this long.
    leader_fallback_timeout: float = attrs.field(
        default=attrs.Factory(lambda self: round(max(1.0, 3 * self.append_entries_period), 4), takes_self=True))
    # Failure detection and reassignment
    # A dead process is seen at once (its Raft connections reset and the heartbeat
    # probes it, membership.heartbeat); the beat only times out frozen or cut-off nodes.
    heartbeat_interval: float = 0.2
    suspect_timeout: float = 0.6
    # pysyncobj's own election timeout (randomised up to 1.5 times it): a backstop that
    # fires only if neither append_entries nor the leader's beat arrive for that long.
    raft_backstop_timeout: float = attrs.field(default=attrs.Factory(lambda self: round(max(
        4 * self.append_entries_period, self.raft_max_timeout + 2 * self.heartbeat_interval), 4), takes_self=True))
    rebalance_delay: float = 1.0
    # A leader removes a broker from the committed set only after reporting brokers this long
    # (the data path's own grace period, upstream.release_after_s: membership.planner).
    broker_grace: float = 0.0
    quorum_lease: float = 1.5
    commit_timeout: float = 5.0
    # The nodes' advertised addresses float (an address mover, proxy.addresses): the map then
    # names the peers whose host refused a heartbeat, whose address floats before the commit
    # that marks them down (ServingMap.refused). Without a mover nothing would read it.
    floating_addresses: bool = False
    # The member's threads run SCHED_RR at this priority where allowed (membership.realtime); 0: never.
    realtime_priority: int = 0

    def __attrs_post_init__(self) -> None:
        self.validate()

    # ---- validation ------------------------------------------------------------------------

    def validate(self) -> None:
        if not isinstance(self.password, str) or not self.password:
            raise ConfigError(
                "password",
                "is required (pysyncobj sends pickles between members; without a shared "
                "password anyone who reaches the Raft port can run code in the proxy)",
            )
        for name in (
            "raft_min_timeout",
            "raft_max_timeout",
            "append_entries_period",
            "raft_backstop_timeout",
            "autotick_period",
            "connection_timeout",
            "connection_retry_time",
            "leader_fallback_timeout",
            "heartbeat_interval",
            "suspect_timeout",
            "quorum_lease",
            "commit_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(name, f"must be a number > 0, got {value!r}")
        if not isinstance(self.rebalance_delay, (int, float)) or self.rebalance_delay < 0:
            raise ConfigError("rebalance_delay", f"must be >= 0, got {self.rebalance_delay!r}")
        if not isinstance(self.realtime_priority, int) or not 0 <= self.realtime_priority <= 99:
            raise ConfigError("realtime_priority", f"must be between 0 (never) and 99, got {self.realtime_priority!r}")
        if not isinstance(self.broker_grace, (int, float)) or self.broker_grace < 0:
            raise ConfigError("broker_grace", f"must be >= 0, got {self.broker_grace!r}")

        def need(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise ConfigError(field, message)

        aep = self.append_entries_period
        need(
            self.raft_max_timeout > self.raft_min_timeout,
            "raft_max_timeout",
            f"must be > raft_min_timeout ({self.raft_min_timeout})",
        )
        need(
            self.raft_min_timeout >= self.heartbeat_interval,
            "raft_min_timeout",
            f"must be >= heartbeat_interval ({self.heartbeat_interval}): one lost beat must not start an election",
        )
        need(
            self.raft_backstop_timeout > 3 * aep,
            "raft_backstop_timeout",
            f"must be > 3 * append_entries_period ({3 * aep})",
        )
        need(
            self.raft_backstop_timeout > self.raft_max_timeout + self.heartbeat_interval,
            "raft_backstop_timeout",
            f"must be > raft_max_timeout + heartbeat_interval ({self.raft_max_timeout + self.heartbeat_interval})",
        )
        need(
            self.connection_timeout >= self.raft_max_timeout,
            "connection_timeout",
            f"must be >= raft_max_timeout ({self.raft_max_timeout})",
        )
        need(
            self.leader_fallback_timeout > 2 * aep,
            "leader_fallback_timeout",
            f"must be > 2 * append_entries_period ({2 * aep})",
        )
        need(
            self.heartbeat_interval >= self.autotick_period,
            "heartbeat_interval",
            f"must be >= autotick_period ({self.autotick_period})",
        )
        need(
            self.suspect_timeout >= round(3 * self.heartbeat_interval, 9),  # 3 * 0.2 is 0.6000000000000001
            "suspect_timeout",
            f"must be >= 3 * heartbeat_interval ({round(3 * self.heartbeat_interval, 9):g})",
        )
        need(
            self.quorum_lease >= 2 * self.raft_max_timeout,
            "quorum_lease",
            f"must be >= 2 * raft_max_timeout ({2 * self.raft_max_timeout})",
        )
        need(
            self.commit_timeout > self.raft_max_timeout,
            "commit_timeout",
            f"must be > raft_max_timeout ({self.raft_max_timeout})",
        )

        need(bool(self.members), "members", "must name at least this node")
        ids = [m.id for m in self.members]
        need(len(set(ids)) == len(ids), "members", f"duplicate node ids in {ids}")
        need(self.node_id in ids, "node_id", f"{self.node_id!r} is not one of the members {ids}")
        raft = [m.raft_address for m in self.members]
        need(len(set(raft)) == len(raft), "members", f"two members share a Raft address: {raft}")
        hb = [m.heartbeat_address for m in self.members]
        need(len(set(hb)) == len(hb), "members", f"two members share a heartbeat address: {hb}")
        try:
            validate_addresses([m.node for m in self.members], [])
        except ValueError as exc:
            raise ConfigError("members", str(exc)) from None

    # ---- accessors -------------------------------------------------------------------------

    @property
    def legacy_append_entries_period(self) -> float:
        """What a leader sends while a peer's elections still run on append_entries (a node
        from before the leader's beat, whose pysyncobj election timeout is raft_min_timeout)."""
        return round(self.raft_min_timeout / 3.5, 4)

    @property
    def me(self) -> MemberSpec:
        return next(m for m in self.members if m.id == self.node_id)

    @property
    def peers(self) -> tuple[MemberSpec, ...]:
        return tuple(m for m in self.members if m.id != self.node_id)

    def spec(self, node_id: str) -> MemberSpec:
        return next(m for m in self.members if m.id == node_id)

    def nodes(self) -> dict[ProxyId, ProxyNode]:
        return {m.id: m.node for m in self.members}

    # ---- (de)serialisation -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], node_id: str | None = None) -> MemberConfig:
        data = dict(data)
        members = []
        member_keys = {"id", "host", "bootstrap_port", "rack", "ports"} | {f.name for f in attrs.fields(MemberSpec)}
        for i, raw in enumerate(data.pop("members", [])):
            raw = dict(raw)
            for key in sorted(set(raw) - member_keys - {"node"}):
                raise ConfigError(f"members[{i}].{key}", unknown_key_message(key, member_keys - {"node"}))
            ports = raw.pop("ports", None)
            scheme = None
            if isinstance(ports, Mapping):
                scheme = PortScheme(
                    base=ports.get("base"),
                    explicit={int(k): int(v) for k, v in (ports.get("explicit") or {}).items()},
                )
            node_kwargs = {
                "id": raw.pop("id"),
                "host": raw.pop("host"),
                "bootstrap_port": raw.pop("bootstrap_port"),
                "rack": raw.pop("rack", None),
            }
            if scheme is not None:
                node_kwargs["ports"] = scheme
            members.append(MemberSpec(node=ProxyNode(**node_kwargs), **raw))
        if node_id is not None:
            data["node_id"] = node_id
        if "node_id" not in data:
            raise ConfigError("node_id", "is required")
        fields = {f.name for f in attrs.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            key = sorted(unknown)[0]
            raise ConfigError(key, unknown_key_message(key, fields))
        return cls(members=members, **data)

    @classmethod
    def from_json_file(cls, path: str | Path, node_id: str | None = None) -> MemberConfig:
        return cls.from_dict(json.loads(Path(path).read_text()), node_id=node_id)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in attrs.fields(type(self)) if f.name != "members"
        }
        out["members"] = [
            {
                "id": m.node.id,
                "host": m.node.host,
                "bootstrap_port": m.node.bootstrap_port,
                "rack": m.node.rack,
                "ports": {"base": m.node.ports.base, "explicit": {str(b): p for b, p in m.node.ports.explicit}},
                "raft_host": m.raft_host,
                "raft_port": m.raft_port,
                "heartbeat_port": m.heartbeat_port,
            }
            for m in self.members
        ]
        return out
