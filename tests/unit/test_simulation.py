"""A seeded simulation of the fleet state machine and the leader's planner (VOPR style).

One seed derives every fault: node deaths and restarts (a restarted replica
replays the log from scratch), leader changes with deposed leaders that go on
proposing from stale state for a while, proposals lost or delayed and
delivered out of order, replicas that lag behind the log, wrong liveness views
(false suspicions, late detections), upstream broker changes and operator
drains.

Raft itself is abstracted to its guarantee: one committed log that every
replica applies in order. What is under test is what we build on top of it:
``FleetState.apply`` (conditional, idempotent commands) and ``Planner`` (the
leader's decisions), exactly the classes ``FleetMember`` runs.

Safety, checked after every apply of every replica:
  * one state per log index across replicas, and one state (so one owners
    table: at most one owner per identity) per epoch across replicas and time;
  * a replica's epoch never decreases;
  * no broker has two owners; owners, up and draining only name members; the
    table every data path derives (``repaired``) is valid.
Liveness: once faults stop (a stable leader, no loss, true liveness views),
the fleet converges within ``CONVERGE_S`` of simulated time: every alive node
a member and up, every dead one down, the reported brokers committed, every
broker owned by an eligible alive node, balanced, every replica identical.

Replay one seed: ``KPROXY_SIM_SEED=123 pytest tests/unit/test_simulation.py``;
more seeds: ``KPROXY_SIM_SEEDS=5000``.
"""

from __future__ import annotations

import os
import random

import attrs
import pytest

from membership.commands import APPLIED, REJECTED, Drain, Join, MarkDown, MarkUp, Reassign, Undrain
from membership.effective import effective_owners
from membership.planner import Planner
from membership.state import FleetState
from topology import Broker, ProxyNode, assign

pytestmark = pytest.mark.unit

TICK_S = 0.05
FAULT_TICKS = 240  # 12 s of simulated faults
REBALANCE_DELAY_S = 0.5
PROPOSAL_TIMEOUT_S = 0.6
CONVERGE_S = 6.0  # liveness bound once faults stop
DEFAULT_SEEDS = 300


class SimulationFailure(AssertionError):
    pass


@attrs.define
class Replica:
    id: str
    node: ProxyNode
    alive: bool = True
    applied: int = 0
    state: FleetState = FleetState()
    planner: Planner = attrs.field(factory=lambda: Planner(REBALANCE_DELAY_S))
    inflight: tuple[int, float] | None = None  # (token, give up at)


@attrs.define
class Proposal:
    deliver_at: float
    proposer: str
    token: int
    command: object


class Simulation:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        rng = self.rng
        n = rng.randint(1, 5)
        racks = [None, "a", "b"]
        self.replicas = {
            f"p{i}": Replica(f"p{i}", ProxyNode(f"p{i}", f"127.0.0.{11 + i}", 9092, rng.choice(racks)))
            for i in range(n)
        }
        self.all_brokers = [Broker(i, f"kafka{i}", 9092, rng.choice(racks)) for i in range(1, rng.randint(2, 9))]
        self.upstream = tuple(self.all_brokers)
        self.log: list[tuple[object, str, int]] = []
        self.net: list[Proposal] = []
        self.leader: str | None = None
        self.stale: dict[str, float] = {}  # deposed leaders still proposing until t
        self.now = 0.0
        self.tokens = 0
        self.faults = True
        self.p_loss = rng.choice([0.0, 0.1, 0.3])
        self.p_view_error = rng.choice([0.0, 0.05, 0.2])
        self.max_delay = rng.choice([0.0, 0.1, 0.4])
        self.state_at: dict[int, FleetState] = {0: FleetState()}
        self.state_of_epoch: dict[int, FleetState] = {0: FleetState()}
        self.trace: list[str] = []
        self.rejected = 0

    # ---- helpers ------------------------------------------------------------------------------

    def fail(self, why: str) -> None:
        tail = "\n  ".join(self.trace[-25:])
        raise SimulationFailure(
            f"simulation seed {self.seed} failed at t={self.now:.2f}s: {why}\n"
            f"replay: KPROXY_SIM_SEED={self.seed} pytest tests/unit/test_simulation.py\n"
            f"last events:\n  {tail}"
        )

    def note(self, event: str) -> None:
        self.trace.append(f"t={self.now:.2f} {event}")

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.alive]

    def view(self, r: Replica) -> frozenset[str]:
        live = {x.id for x in self.alive()} | {r.id}
        if self.faults and self.rng.random() < self.p_view_error:
            victim = self.rng.choice(sorted(self.replicas))
            if victim != r.id:
                live ^= {victim}  # a false suspicion or a missed death
        return frozenset(live)

    def propose(self, r: Replica, command: object) -> None:
        self.tokens += 1
        delay = self.rng.uniform(0, self.max_delay) if self.faults else TICK_S
        self.net.append(Proposal(self.now + delay, r.id, self.tokens, command))
        r.inflight = (self.tokens, self.now + PROPOSAL_TIMEOUT_S)
        self.note(f"{r.id} proposes {command!r}")

    # ---- faults -------------------------------------------------------------------------------

    def inject_faults(self) -> None:
        rng = self.rng
        x = rng.random()
        alive = self.alive()
        dead = [r for r in self.replicas.values() if not r.alive]
        if x < 0.015 and alive:
            r = rng.choice(alive)
            r.alive = False
            r.inflight = None
            self.stale.pop(r.id, None)
            if self.leader == r.id:
                self.leader = None
            self.note(f"kill {r.id}")
        elif x < 0.03 and dead:
            r = rng.choice(dead)
            self.restart(r)
        elif x < 0.05 and alive:
            new = rng.choice(alive).id
            if self.leader is not None and self.leader != new:
                self.stale[self.leader] = self.now + rng.uniform(0, 1.0)
            self.leader = new
            self.replicas[new].planner.reset()
            self.note(f"leader {new}")
        elif x < 0.06:
            if self.leader is not None:
                self.stale[self.leader] = self.now + rng.uniform(0, 1.0)
            self.leader = None
            self.note("no leader")
        elif x < 0.07:
            k = rng.randint(1, len(self.all_brokers))
            self.upstream = tuple(sorted(rng.sample(self.all_brokers, k), key=lambda b: b.id))
            self.note(f"upstream {[b.id for b in self.upstream]}")
        elif x < 0.08 and alive:
            r = rng.choice(alive)
            target = rng.choice(sorted(self.replicas))
            if r.inflight is None:
                self.propose(r, rng.choice([Drain(target), Undrain(target)]))

    def restart(self, r: Replica) -> None:
        r.alive = True
        r.applied = 0
        r.state = FleetState()
        r.planner = Planner(REBALANCE_DELAY_S)
        r.inflight = None
        self.note(f"restart {r.id}")

    # ---- one tick -----------------------------------------------------------------------------

    def deliver(self) -> None:
        due = [p for p in self.net if p.deliver_at <= self.now]
        self.net = [p for p in self.net if p.deliver_at > self.now]
        self.rng.shuffle(due)  # out of order
        for p in due:
            if self.faults and self.rng.random() < self.p_loss:
                self.note(f"lost {p.command!r}")
                continue
            if self.leader is None and p.proposer not in self.stale:
                self.note(f"dropped (no leader) {p.command!r}")
                continue
            self.log.append((p.command, p.proposer, p.token))

    def apply_some(self, r: Replica) -> None:
        pending = len(self.log) - r.applied
        count = pending if not self.faults else self.rng.randint(0, pending)
        for _ in range(count):
            command, proposer, token = self.log[r.applied]
            before = r.state
            after, result = before.apply(command)
            r.applied += 1
            r.state = after
            if proposer == r.id and r.inflight and r.inflight[0] == token:
                r.inflight = None
            self.check_safety(r, command, before, after, result)

    def check_safety(self, r: Replica, command, before: FleetState, after: FleetState, result) -> None:
        known = self.state_at.setdefault(r.applied, after)
        if known != after:
            self.fail(f"{r.id} diverged at log index {r.applied}: {after} != {known}")
        if after.epoch < before.epoch:
            self.fail(f"{r.id} epoch went back {before.epoch} -> {after.epoch}")
        known = self.state_of_epoch.setdefault(after.epoch, after)
        if known != after:
            self.fail(f"two states for epoch {after.epoch}: {after} and {known}")
        ids = [b for b, _ in after.owners]
        if len(ids) != len(set(ids)):
            self.fail(f"a broker with two owners: {after.owners}")
        members = after.member_ids()
        if not (set(after.owner_map().values()) <= members and after.up <= members and after.draining <= members):
            self.fail(f"non-members in the state: {after}")
        if after.problem(after.repaired()) is not None:
            self.fail(f"repaired table invalid: {after.problem(after.repaired())}")
        decision = isinstance(command, (MarkDown, Reassign)) or (
            isinstance(command, MarkUp) and command.owners is not None
        )
        if decision and result.outcome == APPLIED and not after.is_valid():
            self.fail(f"{command!r} installed an invalid table: {after.problem(after.owner_map())}")
        if result.outcome == REJECTED:
            self.rejected += 1

    def act(self, r: Replica) -> None:
        if r.inflight is not None and self.now >= r.inflight[1]:
            r.inflight = None  # outcome unknown: re-derive from fresh state
        if r.inflight is not None:
            return
        if r.node not in r.state.members:
            if self.rng.random() < 0.5:
                self.propose(r, Join(r.node))
            return
        is_leader = r.id == self.leader or self.stale.get(r.id, -1.0) > self.now
        if not is_leader:
            r.planner.reset()
            return
        command = r.planner.next_command(r.state, self.view(r), self.now, brokers=self.upstream)
        if command is not None:
            self.propose(r, command)

    def tick(self) -> None:
        self.now += TICK_S
        if self.faults:
            self.inject_faults()
        self.stale = {k: v for k, v in self.stale.items() if v > self.now}
        self.deliver()
        for r in self.alive():
            self.apply_some(r)
        for r in self.alive():
            self.act(r)

    # ---- phases -------------------------------------------------------------------------------

    def heal(self) -> None:
        self.faults = False
        self.stale.clear()
        for r in self.replicas.values():
            if not r.alive and self.rng.random() < 0.5:
                self.restart(r)
        if not self.alive():
            self.restart(self.rng.choice(sorted(self.replicas.values(), key=lambda r: r.id)))
        if self.leader is None or not self.replicas[self.leader].alive:
            self.leader = self.rng.choice(sorted(r.id for r in self.alive()))
            self.replicas[self.leader].planner.reset()
        self.note(f"heal: leader {self.leader}, alive {[r.id for r in self.alive()]}")

    def converged(self) -> str | None:
        """None when converged, else what is still missing."""
        if self.net:
            return "proposals in flight"
        alive = self.alive()
        for r in alive:
            if r.applied != len(self.log):
                return f"{r.id} behind the log"
            if r.inflight is not None:
                return f"{r.id} waiting for a proposal"
        s = self.replicas[self.leader].state
        alive_ids = {r.id for r in alive}
        if not alive_ids <= s.member_ids():
            return "an alive node is not a member"
        if s.up != alive_ids:
            return f"up {sorted(s.up)} != alive {sorted(alive_ids)}"
        if s.brokers != self.upstream:
            return "upstream brokers not committed"
        if not s.is_valid():
            return f"table invalid: {s.problem(s.owner_map())}"
        if not set(s.owner_map().values()) <= alive_ids:
            return "a broker owned by a dead node"
        owners = s.owner_map()
        if assign(s.brokers, s.eligible_nodes(), owners) != owners:
            return "not balanced"
        if any(r.state != s for r in alive):
            return "replicas differ"
        return None

    def run(self) -> float:
        for _ in range(FAULT_TICKS):
            self.tick()
        self.heal()
        start = self.now
        for _ in range(int(CONVERGE_S / TICK_S)):
            self.tick()
            if self.converged() is None:
                break
        else:
            self.fail(f"did not converge within {CONVERGE_S}s after faults stopped: {self.converged()}")
        # Converged: every data path uses the committed table.
        s = self.replicas[self.leader].state
        nodes = {r.id: r.node for r in self.replicas.values()}
        for r in self.alive():
            eff = effective_owners(
                r.state, self_id=r.id, nodes=nodes, reachable=set(nodes), degraded=False, local_brokers=self.upstream
            )
            if eff != s.owner_map():
                self.fail(f"{r.id} effective table differs from the committed one")
        # Stable: nothing more to do.
        for _ in range(int(2 * REBALANCE_DELAY_S / TICK_S)):
            self.tick()
        if self.replicas[self.leader].state != s:
            self.fail("state kept changing after convergence")
        return self.now - start


def _seeds() -> list[int]:
    one = os.environ.get("KPROXY_SIM_SEED")
    if one is not None:
        return [int(one)]
    count = int(os.environ.get("KPROXY_SIM_SEEDS", DEFAULT_SEEDS))
    base = int(os.environ.get("KPROXY_SIM_SEED_BASE", 0))
    return list(range(base, base + count))


def test_simulation_many_seeds():
    worst = 0.0
    commits = rejected = 0
    for seed in _seeds():
        sim = Simulation(seed)
        worst = max(worst, sim.run())
        commits += len(sim.log)
        rejected += sim.rejected
    print(
        f"simulated {len(_seeds())} seeds: {commits} log entries, {rejected} replica-applies "
        f"rejected (stale or invalid), worst convergence {worst:.2f}s"
    )


def test_simulation_detects_a_broken_state_machine(monkeypatch):
    """The harness can fail: a state machine that ignores expected epochs is caught."""
    from membership import state as state_mod

    def careless(self, expected_epoch, up, owners, check=True):
        if up == self.up and owners == self.owners:
            return self._unchanged()
        return self._next(up=up, owners=owners)

    monkeypatch.setattr(state_mod.FleetState, "_decide", careless)
    failures = 0
    for seed in range(60):
        try:
            Simulation(seed).run()
        except SimulationFailure as exc:
            failures += 1
            assert f"seed {seed}" in str(exc)
    assert failures > 0
