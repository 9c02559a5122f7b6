"""The assignment algorithm: which proxy node advertises which broker identity.

``assign(brokers, live_nodes, previous)`` returns ``broker_id -> proxy_id``.

Precedence, strongest first:

1. **Coverage** (hard): every broker gets exactly one owner among the live
   nodes.
2. **Balance** (hard): loads differ by at most one. With ``M`` brokers on ``n``
   nodes, ``q, extra = divmod(M, n)``: exactly ``extra`` nodes own ``q + 1``
   and the others own ``q``.
3. **Stability** (minimal movement): a broker keeps its previous owner when
   that owner is live, unless balance forces it away. The number of moved
   identities is the minimum any balanced assignment needs: a node's death
   moves only its identities (when ``previous`` was balanced), a join moves
   only what the new node must take.
4. **Rack affinity** (soft): among the moves balance forces, a node sheds its
   off-rack identities first, and a moving identity goes to a node of its own
   rack when one of them has room, otherwise to any node. Rack affinity never
   causes a move by itself and never breaks balance. After ``assign`` no single
   moved identity could go to an in-rack node with room, and no two moved
   identities could swap to gain an in-rack placement.

A broker and a node "share a rack" only when both racks are set and equal.

Determinism: inputs are sorted by id, every tie is broken by id; no hashing,
no randomness, so every process computes the same answer from the same input.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from topology.model import Broker, BrokerId, ProxyId, ProxyNode


class NoLiveNodes(ValueError):
    """There are brokers to assign but no live node to own them."""


def same_rack(broker: Broker, node: ProxyNode) -> bool:
    return broker.rack is not None and broker.rack == node.rack


def _sorted_unique(items: Iterable, what: str) -> list:
    out = sorted(items, key=lambda x: x.id)
    for a, b in zip(out, out[1:]):
        if a.id == b.id:
            raise ValueError(f"{what} id {a.id!r} appears twice")
    return out


def assign(
    brokers: Iterable[Broker],
    live_nodes: Iterable[ProxyNode],
    previous: Mapping[BrokerId, ProxyId] | None = None,
) -> dict[BrokerId, ProxyId]:
    """A balanced, stable, rack-aware owner for every broker (see the module doc).

    ``previous`` may name brokers that no longer exist or nodes that are not
    live: those entries are ignored. Raises :class:`NoLiveNodes` when there are
    brokers but no node, ``ValueError`` on duplicate ids.
    """
    broker_list = _sorted_unique(brokers, "broker")
    nodes = _sorted_unique(live_nodes, "node")
    if not broker_list:
        return {}
    if not nodes:
        raise NoLiveNodes(f"{len(broker_list)} brokers but no live node")
    prev = previous or {}
    q, extra = divmod(len(broker_list), len(nodes))
    top = q + 1

    held: dict[ProxyId, list[Broker]] = {n.id: [] for n in nodes}
    movers: list[Broker] = []
    for b in broker_list:
        owner = prev.get(b.id)
        if owner is not None and owner in held:
            held[owner].append(b)
        else:
            movers.append(b)

    def shed(node: ProxyNode, count: int) -> None:
        # Off-rack identities go first, then the higher broker ids.
        victims = sorted(held[node.id], key=lambda b: (same_rack(b, node), -b.id))[:count]
        for b in victims:
            held[node.id].remove(b)
            movers.append(b)

    # Nobody keeps more than q + 1 ...
    for node in nodes:
        excess = len(held[node.id]) - top
        if excess > 0:
            shed(node, excess)
    # ... and at most `extra` nodes keep q + 1; the others at q + 1 shed one,
    # those holding an off-rack identity first.
    at_top = [n for n in nodes if len(held[n.id]) == top]
    surplus = len(at_top) - extra
    if surplus > 0:
        at_top.sort(key=lambda n: (all(same_rack(b, n) for b in held[n.id]), n.id))
        for node in at_top[:surplus]:
            shed(node, 1)

    load = {n.id: len(held[n.id]) for n in nodes}
    n_top = sum(1 for v in load.values() if v == top)
    result: dict[BrokerId, ProxyId] = {b.id: nid for nid, bs in held.items() for b in bs}

    def can_accept(nid: ProxyId) -> bool:
        return load[nid] < q or (load[nid] == q and n_top < extra)

    def place(b: Broker, node: ProxyNode) -> None:
        nonlocal n_top
        result[b.id] = node.id
        load[node.id] += 1
        if load[node.id] == top:
            n_top += 1

    # Pass 1: moving identities that can land in their own rack do so.
    movers.sort(key=lambda b: b.id)
    rest: list[Broker] = []
    for b in movers:
        cands = [n for n in nodes if same_rack(b, n) and can_accept(n.id)]
        if cands:
            place(b, min(cands, key=lambda n: (load[n.id], n.id)))
        else:
            rest.append(b)
    # Pass 2: the others go to the least loaded node with room.
    for b in rest:
        cands = [n for n in nodes if can_accept(n.id)]
        # Capacity always suffices: sum of caps == len(broker_list).
        place(b, min(cands, key=lambda n: (load[n.id], n.id)))
    return dict(sorted(result.items()))


def is_balanced(mapping: Mapping[BrokerId, ProxyId], node_ids: Iterable[ProxyId]) -> bool:
    """Loads over ``node_ids`` (zero for nodes owning nothing) differ by at most one."""
    loads = {n: 0 for n in node_ids}
    for p in mapping.values():
        if p not in loads:
            return False
        loads[p] += 1
    return not loads or max(loads.values()) - min(loads.values()) <= 1
