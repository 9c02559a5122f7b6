"""kproxy membership: the Raft-replicated fleet table and failure detection.

Theory of operation
-------------------
The fleet's proxies replicate one small state machine with pysyncobj (Raft):
members and their advertised addresses, which members are up, which are
draining, the upstream brokers, and the owners table ``broker_id ->
proxy_id`` with an epoch that grows by one on every accepted change.

* ``state`` / ``commands`` — the pure core. ``FleetState.apply(command)``
  reads no clock, randomness or ``hash()``; every replica replaying the log
  reaches the same state. Intent commands (Join, SetBrokers, Drain, Undrain)
  are unconditional and idempotent; the leader's decisions (MarkDown, MarkUp,
  Reassign) are conditional on the expected epoch, idempotent, and carry the
  owners table computed by ``topology.assign``.
* ``formats`` — node-by-node upgrades: the state format the fleet has
  committed, the range each member reads (advertised in its Join), the rule
  that refuses a node which cannot read the fleet's format and the leader's
  ``SetFormat`` once every member can go higher.
* ``planner`` — the leader's decisions as a pure function of (state, liveness
  view, time): deaths are marked down together with the new table in one
  commit; a returning node is marked up at once and gets identities by a
  second commit after ``rebalance_delay`` of continuous liveness; drains
  move identities at once. A new leader simply re-plans from the log.
* ``heartbeat`` — UDP heartbeats: process death seen within milliseconds (its
  Raft connections reset, the member probes its heartbeat port, the dead port
  refuses), a frozen or partitioned node after ``suspect_timeout``.
* ``effective`` / ``serving`` — what the data path serves, as one
  ``ServingMap``: the committed table, or, after ``quorum_lease`` without
  quorum, the last committed table with the identities of unreachable owners
  taken over by reachable nodes; advertised addresses, vacant nodes and
  stand-in duties.
* ``roster`` — live membership changes (add or remove one node at a time,
  refused when the nodes alive now could not commit in the new configuration);
  the committed ``FleetState.roster`` is the members every node follows
  (heartbeat peers, quorum count), pysyncobj's dynamic membership the Raft side.
* ``election`` — when a follower starts a Raft election: the leader's UDP beat
  (its term and a leader flag in each datagram) holds elections off, so an idle
  leader sends append_entries rarely and pysyncobj's own timer is a backstop; a
  leader whose beat is overdue or who is declared dead is replaced at once.
* ``control.MemberCore`` — one member's decisions, sans-IO: join and plan
  gating, suspicion, the quorum lease, elections (``election``), the serving map.
* ``raft`` — the thin ``SyncObj`` subclass (one ``@replicated`` method per
  command) and the tuned pysyncobj configuration.
* ``member.Member`` — the interface the data path uses, a thin shell that
  executes ``MemberCore``'s actions; ``status.MemberStatus`` its typed status;
  ``standalone`` runs one member driven by JSON lines.

The pure modules (state, commands, formats, planner, roster, effective, serving, election,
control, status, sim) import neither pysyncobj nor sockets; ``sim`` is the seeded
fleet simulator (``python -m membership.sim --seed N``) that runs them under
faults.
"""
