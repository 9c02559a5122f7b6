"""The settings every client family runs with in drills, and why.

Client settings (why): every family gets
  * acks=all, idempotence on (producers), linger 5 ms;
  * request timeout 10 s (``REQUEST_TIMEOUT_MS``): a silent peer (frozen or
    partitioned proxy) is noticed after at most this long (defaults are
    30-60 s); it stays above Kafka's own leader fail-over time (broker
    session timeout 6 s in ``chaos.testbed.kafka_cluster``) so a broker kill causes
    no spurious request timeouts;
  * reconnect backoff 50 ms -> max 1 s where the client has the knob
    (kafka-python's default max is 30 s, librdkafka's 10 s);
  * retry backoff 100 ms -> max 1 s;
  * metadata max age 10 s (default 5 min) so a client that missed a
    disconnect still learns a new address map soon;
  * consumer session timeout 30 s, heartbeat 3 s: a hung coordinator
    connection (10 s request timeout) is replaced before the session
    expires, so a proxy fault alone does not cause a rebalance (a rebalance
    would redeliver uncommitted records);
  * fetch: a broker answers once it has ``FETCH_MIN_BYTES`` or after
    ``FETCH_MAX_WAIT_MS`` (50 ms); with the default of one byte, every record
    came back in a fetch of its own, and the drill consumers, which commit
    after every poll, committed ~140 times a second each: their fetches and
    commits kept the three brokers busy with most of a core (BENCHMARKS.md,
    session 32). A record now reaches a consumer up to 50 ms later.
See ``SETTINGS`` for the exact per-family options.
"""

from __future__ import annotations

from typing import Any

REQUEST_TIMEOUT_MS = 10_000
SESSION_TIMEOUT_MS = 30_000
HEARTBEAT_INTERVAL_MS = 3_000
METADATA_MAX_AGE_MS = 10_000
RECONNECT_BACKOFF_MS = 50
RECONNECT_BACKOFF_MAX_MS = 1_000
RETRY_BACKOFF_MS = 100
RETRY_BACKOFF_MAX_MS = 1_000
DELIVERY_TIMEOUT_MS = 120_000  # Java/kafka-python/librdkafka: give up on a record after this long
FETCH_MAX_WAIT_MS = 50
FETCH_MIN_BYTES = 64 * 1024  # more than the drill's records fill in FETCH_MAX_WAIT_MS
LINGER_MS = 5
KEY_SPREAD = 1000  # wire key = seq % KEY_SPREAD (Java: --repeating-keys)

FLUSH_TIMEOUT_S = 30.0  # producer: wait for outstanding acks on stop
COMMIT_RETRY_S = 10.0  # consumer: keep retrying a failed commit this long
POLL_TIMEOUT_S = 0.2  # consumer poll
TOPIC_WAIT_S = 60.0  # a consumer waits this long for its topic's metadata
JVM_EXIT_TIMEOUT_S = 30.0  # after SIGTERM to the JVM, SIGKILL it after this long
MAX_BEHIND_S = 0.5  # producer pacing: after a stall longer than this, do not burst to catch up
MAX_LIFETIME_S = 3600.0  # without --duration-s: stop anyway after this long (an orphan must end)

SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "aiokafka": {
        "producer": {
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": LINGER_MS,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,  # also the batch TTL while a partition has no leader
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
        },
        "consumer": {
            "auto_offset_reset": "earliest",
            "enable_auto_commit": False,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "session_timeout_ms": SESSION_TIMEOUT_MS,
            "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
            "fetch_max_wait_ms": FETCH_MAX_WAIT_MS,
            "fetch_min_bytes": FETCH_MIN_BYTES,
        },
    },
    "confluent": {
        "producer": {
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": LINGER_MS,
            "request.timeout.ms": REQUEST_TIMEOUT_MS,
            "socket.timeout.ms": REQUEST_TIMEOUT_MS,
            "message.timeout.ms": DELIVERY_TIMEOUT_MS,
            "reconnect.backoff.ms": RECONNECT_BACKOFF_MS,
            "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
            "retry.backoff.ms": RETRY_BACKOFF_MS,
            "retry.backoff.max.ms": RETRY_BACKOFF_MAX_MS,
            "topic.metadata.refresh.interval.ms": METADATA_MAX_AGE_MS,
            "log_level": 3,
        },
        "consumer": {
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "socket.timeout.ms": REQUEST_TIMEOUT_MS,
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": HEARTBEAT_INTERVAL_MS,
            "reconnect.backoff.ms": RECONNECT_BACKOFF_MS,
            "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
            "retry.backoff.ms": RETRY_BACKOFF_MS,
            "retry.backoff.max.ms": RETRY_BACKOFF_MAX_MS,
            "topic.metadata.refresh.interval.ms": METADATA_MAX_AGE_MS,
            "fetch.wait.max.ms": FETCH_MAX_WAIT_MS,
            "fetch.min.bytes": FETCH_MIN_BYTES,
            "log_level": 3,
        },
    },
    "kafka-python": {
        "producer": {
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": LINGER_MS,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
            "reconnect_backoff_ms": RECONNECT_BACKOFF_MS,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
        },
        "consumer": {
            "auto_offset_reset": "earliest",
            "enable_auto_commit": False,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "session_timeout_ms": SESSION_TIMEOUT_MS,
            "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
            "reconnect_backoff_ms": RECONNECT_BACKOFF_MS,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
            "fetch_max_wait_ms": FETCH_MAX_WAIT_MS,
            "fetch_min_bytes": FETCH_MIN_BYTES,
        },
    },
    "java": {
        # --acks -1 and --throughput/--value-prefix/--repeating-keys on the command line.
        "producer": {
            "enable.idempotence": "true",
            "retries": "2147483647",  # the VerifiableProducer sets 0 otherwise; idempotence needs retries
            "max.in.flight.requests.per.connection": "5",
            "linger.ms": str(LINGER_MS),
            "request.timeout.ms": str(REQUEST_TIMEOUT_MS),
            "delivery.timeout.ms": str(DELIVERY_TIMEOUT_MS),  # >= linger.ms + request.timeout.ms
            "reconnect.backoff.ms": str(RECONNECT_BACKOFF_MS),
            "reconnect.backoff.max.ms": str(RECONNECT_BACKOFF_MAX_MS),
            "retry.backoff.ms": str(RETRY_BACKOFF_MS),
            "retry.backoff.max.ms": str(RETRY_BACKOFF_MAX_MS),
            "metadata.max.age.ms": str(METADATA_MAX_AGE_MS),
        },
        # --session-timeout, --reset-policy earliest, --group-id on the command line.
        "consumer": {
            "request.timeout.ms": str(REQUEST_TIMEOUT_MS),
            "heartbeat.interval.ms": str(HEARTBEAT_INTERVAL_MS),
            "reconnect.backoff.ms": str(RECONNECT_BACKOFF_MS),
            "reconnect.backoff.max.ms": str(RECONNECT_BACKOFF_MAX_MS),
            "retry.backoff.ms": str(RETRY_BACKOFF_MS),
            "retry.backoff.max.ms": str(RETRY_BACKOFF_MAX_MS),
            "metadata.max.age.ms": str(METADATA_MAX_AGE_MS),
            "fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
            "fetch.min.bytes": str(FETCH_MIN_BYTES),
        },
    },
}
