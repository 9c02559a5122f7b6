"""Local Apache Kafka on loopback: real KRaft brokers from the Maven Central jars.

Theory of operation
-------------------
``chaos/kafka/pom.xml`` makes Maven copy the official ``org.apache.kafka`` jars
(broker ``kafka_2.13``, ``kafka-tools``, clients, a log4j2 binding) into
``chaos/kafka/libs/``. This module starts M brokers from those jars as plain
``java`` processes, each in combined broker+controller mode (KRaft, static
voters), on 127.0.0.1 with its own ports, data dir, log and ``broker.rack``.

Everything a cluster needs to be found again lives in ``STATE_DIR/cluster.json``
(ports, racks, PIDs), so ``kproxy kafka down`` in another process stops exactly
the processes that ``up`` started, by PID, after checking that each PID is still
a java process started for this state dir.

Brokers come and go (:meth:`KafkaCluster.add_broker`, :meth:`KafkaCluster.remove_broker`):
an added broker is broker-only (``process.roles=broker``) and joins the running cluster under
the static controller quorum of the brokers started with it; it can be decommissioned again
(stopped with a controlled shutdown, then unregistered: ``kafka-cluster.sh unregister``). The
first brokers are the quorum's voters and stay.

Sizing for a 2-core machine: a 3-broker cluster must fit beside three proxies,
clients and Spark, so each JVM gets a small heap, SerialGC and two network and
two I/O threads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import psutil

from chaos.testbed import KAFKA_BASE_PORT
from chaos.testbed.security import ClientSecurity, Protocol, TestbedSecurity

REPO = Path(__file__).resolve().parents[2]
KAFKA_DIR = REPO / "chaos" / "kafka"
LIBS = KAFKA_DIR / "libs"
POM = KAFKA_DIR / "pom.xml"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_BASE_PORT = KAFKA_BASE_PORT
JVM_OPTS = (
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:ActiveProcessorCount=2",
    "-XX:TieredStopAtLevel=1",
    "-Xss512k",
    "-Djava.awt.headless=true",
)
LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = INFO
logger.raft.name = org.apache.kafka.raft
logger.raft.level = WARN
"""
TOOLS_LOG4J2 = """\
status = error
appender.stderr.type = Console
appender.stderr.name = STDERR
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stderr.ref = STDERR
"""


class KafkaError(RuntimeError):
    """The local cluster could not be started, found or stopped (message says why)."""


# A broker's RELAY listener (see KafkaCluster's relay_host) listens on its port plus this.
RELAY_PORT_OFFSET = 200


@attrs.frozen
class BrokerSpec:
    id: int
    host: str
    port: int
    controller_port: int
    rack: str | None
    controller: bool = True  # a voter of the static quorum (broker+controller); False: broker only

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def relay_port(self) -> int:
        """The port of the optional RELAY listener (``KafkaCluster(relay_host=...)``)."""
        return self.port + RELAY_PORT_OFFSET


def ensure_jars() -> Path:
    """Fetch the Kafka jars with Maven unless already cached (idempotent)."""
    if not (LIBS / ".stamp").exists() or not any(LIBS.glob("kafka_2.13-*.jar")):
        if shutil.which("mvn") is None:
            raise KafkaError("Maven (mvn) is needed to fetch the Kafka jars and was not found on PATH")
        proc = subprocess.run(
            ["mvn", "-q", "-B", "-f", str(POM), "package"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise KafkaError(f"mvn failed to fetch the Kafka jars:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        (LIBS / ".stamp").touch()
    return LIBS


def kafka_version() -> str:
    jars = sorted(LIBS.glob("kafka_2.13-*.jar"))
    if not jars:
        raise KafkaError("Kafka jars not fetched yet (run `make kafka-jars`)")
    return jars[0].name.removeprefix("kafka_2.13-").removesuffix(".jar")


def java_bin() -> str:
    java = shutil.which("java")
    if java is None:
        raise KafkaError("Java is required to run Kafka (Java 17+) and `java` was not found on PATH")
    return java


def classpath() -> str:
    ensure_jars()
    return str(LIBS / "*")


def tools_env(state_dir: Path | None = None) -> dict[str, str]:
    """Environment for Kafka's own command line tools: quiet logging to stderr."""
    env = dict(os.environ)
    cfg_dir = Path(state_dir) if state_dir else KAFKA_DIR
    cfg = cfg_dir / "tools-log4j2.properties"
    if not cfg.exists():
        cfg.write_text(TOOLS_LOG4J2)
    env["KAFKA_TOOLS_LOG4J"] = str(cfg)
    return env


def java_tool_cmd(main_class: str, *args: str, heap: str = "256m") -> list[str]:
    """Command line that runs one of Kafka's tools (``org.apache.kafka.tools.*``)."""
    log_cfg = KAFKA_DIR / "tools-log4j2.properties"
    if not log_cfg.exists():
        log_cfg.write_text(TOOLS_LOG4J2)
    return [
        java_bin(),
        f"-Xmx{heap}",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        f"-Dlog4j2.configurationFile={log_cfg}",
        "-cp",
        classpath(),
        main_class,
        *args,
    ]


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_base_port(brokers: int = 3, *, host: str = DEFAULT_HOST, seed: int | None = None) -> int:
    """A ``base_port`` whose broker (base+i), controller (base+100+i) and relay listener (base+200+i)
    ports are all free."""
    import random

    rng = random.Random(seed)
    for _ in range(200):
        base = rng.randrange(20000, 39000)
        if all(port_free(host, base + off + i) for off in (0, 100, RELAY_PORT_OFFSET) for i in range(brokers)):
            return base
    raise KafkaError("no free port range found for a local Kafka cluster")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class KafkaCluster:
    """M local KRaft brokers. Use ``start()`` / ``stop()``, or as a context manager."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        brokers: int = 3,
        *,
        host: str = DEFAULT_HOST,
        base_port: int = DEFAULT_BASE_PORT,
        racks: list[str] | None = None,
        relay_host: str | None = None,
        exec_prefix: tuple[str, ...] = (),
        security: Protocol = Protocol.PLAINTEXT,
        reauth_ms: int = 0,
        proxy_hosts: tuple[str, ...] = (),
    ) -> None:
        """``security``: the protocol of the brokers' client (and inter-broker) listener; its CA,
        certificates and SASL users are made under ``state_dir/security`` (chaos.testbed.security).
        ``reauth_ms``: the brokers' ``connections.max.reauth.ms`` (KIP-368) with SASL.
        ``proxy_hosts``: the addresses the proxy certificate names (default: every test fleet's
        loopback address, ``TestbedSecurity.create``).
        ``relay_host``: also give each broker a second listener, RELAY, on ``host:port+200``
        advertised at ``relay_host:port+200``, for a relay in front of it (chaos.bench.relay: the
        bench's baseline hop). A client that bootstraps through the relay is then told the
        relay's addresses; the PLAINTEXT listener and its clients are unchanged.
        ``exec_prefix``: run each broker through it (``ip netns exec NS``: on an emulated host,
        ``chaos.testbed.hosts``, whose address is ``host``)."""
        if brokers < 1:
            raise KafkaError("brokers must be at least 1")
        if racks is not None and len(racks) != brokers:
            raise KafkaError(f"racks: {len(racks)} given for {brokers} brokers")
        self.state_dir = Path(state_dir).resolve()
        self.host = host
        self.protocol = security
        self.reauth_ms = reauth_ms
        self.security: TestbedSecurity | None = None
        if security is not Protocol.PLAINTEXT:
            self.security = TestbedSecurity.create(self.state_dir / "security", security,
                                                   broker_hosts=(host, "localhost"), proxy_hosts=proxy_hosts)
        self.relay_host = relay_host
        self.exec_prefix = tuple(exec_prefix)
        self.specs = [
            BrokerSpec(
                id=i,
                host=host,
                port=base_port + i - 1,
                controller_port=base_port + 100 + i - 1,
                rack=(racks[i - 1] if racks else f"rack-{i}"),
            )
            for i in range(1, brokers + 1)
        ]
        self.cluster_id: str | None = None
        self.pids: dict[int, int] = {}
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    # ----------------------------------------------------------------- state
    @property
    def state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def bootstrap(self) -> list[str]:
        return [s.address for s in self.specs]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(self.bootstrap)

    @property
    def client_security(self) -> ClientSecurity:
        """What a client needs to reach the brokers directly (PLAINTEXT: nothing)."""
        if self.security is None:
            return ClientSecurity(Protocol.PLAINTEXT)
        return self.security.client

    def admin_config(self, **extra: Any) -> dict[str, Any]:
        """confluent-kafka settings for an admin client of this cluster."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.client_security.confluent(), **extra}

    def spec(self, broker_id: int) -> BrokerSpec:
        for s in self.specs:
            if s.id == broker_id:
                return s
        raise KafkaError(f"no broker {broker_id} in this cluster (ids: {[s.id for s in self.specs]})")

    def describe(self) -> dict[str, Any]:
        return {
            "bootstrap": self.bootstrap,
            "cluster_id": self.cluster_id,
            "kafka_version": kafka_version(),
            "state_dir": str(self.state_dir),
            "relay_host": self.relay_host,
            "exec_prefix": list(self.exec_prefix),
            "security": self.protocol.value,
            "reauth_ms": self.reauth_ms,
            "client": self.client_security.describe(),
            "brokers": [
                {
                    "id": s.id,
                    "host": s.host,
                    "port": s.port,
                    "controller_port": s.controller_port,
                    "rack": s.rack,
                    "controller": s.controller,
                    "pid": self.pids.get(s.id),
                }
                for s in self.specs
            ],
        }

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.describe(), indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> "KafkaCluster":
        path = Path(state_dir).resolve() / "cluster.json"
        if not path.exists():
            raise KafkaError(f"no local Kafka cluster in {Path(state_dir)} (missing {path.name})")
        data = json.loads(path.read_text())
        brokers = data["brokers"]
        self = cls(state_dir, len(brokers), host=brokers[0]["host"], relay_host=data.get("relay_host"),
                   exec_prefix=tuple(data.get("exec_prefix", ())),
                   security=Protocol(data.get("security", "PLAINTEXT")), reauth_ms=data.get("reauth_ms", 0))
        self.specs = [
            BrokerSpec(b["id"], b["host"], b["port"], b["controller_port"], b.get("rack"), b.get("controller", True))
            for b in brokers
        ]
        self.cluster_id = data.get("cluster_id")
        self.pids = {b["id"]: b["pid"] for b in brokers if b.get("pid")}
        return self

    # ------------------------------------------------------------ processes
    def _broker_dir(self, broker_id: int) -> Path:
        return self.state_dir / f"broker-{broker_id}"

    def _write_config(self, s: BrokerSpec) -> Path:
        d = self._broker_dir(s.id)
        (d / "data").mkdir(parents=True, exist_ok=True)
        controllers = [o for o in self.specs if o.controller]
        voters = ",".join(f"{o.id}@{o.host}:{o.controller_port}" for o in controllers)
        rf = min(3, len(controllers))  # the brokers started together: an added one keeps their settings
        name = self.protocol.value  # the client listener is named after its protocol
        listeners = f"{name}://{s.host}:{s.port}"
        if s.controller:
            listeners += f",CONTROLLER://{s.host}:{s.controller_port}"
        advertised = f"{name}://{s.host}:{s.port}"
        protocols = f"{name}:{name},CONTROLLER:PLAINTEXT"
        if self.relay_host:
            listeners += f",RELAY://{s.host}:{s.relay_port}"
            advertised += f",RELAY://{self.relay_host}:{s.relay_port}"
            protocols += ",RELAY:PLAINTEXT"
        props = {
            "process.roles": "broker,controller" if s.controller else "broker",
            "node.id": s.id,
            "controller.quorum.voters": voters,
            "listeners": listeners,
            "advertised.listeners": advertised,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": name,
            "listener.security.protocol.map": protocols,
            "log.dirs": d / "data",
            "num.network.threads": 2,
            "num.io.threads": 2,
            "background.threads": 2,
            "num.replica.fetchers": 1,
            "num.recovery.threads.per.data.dir": 1,
            "log.cleaner.threads": 1,
            "num.partitions": 3,
            "default.replication.factor": rf,
            "min.insync.replicas": min(2, rf),
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": 6,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min(2, rf),
            "transaction.state.log.num.partitions": 6,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min(2, rf),
            "group.initial.rebalance.delay.ms": 0,
            "auto.create.topics.enable": "true",
            "log.segment.bytes": 64 * 1024 * 1024,
            "controller.quorum.election.timeout.ms": 1000,
            "controller.quorum.fetch.timeout.ms": 2000,
            "broker.session.timeout.ms": 6000,
            "broker.heartbeat.interval.ms": 500,
            "replica.lag.time.max.ms": 10000,
        }
        if s.rack:
            props["broker.rack"] = s.rack
        if self.security is not None:
            props.update(self.security.broker_props(name, reauth_ms=self.reauth_ms))
        path = d / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (d / "log4j2.properties").write_text(LOG4J2)
        return path

    def _format(self, s: BrokerSpec, config: Path) -> None:
        if (self._broker_dir(s.id) / "data" / "meta.properties").exists():
            return
        cmd = [java_bin(), "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               f"-Dlog4j2.configurationFile={self._broker_dir(s.id) / 'log4j2.properties'}",
               f"-Dkafka.logs.dir={self._broker_dir(s.id)}",
               "-cp", classpath(), "kafka.tools.StorageTool",
               "format", f"--cluster-id={self.cluster_id}", "-c", str(config),  # an id may start with "-"
               *(self.security.format_args() if self.security else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise KafkaError(f"formatting storage of broker {s.id} failed:\n{proc.stdout}{proc.stderr}")

    def _launch(self, s: BrokerSpec) -> None:
        d = self._broker_dir(s.id)
        if not self._port_free(s.host, s.port) or (s.controller and not self._port_free(s.host, s.controller_port)):
            raise KafkaError(
                f"port {s.host}:{s.port} or {s.host}:{s.controller_port} for broker {s.id} is already taken"
                " (another Kafka running? stop it or choose another --base-port)"
            )
        cmd = [
            *self.exec_prefix, java_bin(), *JVM_OPTS,
            f"-Dlog4j2.configurationFile={d / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={d}",
            f"-Dkproxy.state.dir={self.state_dir}",
            "-cp", classpath(), "kafka.Kafka", str(d / "server.properties"),
        ]
        out = open(d / "stdout.log", "ab")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=d)
        out.close()
        self._procs[s.id] = proc
        self.pids[s.id] = proc.pid

    def _port_free(self, host: str, port: int) -> bool:
        """On this host: bind it. On an emulated host (another namespace) the address is not
        ours to bind here, so free means nothing answers there."""
        return not _port_open(host, port) if self.exec_prefix else port_free(host, port)

    def log_tail(self, broker_id: int, lines: int = 30) -> str:
        d = self._broker_dir(broker_id)
        chunks = []
        for name in ("stdout.log", "server.log"):
            p = d / name
            if p.exists():
                text = p.read_text(errors="replace").splitlines()[-lines:]
                chunks.append(f"--- {p} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(chunks) or f"(no logs in {d})"

    def _alive(self, broker_id: int) -> bool:
        proc = self._procs.get(broker_id)
        if proc is not None:  # we started it: between fork and exec its cmdline is still ours, so ask Popen
            return proc.poll() is None
        pid = self.pids.get(broker_id)
        return pid is not None and _is_our_java(pid, self.state_dir)

    def start(self, timeout: float = 90.0) -> "KafkaCluster":
        """Start every broker, wait until all are registered and RF=3 topics work."""
        java_bin()
        ensure_jars()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.state_file.exists():
            old = KafkaCluster.load(self.state_dir)
            if any(old._alive(b) for b in old.pids):
                raise KafkaError(f"a cluster from {self.state_dir} is still running: run `kproxy kafka down` first")
            self.cluster_id = old.cluster_id
        if self.cluster_id is None:
            self.cluster_id = _new_cluster_id()
        for s in self.specs:
            self._format(s, self._write_config(s))
        try:
            for s in self.specs:
                self._launch(s)
            self._save()
            self.wait_ready(timeout)
            self._check_topic_creation()
        except BaseException:
            self.stop()
            raise
        return self

    def _check_topic_creation(self, timeout: float = 30.0) -> None:
        """Ready means usable: a topic with RF min(3, brokers) and min.insync.replicas 2 is created,
        gets a leader for every partition, and is deleted again."""
        from confluent_kafka.admin import AdminClient

        name = f"kproxy-ready-{uuid.uuid4().hex[:12]}"
        self.create_topic(name, partitions=len(self.specs), timeout=timeout)
        admin = AdminClient(self.admin_config(log_level=0))
        admin.delete_topics([name], operation_timeout=timeout)[name].result(timeout=timeout)

    def wait_ready(self, timeout: float = 90.0, brokers: list[int] | None = None) -> None:
        """Wait until every (or the given) broker is registered and serving."""
        want = set(brokers or [s.id for s in self.specs])
        deadline = time.monotonic() + timeout
        registered: set[int] = set()
        while time.monotonic() < deadline:
            for bid in list(want):
                if not self._alive(bid):
                    raise KafkaError(f"broker {bid} exited during start-up:\n{self.log_tail(bid)}")
            registered = self._registered_brokers()
            if want <= registered:
                return
            time.sleep(0.25)
        missing = sorted(want - registered)
        tails = "\n".join(self.log_tail(b) for b in missing)
        raise KafkaError(f"brokers {missing} not registered within {timeout:.0f}s:\n{tails}")

    def _registered_brokers(self) -> set[int]:
        from confluent_kafka.admin import AdminClient

        live = [s.address for s in self.specs if _port_open(s.host, s.port)]
        if not live:
            return set()
        admin = AdminClient({**self.admin_config(), "bootstrap.servers": ",".join(live), "socket.timeout.ms": 2000,
                             "log_level": 0})
        try:
            md = admin.list_topics(timeout=2)
        except Exception:
            return set()
        return set(md.brokers)

    def create_topic(self, name: str, partitions: int = 3, replication: int | None = None,
                     config: dict[str, str] | None = None, timeout: float = 30.0) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        rf = replication or min(3, len(self.specs))
        admin = AdminClient(self.admin_config())
        cfg = {"min.insync.replicas": str(min(2, rf))}
        cfg.update(config or {})
        fut = admin.create_topics([NewTopic(name, partitions, rf, config=cfg)], operation_timeout=timeout)[name]
        try:
            fut.result(timeout=timeout)
        except Exception as exc:  # TOPIC_ALREADY_EXISTS is fine
            if "already exists" not in str(exc).lower():
                raise
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            md = admin.list_topics(topic=name, timeout=5).topics.get(name)
            if md is not None and md.error is None and len(md.partitions) == partitions and all(
                p.leader >= 0 for p in md.partitions.values()
            ):
                return
            time.sleep(0.2)
        raise KafkaError(f"topic {name} has no leader for every partition after {timeout}s")

    def kill(self, broker_id: int, sig: int = signal.SIGKILL) -> None:
        """Send a signal to one broker (default SIGKILL), only if it is ours."""
        self.spec(broker_id)
        pid = self.pids.get(broker_id)
        if pid is None or not _is_our_java(pid, self.state_dir):
            raise KafkaError(f"broker {broker_id} is not running")
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            _wait_gone(pid, 10.0)
            self._reap(broker_id)
            self.pids.pop(broker_id, None)
            self._save()

    def restart(self, broker_id: int, timeout: float = 60.0) -> None:
        """Start a killed broker again and wait until it is registered."""
        s = self.spec(broker_id)
        if self._alive(broker_id):
            raise KafkaError(f"broker {broker_id} is still running")
        deadline = time.monotonic() + 15
        while not self._port_free(s.host, s.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._launch(s)
        self._save()
        self.wait_ready(timeout, brokers=[broker_id])

    def add_broker(self, rack: str | None = None, timeout: float = 60.0) -> BrokerSpec:
        """Start one more broker (broker only, the next id and port) into the running cluster and
        wait until it is registered."""
        if not any(self._alive(s.id) for s in self.specs if s.controller):
            raise KafkaError("the cluster is not running: no controller to join")
        first = self.specs[0]
        bid = max(s.id for s in self.specs) + 1
        spec = BrokerSpec(bid, self.host, first.port + bid - first.id, first.controller_port + bid - first.id,
                          rack if rack is not None else f"rack-{bid}", controller=False)
        self.specs.append(spec)
        try:
            self._format(spec, self._write_config(spec))
            self._launch(spec)
            self._save()
            self.wait_ready(timeout, brokers=[bid])
        except BaseException:
            self._stop_one(bid, 10.0)
            self.specs.remove(spec)
            self._save()
            raise
        return spec

    def remove_broker(self, broker_id: int, timeout: float = 60.0) -> None:
        """Decommission broker ``broker_id`` (one :meth:`add_broker` started): a controlled shutdown
        (SIGTERM: its partition leaderships move first), then unregister it from the cluster, so it
        is gone from Metadata and DescribeCluster for good. Moving its replicas is the caller's."""
        spec = self.spec(broker_id)
        if spec.controller:
            raise KafkaError(f"broker {broker_id} is a voter of the controller quorum: only a broker added "
                             "with add_broker can be decommissioned")
        self._stop_one(broker_id, timeout)
        others = ",".join(s.address for s in self.specs if s.id != broker_id and self._alive(s.id))
        if not others:
            raise KafkaError("no running broker left to unregister it with")
        cmd = java_tool_cmd("org.apache.kafka.tools.ClusterTool", "unregister", "--bootstrap-server", others,
                            "--id", str(broker_id), *self._tool_config_args())
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tools_env(self.state_dir))
        if proc.returncode != 0:
            raise KafkaError(f"unregistering broker {broker_id} failed:\n{proc.stdout}{proc.stderr}")
        self.specs.remove(spec)
        self._save()

    def _tool_config_args(self) -> list[str]:
        """``--config FILE`` with the client's security settings for Kafka's tools (PLAINTEXT: none)."""
        if self.security is None:
            return []
        return ["--config", str(self.client_security.java_properties(self.state_dir / "tool-client.properties"))]

    def _stop_one(self, broker_id: int, timeout: float) -> None:
        """SIGTERM (a controlled shutdown), SIGKILL after ``timeout``; only ours, by PID."""
        pid = self.pids.get(broker_id)
        if pid is not None and _is_our_java(pid, self.state_dir):
            os.kill(pid, signal.SIGTERM)
            if not _wait_gone(pid, timeout):
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, 10.0)
        self._reap(broker_id)
        self.pids.pop(broker_id, None)

    def _reap(self, broker_id: int) -> None:
        proc = self._procs.pop(broker_id, None)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every broker: SIGTERM, then SIGKILL after ``timeout``. Only ours, by PID."""
        pids = {b: p for b, p in self.pids.items() if _is_our_java(p, self.state_dir)}
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for bid, pid in pids.items():
            if not _wait_gone(pid, max(0.1, deadline - time.monotonic())):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _wait_gone(pid, 10.0)
            self._reap(bid)
        self.pids.clear()
        if self.state_dir.exists():
            self._save()

    def __enter__(self) -> "KafkaCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _new_cluster_id() -> str:
    import base64

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _is_our_java(pid: int, state_dir: Path) -> bool:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(a == f"-Dkproxy.state.dir={state_dir}" for a in cmd)


def _wait_gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout=timeout)
        return True
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
