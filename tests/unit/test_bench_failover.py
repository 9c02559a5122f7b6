"""The failover bench's drain-versus-control arithmetic and the control's preconditions."""

from __future__ import annotations

import pytest

from chaos.drills import faults
from chaos.bench.failover import excess

pytestmark = pytest.mark.unit


def test_excess_is_drain_minus_control_per_family_and_percentile():
    drain = {"confluent": {"p50": 80.0, "p99": 230.0, "max": 250.0, "n": 8},
             "java": {"p50": 60.0, "p99": 120.0, "max": 130.0, "n": 4},
             "aiokafka": {"p50": 50.0, "p99": None, "max": 70.0, "n": 1}}
    control = {"confluent": {"p50": 70.0, "p99": 200.0, "max": 260.0, "n": 8},
               "aiokafka": {"p50": 40.0, "p99": 90.0, "max": 95.0, "n": 8}}
    assert excess(drain, control) == {
        "aiokafka": {"p50": 10.0, "p99": None, "max": -25.0},
        "confluent": {"p50": 10.0, "p99": 30.0, "max": -10.0},
    }  # java has no control figure: left out


def test_control_is_not_a_fault_and_needs_a_fleet():
    assert "none" not in faults.FAULTS and "none" in faults.CONTROLS and "none" in faults.INJECT
    with pytest.raises(faults.FaultUnavailable, match="needs a proxy fleet"):
        faults.check("none", fleet=None, kafka=object())
    with pytest.raises(ValueError, match="unknown fault"):
        faults.check("nothing", fleet=object(), kafka=object())


class _Fleet:
    def __init__(self, hosts: object | None) -> None:
        self.hosts = hosts


def test_host_faults_need_emulated_hosts_and_partition_one_way_needs_nft(monkeypatch):
    from chaos.drills import host_faults
    from chaos.testbed.hosts import plan_hosts

    assert set(faults.INJECT) >= set(faults.FAULTS)  # every fault has an injector
    for fault in ("partition-one-way", "flap", "partition-two"):
        with pytest.raises(faults.FaultUnavailable, match="needs emulated hosts"):
            faults.check(fault, fleet=_Fleet(None), kafka=object())
    on_hosts = _Fleet(plan_hosts("kpabcde", ["p1", "p2", "p3"]))
    faults.check("flap", fleet=on_hosts, kafka=object())
    faults.check("partition", fleet=on_hosts, kafka=object())  # its link, not loopback nftables
    monkeypatch.setattr(host_faults.shutil, "which", lambda name: None)
    with pytest.raises(faults.FaultUnavailable, match="nft command"):
        faults.check("partition-one-way", fleet=on_hosts, kafka=object())


def test_bench_failover_refuses_a_fault_it_does_not_measure():
    from chaos.bench.failover import run

    with pytest.raises(ValueError, match="not one of"):
        run(fault="drain")
