"""`kproxy bench failover`: RTO per client family over many SIGKILL drills, and graceful drains.

Runs the drill harness (real clients, real Kafka, a real fleet) ``drills`` times
with the ``kill`` fault (the node that owns the most identities is SIGKILLed,
then restarted and rebalanced before the next drill), then ``drains`` times with
the ``drain`` fault, then as many times with the ``none`` control (no fault,
same kind of window). Reports per client family p50/p99/max RTO, detection
(fault -> node_down) and commit (node_down -> committed map) times, lost and
duplicated records. Targets: p99 RTO <= 1 s for process death; <= 100 ms of
client-visible disruption for a graceful drain.

With ``light_clients`` N, N light clients (chaos.bench.light_clients: bootstrap,
Metadata, one connection to a broker identity, re-located and reconnected on
loss) run beside the real ones during the SIGKILL drills, spread evenly over
the broker identities (the victim carries those of the identities it owns);
``light_recovered_s`` (p50/p99/max) is, for every light client whose connection
the fault cut, the time from the fault to that client being back. The bench's
fleet then has no per-source accept limit (the light clients share 20 loopback
source addresses), and the light clients run as several processes (see
``LightClientProcess``). Before each fault the bench waits until every light
client holds a connection again (``DrillConfig.before_fault``): the previous
victim's restart moves identities back, which cuts their clients too, and that
storm must not overlap the next fault's; and until no node still moves a
connection off itself (``/status`` ``moving``: the handback's drain).

A drain's disruption does not start at the drain command (its RTO, the gap
around that instant, is often a client's ordinary gap): it starts when the
nodes apply the new map and close connections, tens of ms later, and again
when the identities move back. So the drain is also measured by each client's
longest gap in the drain's window (``max_gap_ms``), next to the same measure
under the control, which is the clients' own longest gap in such a window
without any fault. ``excess_ms`` = drain minus control, per family and
percentile: what the drain added.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from chaos.bench.light_clients import (DEFAULT_PROCESSES, LightClientProcess, LightEvent, fault_spans,
                                      light_recovered_s, recovered_stats, recovery_stages_ms, split)
from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
from chaos.testbed.fleet import LocalFleet
from chaos.testbed.hosts import LOOPBACK, NETNS
from chaos.testbed.security import Protocol
from chaos.measures import stats_ms

DEFAULT_CLIENTS = ("aiokafka:producer,confluent:producer,kafka-python:producer,java:producer,"
                   "aiokafka:consumer,confluent:consumer")


# The faults ``--fault`` may measure (the node owning the most identities is the victim where
# the fault picks one that way); the two-node cascades have the lease as their bound.
BENCH_FAULTS = ("kill", "freeze", "partition", "partition-one-way", "flap", "leader-kill", "kill-two", "freeze-two",
                "partition-two")
TWO_NODE = frozenset({"kill-two", "freeze-two", "partition-two"})


def _fleet_stats(result: dict[str, Any]) -> dict[str, Any]:
    faults = result.get("faults", [])
    return {key: stats_ms([f[key] for f in faults if f.get(key) is not None])
            for key in ("detect_ms", "commit_ms", "failover_ms")}


def run(*, drills: int = 20, drains: int = 5, clients: str = DEFAULT_CLIENTS, rate: float = 50.0,
        state_dir: str | None = None, out_dir: str | None = None, seed: int | None = None,
        light_clients: int = 0, progress: Callable[[dict[str, Any]], None] | None = None,
        hosts: str = LOOPBACK, fault: str = "kill", security: Protocol = Protocol.PLAINTEXT,
        workers: int = 1, share_upstream: bool = False, coalesce_metadata: bool = True,
        fair_accept: bool = True) -> dict[str, Any]:
    """``workers``: data-path workers per node of the fleet brought up here (not with ``state_dir``).
    ``share_upstream``: the fleet brought up here runs with ``limits.share_upstream`` on;
    ``coalesce_metadata`` False: with ``limits.coalesce_metadata`` off; ``fair_accept``: its
    ``limits.fair_accept``.
    ``light_clients``: that many light clients (chaos.bench.light_clients) beside the
    real ones during the SIGKILL drills; reported as ``light_recovered_s``.
    ``hosts``: the fleet brought up here, on loopback or on emulated hosts (``netns``).
    ``fault``: the fault of the main drills (``BENCH_FAULTS``; default SIGKILL).
    ``security``: its Kafka's listener; not plaintext: the fleet and every client are secured
    as ``LocalFleet.up`` does (TLS toward the clients, TLS/SASL upstream)."""
    if fault not in BENCH_FAULTS:
        raise ValueError(f"fault {fault!r} is not one of {', '.join(BENCH_FAULTS)}")
    if light_clients and hosts != LOOPBACK:
        raise ValueError("light clients run on loopback only (the load generator is not placed on an emulated host)")
    if light_clients and security is not Protocol.PLAINTEXT:
        raise ValueError("light clients speak plaintext only")
    light_events: list[LightEvent] = []
    light_nice = 0
    light_autogroup = False
    unsettled: list[int] = []  # faults injected before every light client was back
    unmoved: list[int] = []  # faults injected while a node still moved connections
    with tempfile.TemporaryDirectory(prefix="kproxy-bench-failover-") as tmp:
        # No per-source accept limit: thousands of light clients reconnect from a few
        # loopback addresses in the same second (proxy.admission would refuse most).
        limits: dict[str, Any] = {"accepts_per_source_per_s": 0} if light_clients else {}
        if share_upstream:
            limits["share_upstream"] = True
        if not coalesce_metadata:
            limits["coalesce_metadata"] = False
        limits["fair_accept"] = fair_accept
        extra = {"limits": limits} if limits else None
        fleet = LocalFleet.load(state_dir) if state_dir else LocalFleet.up(Path(tmp) / "fleet", first_ip=51,
                                                                            extra_config=extra, hosts=hosts,
                                                                            security=security, workers=workers)
        out = Path(out_dir) if out_dir else Path(tmp) / "traces"
        light = None
        try:
            if light_clients:
                if progress is not None:
                    progress({"phase": f"connecting {light_clients} light clients"})
                light = LightClientProcess(fleet.bootstrap, light_clients, out / "light-events.jsonl")
                out.mkdir(parents=True, exist_ok=True)
                light.start()
            settle = None if light is None else _settle(light, fleet, progress, unsettled, unmoved)
            kill = run_drill(DrillConfig(fault=fault, out_dir=out / fault, repeat=drills,
                                         clients=parse_clients(clients), rate=rate, seed=seed,
                                         before_fault=settle),
                             Target.of_fleet(fleet), progress)
            if light is not None:
                light_events = light.stop()
                light_nice = light.nice if light.nice_applied else 0
                light_autogroup = light.autogroup_nice_applied
                light = None
            drain = control = None
            if drains:
                drain = run_drill(DrillConfig(fault="drain", out_dir=out / "drain", repeat=drains,
                                              clients=parse_clients(clients), rate=rate, seed=seed),
                                  Target.of_fleet(fleet), progress)
                control = run_drill(DrillConfig(fault="none", out_dir=out / "control", repeat=drains,
                                                clients=parse_clients(clients), rate=rate, seed=seed),
                                    Target.of_fleet(fleet), progress)
        finally:
            if light is not None:
                light.stop()
            if not state_dir:
                fleet.down()
                logs = fleet.state_dir / "logs"
                if out_dir and logs.is_dir():  # the bench's own fleet goes with the temporary directory: keep its logs
                    try:
                        shutil.copytree(logs, out / "fleet-logs", dirs_exist_ok=True)
                    except OSError as exc:  # never in place of the run's own outcome
                        if progress is not None:
                            progress({"phase": f"the fleet's logs were not kept: {exc}"})
    fleet_kill = _fleet_stats(kill)
    result: dict[str, Any] = {
        "drills": kill.get("repeat"),
        "fault": "kill (SIGKILL of the node owning the most identities)" if fault == "kill" else fault,
        "clients": clients,
        "rate_per_producer": rate,
        "hosts": LOOPBACK if fleet.hosts is None else NETNS,
        "workers": None if state_dir else workers,
        "share_upstream": None if state_dir else share_upstream,
        "coalesce_metadata": None if state_dir else coalesce_metadata,
        "fair_accept": None if state_dir else fair_accept,
        "security": fleet.security.value,
        "rto_ms": {f: {k: v[k] for k in ("p50", "p99", "max")} for f, v in kill["rto_ms"].items()},
        "max_gap_ms": kill.get("max_gap_ms"),
        "longest_silence_ms": {f: {k: v[k] for k in ("p50", "p99", "max")}
                               for f, v in (kill.get("longest_silence_ms") or {}).items()},
        # From a node back to the next fault: what the handback costs each family.
        "handback_gap_ms": {f: {k: v[k] for k in ("p50", "p99", "max")}
                            for f, v in (kill.get("handback_gap_ms") or {}).items()},
        "detect_ms": fleet_kill["detect_ms"],
        "commit_ms": fleet_kill["commit_ms"],
        "failover_ms": fleet_kill["failover_ms"],
        "address_moved_ms": stats_ms([s["address_moved_ms"] for s in kill.get("steps", [])
                                      if s.get("address_moved_ms") is not None]),
        "lost": kill["lost"] + (drain["lost"] if drain else 0),
        "duplicated": kill["duplicated"] + (drain["duplicated"] if drain else 0),
        "records_acked": kill["records"]["acked"],
        "passed": kill.get("passed"),
        "errors": kill.get("errors", [])[:10],
        "faults_measured": len(kill.get("faults", [])),
        "seed": kill.get("seed"),
    }
    if drain is not None and control is not None:
        result["drain"] = {
            "drills": drain.get("repeat"),
            "rto_ms": {f: {k: v[k] for k in ("p50", "p99", "max")} for f, v in drain["rto_ms"].items()},
            "max_gap_ms": drain.get("max_gap_ms"),
            "failover_ms": _fleet_stats(drain)["failover_ms"],
            "passed": drain.get("passed"),
            "errors": drain.get("errors", [])[:10],
        }
        result["control"] = {
            "drills": control.get("repeat"),
            "max_gap_ms": control.get("max_gap_ms"),
            "rto_ms": {f: {k: v[k] for k in ("p50", "p99", "max")} for f, v in control["rto_ms"].items()},
            "passed": control.get("passed"),
            "errors": control.get("errors", [])[:10],
        }
        result["drain"]["excess_ms"] = excess(drain.get("max_gap_ms") or {}, control.get("max_gap_ms") or {})
    p99s = [v["p99"] for v in result["rto_ms"].values() if v["p99"] is not None]
    bound = 2000 if fault in TWO_NODE else 1000
    result["targets"] = {f"{fault}_rto_p99_ms<={bound}": bool(p99s) and max(p99s) <= bound}
    if light_clients:
        recovered, never = light_recovered_s(light_events, fault_spans(kill.get("steps", [])))
        result["light_clients"] = light_clients
        result["light_generator_processes"] = len(split(light_clients, DEFAULT_PROCESSES))
        result["light_generator_nice"] = light_nice
        result["light_generator_autogroup_nice"] = light_autogroup  # its own autogroup at that nice
        result["light_recovered_s"] = recovered_stats(recovered)
        result["light_recovery_stages_ms"] = recovery_stages_ms(light_events, fault_spans(kill.get("steps", [])))
        result["light_reconnects_measured"] = len(recovered)
        result["light_never_back"] = never
        result["light_unsettled_faults"] = len(unsettled)
        result["light_unmoved_faults"] = len(unmoved)
        top = result["light_recovered_s"]["max"]
        result["targets"]["light_all_back_within_5s"] = bool(recovered) and never == 0 and top <= 5.0
    if "drain" in result:
        dmax = [v["p99"] for v in result["drain"]["rto_ms"].values() if v["p99"] is not None]
        result["targets"]["drain_rto_p99_ms<=100"] = bool(dmax) and max(dmax) <= 100
        emax = [v["p99"] for v in result["drain"]["excess_ms"].values() if v["p99"] is not None]
        result["targets"]["drain_max_gap_excess_p99_ms<=100"] = bool(emax) and max(emax) <= 100
    return result


LIGHT_SETTLE_TIMEOUT_S = 60.0
# A handback's drain ends by the drain deadline (limits.drain_timeout_s, 5 s by default).
MOVES_DONE_TIMEOUT_S = 15.0


def _settle(light: LightClientProcess, fleet: LocalFleet, progress: Callable[[dict[str, Any]], None] | None,
            unsettled: list[int], unmoved: list[int]) -> Callable[[], None]:
    """Before each fault: wait until every light client holds a connection again (a fault that
    came without is counted in ``unsettled``), and until no node still moves connections off
    itself (the victim's restart hands its identities back; the old owner closes a busy
    client's connection only at the drain deadline, 5 s on, which landed in the next fault's
    window in session 32's runs: counted in ``unmoved``)."""
    def settle() -> None:
        if not light.wait_settled(LIGHT_SETTLE_TIMEOUT_S):
            unsettled.append(1)
            if progress is not None:
                progress({"phase": f"light clients not all back within {LIGHT_SETTLE_TIMEOUT_S:.0f} s before a fault"})
        if not fleet.wait_moves_done(MOVES_DONE_TIMEOUT_S):
            unmoved.append(1)
            if progress is not None:
                progress({"phase": f"connections still moving {MOVES_DONE_TIMEOUT_S:.0f} s on, before a fault"})
    return settle


def excess(drain: dict[str, dict[str, Any]], control: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per family and percentile: the drain's longest-gap figure minus the control's (None if either is)."""
    out: dict[str, dict[str, Any]] = {}
    for family in sorted(set(drain) & set(control)):
        out[family] = {k: None if drain[family].get(k) is None or control[family].get(k) is None
                       else drain[family][k] - control[family][k] for k in ("p50", "p99", "max")}
    return out
