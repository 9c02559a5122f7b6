"""The embedded default: local Kafka + N proxy nodes on 127.0.0.11, .12, …

``LocalFleet.up(state_dir)`` starts a local Kafka cluster (unless given an
existing bootstrap), writes the fleet's config (one TOML for every node) and
secrets (``fleet.env``, 0600: admin token and Raft password, generated), starts
one ``kproxy run`` process per node, and waits until the fleet is healthy: a
Raft leader, every broker identity assigned to a live node, every live node on
the same epoch. Everything needed to find the processes again is in
``STATE_DIR/fleet.json``; ``down`` stops exactly those processes, by PID.

Views and actions (status, health, drain, kill through the admin API) are
``proxy.admin_client.ClusterAdmin``'s: a ``LocalFleet`` is that plus the
processes it started.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError
from chaos.testbed.proxies import ADMIN_PORT, NodeProcess, ProxyProcessError, fleet_config, node_ip
from proxy.admin_client import AdminError, ClusterAdmin


class LocalFleetError(AdminError):
    """The local fleet could not be started, found or acted on."""


class LocalFleet(ClusterAdmin):
    nodes: dict[str, NodeProcess]  # type: ignore[assignment]

    def __init__(self, state_dir: str | os.PathLike[str], config_path: Path, nodes: list[NodeProcess],
                 kafka: KafkaCluster | None, upstream: list[str]) -> None:
        super().__init__(list(nodes), upstream)
        self.state_dir = Path(state_dir).resolve()
        self.config_path = config_path
        self.kafka = kafka

    # ------------------------------------------------------------- set-up
    @classmethod
    def up(cls, state_dir: str | os.PathLike[str], brokers: int = 3, proxies: int = 3,
           kafka_bootstrap: str | list[str] | None = None, *, racks: list[str] | None = None,
           timeout: float = 90.0, kafka_base_port: int | None = None, first_ip: int = 11,
           extra_config: dict[str, Any] | None = None, workers: int = 1) -> "LocalFleet":
        """Proxies get 127.0.0.<first_ip>, <first_ip+1>, … (default .11, .12, …), each with
        ``workers`` data-path processes."""
        state = Path(state_dir).resolve()
        state.mkdir(parents=True, exist_ok=True)
        if (state / "fleet.json").exists():
            old = cls.load(state)
            if any(n.alive() for n in old.nodes.values()):
                raise LocalFleetError(f"a fleet from {state} is still running: run `kproxy fleet down` first")
        kafka = None
        if kafka_bootstrap is None:
            kwargs = {"base_port": kafka_base_port} if kafka_base_port else {}
            kafka = KafkaCluster(state / "kafka", brokers, **kwargs)
            kafka.start(timeout=timeout)
            upstream = kafka.bootstrap
        else:
            upstream = kafka_bootstrap.split(",") if isinstance(kafka_bootstrap, str) else list(kafka_bootstrap)
        cfg = fleet_config(state / "fleet.toml", upstream, proxies, racks=racks or [f"rack-{i}" for i in (1, 2, 3)],
                           first_ip=first_ip, extra=extra_config, workers=workers)
        nodes = [NodeProcess(cfg, f"p{i + 1}", node_ip(i, first_ip), ADMIN_PORT, state / "logs" / f"p{i + 1}.log")
                 for i in range(proxies)]
        fleet = cls(state, cfg, nodes, kafka, upstream)
        try:
            for n in nodes:
                n.start()
            fleet._save()
            for n in nodes:
                n.wait_ready(timeout)
            fleet.wait_healthy(timeout)
            fleet.wait_balanced(timeout)  # nodes that joined last get their identities a moment later
        except BaseException:
            fleet.down()
            raise
        return fleet

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> "LocalFleet":
        state = Path(state_dir).resolve()
        path = state / "fleet.json"
        if not path.exists():
            raise LocalFleetError(f"no local fleet in {state} (missing fleet.json): run `kproxy fleet up` first")
        data = json.loads(path.read_text())
        cfg = Path(data["config"])
        nodes = [NodeProcess(cfg, n["id"], n["host"], n["admin_port"], n["log"], pid=n.get("pid"))
                 for n in data["nodes"]]
        kafka = KafkaCluster.load(data["kafka_state_dir"]) if data.get("kafka_state_dir") else None
        return cls(state, cfg, nodes, kafka, data["upstream"])

    def _save(self) -> None:
        data = {
            "config": str(self.config_path),
            "upstream": self.upstream,
            "kafka_state_dir": str(self.kafka.state_dir) if self.kafka else None,
            "nodes": [{"id": n.node_id, "host": n.host, "admin_port": n.admin_port, "log": str(n.log_path),
                       "pid": n.pid} for n in self.nodes.values()],
        }
        tmp = self.state_dir / "fleet.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.state_dir / "fleet.json")

    def down(self) -> None:
        for n in self.nodes.values():
            n.stop()
        if self.kafka is not None:
            self.kafka.stop()
        self._save()

    # ------------------------------------------------------------- actions
    def signal_node(self, node_id: str, sig: str) -> None:
        node = self._node(node_id)
        try:
            node.signal(sig.upper())
        except ProxyProcessError as exc:
            raise LocalFleetError(str(exc)) from None

    def restart_node(self, node_id: str, timeout: float = 60.0) -> None:
        node = self._node(node_id)
        if node.alive():
            node.stop()
        node.start()
        self._save()
        node.wait_ready(timeout)


__all__ = ["LocalFleet", "LocalFleetError", "KafkaError"]
