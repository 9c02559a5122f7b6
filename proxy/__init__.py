"""kproxy's data path: one node's Kafka-protocol proxy.

Theory of operation
-------------------
Bytes go through sans-IO cores and thin asyncio shells around them.

* Bytes (no I/O): :mod:`proxy.codec` joins, per connection, the
  :mod:`proxy.request_tracker` (client -> broker: peek request headers into
  the correlation table of :mod:`proxy.framing`) and the
  :mod:`proxy.response_splitter` (broker -> client: cut-through slices, and
  whole address-carrying frames for :mod:`proxy.rewrite`).
* Decisions (no I/O, injected clock): :mod:`proxy.drain` (a connection's
  drain as a state table, the node's drain), :mod:`proxy.takeover` (which
  vacant nodes' addresses to stand in on), :mod:`proxy.advertised` (the
  address clients are told for each identity, from the one
  :class:`membership.serving.ServingMap`).
* Shells: :mod:`proxy.connection` (a client/broker pair's protocols; the
  per-chunk hot path), :mod:`proxy.registry` (the node's connections and
  their drain), :mod:`proxy.listeners`, :mod:`proxy.discovery`, and
  :mod:`proxy.datapath`, which wires them into one node's
  :class:`proxy.datapath.DataPath`.
* The process: :mod:`proxy.runtime` (data path + admin endpoint + optional
  fleet member, joined by :mod:`proxy.member_link`), :mod:`proxy.config`.
  A node of ``workers`` > 1 is several processes instead: the
  :mod:`proxy.supervisor` (member, heartbeat, admin; decisions in
  :mod:`proxy.worker_pool`) and W :mod:`proxy.worker` processes, each a
  DataPath on the shared listeners (SO_REUSEPORT), talking over
  :mod:`proxy.worker_wire`.
"""
