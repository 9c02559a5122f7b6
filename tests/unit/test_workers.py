"""The pure parts of a node's data-path workers: the wire between supervisor and workers,
the acknowledgement book, the restart policy, the merged status and counters, the config field."""

from __future__ import annotations

import pickle

import attrs
import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from membership.serving import ServingMap
from proxy.config import ConfigError, parse
from proxy.datapath import DataPathStatus
from proxy.metrics import render_families
from proxy.status import NodeStatus, WorkerRow
from proxy.worker_pool import AckBook, RestartPolicy, merge_datapath_status, merge_metric_families
from proxy.worker_wire import MAX_MESSAGE_BYTES, Applied, ApplyMap, FrameReader, WireError, encode

pytestmark = [pytest.mark.unit]


def _map(version: int, epoch: int | None = None) -> ServingMap:
    return ServingMap(epoch=version if epoch is None else epoch, owners={1: "p1", 2: "p2"}, version=version)


# ------------------------------------------------------------------ wire
def test_frames_decode_byte_by_byte_and_whole():
    messages = [ApplyMap(_map(3)), Applied(3, 3), Applied(4, 4)]
    wire = b"".join(encode(m) for m in messages)
    reader = FrameReader()
    got = []
    for i in range(len(wire)):
        got += reader.feed(wire[i:i + 1])
    assert got == messages
    assert reader.pending == 0
    assert FrameReader().feed(wire) == messages


def test_a_partial_frame_waits_for_the_rest():
    wire = encode(Applied(1, 1))
    reader = FrameReader()
    assert reader.feed(wire[:-1]) == []
    assert reader.pending == len(wire) - 1
    assert reader.feed(wire[-1:]) == [Applied(1, 1)]


def test_an_oversized_length_or_garbage_is_a_wire_error():
    with pytest.raises(WireError):
        FrameReader().feed((MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(WireError):
        FrameReader().feed((5).to_bytes(4, "big") + b"\x00nope")


# ------------------------------------------------------------------ acks
def test_a_map_is_applied_only_once_every_ready_worker_acknowledged_it():
    book = AckBook()
    assert book.applied() is None
    book.pushed(_map(1))
    book.ready(0, 1)
    book.ready(1, 1)
    assert book.applied() == _map(1)
    book.pushed(_map(2))
    assert book.behind() == [0, 1]
    book.acked(0, 2)
    assert book.applied() == _map(1)  # worker 1 still serves version 1
    assert book.behind() == [1]
    book.acked(1, 2)
    assert book.applied() == _map(2)
    assert book.behind() == []


def test_a_worker_that_exits_does_not_hold_the_map_back_and_a_restarted_one_counts_once_ready():
    book = AckBook()
    book.pushed(_map(1))
    book.ready(0, 1)
    book.ready(1, 1)
    book.pushed(_map(2))
    book.acked(0, 2)
    book.left(1)  # crashed before acknowledging 2
    assert book.applied() == _map(2)
    book.ready(1, 2)  # restarted with the latest map
    assert book.applied() == _map(2)
    book.pushed(_map(3))
    book.acked(1, 3)
    assert book.applied() == _map(2)


def test_an_older_map_is_not_pushed_and_old_acks_do_not_go_back():
    book = AckBook()
    assert book.pushed(_map(5))
    assert not book.pushed(_map(4))
    assert book.latest == _map(5)
    book.ready(0, 5)
    book.acked(0, 3)
    assert book.version_of(0) == 5


def test_a_worker_started_before_any_map_holds_the_first_map_back_until_it_acknowledges():
    book = AckBook()
    book.ready(0, -1)
    book.pushed(_map(1))
    assert book.applied() is None
    assert book.behind() == [0]
    book.acked(0, 1)
    assert book.applied() == _map(1)


# --------------------------------------------------------------- restarts
def test_restart_backoff_doubles_for_a_crash_loop_is_bounded_and_resets_after_a_stable_run():
    policy = RestartPolicy(first_s=0.1, max_s=1.0, stable_s=30.0)
    now = 100.0
    policy.started(0, now)
    delays = []
    for _ in range(6):
        now += 1.0  # each run lasts a second: a crash loop
        delays.append(policy.exited(0, now))
        now += delays[-1]
        policy.started(0, now)
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    now += 60.0  # this run was stable
    assert policy.exited(0, now) == 0.1
    assert policy.restarts == {0: 7}


def test_restarts_of_one_worker_do_not_slow_another():
    policy = RestartPolicy(first_s=0.1, max_s=10.0, stable_s=30.0)
    policy.started(0, 0.0)
    policy.started(1, 0.0)
    policy.exited(0, 1.0)
    policy.started(0, 1.1)
    assert policy.exited(0, 2.0) == 0.2
    assert policy.exited(1, 2.0) == 0.1


# ------------------------------------------------------------- merging
def _dp(listeners, unbound=(), connections=0, draining=False, brokers=()):  # type: ignore[no-untyped-def]
    return DataPathStatus("p1", "127.0.0.11:9092", tuple(listeners), tuple(unbound), (), connections, draining,
                          tuple(brokers))


def test_node_status_adds_connections_and_is_unbound_where_any_worker_is():
    merged = merge_datapath_status([_dp([1, 2, 3], connections=4), _dp([1, 2], unbound=[3], connections=5,
                                                                       draining=True)])
    assert merged.connections == 9
    assert merged.listeners == (1, 2)
    assert merged.unbound == (3,)
    assert merged.draining
    assert merged.floating is None
    held = {"held": {"p1": "198.18.0.11"}, "fenced": False, "tickles_sent": 2}
    with_floating = attrs.evolve(_dp([1]), floating=held)
    assert merge_datapath_status([_dp([1]), with_floating]).floating == held


def test_metrics_of_workers_add_up_to_the_node_totals():
    def worker(requests: float, active: float, created: float):  # type: ignore[no-untyped-def]
        c = CounterMetricFamily("kproxy_requests", "Requests", labels=["node", "api_key"])
        c.add_metric(["p1", "0"], requests, created=created)
        g = GaugeMetricFamily("kproxy_connections_active", "Open", labels=["node"])
        g.add_metric(["p1"], active)
        return pickle.loads(pickle.dumps([c, g]))  # as they cross the socketpair

    merged = merge_metric_families([worker(10, 3, 50.0), worker(32, 4, 40.0)])
    text = render_families(merged).decode()
    assert 'kproxy_requests_total{api_key="0",node="p1"} 42.0' in text
    assert 'kproxy_requests_created{api_key="0",node="p1"} 40.0' in text
    assert 'kproxy_connections_active{node="p1"} 7.0' in text


def test_node_totals_do_not_go_down_when_a_worker_exits():
    from proxy.worker_pool import RetiredCounters

    def worker(requests: float, active: float):  # type: ignore[no-untyped-def]
        c = CounterMetricFamily("kproxy_requests", "Requests", labels=["node"])
        c.add_metric(["p1"], requests, created=10.0)
        g = GaugeMetricFamily("kproxy_connections_active", "Open", labels=["node"])
        g.add_metric(["p1"], active)
        return [c, g]

    retired = RetiredCounters()
    retired.seen(0, worker(100, 5))
    retired.seen(1, worker(40, 2))
    retired.exited(0)  # crashed: its 100 requests stay in the node's total, its 5 connections do not
    text = render_families(retired.totals([worker(45, 3), worker(1, 1)])).decode()  # worker 1, worker 0 anew
    assert 'kproxy_requests_total{node="p1"} 146.0' in text
    assert 'kproxy_connections_active{node="p1"} 4.0' in text


def test_worker_rows_round_trip_through_status_json():
    from tests.unit.test_status import node_json

    status = NodeStatus.from_json(node_json("p1", role="leader", term=1, epoch=3, assignment={"1": "p1"}))
    assert status.workers == ()
    rows = (WorkerRow(0, 123, True, 0, 5, 7, 9), WorkerRow(1, None, False, 2))
    with_workers = NodeStatus.from_json({**status.to_json(), "workers": [r.to_json() for r in rows]})
    assert with_workers.workers == rows


# ---------------------------------------------------------------- config
CONFIG = {"upstream": {"bootstrap": ["127.0.0.1:19092"]}, "ports": {"base": 9100},
          "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092}]}


def _workers(value):  # type: ignore[no-untyped-def]
    node = dict(CONFIG["nodes"][0], workers=value)  # type: ignore[index]
    return parse({**CONFIG, "nodes": [node]}).node("p1").workers


def test_workers_is_an_integer_or_auto_one_per_core(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert _workers(3) == 3
    assert _workers("auto") == 6
    assert parse(CONFIG).node("p1").workers == 6  # a file that leaves it out: one per core


@pytest.mark.parametrize("value", [0, -1, "two", 2.5, True, 1000])
def test_bad_workers_names_the_field(value):
    with pytest.raises(ConfigError) as err:
        _workers(value)
    assert err.value.field == "nodes[0].workers"


def test_run_with_bad_workers_exits_2_naming_the_field(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli

    bad = tmp_path / "bad.toml"
    bad.write_text('[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
                   '[[nodes]]\nid = "p1"\nhost = "127.0.0.11"\nbootstrap_port = 9092\nworkers = "many"\n')
    result = CliRunner().invoke(cli, ["run", "--config", str(bad), "--node", "p1"])
    assert result.exit_code == 2
    assert "nodes[0].workers" in result.output


# ------------------------------------------------------------------ bench
def test_bench_figures_per_arm_from_hand_made_runs():
    from chaos.bench.workers import _figures

    out = _figures({"direct": [(1000, 1.0, 0.0), (3000, 1.0, 0.0)],
                    "w1": [(500, 1.0, 0.05), (500, 1.0, 0.05)],
                    "w2": [(1000, 1.0, 0.1), (1000, 2.0, 0.1)]}, connections=4)
    assert out["arms"]["direct"]["requests_per_s"] == 2000
    assert out["arms"]["w1"] == {"requests_per_s": 500, "requests_per_s_runs": [500, 500],
                                 "cpu_us_per_request": 100.0, "cpu_cores_busy": 0.05, "ratio_to_direct": 0.25}
    assert out["arms"]["w2"]["requests_per_s"] == 750
    assert out["arms"]["w2"]["cpu_us_per_request"] == 100.0


def test_bench_produce_frames_are_produce_requests_with_the_asked_acks():
    from chaos.bench.workers import CORRELATION_OFFSET, produce_frame

    frame = produce_frame("t", acks=1)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert int.from_bytes(frame[4:6], "big") == 0  # api_key Produce
    assert int.from_bytes(frame[CORRELATION_OFFSET:CORRELATION_OFFSET + 4], "big") == 0
    assert produce_frame("t") != frame  # acks=all by default
    with pytest.raises(ValueError):
        produce_frame("t", acks=0)
