"""kproxy topology: the pure data of the fleet and the assignment algorithm.

Theory of operation
-------------------
A fleet of proxy nodes (:class:`ProxyNode`) stands in front of a set of Kafka
brokers (:class:`Broker`). Every node binds a bootstrap port plus one port per
broker identity (its :class:`PortScheme`), so any node can serve any identity.
An assignment (``broker_id -> proxy_id``) decides only what is *advertised*:
:func:`assign` computes it (covering, balanced, stable, rack-aware; the
precedence is documented in ``topology.assign``) and :class:`AddressMap` turns
it into the ``host:port`` clients are told for each broker id.

This package does no I/O, reads no clock, uses no randomness and imports
nothing else of kproxy: the same input gives the same output in every process,
which is what lets the Raft log carry plain data and every replica agree.
"""

from topology.address import AddressConflict, AddressMap, validate_addresses
from topology.assign import NoLiveNodes, assign, is_balanced, same_rack
from topology.model import Assignment, Broker, BrokerId, PortScheme, ProxyId, ProxyNode, freeze_owners

__all__ = [
    "AddressConflict",
    "AddressMap",
    "Assignment",
    "Broker",
    "BrokerId",
    "NoLiveNodes",
    "PortScheme",
    "ProxyId",
    "ProxyNode",
    "assign",
    "freeze_owners",
    "is_balanced",
    "same_rack",
    "validate_addresses",
]
