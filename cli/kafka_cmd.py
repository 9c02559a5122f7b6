"""`kproxy kafka up|down|kill|restart|add-broker|remove-broker`: the local Apache Kafka test bed."""

from __future__ import annotations

import json
import signal
import sys

import click

from chaos.testbed import KAFKA_BASE_PORT
from chaos.testbed.security import SECURITY_CHOICES as SECURITY

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT}
state_dir_option = click.option(
    "--state-dir", required=True, type=click.Path(file_okay=False), help="Directory holding the cluster's state."
)


def _fail(exc: Exception, code: int = 1) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(code)


@click.group()
def kafka() -> None:
    """Local Apache Kafka (real KRaft brokers from the Maven Central jars)."""


@kafka.command()
@click.option("--brokers", type=click.IntRange(1, 9), default=3, show_default=True)
@state_dir_option
@click.option("--base-port", type=click.IntRange(1024, 65000), default=KAFKA_BASE_PORT, show_default=True)
@click.option("--rack", "racks", multiple=True, help="broker.rack per broker, in id order (repeat).")
@click.option("--timeout", type=float, default=90.0, show_default=True)
@click.option("--security", type=click.Choice(SECURITY), default="plaintext", show_default=True,
              help="Protocol of the brokers' listener. TLS: a CA and certificates are made in STATE_DIR/security;"
                   " SASL: PLAIN, SCRAM-SHA-256/512 and OAUTHBEARER (unsecured tokens) for user 'kproxy'.")
@click.option("--reauth-ms", type=click.IntRange(0), default=0, show_default=True,
              help="SASL: the brokers' connections.max.reauth.ms (KIP-368); 0: never.")
@click.option("--json", "as_json", is_flag=True, help="Print bootstrap, brokers and client settings as JSON.")
def up(brokers: int, state_dir: str, base_port: int, racks: tuple[str, ...], timeout: float, security: str,
       reauth_ms: int, as_json: bool) -> None:
    """Start BROKERS local brokers and wait until they are all registered."""
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError
    from chaos.testbed.security import Protocol

    if racks and len(racks) != brokers:
        raise click.BadParameter(f"{len(racks)} racks for {brokers} brokers", param_hint="--rack")
    try:
        cluster = KafkaCluster(state_dir, brokers, base_port=base_port, racks=list(racks) or None,
                               security=Protocol.parse(security), reauth_ms=reauth_ms)
        cluster.start(timeout=timeout)
    except KafkaError as exc:
        _fail(exc)
    info = cluster.describe()
    if as_json:
        click.echo(json.dumps(info))
        return
    click.echo(",".join(info["bootstrap"]))
    if cluster.security is not None:
        props = cluster.client_security.java_properties(cluster.security.dir / "client.properties")
        click.echo(f"client settings (Java properties, password inside, mode 0600): {props}", err=True)


@kafka.command()
@state_dir_option
def down(state_dir: str) -> None:
    """Stop every broker that `up` started in STATE_DIR."""
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError

    try:
        cluster = KafkaCluster.load(state_dir)
        stopped = sorted(cluster.pids)
        cluster.stop()
    except KafkaError as exc:
        _fail(exc)
    click.echo(f"stopped brokers {stopped}")


@kafka.command()
@click.argument("broker_id", type=int)
@state_dir_option
@click.option("--signal", "sig", type=click.Choice(sorted(SIGNALS)), default="KILL", show_default=True)
def kill(broker_id: int, state_dir: str, sig: str) -> None:
    """Send a signal to one broker (default SIGKILL)."""
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError

    try:
        KafkaCluster.load(state_dir).kill(broker_id, SIGNALS[sig])
    except KafkaError as exc:
        _fail(exc)
    click.echo(f"sent SIG{sig} to broker {broker_id}")


@kafka.command()
@click.argument("broker_id", type=int)
@state_dir_option
def restart(broker_id: int, state_dir: str) -> None:
    """Start a killed broker again and wait until it is registered."""
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError

    try:
        KafkaCluster.load(state_dir).restart(broker_id)
    except KafkaError as exc:
        _fail(exc)
    click.echo(f"broker {broker_id} restarted")


@kafka.command("add-broker")
@state_dir_option
@click.option("--rack", default=None, help="broker.rack of the new broker (default rack-ID).")
@click.option("--timeout", type=float, default=60.0, show_default=True)
def add_broker(state_dir: str, rack: str | None, timeout: float) -> None:
    """Start one more broker (broker only, the next id) into the running cluster; prints its id and address."""
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError

    try:
        spec = KafkaCluster.load(state_dir).add_broker(rack=rack, timeout=timeout)
    except KafkaError as exc:
        _fail(exc)
    click.echo(f"broker {spec.id} at {spec.address}")


@kafka.command("remove-broker")
@click.argument("broker_id", type=int)
@state_dir_option
@click.option("--timeout", type=float, default=60.0, show_default=True)
def remove_broker(broker_id: int, state_dir: str, timeout: float) -> None:
    """Decommission a broker add-broker started: controlled shutdown, then unregister it
    (move its partitions away first if they must stay available)."""
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError

    try:
        KafkaCluster.load(state_dir).remove_broker(broker_id, timeout=timeout)
    except KafkaError as exc:
        _fail(exc)
    click.echo(f"broker {broker_id} stopped and unregistered")
