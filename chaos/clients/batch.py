"""The batch face of every client family: produce N records, consume them back.

Record ``i`` of a batch with integer prefix ``P`` has key ``str(i)`` and value
``f"{P}.{i}"`` in every family (that is how the VerifiableProducer numbers its
records), so a test can compare what was produced with what was consumed
without caring which family wrote it. The per-family code is in the adapters
(``chaos.clients.adapter(family)``).
"""

from __future__ import annotations

import json
import subprocess
from typing import Iterable

import attrs

from chaos.clients import FAMILIES, adapter  # noqa: F401  (FAMILIES: the families this face serves)
from chaos.testbed.kafka_cluster import java_tool_cmd
from chaos.testbed.security import ClientSecurity


class ClientError(RuntimeError):
    """A client failed to produce or consume what it was asked to."""


@attrs.frozen
class Ack:
    key: str | None
    value: str
    partition: int
    offset: int


@attrs.frozen
class Consumed:
    key: str | None
    value: str
    partition: int
    offset: int


def values(prefix: int, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


def _bootstrap(servers: str | Iterable[str]) -> str:
    return servers if isinstance(servers, str) else ",".join(servers)


# ------------------------------------------------------------------ produce
def produce(family: str, bootstrap: str | Iterable[str], topic: str, n: int, prefix: int,
            *, idempotent: bool = True, timeout: float = 60.0, security: ClientSecurity | None = None) -> list[Ack]:
    """Produce ``n`` records with acks=all (idempotent where the client can); return the acks.
    ``security``: TLS/SASL settings (chaos.testbed.security), none for plaintext."""
    acks = adapter(family).produce(_bootstrap(bootstrap), topic, n, prefix, idempotent, timeout, security=security)
    if len(acks) != n:
        raise ClientError(f"{family}: {len(acks)} of {n} records acknowledged")
    return acks


# ------------------------------------------------------------------ consume
def consume(family: str, bootstrap: str | Iterable[str], topic: str, group: str, n: int,
            *, timeout: float = 60.0, security: ClientSecurity | None = None) -> list[Consumed]:
    """Consume from the earliest offset in consumer group ``group`` until ``n`` records, committing."""
    got = adapter(family).consume(_bootstrap(bootstrap), topic, group, n, timeout, security=security)
    if len(got) < n:
        raise ClientError(f"{family}: consumed {len(got)} of {n} records within {timeout}s")
    return got


# -------------------------------------------------------------- java tools
def run_json_tool(cmd: list[str], timeout: float) -> list[dict]:
    """Run one of Kafka's verifiable tools; return its JSON-lines events."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ClientError(f"{cmd[-1]}: timed out after {timeout}s") from exc
    events = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            events.append(json.loads(line))
    if proc.returncode != 0:
        raise ClientError(f"java tool exited {proc.returncode}: {proc.stderr[-2000:]}")
    return events


def kafka_tool(main_class: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one of Kafka's admin tools (``org.apache.kafka.tools.TopicCommand`` …); raise on failure."""
    proc = subprocess.run(java_tool_cmd(main_class, *args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise ClientError(f"{main_class} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def topics_describe(bootstrap: str | Iterable[str], topic: str | None = None) -> str:
    args = ["--bootstrap-server", _bootstrap(bootstrap), "--describe"]
    if topic:
        args += ["--topic", topic]
    return kafka_tool("org.apache.kafka.tools.TopicCommand", *args).stdout


def consumer_groups_describe(bootstrap: str | Iterable[str], group: str) -> str:
    return kafka_tool("org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server",
                      _bootstrap(bootstrap), "--describe", "--group", group).stdout


# ------------------------------------------------------------- transactions
def transactional_produce(family: str, bootstrap: str | Iterable[str], topic: str, n: int, prefix: int,
                          *, commit: bool = True, timeout: float = 60.0,
                          security: ClientSecurity | None = None) -> None:
    """Produce ``n`` records in one transaction, then commit (or abort) it.

    For ``java`` the records come from partition 0 of ``topic + "-in"`` (which
    must hold at least ``n`` records), copied by Kafka's own
    TransactionalMessageCopier (consume-transform-produce with sendOffsetsToTransaction).
    """
    tid = f"tx-{family}-{topic}-{prefix}"
    adapter(family).transactional_produce(_bootstrap(bootstrap), topic, tid, n, prefix, commit, timeout,
                                          security=security)


def consume_committed(bootstrap: str | Iterable[str], topic: str, group: str, n: int,
                      timeout: float = 60.0, security: ClientSecurity | None = None) -> list[Consumed]:
    """Read with isolation.level=read_committed (confluent) until ``n`` records or ``timeout``."""
    return adapter("confluent").consume(_bootstrap(bootstrap), topic, group, n, timeout,
                                        isolation="read_committed", commit=False, security=security)
