"""Faults for drills: inject, wait for the effects, undo.

Theory of operation
-------------------
A fault is an async function ``fault(ctx)`` run by ``chaos.drills.drill`` between the
drill's ``drill_start`` and ``drill_end`` events. It

1. picks its victim with ``ctx.rng`` (one seed derives every choice);
2. takes the fault instant (``time.time_ns()`` just before the signal, the
   nft rule or the admin call) and writes a ``fault`` event (fault, node);
3. waits, with deadlines, until every client has a success after that instant
   (``ctx.wait_recovered``) and until the fleet has reacted (victim seen down,
   a new assignment committed; ``ReactionWatcher``);
4. undoes the fault (restart, SIGCONT, heal, undrain) and writes
   ``node_back`` once the victim serves again, then waits until the fleet is
   healthy.

``rolling-restart`` repeats 2-4 for every proxy in turn, one ``fault`` event per
node, so each restart gets its own window.

Faults and what they need:

=================  ==========================================================
kill               SIGKILL a random proxy node; restart it afterwards
freeze             SIGSTOP a random proxy node (on emulated hosts: every process
                   of its host); SIGCONT after recovery (at least ``hold_s``
                   after the fault)
partition          drop every packet from/to a random proxy's loopback address
                   (nftables, ``chaos.drills.netfault``; on emulated hosts: its
                   link down); heal after recovery (at least ``hold_s``);
                   SKIPPED where nft/CAP_NET_ADMIN is missing
leader-kill        SIGKILL the Raft leader; restart it afterwards
broker-kill        SIGKILL a random Kafka broker; restart it afterwards (works
                   without a fleet, straight against Kafka)
drain              graceful drain of a random proxy through the admin API;
                   undrain afterwards
rolling-restart    every proxy in turn: drain, SIGTERM (SIGKILL after
                   ``stop_timeout_s``), restart, undrain, wait healthy
kill-two           the fleet losing two of three nodes (issue 4): SIGKILL the node
                   owning the most identities; once every client recovered and
                   the fleet committed a new map, SIGKILL the survivor owning
                   the most; the last node must serve every identity (no
                   quorum: its lease, DESIGN §2.5) and every client recover;
                   then restart both and wait until the identities rebalance
freeze-two         the same with SIGSTOP (SIGCONT both at the end)
leader-kill-two    the same with the Raft leader as each victim
partition-one-way, flap, partition-two
                   emulated hosts only: ``chaos.drills.host_faults``
grow-shrink        live membership: add two proxy nodes one at a time (admin
                   add-node, then the process; identities move to them by
                   planned moves), then remove as many original nodes, the last
                   first (drained: their identities move by planned moves; then
                   removed from Raft; then stopped); one ``fault`` event per
                   change. Local
                   loopback fleets only (the new nodes take the next addresses)
none               the control (not in ``FAULTS``): a ``fault`` event naming a
                   random live proxy and nothing else, then as long as a drain
                   takes; the same measures over the same kind of window give
                   the clients' own gaps under the same load (the baseline a
                   drain's disruption is compared with)
=================  ==========================================================

How the fleet reacts is recorded by ``chaos.drills.watcher.ReactionWatcher``.
Every blocking fleet/Kafka call runs in a worker thread under a deadline.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from chaos.drills import host_faults
from chaos.drills.fault_names import CONTROLS, FAULTS, FLEET_FAULTS, FaultFailed, FaultUnavailable
from chaos.drills.watcher import VIEW_TIMEOUT_S, ReactionWatcher, in_thread
from chaos.trace import TraceWriter

CONTROL_HOLD_S = 0.3  # "none": about as long as a drain, its undrain and the health check take


# --------------------------------------------------------------- context
@attrs.define
class FaultContext:
    """What a fault needs. ``wait_recovered(ts_ns)`` is the drill's: every client had a success after ts."""

    fault: str
    trace: TraceWriter
    rng: random.Random
    wait_recovered: Callable[[int], Awaitable[bool]]
    fleet: Any | None = None
    kafka: Any | None = None
    watcher: ReactionWatcher | None = None
    hold_s: float = 2.0
    react_timeout_s: float = 15.0
    restore_timeout_s: float = 90.0
    stop_timeout_s: float = 30.0
    on_failover: Callable[[dict[str, Any]], None] | None = None  # see ``chaos.drills.drill.DrillConfig``
    steps: list[dict[str, Any]] = attrs.Factory(list)
    errors: list[str] = attrs.Factory(list)  # problems that make the drill fail but do not stop it

    def mark_fault(self, node: str | None, ts_ns: int) -> dict[str, Any]:
        self.trace.fleet("fault", fault=self.fault, node=node, ts_ns=ts_ns)
        step = {"fault": self.fault, "node": node, "fault_ts_ns": ts_ns, "recovered": None, "reacted": None,
                "back_ts_ns": None}
        self.steps.append(step)
        return step

    def mark_back(self, step: dict[str, Any]) -> None:
        ts = time.time_ns()
        self.trace.fleet("node_back", fault=self.fault, node=step["node"], ts_ns=ts)
        step["back_ts_ns"] = ts

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        return await in_thread(fn, *args, timeout_s=timeout_s or self.restore_timeout_s)

    async def wait_healthy(self) -> None:
        if self.fleet is not None:
            await self.call(self.fleet.wait_healthy, self.restore_timeout_s,
                            timeout_s=self.restore_timeout_s + 10)

    async def node_pid(self, node: str) -> int | None:
        """The node's PID from the fleet view, if the fleet reports it (a process we started)."""
        assert self.fleet is not None
        view = await self.call(self.fleet.fleet_view, timeout_s=VIEW_TIMEOUT_S * 3)
        row = view.node(node)
        return row.pid if row is not None else None

    async def live_nodes(self) -> list[str]:
        assert self.fleet is not None
        view = await self.call(self.fleet.fleet_view, timeout_s=VIEW_TIMEOUT_S * 3)
        return view.alive_ids() or sorted(self.fleet.node_ids)

    async def hold_until(self, fault_ts_ns: int) -> None:
        """Keep a timed fault (freeze, partition) at least ``hold_s`` (a fault parameter)."""
        remaining_s = self.hold_s - (time.time_ns() - fault_ts_ns) / 1e9
        if remaining_s > 0:
            await trio.sleep(remaining_s)

    async def await_effects(self, step: dict[str, Any], *, down: bool = True) -> None:
        """Wait until every client recovered and the fleet reacted (each with its deadline)."""
        ts, node = step["fault_ts_ns"], step["node"]
        async with trio.open_nursery() as nursery:
            if down:  # on emulated hosts: fault -> a survivor holds the victim's address
                nursery.start_soon(host_faults.watch_address, self, step)
            step["recovered"] = await self.wait_recovered(ts)
            if self.watcher is not None:
                w = self.watcher
                ok_down = (await w.wait_for(lambda: w.down_since(node, ts), self.react_timeout_s)) if down else True
                ok_commit = await w.wait_for(lambda: w.committed_since(ts), self.react_timeout_s)
                step["reacted"] = ok_down and ok_commit


def check(fault: str, *, fleet: Any | None, kafka: Any | None) -> None:
    """Raise ``FaultUnavailable`` if ``fault`` cannot run against this target."""
    if fault not in FAULTS + CONTROLS:
        raise ValueError(f"unknown fault {fault!r} (one of {', '.join(FAULTS + CONTROLS)})")
    if fault in CONTROLS and fleet is None:
        raise FaultUnavailable(f"{fault} needs a proxy fleet (it names a proxy)")
    if fault in FLEET_FAULTS and fleet is None:
        raise FaultUnavailable(f"{fault} needs a proxy fleet")
    if fault == "broker-kill" and kafka is None:
        raise FaultUnavailable("broker-kill needs the local Kafka cluster (the fleet runs against an external one)")
    host_faults.check(fault, fleet)
    if fault == "grow-shrink" and (getattr(fleet, "hosts", None) is not None or not hasattr(fleet, "add_node")):
        raise FaultUnavailable("grow-shrink: needs a local fleet on loopback (kproxy fleet up, without --hosts netns)")
    if fault == "partition" and getattr(fleet, "hosts", None) is None:
        from chaos.drills.netfault import partition_support

        ok, why = partition_support()
        if not ok:
            raise FaultUnavailable(f"partition: {why}")


# ------------------------------------------------------------------ faults
async def _signal_fault(ctx: FaultContext, victim: str, sig: str) -> dict[str, Any]:
    assert ctx.fleet is not None
    ts = time.time_ns()
    await host_faults.signal_host(ctx, victim, sig)
    return ctx.mark_fault(victim, ts)


async def _restart(ctx: FaultContext, step: dict[str, Any]) -> None:
    assert ctx.fleet is not None
    if ctx.on_failover is not None:
        await ctx.call(ctx.on_failover, step, timeout_s=30)
    await ctx.call(ctx.fleet.restart_node, step["node"])
    ctx.mark_back(step)
    await ctx.wait_healthy()


async def kill(ctx: FaultContext) -> None:
    victim = ctx.rng.choice(await ctx.live_nodes())
    step = await _signal_fault(ctx, victim, "KILL")
    await ctx.await_effects(step)
    await _restart(ctx, step)


async def _leader(ctx: FaultContext, exclude: frozenset[str] = frozenset()) -> str:
    """The Raft leader, once there is one outside ``exclude`` (nodes already failed)."""
    assert ctx.fleet is not None
    victim = None
    with trio.move_on_after(ctx.restore_timeout_s):
        for _ in range(1000):
            victim = await ctx.call(ctx.fleet.leader, timeout_s=10)
            if victim and str(victim) not in exclude:
                return str(victim)
            await trio.sleep(0.1)
    raise FaultFailed(f"the fleet has no leader to kill (last seen: {victim})")


async def leader_kill(ctx: FaultContext) -> None:
    step = await _signal_fault(ctx, await _leader(ctx), "KILL")
    await ctx.await_effects(step)
    await _restart(ctx, step)


async def _most_loaded(ctx: FaultContext, exclude: frozenset[str] = frozenset()) -> str:
    """A live node owning the most identities in the committed table (ties: a seeded choice)."""
    assert ctx.fleet is not None
    view = await ctx.call(ctx.fleet.fleet_view, timeout_s=VIEW_TIMEOUT_S * 3)
    loads = {n.id: len(n.identities) for n in view.nodes if n.alive and n.id not in exclude}
    if not loads:
        raise FaultFailed("no live node to pick a victim from")
    most = max(loads.values())
    return ctx.rng.choice(sorted(n for n, load in loads.items() if load == most))


async def _last_node_serves_all(ctx: FaultContext, survivor: str, step: dict[str, Any]) -> None:
    """Wait until ``survivor`` (alone, without quorum) advertises itself for every broker."""
    assert ctx.fleet is not None
    owners: dict[str, Any] = {}
    with trio.move_on_after(ctx.react_timeout_s):
        for _ in range(int(ctx.react_timeout_s / 0.1) + 2):
            status = await ctx.call(ctx.fleet.status, survivor, timeout_s=5)
            owners = status.assignment  # what it advertises now (its serving map, degraded mode included)
            brokers = {str(b.id) for b in status.brokers}
            if brokers and set(owners) == brokers and set(owners.values()) == {survivor}:
                step["last_node_serves_all"] = True
                return
            await trio.sleep(0.1)
    step["last_node_serves_all"] = False
    ctx.errors.append(f"{survivor}, the last node, did not advertise itself for every broker within "
                      f"{ctx.react_timeout_s:.0f} s: advertised owners {owners}")


async def _cascade(ctx: FaultContext, sig: str,
                   pick: Callable[[FaultContext, frozenset[str]], Awaitable[str]]) -> None:
    """Two of three nodes fail one after the other (``CASCADES``); then both come back."""
    assert ctx.fleet is not None
    steps: list[dict[str, Any]] = []
    try:
        steps.append(await _signal_fault(ctx, await pick(ctx, frozenset()), sig))
        await ctx.await_effects(steps[0])
        if sig == "STOP":
            await ctx.hold_until(steps[0]["fault_ts_ns"])
        steps.append(await _signal_fault(ctx, await pick(ctx, frozenset({steps[0]["node"]})), sig))
        survivors = sorted(set(ctx.fleet.node_ids) - {s["node"] for s in steps})
        if len(survivors) != 1:
            raise FaultFailed(f"{ctx.fault} needs a fleet of three nodes (survivors: {survivors})")
        # No quorum is left, so no new map is committed: the survivor's lease makes it serve alone.
        await _last_node_serves_all(ctx, survivors[0], steps[1])
        steps[1]["recovered"] = await ctx.wait_recovered(steps[1]["fault_ts_ns"])
        if sig == "STOP":
            await ctx.hold_until(steps[1]["fault_ts_ns"])
    finally:
        if sig == "STOP":
            with trio.CancelScope(shield=True):
                for step in steps:
                    await host_faults.signal_host(ctx, step["node"], "CONT")
    for step in steps:
        if sig == "STOP":
            if not await _wait_alive(ctx, step["node"]):
                raise FaultFailed(f"{step['node']} is not alive {ctx.restore_timeout_s:.0f} s after SIGCONT")
        else:
            await ctx.call(ctx.fleet.restart_node, step["node"])
        ctx.mark_back(step)
    await ctx.call(ctx.fleet.wait_balanced, ctx.restore_timeout_s, timeout_s=ctx.restore_timeout_s + 10)


async def kill_two(ctx: FaultContext) -> None:
    await _cascade(ctx, "KILL", _most_loaded)


async def freeze_two(ctx: FaultContext) -> None:
    await _cascade(ctx, "STOP", _most_loaded)


async def leader_kill_two(ctx: FaultContext) -> None:
    await _cascade(ctx, "KILL", _leader)


async def _wait_alive(ctx: FaultContext, node: str) -> bool:
    if ctx.watcher is None:
        return True
    return await ctx.watcher.wait_alive(node, True, ctx.restore_timeout_s)


async def freeze(ctx: FaultContext) -> None:
    assert ctx.fleet is not None
    victim = ctx.rng.choice(await ctx.live_nodes())
    step = await _signal_fault(ctx, victim, "STOP")
    try:
        await ctx.await_effects(step)
        await ctx.hold_until(step["fault_ts_ns"])
    finally:
        with trio.CancelScope(shield=True):
            await host_faults.signal_host(ctx, victim, "CONT")
    if not await _wait_alive(ctx, victim):
        raise FaultFailed(f"{victim} is not alive {ctx.restore_timeout_s:.0f} s after SIGCONT")
    ctx.mark_back(step)
    await ctx.wait_healthy()


async def partition(ctx: FaultContext) -> None:
    from chaos.drills.netfault import Partition

    assert ctx.fleet is not None
    if getattr(ctx.fleet, "hosts", None) is not None:  # a host's link, not a loopback address
        await host_faults.partition_host(ctx)
        return
    victim = ctx.rng.choice(await ctx.live_nodes())
    address = await ctx.call(ctx.fleet.node_address, victim, timeout_s=10)
    peers = {await ctx.call(ctx.fleet.node_address, n, timeout_s=10) for n in ctx.fleet.node_ids if n != victim}
    pid = await ctx.node_pid(victim)
    cut = Partition(address)
    ts = time.time_ns()
    await ctx.call(cut.apply, timeout_s=15)
    step = ctx.mark_fault(victim, ts)
    try:
        await _check_leaks(ctx, step, pid, address, peers)
        await ctx.await_effects(step)
        await ctx.hold_until(ts)
        await _check_leaks(ctx, step, pid, address, peers)
    finally:
        with trio.CancelScope(shield=True):
            await ctx.call(cut.heal, timeout_s=15)
    if not await _wait_alive(ctx, victim):
        raise FaultFailed(f"{victim} is not alive {ctx.restore_timeout_s:.0f} s after the partition healed")
    ctx.mark_back(step)
    await ctx.wait_healthy()


async def _check_leaks(ctx: FaultContext, step: dict[str, Any], pid: int | None, address: str,
                       peers: set[str]) -> None:
    """Record the victim's sockets the address partition cannot cut; those reaching fleet peers
    make the partition a half partition: an error of the drill, with the reason."""
    from chaos.drills.netfault import foreign_connections

    if pid is None:
        step["leaks"] = "unknown (no pid in the fleet view)"
        return
    try:
        leaks = await ctx.call(foreign_connections, pid, address, timeout_s=10)
    except Exception as exc:  # the process may be gone; nothing to report then
        step["leaks"] = f"unknown ({type(exc).__name__}: {exc})"
        return
    to_peers = sorted({f"{local}->{remote}" for _, local, remote in leaks if remote.rsplit(":", 1)[0] in peers})
    other = sorted({f"{status} {local}->{remote}".strip() for status, local, remote in leaks
                    if remote.rsplit(":", 1)[0] not in peers})
    known = step.setdefault("leaks", {"to_peers": [], "other": []})
    known["to_peers"] = sorted(set(known["to_peers"]) | set(to_peers))
    known["other"] = sorted(set(known["other"]) | set(other))
    if to_peers:
        message = (f"partition of {step['node']} ({address}) is incomplete: its connections "
                   f"{', '.join(to_peers[:6])} to fleet peers do not use {address}, so the rules on "
                   f"{address} cannot cut them (bind the node's outgoing sockets to its address)")
        if message not in ctx.errors:
            ctx.errors.append(message)


async def broker_kill(ctx: FaultContext) -> None:
    kafka = ctx.kafka
    assert kafka is not None
    alive = sorted(b for b, pid in kafka.pids.items() if pid)
    if not alive:
        raise FaultFailed("no running Kafka broker to kill")
    broker = ctx.rng.choice(alive)
    ts = time.time_ns()
    await ctx.call(kafka.kill, broker, signal.SIGKILL, timeout_s=20)
    step = ctx.mark_fault(f"broker-{broker}", ts)
    # Kafka's own fail-over: no proxy goes down and the assignment need not change, so only
    # the clients' recovery is awaited.
    try:
        step["recovered"] = await ctx.wait_recovered(ts)
    finally:
        # Restarted even when the drill is cancelled (a workload died meanwhile): a broker
        # left dead fails every drill after this one on the same cluster.
        with trio.CancelScope(shield=True):
            await ctx.call(kafka.restart, broker, ctx.restore_timeout_s, timeout_s=ctx.restore_timeout_s + 10)
    ctx.mark_back(step)
    await ctx.wait_healthy()


async def drain(ctx: FaultContext) -> None:
    assert ctx.fleet is not None
    victim = ctx.rng.choice(await ctx.live_nodes())
    ts = time.time_ns()
    step = ctx.mark_fault(victim, ts)
    step["drain"] = await ctx.call(ctx.fleet.drain, victim, timeout_s=60)
    await ctx.await_effects(step, down=False)
    step["undrain"] = await ctx.call(ctx.fleet.undrain, victim, timeout_s=60)
    ctx.mark_back(step)
    await ctx.wait_healthy()


async def rolling_restart(ctx: FaultContext) -> None:
    assert ctx.fleet is not None
    order = sorted(ctx.fleet.node_ids)
    ctx.rng.shuffle(order)
    for node in order:
        ts = time.time_ns()
        step = ctx.mark_fault(node, ts)
        step["drain"] = await ctx.call(ctx.fleet.drain, node, timeout_s=60)
        await ctx.await_effects(step, down=False)
        await ctx.call(ctx.fleet.signal_node, node, "TERM", timeout_s=10)
        if not await _wait_dead(ctx, node):
            await ctx.call(ctx.fleet.signal_node, node, "KILL", timeout_s=10)
            if not await _wait_dead(ctx, node):
                raise FaultFailed(f"{node} still alive after SIGTERM and SIGKILL")
        await ctx.call(ctx.fleet.restart_node, node)
        step["undrain"] = await ctx.call(ctx.fleet.undrain, node, timeout_s=60)
        ctx.mark_back(step)
        await ctx.wait_healthy()
        # Before the next node: every client served again after this one came back.
        step["steady"] = await ctx.wait_recovered(step["back_ts_ns"])


GROW_BY = 2  # 3 -> 5 -> 3


async def grow_shrink(ctx: FaultContext) -> None:
    """Grow the fleet by GROW_BY nodes and shrink it back, one membership change at a time."""
    assert ctx.fleet is not None
    base = sorted(ctx.fleet.node_ids)
    prefix, last = ctx.fleet.node_address(base[-1]).rsplit(".", 1)
    added = [f"p{len(base) + i + 1}" for i in range(GROW_BY)]
    for i, node in enumerate(added):
        await _member_change(ctx, node, ctx.fleet.add_node, node, f"{prefix}.{int(last) + i + 1}")
    # The shrink removes original nodes: each owns identities, so its removal moves them by
    # planned moves (the drain), and one of them may be the Raft leader (it hands over first).
    for node in list(reversed(base))[:GROW_BY]:
        await _member_change(ctx, node, ctx.fleet.remove_node, node)


async def _member_change(ctx: FaultContext, node: str, change: Callable[..., Any], *args: Any) -> None:
    ts = time.time_ns()
    step = ctx.mark_fault(node, ts)
    answer = await ctx.call(change, *args, timeout_s=ctx.restore_timeout_s)
    step["change_s"] = (time.time_ns() - ts) / 1e9
    step["timings_s"] = answer.get("timings_s")
    await ctx.await_effects(step, down=False)
    ctx.mark_back(step)
    await ctx.wait_healthy()
    step["steady"] = await ctx.wait_recovered(step["back_ts_ns"])


async def control(ctx: FaultContext) -> None:
    """No fault at all: the baseline for the same measures (see the module docstring)."""
    assert ctx.fleet is not None
    victim = ctx.rng.choice(await ctx.live_nodes())
    ts = time.time_ns()
    step = ctx.mark_fault(victim, ts)
    step["recovered"] = await ctx.wait_recovered(ts)
    await trio.sleep(max(0.0, CONTROL_HOLD_S - (time.time_ns() - ts) / 1e9))
    ctx.mark_back(step)
    await ctx.wait_healthy()


async def _wait_dead(ctx: FaultContext, node: str) -> bool:
    if ctx.watcher is None:
        return True
    return await ctx.watcher.wait_alive(node, False, ctx.stop_timeout_s)


INJECT: dict[str, Callable[[FaultContext], Awaitable[None]]] = {
    "kill": kill,
    "freeze": freeze,
    "partition": partition,
    "leader-kill": leader_kill,
    "broker-kill": broker_kill,
    "drain": drain,
    "rolling-restart": rolling_restart,
    "kill-two": kill_two,
    "freeze-two": freeze_two,
    "leader-kill-two": leader_kill_two,
    "partition-one-way": host_faults.partition_one_way,
    "flap": host_faults.flap,
    "partition-two": host_faults.partition_two,
    "grow-shrink": grow_shrink,
    "none": control,
}
