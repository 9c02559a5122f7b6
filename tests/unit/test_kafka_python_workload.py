"""The kafka-python consumer workload's topic wait: a lookup that fails with a retriable error
(kafka-python raises what failed its metadata request, e.g. a reset connection) is retried and
traced, not the end of the workload. The client library is replaced by a stand-in object here:
what is tested is the workload's loop, not Kafka (tests/integration/test_workloads.py runs the
real thing)."""

from __future__ import annotations

import argparse
import json

import kafka
import pytest
from kafka import errors

from chaos.clients import kafka_python_client
from chaos.clients.paced import ConsumerTrace, Stop
from chaos.trace import TraceWriter

pytestmark = pytest.mark.unit


class Consumer:
    lookups: list[str] = []
    stop: Stop | None = None  # set by the test: subscribing ends the run

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.answers: list[object] = [errors.KafkaConnectionError("reset"), None, {0, 1}]
        self.subscribed: list[str] = []

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        answer = self.answers.pop(0)
        Consumer.lookups.append(type(answer).__name__)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def subscribe(self, topics: list[str]) -> None:
        self.subscribed = topics
        assert Consumer.stop is not None
        Consumer.stop.event.set()  # subscribed: the test has seen what it needs

    def poll(self, timeout_ms: int) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_a_retriable_error_while_waiting_for_the_topic_is_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(kafka, "KafkaConsumer", Consumer)
    monkeypatch.setattr(Consumer, "lookups", [])
    stop = Stop(duration_s=30)
    monkeypatch.setattr(Consumer, "stop", stop)
    writer = TraceWriter(tmp_path, "c", "run-1")
    trace = ConsumerTrace(writer, "kafka-python-consumer", "kafka-python", "t", group="g")
    args = argparse.Namespace(bootstrap="127.0.0.1:1", group="g", client_id="c", topic="t", security=None)
    kafka_python_client.consume_paced(args, trace, stop)
    writer.close()
    assert Consumer.lookups == ["KafkaConnectionError", "NoneType", "set"]
    events = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [e["detail"] for e in events if e["event"] == "error"] == [
        "partitions_for_topic: KafkaConnectionError: KafkaConnectionError: reset"]


def test_a_non_retriable_error_while_waiting_for_the_topic_ends_the_workload(tmp_path, monkeypatch):
    class Refusing(Consumer):
        def partitions_for_topic(self, topic: str) -> set[int] | None:
            raise errors.IllegalStateError("closed")

    monkeypatch.setattr(kafka, "KafkaConsumer", Refusing)
    writer = TraceWriter(tmp_path, "c", "run-1")
    trace = ConsumerTrace(writer, "kafka-python-consumer", "kafka-python", "t", group="g")
    args = argparse.Namespace(bootstrap="127.0.0.1:1", group="g", client_id="c", topic="t", security=None)
    with pytest.raises(errors.IllegalStateError):
        kafka_python_client.consume_paced(args, trace, Stop(duration_s=30))
    writer.close()
