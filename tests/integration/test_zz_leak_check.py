"""No real broker address ever reaches a client (runs last: scans the whole session's traffic).

The session proxy copies every byte it sends to clients into ``tap_dir``, one
file per connection. A real broker address would appear as its host string
followed by its int32 port, as Kafka encodes it in every address-carrying
response; the advertised addresses must appear the same way (proof the tap saw
the responses).
"""

from __future__ import annotations

import struct

import pytest

from chaos.clients import batch as clients

pytestmark = [pytest.mark.integration]


def test_no_real_broker_address_in_any_response(proxy, kafka_cluster, tap_dir, topic_name):
    bs = proxy.bootstrap
    # Make sure every address-carrying API passed through at least once, even when run alone.
    clients.produce("aiokafka", bs, topic_name, 10, prefix=1)
    clients.consume("kafka-python", bs, topic_name, f"g-{topic_name}", 10)
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bs, "log_level": 2})
    assert len(admin.describe_cluster().result(timeout=20).nodes) == 3

    blobs = [p.read_bytes() for p in sorted(tap_dir.iterdir())]
    assert len(blobs) >= 5, "the tap saw too few connections"
    data = b"\n".join(blobs)
    for spec in kafka_cluster.specs:
        real = spec.host.encode() + struct.pack(">i", spec.port)
        assert data.count(real) == 0, f"real address {spec.address} leaked to a client"
        advertised = b"127.0.0.21" + struct.pack(">i", 9100 + spec.id)
        assert data.count(advertised) > 0, f"advertised address of broker {spec.id} never seen"
