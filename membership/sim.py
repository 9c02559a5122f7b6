"""A seeded simulation of a whole fleet of ``MemberCore``s (TigerBeetle VOPR style).

    python -m membership.sim --seed 123          # replay one seed
    python -m membership.sim --seeds 500         # seeds 0..499

Pure: simulated time, a simulated Raft and simulated heartbeats, and the
product's own pure parts: ``MemberCore`` (join and plan gating, suspicion, the
quorum lease, election hastening, the serving map), ``Planner``,
``FleetState`` and ``build_serving_map``. One seed derives everything: the
fleet's size, the fault rates and every fault.

**Safety phase** (``SAFETY_S`` of simulated time): process deaths and
restarts (a restarted member's Raft starts empty and is caught up), freezes
(SIGSTOP: no ticks, no heartbeats, a jump in time when it resumes),
partitions, heartbeat and proposal loss, commit delays, leaders deposed while
they still believe they lead, drains and undrains, upstream broker changes.
Checked at every step:

* the log: every applied leader decision leaves a valid table; owners, up and
  draining only name members; the table every replica derives is valid;
* at most one owner per identity per epoch: all maps that are not degraded at
  one epoch agree on the owner of every identity that epoch's committed table
  covers (an identity the table does not cover yet is placed locally: DESIGN
  §2.3 makes that harmless);
* no node advertises an identity it does not give to its owner: every address
  in a map is its owner's address for that identity;
* a node's epoch never decreases (per process incarnation);
* stand-in duties only name vacant nodes, never make a draining node or a
  node itself stand in, and outside degraded mode follow the committed view.

**Liveness phase**: faults stop (partitions heal, frozen nodes resume, no more
loss; some dead nodes restart, at least one node lives and one is not
draining). Within ``LIVENESS_BOUND_S`` every live node publishes the same map,
not degraded, in which every identity is owned, and advertised, by a live node
that is not draining; it stays so for ``2 * rebalance_delay``.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

import attrs

from membership.commands import APPLIED, Command, Drain, MarkDown, MarkUp, Reassign, Result, Undrain
from membership.config import MemberConfig, MemberSpec
from membership.control import (
    Action,
    HastenElection,
    MemberCore,
    Publish,
    RaftView,
    SubmitJoin,
    SubmitPlan,
)
from membership.effective import committed_vacant
from membership.planner import settled_table
from membership.serving import ServingMap
from membership.state import FleetState
from topology import Broker, ProxyNode

TICK_S = 0.05  # a tick of the simulated clock
SAFETY_S = 12.0
LIVENESS_BOUND_S = 20.0  # commit_timeout (5 s) + suspect_timeout + elections + rebalance_delay, with margin
REPLAY = "python -m membership.sim --seed {seed}"

CoreFactory = Callable[[MemberConfig, float], MemberCore]


class SimulationFailure(AssertionError):
    pass


@attrs.define
class SimNode:
    id: str
    node: ProxyNode
    config: MemberConfig
    alive: bool = True
    incarnation: int = 0
    frozen_until: float = 0.0
    side: int = 0  # partition side
    core: MemberCore | None = None
    applied: int = 0  # log entries applied by this replica
    heard: dict[str, float] = attrs.Factory(dict)
    refused: dict[str, float] = attrs.Factory(dict)
    known_leader: str | None = None
    leader_seen_at: float = 0.0
    last_epoch: int = 0


@attrs.define
class Pending:
    """A proposal on its way through Raft: committed at ``at`` unless the leader changes first."""

    at: float
    term: int
    node: str
    incarnation: int
    action: SubmitJoin | SubmitPlan | None  # None: an operator's command
    command: Command


@attrs.define
class Reply:
    at: float
    node: str
    incarnation: int
    action: SubmitJoin | SubmitPlan
    result: Result | None


class Simulation:
    def __init__(self, seed: int, core_factory: CoreFactory = MemberCore) -> None:
        self.seed = seed
        self.rng = rng = random.Random(seed)
        self.core_factory = core_factory
        n = rng.randint(1, 5)
        racks = [None, "a", "b"]
        nodes = [ProxyNode(f"p{i}", f"127.0.0.{11 + i}", 9092, rng.choice(racks)) for i in range(n)]
        specs = [MemberSpec(p, p.host, 7000) for p in nodes]
        self.nodes = {
            p.id: SimNode(p.id, p, MemberConfig(node_id=p.id, members=specs, password="sim",
                                                rebalance_delay=rng.choice([0.0, 0.5, 1.0])))
            for p in nodes
        }
        self.table = {p.id: p for p in nodes}
        self.all_brokers = [Broker(i, f"kafka{i}", 9092, rng.choice(racks)) for i in range(1, rng.randint(2, 9))]
        self.upstream = tuple(self.all_brokers)
        self.p_loss = rng.choice([0.0, 0.1, 0.3])
        self.max_commit_delay = rng.choice([0.02, 0.1, 0.4])
        self.now = 0.0
        self.faults = True
        self.log: list[Command] = []
        self.states: list[FleetState] = [FleetState()]  # state after each log prefix
        self.state_of_epoch: dict[int, FleetState] = {0: FleetState()}
        self.agreed: dict[int, dict[int, str]] = {}  # epoch -> broker -> owner in non-degraded maps
        self.leader: str | None = None
        self.term = 0
        self.stale: dict[str, float] = {}  # deposed leaders that still believe they lead, until
        self.election_at: float | None = 0.3
        self.hastened: dict[str, float] = {}
        self.pending: list[Pending] = []
        self.replies: list[Reply] = []
        self.trace: list[str] = []
        self.published = 0
        for s in self.nodes.values():
            self._boot(s)

    # ---- helpers ------------------------------------------------------------------------------

    def fail(self, why: str) -> None:
        tail = "\n  ".join(self.trace[-30:])
        raise SimulationFailure(
            f"simulation seed {self.seed} failed at t={self.now:.2f}s: {why}\n"
            f"replay: {REPLAY.format(seed=self.seed)}\nlast events:\n  {tail}"
        )

    def note(self, event: str) -> None:
        self.trace.append(f"t={self.now:.2f} {event}")

    def running(self, s: SimNode) -> bool:
        return s.alive and s.frozen_until <= self.now

    def reach(self, a: SimNode, b: SimNode) -> bool:
        return a.side == b.side

    def lost(self) -> bool:
        return self.faults and self.rng.random() < self.p_loss

    def _boot(self, s: SimNode) -> None:
        s.alive, s.frozen_until, s.applied = True, 0.0, 0
        s.incarnation += 1
        s.heard.clear()
        s.refused.clear()
        s.known_leader, s.last_epoch = None, 0
        s.core = self.core_factory(s.config, self.now)
        s.core.set_brokers(self.upstream)

    # ---- the simulated Raft -------------------------------------------------------------------

    def usable(self, leader: str | None) -> bool:
        if leader is None:
            return False
        s = self.nodes[leader]
        return self.running(s) and 2 * sum(self.running(x) and self.reach(s, x) for x in self.nodes.values()) > len(
            self.nodes
        )

    def raft_step(self) -> None:
        if self.leader is not None and not self.usable(self.leader):
            old = self.nodes[self.leader]
            if old.alive:
                self.stale[self.leader] = self.now + self.rng.uniform(0.0, 1.0)
            self.note(f"leader {self.leader} deposed")
            self.leader = None
            self.election_at = self.now + self.rng.uniform(0.3, 0.6)
        if self.leader is None:
            soonest = min(self.hastened.values(), default=None)
            if soonest is not None and (self.election_at is None or soonest < self.election_at):
                self.election_at = soonest
            if self.election_at is not None and self.now >= self.election_at:
                self._elect()
        self.hastened.clear()
        self.stale = {p: t for p, t in self.stale.items() if t > self.now and self.nodes[p].alive}
        self._commit_due()

    def _elect(self) -> None:
        candidates = sorted(p for p in self.nodes if self.usable(p))
        if not candidates:
            self.election_at = self.now + self.rng.uniform(0.3, 0.6)
            return
        eager = sorted(self.hastened, key=lambda p: (self.hastened[p], p))
        first = [p for p in eager if p in candidates]
        self.leader = first[0] if first and self.rng.random() < 0.8 else self.rng.choice(candidates)
        self.term += 1
        self.election_at = None
        self.stale.pop(self.leader, None)
        # The uncommitted proposals of the old term are lost with it.
        for p in self.pending:
            if p.term != self.term and p.action is not None:
                self._reply_later(p.node, p.incarnation, p.action, None)
        self.pending = [p for p in self.pending if p.term == self.term]
        self.note(f"leader {self.leader} term {self.term}")

    def submit(self, s: SimNode, action: SubmitJoin | SubmitPlan | None, command: Command) -> None:
        leader = self.nodes[self.leader] if self.leader is not None else None
        if leader is None or not self.reach(s, leader) or self.lost():
            self.note(f"{s.id} proposal lost {command!r}")
            if action is not None and self.rng.random() < 0.5:
                self._reply_later(s.id, s.incarnation, action, None)
            return
        at = self.now + self.rng.uniform(0.0, self.max_commit_delay if self.faults else TICK_S)
        self.pending.append(Pending(at, self.term, s.id, s.incarnation, action, command))
        self.note(f"{s.id} proposes {command!r}")

    def _reply_later(self, node: str, incarnation: int, action: SubmitJoin | SubmitPlan, result: Result | None) -> None:
        self.replies.append(Reply(self.now + self.rng.uniform(0.0, 0.2), node, incarnation, action, result))

    def _commit_due(self) -> None:
        due = [p for p in self.pending if p.at <= self.now]
        self.pending = [p for p in self.pending if p.at > self.now]
        for p in due:
            command = p.command
            before = self.states[-1]
            after, result = before.apply(command)
            self.log.append(command)
            self.states.append(after)
            self.check_log(command, before, after, result)
            if p.action is not None:
                self._reply_later(p.node, p.incarnation, p.action, result)

    def raft_view(self, s: SimNode) -> RaftView:
        state = self.states[s.applied]
        if s.id == self.leader or s.id in self.stale:
            return RaftView("leader", s.id, self.term, state)
        leader = self.nodes[self.leader] if self.leader is not None else None
        if leader is not None and self.running(leader) and self.reach(s, leader):
            s.known_leader, s.leader_seen_at = leader.id, self.now
        elif self.now - s.leader_seen_at > s.config.raft_max_timeout:
            s.known_leader = None
        role = "follower" if s.known_leader is not None else "candidate"
        return RaftView(role, s.known_leader, self.term, state)

    def catch_up(self, s: SimNode) -> None:
        if s.id in self.stale:
            return  # a deposed leader learns of the new term (and its log) only when its belief ends
        leader = self.nodes[self.leader] if self.leader is not None else None
        if s.id == self.leader or (leader is not None and self.running(leader) and self.reach(s, leader)):
            behind = len(self.log) - s.applied
            s.applied += behind if not self.faults else self.rng.randint(0, behind)

    # ---- heartbeats ---------------------------------------------------------------------------

    def beat(self) -> None:
        for a in self.nodes.values():
            if not self.running(a):
                continue
            for b in self.nodes.values():
                if b is a or not self.reach(a, b):
                    continue
                if not b.alive:
                    a.refused[b.id] = self.now  # a dead process's port refuses at once
                elif b.frozen_until <= self.now and not self.lost():
                    b.heard[a.id] = self.now

    def live(self, s: SimNode) -> frozenset[str]:
        timeout = s.config.suspect_timeout
        return frozenset(
            [s.id, *(p for p, t in s.heard.items() if self.now - t <= timeout and t > s.refused.get(p, -1.0))]
        )

    # ---- faults -------------------------------------------------------------------------------

    def inject_faults(self) -> None:
        rng = self.rng
        x = rng.random()
        nodes = sorted(self.nodes.values(), key=lambda s: s.id)
        alive = [s for s in nodes if s.alive]
        if x < 0.01 and alive:
            s = rng.choice(alive)
            s.alive = False
            self.note(f"kill {s.id}")
        elif x < 0.02:
            dead = [s for s in nodes if not s.alive]
            if dead:
                s = rng.choice(dead)
                self._boot(s)
                self.note(f"restart {s.id}")
        elif x < 0.03 and alive:
            s = rng.choice(alive)
            s.frozen_until = self.now + rng.uniform(0.2, 3.0)
            self.note(f"freeze {s.id} until {s.frozen_until:.2f}")
        elif x < 0.045 and self.leader is not None:
            # A leader change on a healthy fleet (a lost append_entries, a GC pause): the
            # old leader goes on planning from its own view until it learns the new term.
            self.stale[self.leader] = self.now + rng.uniform(0.0, 1.0)
            self.note(f"leader {self.leader} steps down")
            self.leader = None
            self.election_at = self.now + rng.uniform(0.0, 0.3)
        elif x < 0.05:
            for s in nodes:
                s.side = rng.randint(0, 1)
            self.note(f"partition {[(s.id, s.side) for s in nodes]}")
        elif x < 0.06:
            for s in nodes:
                s.side = 0
            self.note("partition healed")
        elif x < 0.065:
            k = rng.randint(1, len(self.all_brokers))
            self.upstream = tuple(sorted(rng.sample(self.all_brokers, k), key=lambda b: b.id))
            self.note(f"upstream {[b.id for b in self.upstream]}")
        elif x < 0.075 and alive:
            target = rng.choice(nodes).id
            self.operator(rng.choice(alive), rng.choice([Drain(target), Undrain(target)]))

    def operator(self, via: SimNode, command: Command) -> None:
        self.submit(via, None, command)

    def heal(self) -> None:
        self.faults = False
        for s in self.nodes.values():
            s.side, s.frozen_until = 0, 0.0
            if not s.alive and self.rng.random() < 0.5:
                self._boot(s)
        alive = sorted(s.id for s in self.nodes.values() if s.alive)
        if not alive:
            s = self.nodes[self.rng.choice(sorted(self.nodes))]
            self._boot(s)
            alive = [s.id]
        self.stale.clear()
        self.upstream = tuple(self.all_brokers) if self.rng.random() < 0.5 else self.upstream
        self.note(f"heal: alive {alive}")

    def _undrain_one_if_needed(self) -> None:
        state = self.states[-1]
        alive = {s.id for s in self.nodes.values() if s.alive}
        if alive and alive <= state.draining and self.leader is not None:
            self.operator(self.nodes[self.leader], Undrain(sorted(alive)[0]))

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> None:
        self.now = round(self.now + TICK_S, 6)
        if self.faults:
            self.inject_faults()
        self.raft_step()
        self.beat()
        for r in [r for r in self.replies if r.at <= self.now]:
            self.replies.remove(r)
            s = self.nodes[r.node]
            if s.alive and s.incarnation == r.incarnation and s.core is not None:
                self.deliver_reply(s, r)
        for s in sorted(self.nodes.values(), key=lambda s: s.id):
            if not self.running(s) or s.core is None:
                continue
            self.catch_up(s)
            s.core.set_brokers(self.upstream)
            heard_all = all(p in s.heard for p in self.nodes if p != s.id)
            self.execute(s, s.core.tick(self.now, self.live(s), heard_all, self.raft_view(s)))

    def deliver_reply(self, s: SimNode, r: Reply) -> None:
        assert s.core is not None
        if isinstance(r.action, SubmitJoin):
            s.core.join_done(r.action.token, r.result is not None, self.now)
        else:
            s.core.plan_done(r.action.token, r.action.command, r.result, "lost", self.now)

    def execute(self, s: SimNode, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, (SubmitJoin, SubmitPlan)):
                self.submit(s, a, a.command)
            elif isinstance(a, HastenElection):
                self.hastened[s.id] = self.now + a.within_s
            elif isinstance(a, Publish):
                self.published += 1
                self.check_map(s, a.map)

    # ---- safety -------------------------------------------------------------------------------

    def check_log(self, command: Command, before: FleetState, after: FleetState, result: Result) -> None:
        if after.epoch < before.epoch:
            self.fail(f"the committed epoch went back {before.epoch} -> {after.epoch}")
        known = self.state_of_epoch.setdefault(after.epoch, after)
        if known != after:
            self.fail(f"two states for epoch {after.epoch}: {after} and {known}")
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

    def check_map(self, s: SimNode, m: ServingMap) -> None:
        if m.epoch < s.last_epoch:
            self.fail(f"{s.id} went back from epoch {s.last_epoch} to {m.epoch}")
        s.last_epoch = m.epoch
        owners = m.owner_map()
        for b, address in m.addresses:
            owner = owners.get(b)
            if owner is None or address != self.table[owner].address_for(b):
                self.fail(f"{s.id} advertises {b} at {address}, but its owner is {owner} (epoch {m.epoch})")
        for duty in m.stand_ins:
            if duty.vacant not in m.vacant or duty.node in m.draining or duty.node == duty.vacant:
                self.fail(f"{s.id}'s map has a wrong stand-in duty {duty} (vacant {sorted(m.vacant)})")
        committed = self.state_of_epoch.get(m.epoch)
        if committed is None:
            self.fail(f"{s.id} serves epoch {m.epoch}, never committed")
            return
        if m.degraded:
            return
        if m.epoch > 0 and m.vacant != committed_vacant(committed):
            self.fail(f"{s.id}'s vacant {sorted(m.vacant)} is not the committed view at epoch {m.epoch}")
        agreed = self.agreed.setdefault(m.epoch, {})
        for b in committed.repaired():
            owner = owners.get(b)
            if agreed.setdefault(b, owner) != owner:
                self.fail(f"two owners of {b} at epoch {m.epoch}: {agreed[b]} and {owner} ({s.id})")

    # ---- liveness -----------------------------------------------------------------------------

    def not_converged(self, settling: bool = True) -> str | None:
        """None when every live node serves the same good map, else what is missing."""
        if settling and self.pending:
            return "proposals in flight"
        alive = [s for s in self.nodes.values() if s.alive]
        maps = {s.id: s.core.serving for s in alive if s.core is not None}
        first = next(iter(maps.values()))
        wanted = {b.id for b in self.upstream}
        if 2 * len(alive) <= len(self.nodes):
            # No quorum can form: every live node serves every identity itself or
            # through another live node (degraded mode, DESIGN §2.5).
            for p, m in maps.items():
                # (it cannot commit a change of the upstream brokers: it may serve more)
                if not m.degraded or not wanted <= set(m.owner_map()) or not set(m.owner_map().values()) <= set(maps):
                    return f"{p} (in a minority) does not serve every identity on live nodes"
            return None
        for s in alive:
            if s.core is None or not s.core.view.has_quorum or s.core.view.leader != self.leader:
                return f"{s.id} does not follow a leader with quorum"
        for p, m in maps.items():
            if m.degraded:
                return f"{p} degraded"
            if (m.epoch, m.owners, m.addresses) != (first.epoch, first.owners, first.addresses):
                return f"{p} serves epoch {m.epoch}, another node {first.epoch}"
        owners = first.owner_map()
        if set(owners) != wanted or {b for b, _ in first.addresses} != wanted:
            return f"identities served {sorted(owners)} != upstream {sorted(wanted)}"
        serving = {s.id for s in alive} - first.draining
        bad = {b: p for b, p in owners.items() if p not in serving}
        if bad:
            return f"identities on dead or draining nodes: {bad}"
        # Settled: the leader has nothing left to do (the rebalance of a returning node included).
        state = self.states[-1]
        if first.epoch != state.epoch or state.up != {s.id for s in alive} or state.brokers != self.upstream:
            return "the committed state is not the fleet's"
        if settled_table(state.brokers, state.eligible_nodes(), owners) != owners:
            return "not balanced yet"
        return None

    def run(self) -> float:
        """Both phases; returns how long convergence took after faults stopped."""
        while self.now < SAFETY_S:
            self.step()
        self.heal()
        start = self.now
        self.step()  # every core sees the healed fleet once before convergence is judged
        while self.not_converged() is not None:
            if self.now - start > LIVENESS_BOUND_S:
                self.fail(f"no convergence within {LIVENESS_BOUND_S}s after faults stopped: {self.not_converged()}")
            self.step()
            self._undrain_one_if_needed()
        took = self.now - start
        settled = {s.id: s.core.serving.owners for s in self.nodes.values() if s.alive and s.core is not None}
        rebalance = max(s.config.rebalance_delay for s in self.nodes.values())
        while self.now - start - took < 2 * rebalance + 1.0:
            self.step()
            problem = self.not_converged(settling=False)
            if problem is not None:
                self.fail(f"diverged again after convergence: {problem}")
        now_serving = {s.id: s.core.serving.owners for s in self.nodes.values() if s.alive and s.core is not None}
        quorum = 2 * len(settled) > len(self.nodes)  # a minority's maps follow its heartbeats
        if quorum and now_serving != settled:
            self.fail("the maps kept changing after convergence")
        return took


def run_seeds(seeds: range | list[int], core_factory: CoreFactory = MemberCore) -> dict[str, float]:
    """Run every seed; raises SimulationFailure at the first failing one."""
    worst = 0.0
    published = commits = 0
    for seed in seeds:
        sim = Simulation(seed, core_factory)
        worst = max(worst, sim.run())
        published += sim.published
        commits += len(sim.log)
    return {"seeds": len(seeds), "worst_convergence_s": worst, "maps_published": published, "log_entries": commits}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m membership.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, help="run this one seed")
    parser.add_argument("--seeds", type=int, default=100, help="run seeds base..base+N-1")
    parser.add_argument("--base", type=int, default=0)
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else list(range(args.base, args.base + args.seeds))
    try:
        stats = run_seeds(seeds)
    except SimulationFailure as exc:
        print(exc, file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
