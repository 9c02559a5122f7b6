"""The Java family: Kafka's own VerifiableProducer / VerifiableConsumer /
TransactionalMessageCopier / ProducerPerformance run with ``java -cp`` (a batch produce/consume,
a transaction),
and the paced workload that runs a verifiable tool as a child JVM and translates its JSON
lines into trace events (see ``chaos.clients.workload``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from chaos.clients.batch import Ack, ClientError, Consumed, kafka_tool, run_json_tool
from chaos.clients.paced import ConsumerTrace, ProducerTrace, Stop, parse_value
from chaos.testbed.security import ClientSecurity, client_settings
from chaos.clients.settings import JVM_EXIT_TIMEOUT_S, KEY_SPREAD, SESSION_TIMEOUT_MS, SETTINGS
from chaos.testbed.kafka_cluster import java_tool_cmd
from chaos.testbed.process import die_with_parent, signal_if_running

log = logging.getLogger("kproxy.workloads")


# ------------------------------------------------------------------ batch
def produce(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float,
            security: ClientSecurity | None = None) -> list[Ack]:
    with tempfile.NamedTemporaryFile("w", suffix=".properties", delete=False) as cfg:
        cfg.write(f"enable.idempotence={'true' if idempotent else 'false'}\n")
        delivery_ms = int(timeout * 1000)
        cfg.write(f"delivery.timeout.ms={delivery_ms}\nlinger.ms=5\n")
        cfg.write(f"request.timeout.ms={min(30000, delivery_ms // 2)}\n")
        # The VerifiableProducer sets retries=0 unless told otherwise; idempotence needs retries.
        cfg.write("retries=2147483647\nmax.in.flight.requests.per.connection=5\n")
        cfg.write("".join(f"{k}={v}\n" for k, v in client_settings(security, "java").items()))
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableProducer", "--bootstrap-server", bs, "--topic", topic,
                        "--max-messages", str(n), "--acks", "-1", "--value-prefix", str(prefix),
                        "--repeating-keys", str(max(n, 1)), "--producer.config", cfg.name)
    events = run_json_tool(cmd, timeout + 30)
    acks = [Ack(e.get("key"), e["value"], e["partition"], e["offset"])
            for e in events if e.get("name") == "producer_send_success"]
    failed = [e for e in events if e.get("name") == "producer_send_error"]
    if failed:
        raise ClientError(f"java: {len(failed)} send errors, first: {failed[0]}")
    return acks


def consume(bs: str, topic: str, group: str, n: int, timeout: float,
            security: ClientSecurity | None = None) -> list[Consumed]:
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableConsumer", "--bootstrap-server", bs, "--topic", topic,
                        "--group-id", group, "--max-messages", str(n), "--verbose", "--reset-policy", "earliest",
                        *_config_args("--consumer.config", security))
    events = run_json_tool(cmd, timeout + 30)
    return [Consumed(e.get("key"), e["value"], e["partition"], e["offset"])
            for e in events if e.get("name") == "record_data"]


def transactional_produce(bs: str, topic: str, tid: str, n: int, prefix: int, commit: bool, timeout: float,
                          security: ClientSecurity | None = None) -> None:
    """The records come from partition 0 of ``topic + "-in"`` (which must hold at least ``n``
    records), copied by Kafka's own TransactionalMessageCopier (consume-transform-produce with
    sendOffsetsToTransaction)."""
    if not commit:
        raise ClientError("java: TransactionalMessageCopier only commits")
    if client_settings(security, "java"):
        raise ClientError("java: TransactionalMessageCopier takes no client config file (no TLS/SASL)")
    cmd = java_tool_cmd("org.apache.kafka.tools.TransactionalMessageCopier", "--broker-list", bs,
                        "--input-topic", f"{topic}-in", "--input-partition", "0", "--output-topic", topic,
                        "--transactional-id", tid, "--consumer-group", f"{tid}-group",
                        "--max-messages", str(n), "--transaction-size", str(max(1, n // 2)))
    events = run_json_tool(cmd, timeout + 30)
    done = [e for e in events if e.get("remaining") == 0 or e.get("message") == "ShutdownComplete"]
    if not done and not any(e.get("transactionsCompleted", 0) for e in events):
        raise ClientError(f"java: copier did not finish: {events[-3:]}")


def perf_transactions(bs: str, topic: str, tid: str, n: int, *, transaction_ms: int, timeout: float,
                      security: ClientSecurity | None = None) -> str:
    """Produce ``n`` records (values ``"0"`` … ``str(n - 1)``) with Kafka's own ProducerPerformance
    as transactional producer ``tid``, committing a transaction every ``transaction_ms``; with
    ``security`` through ``--command-config`` (the TransactionalMessageCopier takes no config
    file, so it cannot reach a secured listener). Returns the tool's report."""
    props = _java_props({"acks": "all", **client_settings(security, "java")})
    try:
        proc = kafka_tool("org.apache.kafka.tools.ProducerPerformance", "--topic", topic, "--num-records", str(n),
                          "--throughput", "-1", "--payload-monotonic", "--transactional-id", tid,
                          "--transaction-duration-ms", str(transaction_ms), "--bootstrap-server", bs,
                          "--command-config", str(props), timeout=timeout)
    finally:
        props.unlink(missing_ok=True)
    return proc.stdout


def _config_args(option: str, security: ClientSecurity | None) -> list[str]:
    """``[option, file]`` with the client properties of ``security``; nothing for plaintext."""
    settings = client_settings(security, "java")
    return [option, str(_java_props(settings))] if settings else []


# ------------------------------------------------------------------ paced
def _java_props(settings: dict[str, Any]) -> Path:
    fd, name = tempfile.mkstemp(prefix="kproxy-workload-", suffix=".properties")
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(f"{k}={v}\n" for k, v in settings.items()))
    return Path(name)


def _run_java(cmd: list[str], stop: Stop, on_event: Any) -> int:
    """Run a verifiable tool; feed each JSON line to ``on_event``; forward SIGTERM; return its exit code."""
    # The JVM is spawned by this process's main thread, which lives as long as the process: here
    # PR_SET_PDEATHSIG is right, and SIGKILLs the JVM if this wrapper dies without forwarding.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1,
                            preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    stop.on_signal.append(lambda signum: signal_if_running(proc, signal.SIGTERM))

    def watchdog() -> None:
        # Stop after --duration-s, and SIGKILL a JVM that ignores SIGTERM.
        while proc.poll() is None and not stop.wait(0.5):
            pass
        if proc.poll() is None:
            signal_if_running(proc, signal.SIGTERM)
        try:
            proc.wait(JVM_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("JVM %d did not exit %.0f s after SIGTERM: SIGKILL", proc.pid, JVM_EXIT_TIMEOUT_S)
            signal_if_running(proc, signal.SIGKILL)

    dog = threading.Thread(target=watchdog, name="jvm-watchdog", daemon=True)
    dog.start()
    assert proc.stdout is not None
    for line in proc.stdout:  # ends at EOF, when the JVM exits
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        on_event(event)
    rc = proc.wait()
    stop.event.set()
    dog.join(JVM_EXIT_TIMEOUT_S + 5)
    return rc


def _java_detail(event: dict[str, Any]) -> str | None:
    ts = event.get("timestamp")
    return None if ts is None else f"java_ts_ms={ts}"


def produce_paced(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> int:
    props = _java_props({**SETTINGS["java"]["producer"], **client_settings(a.security, "java")})
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableProducer", "--bootstrap-server", a.bootstrap,
                        "--topic", a.topic, "--max-messages", "-1", "--throughput", str(int(round(a.rate))),
                        "--acks", "-1", "--value-prefix", str(a.prefix), "--repeating-keys", str(KEY_SPREAD),
                        "--command-config", str(props))

    def on_event(e: dict[str, Any]) -> None:
        name = e.get("name")
        parsed = parse_value(e.get("value"))
        if name == "producer_send_success" and parsed is not None:
            t.ack(parsed[1], int(e["partition"]), int(e["offset"]), detail=_java_detail(e))
        elif name == "producer_send_error":
            t.error(f"{e.get('exception')}: {e.get('message')}", None if parsed is None else parsed[1])

    try:
        return _run_java(cmd, stop, on_event)
    finally:
        props.unlink(missing_ok=True)


def consume_paced(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> int:
    props = _java_props({**SETTINGS["java"]["consumer"], **client_settings(a.security, "java")})
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableConsumer", "--bootstrap-server", a.bootstrap,
                        "--topic", a.topic, "--group-id", a.group, "--max-messages", "-1", "--verbose",
                        "--reset-policy", "earliest", "--session-timeout", str(SESSION_TIMEOUT_MS),
                        "--command-config", str(props))

    def on_event(e: dict[str, Any]) -> None:
        name = e.get("name")
        if name == "record_data":
            t.consume(e.get("value"), int(e["partition"]), int(e["offset"]), detail=_java_detail(e))
        elif name == "offsets_committed" and not e.get("success", True):
            t.error(f"commit failed: {e.get('error')}")

    try:
        return _run_java(cmd, stop, on_event)
    finally:
        props.unlink(missing_ok=True)
