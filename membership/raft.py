"""The thin pysyncobj shell around the pure fleet state.

Each ``@replicated`` method applies one command to ``FleetState`` and returns
the ``Result``; nothing else happens in them (they run on every replica, in log
order, on the pysyncobj tick thread). Pitfalls handled here (DESIGN §9):

* pickle on the wire -> a password is mandatory (``MemberConfig`` refuses to
  start without one; pysyncobj then encrypts and authenticates every frame);
* pysyncobj binds 0.0.0.0 unless told -> ``bindAddress`` is always the
  member's own Raft address;
* batching adds ~100 ms per commit -> ``appendEntriesUseBatch=False``;
* ``connectionRetryTime`` 5 s, ``leaderFallbackTimeout`` 30 s -> tuned down;
* static membership only (``dynamicMembershipChange=False``): adding an
  unreachable node would silently grow the quorum.

``state`` is a class attribute holding the empty state; the first applied
command sets the instance attribute, which pysyncobj then includes in its
snapshots (it serialises instance attributes created after ``__init__``).
"""

from __future__ import annotations

import logging
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, replicated

from membership.commands import (
    REJECTED,
    Drain,
    Join,
    MarkDown,
    MarkUp,
    Reassign,
    Result,
    SetBrokers,
    Undrain,
)
from membership.config import MemberConfig
from membership.state import FleetState

log = logging.getLogger(__name__)


def syncobj_conf(config: MemberConfig) -> SyncObjConf:
    conf = SyncObjConf(
        password=config.password,
        bindAddress=config.me.raft_address,
        appendEntriesUseBatch=False,
        raftMinTimeout=config.raft_min_timeout,
        raftMaxTimeout=config.raft_max_timeout,
        appendEntriesPeriod=config.append_entries_period,
        autoTickPeriod=config.autotick_period,
        connectionTimeout=config.connection_timeout,
        connectionRetryTime=config.connection_retry_time,
        leaderFallbackTimeout=config.leader_fallback_timeout,
        dynamicMembershipChange=False,
        commandsWaitLeader=True,
        # Bounded bind retries: a port in use is reported by start(), not retried forever.
        bindRetryTime=0.1,
        maxBindRetries=20,
        # Snapshots in memory (the journal is in memory too): a restarted member
        # rejoins empty and is caught up by the leader.
        fullDumpFile=None,
        journalFile=None,
    )
    conf.validate()
    return conf


class FleetRaft(SyncObj):
    state: FleetState = FleetState()

    def __init__(self, config: MemberConfig) -> None:
        super().__init__(
            config.me.raft_address,
            [m.raft_address for m in config.peers],
            conf=syncobj_conf(config),
        )

    def _apply(self, command: object, kind: type) -> Result:
        if not isinstance(command, kind):
            return Result(REJECTED, self.state.epoch, f"expected {kind.__name__}")
        try:
            new, result = self.state.apply(command)
        except Exception:  # a bug: never let it wedge the log (pysyncobj would retry forever)
            log.exception("applying %r failed", command)
            return Result(REJECTED, self.state.epoch, "internal error")
        self.state = new
        return result

    @replicated
    def join(self, command: Join) -> Result:
        return self._apply(command, Join)

    @replicated
    def set_brokers(self, command: SetBrokers) -> Result:
        return self._apply(command, SetBrokers)

    @replicated
    def drain(self, command: Drain) -> Result:
        return self._apply(command, Drain)

    @replicated
    def undrain(self, command: Undrain) -> Result:
        return self._apply(command, Undrain)

    @replicated
    def mark_down(self, command: MarkDown) -> Result:
        return self._apply(command, MarkDown)

    @replicated
    def mark_up(self, command: MarkUp) -> Result:
        return self._apply(command, MarkUp)

    @replicated
    def reassign(self, command: Reassign) -> Result:
        return self._apply(command, Reassign)

    def submit(self, command: object, callback) -> None:
        """Propose ``command`` through the replicated method of its type."""
        method = {
            Join: self.join,
            SetBrokers: self.set_brokers,
            Drain: self.drain,
            Undrain: self.undrain,
            MarkDown: self.mark_down,
            MarkUp: self.mark_up,
            Reassign: self.reassign,
        }[type(command)]
        method(command, callback=callback)


# ---- outgoing source address ------------------------------------------------------------------
# pysyncobj binds its listening socket to ``bindAddress`` but opens its outgoing
# connections from whatever address the kernel picks (127.0.0.1 on loopback). A
# node is then not isolated by filtering its own address (the partition drill),
# and on a real host the source may be an interface the peers do not expect. One
# member per process (``kproxy run``) calls ``bind_outgoing(host)`` so every
# outgoing Raft socket is bound to the node's address first.

class _SourceBoundSockets:
    """Stands in for the ``socket`` module inside pysyncobj.tcp_connection only."""

    def __init__(self, real: Any, host: str) -> None:
        self._real = real
        self._host = host

    def socket(self, family: int = -1, type: int = -1, *args: Any) -> Any:  # noqa: A002
        s = self._real.socket(family, type, *args)
        if type == self._real.SOCK_STREAM:
            s.bind((self._host, 0))
        return s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def bind_outgoing(host: str) -> None:
    """Bind every outgoing pysyncobj connection of this process to ``host``."""
    import socket as real_socket

    import pysyncobj.tcp_connection as tcp_connection

    tcp_connection.socket = _SourceBoundSockets(real_socket, host)  # type: ignore[attr-defined]
