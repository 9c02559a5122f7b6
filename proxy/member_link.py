"""Glue between the data path and the fleet member (membership/), in one process.

The data path never decides the assignment: it applies the member's
:class:`membership.serving.ServingMap` (pushed onto the event loop on every
change) and reports the upstream brokers it discovered. This module maps the node's TOML config onto the
member's config; any inconsistency is reported as a ``ConfigError`` naming the
``fleet.*`` or ``nodes[*]`` field.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable

from membership.config import ConfigError as MemberConfigError
from membership.config import MemberConfig, MemberSpec
from membership.member import Member
from membership.serving import ServingMap
from proxy.addresses.config import NONE as NO_MOVER
from proxy.config import Config, ConfigError, proxy_nodes
from proxy.datapath import DataPath
from proxy.hosts import is_wildcard, join_host_port
from proxy.upstream import UpstreamBroker
from topology import Broker

log = logging.getLogger("kproxy.member_link")

_FIELD = {"raft_min_timeout": "fleet.raft_min_timeout_s", "raft_max_timeout": "fleet.raft_max_timeout_s",
          "suspect_timeout": "fleet.dead_after_s", "quorum_lease": "fleet.lease_s",
          "rebalance_delay": "fleet.rebalance_delay_s", "password": "fleet.password", "members": "nodes",
          "broker_grace": "upstream.release_after_s"}


def member_config(config: Config, node_id: str) -> MemberConfig:
    assert config.fleet is not None
    members = []
    for n, node in zip(config.nodes, proxy_nodes(config)):
        assert n.raft_port is not None
        # The others dial a member's advertised host; it binds its own (a wildcard behind NAT).
        members.append(MemberSpec(node=node, raft_host=n.advertised, raft_port=n.raft_port,
                                  bind_host=None if n.host == n.advertised else n.host))
    f = config.fleet
    try:
        return MemberConfig(node_id=node_id, members=tuple(members), password=f.password,
                            raft_min_timeout=f.raft_min_timeout_s, raft_max_timeout=f.raft_max_timeout_s,
                            connection_timeout=max(1.0, f.raft_max_timeout_s),
                            suspect_timeout=f.dead_after_s, quorum_lease=f.lease_s,
                            rebalance_delay=f.rebalance_delay_s, broker_grace=config.release_after_s,
                            floating_addresses=config.addresses.kind != NO_MOVER,
                            realtime_priority=f.member_priority)
    except MemberConfigError as exc:
        raise ConfigError(_FIELD.get(exc.field, f"fleet.{exc.field}"), str(exc)) from None


def check_raft_ports(config: Config, node_id: str) -> None:
    """Raise a one-line OSError naming the address if this member's Raft (TCP) or heartbeat
    (UDP) port cannot be bound here. A node checks before it binds any data listener, but joins
    Raft only after they are bound: a member is assigned identities ``rebalance_delay_s`` after
    it is heard, and must be able to serve them by then."""
    me = member_config(config, node_id).me
    host, _, port = me.raft_bind_address.rpartition(":")
    checks = (("Raft listener (TCP)", socket.SOCK_STREAM, (host, int(port))),
              ("heartbeat listener (UDP)", socket.SOCK_DGRAM, me.heartbeat_bind))
    for what, kind, address in checks:
        try:
            family = socket.getaddrinfo(address[0], address[1], type=kind)[0][0]
            with socket.socket(family, kind) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as pysyncobj binds: TIME_WAIT is no obstacle
                s.bind(address)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise OSError(exc.errno, f"{what} {join_host_port(*address)}: cannot bind ({reason})") from None


def start_member(member: Member, bind_host: str, brokers: Iterable[UpstreamBroker]) -> None:
    """Start ``member`` (blocks until Raft is up) with the brokers the data path knows so far."""
    from membership.raft import bind_outgoing

    if not is_wildcard(bind_host):
        bind_outgoing(bind_host)  # Raft traffic leaves from this node's own address
    member.start()
    report_brokers(member, brokers)


def report_brokers(member: Member, brokers: Iterable[UpstreamBroker]) -> None:
    member.set_brokers([Broker(b.node_id, b.host, b.port, b.rack) for b in brokers])


REJOIN_DEADLINE_S = 60.0


def rejoin(member: Member, node_id: str, stopped: Callable[[], bool]) -> None:
    """A (re)started node wants to serve: undo a drain left from its last shutdown (blocking)."""
    deadline = time.monotonic() + REJOIN_DEADLINE_S
    while time.monotonic() < deadline and not stopped():
        if node_id not in member.committed_state().draining and member.status().view.leader:
            if member.committed_state().epoch > 0:
                return
        elif member.status().view.leader:
            try:
                member.undrain(node_id, timeout=5)
                return
            except Exception as exc:  # no leader yet, commit lost: retry until the deadline
                log.info("undrain on start not done yet", extra={"reason": repr(exc)})
        time.sleep(0.2)


class MemberLink:
    """Connects one node's DataPath to its Member: the member's map in, the discovered brokers out."""

    def __init__(self, datapath: DataPath, member: Member, loop: asyncio.AbstractEventLoop) -> None:
        self.datapath = datapath
        self.member = member
        self.loop = loop
        self.last: ServingMap | None = None
        datapath.on_brokers_changed(self._report_brokers)

    def start(self) -> None:
        start_member(self.member, self.datapath.local.host, sorted(self.datapath.brokers.values()))
        self.member.subscribe(self._on_change)

    def _report_brokers(self, brokers: list[UpstreamBroker]) -> None:
        report_brokers(self.member, brokers)

    def _on_change(self, snapshot: ServingMap) -> None:  # member thread
        self.loop.call_soon_threadsafe(self._apply, snapshot)

    def _apply(self, snapshot: ServingMap) -> None:  # event loop
        if self.last is not None and snapshot.version < self.last.version:
            return  # an older snapshot overtaken by a newer one
        self.last = snapshot
        drained = self.datapath.apply_map(snapshot)
        if drained:
            log.info("moved clients away", extra={"epoch": snapshot.epoch, "connections": drained})
