"""Real Kafka clients, one adapter per family, each the real library:

``aiokafka`` (asyncio), ``confluent`` (confluent-kafka / librdkafka),
``kafka-python``, and ``java`` (Kafka's own VerifiableProducer /
VerifiableConsumer / admin tools run with ``java -cp``).

Every adapter module (``adapter(family)``) offers both faces:

* batch (``chaos.clients.batch``): ``produce``, ``consume``,
  ``transactional_produce`` -- N records, then back;
* paced (``chaos.clients.workload``, one OS process per client):
  ``produce_paced``, ``consume_paced`` -- a fixed-rate producer or a
  committing consumer that writes trace events until SIGTERM.

``FAMILIES`` is the one list of families: the drills, the CLI options, the
benchmarks and the trace schema read it from here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = ("aiokafka", "confluent", "kafka-python", "java")
ROLES = ("producer", "consumer")

_ADAPTERS = {"aiokafka": "aiokafka_client", "confluent": "confluent_client",
             "kafka-python": "kafka_python_client", "java": "java_client"}
assert tuple(_ADAPTERS) == FAMILIES


def adapter(family: str) -> ModuleType:
    """The adapter module of ``family`` (imported on first use: each pulls in its own library)."""
    if family not in _ADAPTERS:
        raise ValueError(f"unknown family {family!r}")
    return importlib.import_module(f"chaos.clients.{_ADAPTERS[family]}")
