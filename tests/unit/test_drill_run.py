"""DrillRun's pure parts: the progress payload the callbacks read, the manifest and the result.
No processes: the target is an address nobody dials, the clock is a hand-moved counter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.drills.drill import ClientProgress, DrillConfig, DrillProgress, DrillRun, Target
from chaos.drills.load import WorkloadGroup

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(**overrides: object) -> DrillProgress:
    fields = dict(phase="drill 1/2: fault", run_id="kill-7-1", seed=7, fault="kill", repeat=2, drill=1,
                  steps=({"fault": "kill", "node": "n2"},), errors=("late",), tracebacks=(), elapsed_s=3.5,
                  clients={"java-producer": ClientProgress(ok=4, errors=1)}, acked=4)
    fields.update(overrides)
    return DrillProgress(**fields)  # type: ignore[arg-type]


def test_progress_json_has_the_keys_the_callbacks_read():
    assert _progress().to_json() == {
        "phase": "drill 1/2: fault", "run_id": "kill-7-1", "seed": 7, "fault": "kill", "repeat": 2, "drill": 1,
        "steps": [{"fault": "kill", "node": "n2"}], "errors": ["late"], "tracebacks": [], "elapsed_s": 3.5,
        "clients": {"java-producer": {"ok": 4, "errors": 1}}, "acked": 4,
    }
    assert _progress(phase="done", passed=False).to_json()["passed"] is False


def test_progress_json_is_a_copy():
    progress = _progress()
    payload = progress.to_json()
    payload["steps"][0]["node"] = "changed"
    payload["errors"].append("more")
    assert progress.steps[0]["node"] == "n2" and progress.errors == ("late",)


@pytest.fixture
def runs():
    made: list[DrillRun] = []
    yield made
    for run in made:
        run.fleet_trace.close()


def _run(tmp_path: Path, clock: Clock, seen: list[dict], runs: list[DrillRun]) -> DrillRun:
    config = DrillConfig(fault="none", out_dir=tmp_path, repeat=2,
                         clients=(("java", "consumer"), ("java", "producer")), on_failover=print)
    runs.append(DrillRun.create(config, Target(["127.0.0.1:1"]), seen.append, seed=7, clock=clock))
    return runs[-1]


def test_snapshot_counts_the_clients_from_the_trace(tmp_path, runs):
    clock, seen = Clock(), []
    run = _run(tmp_path, clock, seen, runs)
    ack = {"source": "client", "client_id": "java-producer", "event": "ack", "ts_ns": 5, "key": "1", "seq": 0}
    error = {"source": "client", "client_id": "java-producer", "event": "error", "ts_ns": 6}
    (run.trace_dir / "java-producer.jsonl").write_text(json.dumps(ack) + "\n" + json.dumps(error) + "\n")
    run.tail.poll()
    clock.now += 2.5
    run.drill = 1
    run.report("drill 1/2: steady")
    assert seen == [{
        "phase": "drill 1/2: steady", "run_id": run.run_id, "seed": 7, "fault": "none", "repeat": 2, "drill": 1,
        "steps": [], "errors": [], "tracebacks": [], "elapsed_s": 2.5,
        "clients": {"java-consumer": {"ok": 0, "errors": 0}, "java-producer": {"ok": 1, "errors": 1}},
        "acked": 1,
    }]


def test_manifest_names_the_run_and_adds_pids_once_known(tmp_path, runs):
    run = _run(tmp_path, Clock(), [], runs)
    written = json.loads((run.run_dir / "drill.json").read_text())
    assert run.run_id.startswith("none-7-") and run.topic == f"drill-{run.run_id}"
    assert "pids" not in written
    assert written["clients"][0] == {"family": "java", "role": "consumer", "client_id": "java-consumer",
                                     "prefix": None, "group": f"{run.run_id}-java-consumer"}
    assert "on_failover" not in written["config"] and written["config"]["out_dir"] == str(tmp_path)
    run.write_manifest({"java-producer": 42})
    assert json.loads((run.run_dir / "drill.json").read_text())["pids"] == {"java-producer": 42}


def test_result_fails_on_an_unclean_workload_exit(tmp_path, runs):
    clock = Clock()
    run = _run(tmp_path, clock, [], runs)
    group = WorkloadGroup("producer", {}, run.log_dir, stop_timeout_s=1.0)
    group.exits.update({"java-producer": 0})
    run.groups["producer"] = group
    clock.now += 12.3456
    clean = run.result({"healthy": True, "lost": 0}, trace_errors=[])
    assert clean["passed"] is True and clean["errors"] == [] and clean["duration_s"] == 12.346
    assert clean["lost"] == 0 and clean["clients_spec"] == ["java-consumer", "java-producer"]
    assert clean["workload_exits"] == {"java-producer": 0} and clean["skipped"] is False

    group.exits["java-producer"] = -9
    unclean = run.result({"healthy": True, "lost": 0}, trace_errors=[])
    assert unclean["passed"] is False
    assert unclean["errors"] == ["workloads exited uncleanly: {'java-producer': -9}"]
    assert run.errors == []  # the run's own errors are not changed by building a result


def test_result_fails_when_unhealthy_or_the_trace_is_invalid(tmp_path, runs):
    run = _run(tmp_path, Clock(), [], runs)
    assert run.result({"healthy": False}, trace_errors=[])["passed"] is False
    assert run.result({"healthy": True}, trace_errors=["line 3: bad"])["passed"] is False
    run.errors.append("drain: consumers still missing acked records")
    assert run.result({"healthy": True}, trace_errors=[])["passed"] is False


def test_an_unexpected_workload_exit_names_the_last_lines_of_its_log(tmp_path):
    import sys

    import trio

    from chaos.drills.load import WorkloadExited

    script = "import sys; print('starting'); print('Traceback: KafkaError: the reason'); sys.exit(3)"
    group = WorkloadGroup("consumer", {"x-consumer": [sys.executable, "-c", script]}, tmp_path, stop_timeout_s=1.0)

    async def main() -> None:
        with trio.fail_after(30):
            await group.run()

    with pytest.raises(BaseException) as info:
        trio.run(main)
    exited = [e for e in getattr(info.value, "exceptions", [info.value]) if isinstance(e, WorkloadExited)]
    assert len(exited) == 1, info.value
    assert exited[0].returncode == 3 and exited[0].client_id == "x-consumer"
    assert str(exited[0]).endswith("its log ends: starting | Traceback: KafkaError: the reason")


def test_trace_tail_names_the_partitions_and_keys_a_group_still_misses(tmp_path):
    from chaos.clients.paced import ConsumerTrace, ProducerTrace
    from chaos.drills.load import TraceTail
    from chaos.trace import TraceWriter

    writer = TraceWriter(tmp_path, "t", "run-1")
    producer = ProducerTrace(writer, "p", "aiokafka", "topic", prefix=1)
    consumer = ConsumerTrace(writer, "c", "aiokafka", "topic", group="g")
    for seq, partition in [(1, 0), (2, 1), (3, 1), (4, 2)]:
        producer.ack(seq, partition, offset=seq)
    consumer.consume(b"1.1", 0, 1)
    consumer.consume(b"1.3", 1, 3)
    consumer.error("fetch: NotLeaderForPartitionError")
    writer.close()
    tail = TraceTail(tmp_path)
    tail.poll()
    assert tail.unread(["g"]) == {"g": 2}
    assert tail.unread_detail(["g", "other"]) == {
        "g": {"missing": 2, "partitions": {"1": 1, "2": 1}, "first": ["1.2", "1.4"]},
        "other": {"missing": 4, "partitions": {"0": 1, "1": 2, "2": 1}, "first": ["1.1", "1.2", "1.3"]}}
    assert tail.last_error == {"c": "fetch: NotLeaderForPartitionError"}


def test_a_fleet_snapshot_keeps_every_status_and_names_each_nodes_map(tmp_path, runs):
    import trio

    from proxy.status import NodeStatus
    from tests.unit.test_status import node_json

    class Fleet:
        def statuses(self) -> dict[str, NodeStatus | None]:
            return {"p1": NodeStatus.from_json(node_json("p1", role="leader", term=3, epoch=7,
                                                         assignment={"1": "p2"})),
                    "p2": None}

    run = _run(tmp_path, Clock(), [], runs)
    run.target = Target(["127.0.0.1:1"], fleet=Fleet())
    snap = trio.run(run.fleet_snapshot, "stuck.json")
    assert snap["p2"] is None
    assert snap["p1"]["epoch"] == 7 and snap["p1"]["assignment"] == {"1": "p2"} and snap["p1"]["role"] == "leader"
    saved = json.loads((run.run_dir / "stuck.json").read_text())
    assert saved["p2"] is None and saved["p1"]["node"] == "p1" and "peers" in saved["p1"]


class _Views:
    """A fleet whose map's epoch is the next of ``epochs`` at each look (the last one repeated)."""

    def __init__(self, *epochs: int) -> None:
        self.epochs = list(epochs)
        self.looks = 0

    def fleet_view(self, timeout: float = 1.0):  # type: ignore[no-untyped-def]
        import types
        self.looks += 1
        return types.SimpleNamespace(epoch=self.epochs.pop(0) if len(self.epochs) > 1 else self.epochs[0])


def _settled_at(tmp_path: Path, runs: list[DrillRun], fleet: _Views, *, seen_at: float, epoch: int) -> float:
    """Run wait_settled on a mock clock from 0 with the map ``epoch`` first seen at ``seen_at``: when it returned."""
    import trio
    import trio.testing

    run = _run(tmp_path, Clock(), [], runs)
    run.target = Target(["127.0.0.1:1"], fleet=fleet)
    run.clock = trio.current_time
    run.map_epoch, run.map_seen = epoch, seen_at

    async def main() -> float:
        await run.wait_settled()
        return trio.current_time()

    # autojump only when the run waits (not while a thread answers fleet_view, in real time).
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.1))


def test_the_fault_waits_until_the_map_has_not_changed_for_settle_s(tmp_path, runs):
    settle_s = DrillConfig(fault="none", out_dir=tmp_path).settle_s
    assert settle_s > 0
    fleet = _Views(5)
    assert _settled_at(tmp_path, runs, fleet, seen_at=0.0, epoch=5) == pytest.approx(settle_s)
    assert fleet.looks == 1  # checked once more at the end: still epoch 5


def test_a_map_that_settled_long_ago_costs_no_wait(tmp_path, runs):
    fleet = _Views(5)
    assert _settled_at(tmp_path, runs, fleet, seen_at=-60.0, epoch=5) == pytest.approx(0.0)
    assert fleet.looks == 1


def test_a_change_seen_at_the_last_check_is_waited_out_too(tmp_path, runs):
    settle_s = DrillConfig(fault="none", out_dir=tmp_path).settle_s
    fleet = _Views(6, 6)  # moved since the drill last looked
    assert _settled_at(tmp_path, runs, fleet, seen_at=-60.0, epoch=5) == pytest.approx(settle_s)
    assert fleet.looks == 2
