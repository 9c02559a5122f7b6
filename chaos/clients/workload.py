"""Long-running client workloads for drills: one OS process per (family, role).

Theory of operation
-------------------
A drill starts one process per client with ``python -m chaos.clients.workload ROLE``
and stops it with SIGTERM. Each process writes its trace events through
``chaos.trace.TraceWriter`` to ``<trace_dir>/<client_id>.jsonl``.

Records. Every producer has an integer ``prefix`` P, unique within a run, and
its record number ``seq`` counts 0, 1, 2, ...; the record value on the wire is
``f"{P}.{seq}"`` in every family (that is the VerifiableProducer's own format,
so the Java client needs no special case). In the trace, ``key`` is that
value string and ``seq`` is the number: (run_id, topic, key, seq) names one
record for producers and consumers alike, whatever family wrote or read it.
The wire key is ``str(seq % 1000)`` for the Python families (the Java tool's
``--repeating-keys 1000``), so records spread over every partition.

Producers send at a fixed ``--rate`` (records/s), idempotently with acks=all.
Events: ``send`` (handed to the client), ``ack`` (partition, offset), ``error``
(detail). On SIGTERM, or after ``--duration-s``, a producer stops sending,
flushes (waits for every outstanding acknowledgement, bounded by
``FLUSH_TIMEOUT_S``), closes its client and exits 0.

Consumers join a consumer group (``--group``), read from the earliest offset,
write one ``consume`` event per delivered record and then commit the batch's
offsets synchronously (at-least-once: deliver, then commit; a failed commit is
retried before the next poll, so a failover alone never redelivers). On
SIGTERM they finish the batch in hand, commit, close and exit 0.

Java. ``--family java`` runs Kafka's VerifiableProducer (``--throughput`` =
rate, ``--value-prefix`` = P) or VerifiableConsumer (``--verbose``) as a child
JVM; this process reads its JSON lines and translates them into trace events
(producer_send_success -> ack, producer_send_error -> error, record_data ->
consume, offsets_committed with success=false -> error). The tools print no
event per send, so Java producers have no ``send`` events. Timestamps: every
Java event is stamped with ``time.time_ns()`` when its line is read here (the
trace's one clock); the tool's own ``timestamp`` (ms, wall clock) is kept in
``detail`` as ``java_ts_ms=...``. SIGTERM is forwarded to the JVM, whose
shutdown hook flushes (producer) or commits (consumer) and prints the last
events; the JVM is SIGKILLed if it has not exited ``JVM_EXIT_TIMEOUT_S`` later.

Client settings: ``chaos.clients.settings``; with ``--security-file`` each family adds its
TLS/SASL settings (``chaos.testbed.security.client_settings``) to them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from chaos.clients import FAMILIES, ROLES, adapter
from chaos.clients.paced import ConsumerTrace, ProducerTrace, Stop, watch_parent
from chaos.testbed.security import ClientSecurity
from chaos.trace import TraceWriter

log = logging.getLogger("kproxy.workloads")


def command(role: str, family: str, *, bootstrap: str, topic: str, trace_dir: str | os.PathLike[str],
            client_id: str, run_id: str, rate: float | None = None, prefix: int | None = None,
            group: str | None = None, duration_s: float | None = None, python: str | None = None,
            security_file: str | os.PathLike[str] | None = None) -> list[str]:
    """The command line that starts one workload process (what the drill runs)."""
    cmd = [python or sys.executable, "-m", "chaos.clients.workload", role, "--family", family, "--bootstrap", bootstrap,
           "--topic", topic, "--trace-dir", str(trace_dir), "--client-id", client_id, "--run-id", run_id]
    if role == "producer":
        if rate is None or prefix is None:
            raise ValueError("a producer needs rate and prefix")
        cmd += ["--rate", str(rate), "--prefix", str(prefix)]
    elif role == "consumer":
        if group is None:
            raise ValueError("a consumer needs a group")
        cmd += ["--group", group]
    else:
        raise ValueError(f"unknown role {role!r}")
    if duration_s is not None:
        cmd += ["--duration-s", str(duration_s)]
    if security_file is not None:
        cmd += ["--security-file", str(security_file)]
    return cmd


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos.clients.workload", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    for role in ROLES:
        s = sub.add_parser(role)
        s.add_argument("--family", choices=FAMILIES, required=True)
        s.add_argument("--bootstrap", required=True, help="comma-separated host:port list")
        s.add_argument("--topic", required=True)
        s.add_argument("--trace-dir", required=True)
        s.add_argument("--client-id", required=True)
        s.add_argument("--run-id", required=True)
        s.add_argument("--duration-s", type=float, default=None, help="stop after this long (default: SIGTERM)")
        s.add_argument("--security-file", default=None,
                       help="TLS/SASL settings (chaos.testbed.security.ClientSecurity.save); default: plaintext")
        if role == "producer":
            s.add_argument("--rate", type=float, default=100.0, help="records per second")
            s.add_argument("--prefix", type=int, required=True, help="integer producer number, unique in the run")
        else:
            s.add_argument("--group", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in filter(None, os.environ.get("KPROXY_WORKLOAD_DEBUG", "").split(",")):
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)  # e.g. kafka.coordinator, for a diagnosis
    if a.role == "producer" and a.rate <= 0:
        print("--rate must be positive", file=sys.stderr)
        return 2
    a.security = ClientSecurity.load(a.security_file) if a.security_file else None
    stop = Stop(a.duration_s)
    stop.install()
    watch_parent(stop)
    writer = TraceWriter(a.trace_dir, a.client_id, a.run_id)
    trace: ProducerTrace | ConsumerTrace
    if a.role == "producer":
        trace = ProducerTrace(writer, a.client_id, a.family, a.topic, a.prefix)
        fn = adapter(a.family).produce_paced
    else:
        trace = ConsumerTrace(writer, a.client_id, a.family, a.topic, a.group)
        fn = adapter(a.family).consume_paced
    rc = 0
    try:
        result = fn(a, trace, stop)  # type: ignore[arg-type]
        if isinstance(result, int) and result not in (0, 143):  # 143: JVM ended by SIGTERM
            rc = 1
    except Exception as exc:
        log.exception("%s %s failed", a.family, a.role)
        trace.error(f"workload failed: {type(exc).__name__}: {exc}")
        rc = 1
    finally:
        writer.close()
    print(json.dumps({"client_id": a.client_id, "family": a.family, "role": a.role, "rc": rc, **trace.counts()}),
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
