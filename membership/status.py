"""``MemberStatus``: what ``Member.status()`` reports, typed; ``to_json()`` is its wire form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from membership.control import MemberView
from membership.serving import ServingMap
from membership.formats import SUPPORTED, FormatRange
from membership.state import FleetState
from topology import ProxyId


@attrs.frozen(slots=True)
class PeerStatus:
    """One peer as this node's heartbeat sees it (times in milliseconds ago, None if never)."""

    live: bool
    last_heard_ms_ago: float | None
    refused_ms_ago: float | None
    changed_at: float | None  # the member's monotonic time of the last up/down change

    @classmethod
    def from_heartbeat(cls, info: Mapping[str, Any], changed_at: float | None) -> PeerStatus:
        return cls(bool(info["live"]), info["last_heard_ms_ago"], info["refused_ms_ago"], changed_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "live": self.live,
            "last_heard_ms_ago": self.last_heard_ms_ago,
            "refused_ms_ago": self.refused_ms_ago,
            "changed_at": self.changed_at,
        }


def _serving_json(m: ServingMap) -> dict[str, Any]:
    return {
        "epoch": m.epoch,
        "version": m.version,
        "degraded": m.degraded,
        "changed_at": m.changed_at,
        "owners": {str(b): p for b, p in m.owners},
        "addresses": {str(b): f"{h}:{port}" for b, (h, port) in m.addresses},
        "error": m.error,
    }


@attrs.frozen(slots=True)
class MemberStatus:
    node: ProxyId
    view: MemberView
    state: FleetState  # the committed state
    serving: ServingMap
    peers: tuple[tuple[ProxyId, PeerStatus], ...]
    events: tuple[dict[str, Any], ...]  # membership event records, oldest first
    now: float  # the member's monotonic clock
    supported: FormatRange = SUPPORTED  # the state formats this node reads and writes

    def to_json(self) -> dict[str, Any]:
        state, view = self.state, self.view
        return {
            "node": self.node,
            "role": view.role,
            "term": view.term,
            "leader": view.leader,
            "has_quorum": view.has_quorum,
            "degraded": view.degraded,
            "epoch": state.epoch,
            "assignment": {str(b): p for b, p in state.owners},
            "effective": _serving_json(self.serving),
            "peers": {p: s.to_json() for p, s in self.peers},
            "members": {
                n.id: {
                    "host": n.host,
                    "bootstrap_port": n.bootstrap_port,
                    "rack": n.rack,
                    "up": n.id in state.up,
                    "draining": n.id in state.draining,
                }
                for n in state.members
            },
            "draining": sorted(state.draining),
            "brokers": [b.id for b in state.brokers],
            "state_format": state.format,
            "supported_formats": str(self.supported),
            "member_formats": {p: str(r) for p, r in state.member_formats},
            "events": [dict(e) for e in self.events],
            "now": self.now,
        }
