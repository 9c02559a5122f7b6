"""The embedded default: local Kafka + N proxy nodes on 127.0.0.11, .12, …

``LocalFleet.up(state_dir)`` starts a local Kafka cluster (unless given an
existing bootstrap), writes the fleet's config (one TOML for every node) and
secrets (``fleet.env``, 0600: admin token and Raft password, generated), starts
one ``kproxy run`` process per node, and waits until the fleet is healthy: a
Raft leader, every broker identity assigned to a live node, every live node on
the same epoch. Everything needed to find the processes again is in
``STATE_DIR/fleet.json``; ``down`` stops exactly those processes, by PID.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError
from chaos.testbed.proxies import (ADMIN_PORT, BOOTSTRAP_PORT, AdminEndpoint, NodeProcess, ProxyProcessError, fleet_config,
                           node_ip)


class FleetError(RuntimeError):
    pass


class LocalFleet:
    def __init__(self, state_dir: str | os.PathLike[str] | None, config_path: Path | None,
                 nodes: list[NodeProcess] | list[AdminEndpoint], kafka: KafkaCluster | None,
                 upstream: list[str]) -> None:
        self.state_dir = Path(state_dir).resolve() if state_dir is not None else None
        self.config_path = config_path
        self.nodes = {n.node_id: n for n in nodes}
        self.kafka = kafka
        self.upstream = upstream

    # ------------------------------------------------------------- set-up
    @classmethod
    def up(cls, state_dir: str | os.PathLike[str], brokers: int = 3, proxies: int = 3,
           kafka_bootstrap: str | list[str] | None = None, *, racks: list[str] | None = None,
           timeout: float = 90.0, kafka_base_port: int | None = None, first_ip: int = 11,
           extra_config: dict[str, Any] | None = None) -> "LocalFleet":
        """Proxies get 127.0.0.<first_ip>, <first_ip+1>, … (default .11, .12, …)."""
        state = Path(state_dir).resolve()
        state.mkdir(parents=True, exist_ok=True)
        if (state / "fleet.json").exists():
            old = cls.load(state)
            if any(n.alive() for n in old.nodes.values()):
                raise FleetError(f"a fleet from {state} is still running: run `kproxy fleet down` first")
        kafka = None
        if kafka_bootstrap is None:
            kwargs = {"base_port": kafka_base_port} if kafka_base_port else {}
            kafka = KafkaCluster(state / "kafka", brokers, **kwargs)
            kafka.start(timeout=timeout)
            upstream = kafka.bootstrap
        else:
            upstream = kafka_bootstrap.split(",") if isinstance(kafka_bootstrap, str) else list(kafka_bootstrap)
        cfg = fleet_config(state / "fleet.toml", upstream, proxies, racks=racks or [f"rack-{i}" for i in (1, 2, 3)],
                           first_ip=first_ip, extra=extra_config)
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
            raise FleetError(f"no local fleet in {state} (missing fleet.json): run `kproxy fleet up` first")
        data = json.loads(path.read_text())
        cfg = Path(data["config"])
        nodes = [NodeProcess(cfg, n["id"], n["host"], n["admin_port"], n["log"], pid=n.get("pid"))
                 for n in data["nodes"]]
        kafka = KafkaCluster.load(data["kafka_state_dir"]) if data.get("kafka_state_dir") else None
        return cls(state, cfg, nodes, kafka, data["upstream"])

    @classmethod
    def remote(cls, admin_url: str, token: str | None = None, timeout: float = 5.0) -> "LocalFleet":
        """A running fleet, wherever it runs, known by one node's admin endpoint: that node's
        ``/status`` names every node's endpoint (``admin_endpoints``). Views work without a
        token; actions (drain, undrain, kill through ``POST /kill``) need the fleet's admin
        token; starting, stopping and restarting processes need the local state dir."""
        parts = urllib.parse.urlsplit(admin_url if "://" in admin_url else f"http://{admin_url}")
        if not parts.hostname:
            raise FleetError(f"{admin_url!r} is not an admin URL (http://HOST:PORT)")
        first = AdminEndpoint("?", parts.hostname, parts.port or ADMIN_PORT, token)
        try:
            r = first.get("/status", timeout=timeout)
            r.raise_for_status()
            status = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise FleetError(f"no fleet status from {first.admin_url}: {exc!r}") from None
        members = status.get("members") or {}
        endpoints = status.get("admin_endpoints") or {str(status.get("node")): first.admin_url}
        nodes = []
        for node_id, url in sorted(endpoints.items()):
            u = urllib.parse.urlsplit(url)
            nodes.append(AdminEndpoint(node_id, u.hostname or "", u.port or ADMIN_PORT, token,
                                       bootstrap_port=(members.get(node_id) or {}).get("bootstrap_port",
                                                                                        BOOTSTRAP_PORT)))
        upstream = [f"{b['host']}:{b['port']}" for b in status.get("brokers") or [] if isinstance(b, dict)]
        return cls(None, None, nodes, None, upstream)

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

    # ---------------------------------------------------------- accessors
    @property
    def node_ids(self) -> list[str]:
        return list(self.nodes)

    @property
    def bootstrap(self) -> list[str]:
        return [f"{n.host}:{n.bootstrap_port}" for n in self.nodes.values()]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(self.bootstrap)

    def node_address(self, node_id: str) -> str:
        return self._node(node_id).host

    def _node(self, node_id: str) -> NodeProcess:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise FleetError(f"no node {node_id!r} in this fleet (nodes: {self.node_ids})") from None

    # -------------------------------------------------------------- views
    def status(self, node_id: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        """GET /status of one node (default: the first that answers)."""
        candidates = [self._node(node_id)] if node_id else list(self.nodes.values())
        errors = []
        for n in candidates:
            try:
                r = n.get("/status", timeout=timeout)
                r.raise_for_status()
                return r.json()
            except httpx.HTTPError as exc:
                errors.append(f"{n.node_id}: {exc!r}")
        raise FleetError("no node answered /status: " + "; ".join(errors))

    def statuses(self, timeout: float = 1.0) -> dict[str, dict[str, Any] | None]:
        out: dict[str, dict[str, Any] | None] = {}
        for n in self.nodes.values():
            try:
                r = n.get("/status", timeout=timeout)
                out[n.node_id] = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                out[n.node_id] = None
        return out

    def fleet_view(self, timeout: float = 1.0) -> dict[str, Any]:
        """One picture of the fleet: the leader's table, every node's role and liveness."""
        statuses = self.statuses(timeout)
        answering = {k: v for k, v in statuses.items() if v is not None}
        leaders = [s for s in answering.values() if s.get("role") == "leader"]
        # The authoritative table is the leader's (highest term wins if two claim it).
        source = max(leaders, key=lambda s: s.get("term", 0)) if leaders else (
            max(answering.values(), key=lambda s: s.get("epoch", 0)) if answering else None)
        assignment = dict(source.get("assignment", {})) if source else {}
        members = source.get("members", {}) if source else {}
        nodes = []
        for node_id, n in self.nodes.items():
            s = statuses[node_id]
            nodes.append({
                "id": node_id,
                "address": n.host,
                "pid": n.pid,
                "process": n.alive(),
                "alive": s is not None,
                "role": s.get("role") if s else "unreachable",
                "term": s.get("term") if s else None,
                "epoch": s.get("epoch") if s else None,
                "has_quorum": s.get("has_quorum") if s else None,
                "up": members.get(node_id, {}).get("up"),            # the fleet's committed view
                "draining": members.get(node_id, {}).get("draining"),
                "identities": sorted(int(b) for b, owner in assignment.items() if owner == node_id),
                "standing_in": s.get("standing_in", []) if s else [],  # vacant nodes' addresses it serves
            })
        return {
            "epoch": source.get("epoch") if source else None,
            "leader": source.get("leader") if source else None,
            "assignment": {str(k): v for k, v in sorted(assignment.items(), key=lambda kv: int(kv[0]))},
            "nodes": nodes,
            "brokers": source.get("brokers", []) if source else [],
            "bootstrap": self.bootstrap,
        }

    def leader(self) -> str | None:
        return self.fleet_view().get("leader")

    @staticmethod
    def health_problems(view: dict[str, Any]) -> list[str]:
        problems = []
        if not view.get("leader"):
            problems.append("no Raft leader")
        alive = {n["id"] for n in view["nodes"] if n["alive"]}
        for n in view["nodes"]:
            if not n["alive"]:
                problems.append(f"node {n['id']} unreachable")
        broker_ids = {str(b["id"]) for b in view.get("brokers", [])}
        if not broker_ids:
            problems.append("no upstream brokers known")
        for b in sorted(broker_ids):
            owner = view["assignment"].get(b)
            if owner is None:
                problems.append(f"broker {b} unassigned")
            elif owner not in alive:
                problems.append(f"broker {b} assigned to unreachable node {owner}")
        epochs = {n["epoch"] for n in view["nodes"] if n["alive"]}
        if len(epochs) > 1:
            problems.append(f"nodes disagree on the epoch: {sorted(e for e in epochs if e is not None)}")
        return problems

    def wait_healthy(self, timeout: float = 30.0, *, allow_dead: bool = False) -> dict[str, Any]:
        """Until: a leader, every identity on a live node, one epoch (dead nodes allowed if asked)."""
        deadline = time.monotonic() + timeout
        problems: list[str] = ["not checked"]
        view: dict[str, Any] = {}
        while time.monotonic() < deadline:
            view = self.fleet_view()
            problems = self.health_problems(view)
            if allow_dead:
                problems = [p for p in problems if "unreachable" not in p or "assigned to" in p]
            if not problems:
                return view
            time.sleep(0.1)
        raise FleetError(f"fleet not healthy within {timeout}s: {problems}")

    def wait_balanced(self, timeout: float = 30.0) -> dict[str, Any]:
        """Until healthy and every live, non-draining node's load is within one of the others'."""
        deadline = time.monotonic() + timeout
        loads: dict[str, int] = {}
        while time.monotonic() < deadline:
            view = self.fleet_view()
            serving = [n for n in view["nodes"] if n["alive"] and not n.get("draining")]
            loads = {n["id"]: len(n["identities"]) for n in serving}
            if not self.health_problems(view) and loads and max(loads.values()) - min(loads.values()) <= 1:
                return view
            time.sleep(0.1)
        raise FleetError(f"fleet not balanced within {timeout}s: identities per node {loads}")

    # ------------------------------------------------------------- actions
    def signal_node(self, node_id: str, sig: str) -> None:
        node = self._node(node_id)
        try:
            node.signal(sig.upper())
        except ProxyProcessError as exc:
            raise FleetError(str(exc)) from None

    def restart_node(self, node_id: str, timeout: float = 60.0) -> None:
        node = self._node(node_id)
        if node.alive():
            node.stop()
        node.start()
        self._save()
        node.wait_ready(timeout)

    def _action(self, path: str, via: str | None = None) -> dict[str, Any]:
        """POST an action to one node (default: the leader, else any node that answers)."""
        order = [via] if via else ([self.leader()] + self.node_ids)
        errors = []
        for node_id in order:
            if node_id is None:
                continue
            try:
                r = self._node(node_id).post(path)
            except httpx.HTTPError as exc:
                errors.append(f"{node_id}: {exc!r}")
                continue
            if r.status_code == 200:
                return r.json()
            errors.append(f"{node_id}: HTTP {r.status_code} {r.text[:200]}")
            if r.status_code in (400, 401, 403, 404):
                break
        raise FleetError(f"{path} failed: " + "; ".join(errors))

    def drain(self, node_id: str) -> dict[str, Any]:
        self._node(node_id)
        return self._action(f"/drain/{node_id}")

    def undrain(self, node_id: str) -> dict[str, Any]:
        self._node(node_id)
        return self._action(f"/undrain/{node_id}")


__all__ = ["LocalFleet", "FleetError", "KafkaError"]
