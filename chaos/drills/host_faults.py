"""Host faults on emulated hosts (``--hosts netns``, chaos.testbed.hosts): what a whole host
does when it stalls or its network fails, as opposed to one process dying.

=================  ==========================================================
freeze             (chaos.drills.faults) on emulated hosts SIGSTOPs every
                   process of the victim's host (``ip netns pids``), SIGCONT after
partition          (chaos.drills.faults) on emulated hosts the victim's link goes
                   down (its bridge port: no carrier); up again to heal
partition-one-way  the victim's host drops everything it receives (nftables inside
                   its namespace) but still sends; SKIPPED without ``nft``
flap               the victim's link goes down and up ``FLAPS`` times
                   (``FLAP_DOWN_S`` down, ``FLAP_UP_S`` up), then stays up
partition-two      two of three hosts cut off one after the other (as
                   ``freeze-two``); the last node serves alone on its lease
=================  ==========================================================

Every host fault also measures ``address_moved_ms``: the time from the fault to a survivor
holding the victim's floating address (``HostNet.holders``, polled every ``MOVE_POLL_S``).
"""

from __future__ import annotations

import shutil
import signal
import time
from typing import Any

import trio

from chaos.drills.fault_names import FaultFailed, FaultUnavailable
from chaos.testbed.hosts import HostNet

MOVE_POLL_S = 0.02
FLAPS = 3
FLAP_DOWN_S = 0.3  # shorter than dead_after_s (0.6) by a beat at least: the fleet must not flap with the link
FLAP_UP_S = 1.0
HOSTS_ONLY = frozenset({"partition-one-way", "flap", "partition-two"})


def host_net(ctx: Any) -> HostNet | None:
    plan = getattr(ctx.fleet, "hosts", None)
    return HostNet(plan) if plan is not None else None


def check(fault: str, fleet: Any) -> None:
    """Raise ``FaultUnavailable`` if ``fault`` needs emulated hosts (or nft) this target lacks."""
    if fault in HOSTS_ONLY and getattr(fleet, "hosts", None) is None:
        raise FaultUnavailable(f"{fault} needs emulated hosts (--hosts netns)")
    if fault == "partition-one-way" and shutil.which("nft") is None:
        raise FaultUnavailable("partition-one-way: the nft command (nftables) is not installed")


async def signal_host(ctx: Any, node: str, sig: str) -> None:
    """STOP/CONT every process of ``node``'s host (emulated hosts), else the node's processes."""
    net = host_net(ctx)
    if net is None or sig not in ("STOP", "CONT"):
        await ctx.call(ctx.fleet.signal_node, node, sig, timeout_s=10)
        return
    signum = signal.SIGSTOP if sig == "STOP" else signal.SIGCONT
    pids = await ctx.call(net.signal_host, node, signum, timeout_s=10)
    if not pids:
        raise FaultFailed(f"no process on {node}'s host to {sig}")


async def watch_address(ctx: Any, step: dict[str, Any]) -> None:
    """Record ``address_moved_ms`` (fault -> a survivor holds the victim's floating address)."""
    net = host_net(ctx)
    if net is None or step.get("node") is None:
        return
    host = net.plan.host(step["node"])
    if host.floating is None:
        return
    with trio.move_on_after(ctx.react_timeout_s):
        while True:
            holders = await ctx.call(net.holders, timeout_s=5)
            if any(h != step["node"] for h in holders.get(host.floating, [])):
                step["address_moved_ms"] = (time.time_ns() - step["fault_ts_ns"]) / 1e6
                return
            await trio.sleep(MOVE_POLL_S)


async def _cut(ctx: Any, net: HostNet, node: str, kind: str, cut: bool) -> None:
    if kind == "one-way":
        await ctx.call(net.one_way, node, cut, timeout_s=30)
    else:
        await ctx.call(net.set_link, node, not cut, timeout_s=30)


async def _healed(ctx: Any, step: dict[str, Any]) -> None:
    from chaos.drills.faults import _wait_alive

    if not await _wait_alive(ctx, step["node"]):
        raise FaultFailed(f"{step['node']} is not alive {ctx.restore_timeout_s:.0f} s after the heal")
    ctx.mark_back(step)


async def partition_host(ctx: Any, kind: str = "link") -> None:
    """Cut a random node's host off (its link down, or ``one-way``: it hears nothing), heal after recovery."""
    net = host_net(ctx)
    assert net is not None and ctx.fleet is not None
    victim = ctx.rng.choice(await ctx.live_nodes())
    ts = time.time_ns()
    await _cut(ctx, net, victim, kind, True)
    step = ctx.mark_fault(victim, ts)
    step["cut"] = kind
    try:
        await ctx.await_effects(step)
        await ctx.hold_until(ts)
    finally:
        with trio.CancelScope(shield=True):
            await _cut(ctx, net, victim, kind, False)
    await _healed(ctx, step)
    await ctx.wait_healthy()


async def partition_one_way(ctx: Any) -> None:
    await partition_host(ctx, "one-way")


async def flap(ctx: Any) -> None:
    """A flapping link: down ``FLAP_DOWN_S``, up ``FLAP_UP_S``, ``FLAPS`` times; the fleet may or
    may not declare the node down, the clients must recover either way."""
    net = host_net(ctx)
    assert net is not None and ctx.fleet is not None
    victim = ctx.rng.choice(await ctx.live_nodes())
    ts = time.time_ns()
    step = ctx.mark_fault(victim, ts)
    step["flaps"] = FLAPS
    try:
        for i in range(FLAPS):
            await ctx.call(net.set_link, victim, False, timeout_s=30)
            await trio.sleep(FLAP_DOWN_S)
            await ctx.call(net.set_link, victim, True, timeout_s=30)
            if i < FLAPS - 1:
                await trio.sleep(FLAP_UP_S)
    finally:
        with trio.CancelScope(shield=True):
            await ctx.call(net.set_link, victim, True, timeout_s=30)
    step["recovered"] = await ctx.wait_recovered(ts)
    await _healed(ctx, step)
    await ctx.wait_healthy()


async def partition_two(ctx: Any) -> None:
    """Two of three hosts cut off one after the other; the last node serves alone; both heal."""
    from chaos.drills.faults import _last_node_serves_all, _most_loaded

    net = host_net(ctx)
    assert net is not None and ctx.fleet is not None
    steps: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            victim = await _most_loaded(ctx, frozenset(s["node"] for s in steps))
            ts = time.time_ns()
            await ctx.call(net.set_link, victim, False, timeout_s=30)
            steps.append(ctx.mark_fault(victim, ts))
            if len(steps) == 1:
                await ctx.await_effects(steps[0])
                await ctx.hold_until(ts)
        survivors = sorted(set(ctx.fleet.node_ids) - {s["node"] for s in steps})
        if len(survivors) != 1:
            raise FaultFailed(f"partition-two needs a fleet of three nodes (survivors: {survivors})")
        await _last_node_serves_all(ctx, survivors[0], steps[1])
        steps[1]["recovered"] = await ctx.wait_recovered(steps[1]["fault_ts_ns"])
        await ctx.hold_until(steps[1]["fault_ts_ns"])
    finally:
        with trio.CancelScope(shield=True):
            for step in steps:
                await ctx.call(net.set_link, step["node"], True, timeout_s=30)
    for step in steps:
        await _healed(ctx, step)
    await ctx.call(ctx.fleet.wait_balanced, ctx.restore_timeout_s, timeout_s=ctx.restore_timeout_s + 10)
