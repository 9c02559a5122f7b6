"""The Raft leader's decisions as a pure function of (state, liveness view, time).

``Planner.next_command(state, live, now, brokers)`` returns the one command the
leader should propose next, or None when the committed state already matches
what the leader sees. The caller proposes it, waits for its result (committed,
rejected as stale, or lost in a leader change) and asks again: every decision
is re-derived from the freshest committed state, so a new leader simply
continues where the old one stopped.

Order of business:

1. **Deaths** first: members marked up that the leader does not see live are
   marked down *together with* the table that moves their identities away
   (one commit, epoch + 1; only the dead nodes' identities move).
2. **Returns**: members seen live again are marked up *without* identities
   (the table is kept unless it is invalid). Step one of a rejoin.
3. **Upstream brokers** the leader's own data path reports (``SetBrokers``).
   A new broker is committed at once. A broker missing from the report had
   been missing from Kafka's answers for the data path's grace period
   (``proxy.broker_roster``) *if* the data path was running then: a leader
   that has been reporting for less than ``broker_grace`` (a node just
   started, whose data path never knew a broker in a rolling restart) keeps
   the committed record of a missing broker until it has reported that long.
4. **Repair**: a table that is invalid (a drained owner, a new broker without
   owner) is replaced at once by ``state.repaired()``.
5. **Rebalance**: a valid but unbalanced table (a node came back, a node was
   undrained) is replaced by ``assign(...)`` only once every node that would
   gain identities has been live, in the leader's own view, for
   ``rebalance_delay`` seconds. Step two of a rejoin: a node that dies again
   at once (crash loop, flapping link) never pulls clients over, and the data
   paths of the nodes losing identities see one planned move they can drain.
   Rebalancing also sends identities home to their racks: ``assign`` keeps a
   balanced table as it is, so after drains and undrains two nodes could keep
   each other's rack's broker for good; pairs of identities are swapped back
   (loads unchanged) under the same delay.

No clock is read here: ``now`` comes from the caller (the real monotonic clock
in ``Member``, simulated time in the tests).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from membership.commands import Command, MarkDown, MarkUp, Reassign, SetBrokers
from membership.state import FleetState
from topology import Broker, BrokerId, ProxyId, ProxyNode, assign, same_rack

Table = dict[BrokerId, ProxyId]


def _table(state: FleetState, previous: dict[BrokerId, ProxyId]) -> dict[BrokerId, ProxyId]:
    nodes = state.eligible_nodes()
    return assign(state.brokers, nodes, previous) if nodes else {}


def _rack_homed(owners: dict[BrokerId, ProxyId], brokers: Iterable[Broker],
                nodes: Iterable[ProxyNode]) -> dict[BrokerId, ProxyId]:
    """``owners`` with identities swapped pairwise until none can go home to its rack.

    Broker ``b`` held off-rack by ``p`` swaps with a broker ``c`` that a node ``q`` of ``b``'s
    rack holds off-rack: ``b`` lands home, ``q`` loses nothing of its own, loads are unchanged.
    A ``c`` whose rack is ``p``'s is preferred (both land home). Every swap adds at least one
    identity on its rack, so the loop ends; inputs are sorted, so every replica agrees."""
    by_id = {b.id: b for b in brokers}
    node_of = {n.id: n for n in nodes}
    out = dict(owners)

    def off_rack(bid: BrokerId, owner: ProxyId) -> bool:
        return bid in by_id and owner in node_of and not same_rack(by_id[bid], node_of[owner])

    swapped = True
    while swapped:
        swapped = False
        for bid in sorted(out):
            p = out[bid]
            if not off_rack(bid, p) or by_id[bid].rack is None:
                continue
            home = [n.id for n in sorted(node_of.values(), key=lambda n: n.id) if n.rack == by_id[bid].rack]
            partners = [c for c in sorted(out) if out[c] in home and off_rack(c, out[c])]
            partners.sort(key=lambda c: not same_rack(by_id[c], node_of[p]))  # both home first (stable)
            if partners:
                c = partners[0]
                out[bid], out[c] = out[c], p
                swapped = True
    return out


def settled_table(brokers: Iterable[Broker], nodes: list[ProxyNode],
                  current: dict[BrokerId, ProxyId]) -> dict[BrokerId, ProxyId]:
    """The table a rebalance moves ``current`` to: balanced by ``assign`` (minimal movement),
    then every identity that can go home to its rack swapped there. Equal to ``current``
    when there is nothing left to do (the simulator's test of a settled fleet)."""
    brokers = tuple(brokers)
    return _rack_homed(assign(brokers, nodes, current), brokers, nodes)


class Planner:
    def __init__(self, rebalance_delay: float, broker_grace: float = 0.0) -> None:
        if rebalance_delay < 0:
            raise ValueError("rebalance_delay must be >= 0")
        if broker_grace < 0:
            raise ValueError("broker_grace must be >= 0")
        self.rebalance_delay = rebalance_delay
        self.broker_grace = broker_grace
        self._live_since: dict[ProxyId, float] = {}
        self._reporting_since: float | None = None
        # (state, _settling(state)): the leader asks on every tick, mostly of the same state object.
        self._settled: tuple[FleetState, tuple[Table | None, Table | None, frozenset[ProxyId]]] | None = None

    def reset(self) -> None:
        """Forget the liveness and report history (call when leadership is lost)."""
        self._live_since.clear()
        self._reporting_since = None

    def observe(self, live: Iterable[ProxyId], now: float) -> None:
        live = frozenset(live)
        for p in [p for p in self._live_since if p not in live]:
            del self._live_since[p]
        for p in live:
            self._live_since.setdefault(p, now)

    def live_for(self, node: ProxyId, now: float) -> float:
        since = self._live_since.get(node)
        return 0.0 if since is None else now - since

    def _broker_change(self, state: FleetState, brokers: Iterable[Broker], now: float) -> SetBrokers | None:
        """The reported set, keeping missing brokers' records while the reports are younger than the grace."""
        if self._reporting_since is None:
            self._reporting_since = now
        reported = {b.id: b for b in brokers}
        if now - self._reporting_since < self.broker_grace:
            for b in state.brokers:
                reported.setdefault(b.id, b)
        wanted = tuple(sorted(reported.values(), key=lambda b: b.id))
        return SetBrokers(wanted) if wanted != state.brokers else None

    def next_command(
        self,
        state: FleetState,
        live: Iterable[ProxyId],
        now: float,
        brokers: Iterable[Broker] | None = None,
    ) -> Command | None:
        live = frozenset(live)
        self.observe(live, now)
        members = state.member_ids()

        dead = (state.up & members) - live
        if dead:
            after = attrs.evolve(state, up=state.up - dead)
            return MarkDown(dead, state.epoch, _table(after, state.owner_map()))

        back = (members - state.up) & live
        if back:
            after = attrs.evolve(state, up=state.up | back)
            if after.is_valid():
                return MarkUp(back, state.epoch)
            return MarkUp(back, state.epoch, _table(after, state.owner_map()))

        if brokers is not None:
            command = self._broker_change(state, brokers, now)
            if command is not None:
                return command

        kept = self._settled
        if kept is None or kept[0] is not state:
            kept = self._settled = (state, self._settling(state))
        repaired, target, receivers = kept[1]
        if repaired is not None:
            return Reassign(state.epoch, repaired)
        if target is None:
            return None
        # Every node that would receive an identity it does not hold has been live long enough.
        if all(self.live_for(p, now) >= self.rebalance_delay for p in receivers):
            return Reassign(state.epoch, target)
        return None

    @staticmethod
    def _settling(state: FleetState) -> tuple[Table | None, Table | None, frozenset[ProxyId]]:
        """What the committed table needs, from ``state`` alone (FleetState is immutable, so
        next_command keeps it for that state object; only the rebalance delay depends on time):
        (the repaired table if it is invalid, the rebalanced table if it is not settled, and the
        nodes that would receive an identity they do not hold)."""
        current = state.owner_map()
        if state.problem(current) is not None:
            return state.repaired(), None, frozenset()
        nodes = state.eligible_nodes()
        if not nodes:
            return None, None, frozenset()
        target = settled_table(state.brokers, nodes, current)
        if target == current:
            return None, None, frozenset()
        return None, target, frozenset(p for b, p in target.items() if current.get(b) != p)
