"""The embedded default: local Kafka + N proxy nodes on 127.0.0.11, .12, …

``LocalFleet.up(state_dir)`` starts a local Kafka cluster (unless given an
existing bootstrap), writes the fleet's config (one TOML for every node) and
secrets (``fleet.env``, 0600: admin token and Raft password, generated), starts
one ``kproxy run`` process per node, and waits until the fleet is healthy: a
Raft leader, every broker identity assigned to a live node, every live node on
the same epoch. Everything needed to find the processes again is in
``STATE_DIR/fleet.json``; ``down`` stops exactly those processes, by PID.

With ``hosts="netns"`` every node, the brokers and the drill clients run on emulated hosts of
their own (``chaos.testbed.hosts``: network namespaces on a bridge, addresses of 198.18.0.0/24);
the plan is in ``fleet.json`` and ``down`` removes every namespace, link and address it made.

With ``security`` other than PLAINTEXT the local Kafka's listener speaks that protocol
(``chaos.testbed.security``: its own CA, SCRAM users), and the fleet is configured for it
(``TestbedSecurity.proxy_config``): TLS toward clients with a certificate naming every node
address, TLS and the nodes' own SASL login upstream as the brokers need (the password in
``fleet.env``). In front of an existing secured Kafka, ``testbed`` is its ``TestbedSecurity``.
``client_security`` is then what a client of the fleet needs, ``broker_security`` what a
client of the brokers needs; ``fleet.json`` names the test bed's directory, so ``load`` finds both.

Views and actions (status, health, drain, kill through the admin API) are
``proxy.admin_client.ClusterAdmin``'s: a ``LocalFleet`` is that plus the
processes it started. ``add_node`` / ``remove_node`` grow and shrink it live:
the admin action (a Raft membership change), then the node's process started
(with the fleet file that now lists it) or stopped (and struck from the file).
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from chaos.testbed.hosts import (LOOPBACK, NETNS, HostNet, HostPlan, HostsError, plan_hosts, tag_for,
                                 unavailable_reason)
from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError
from chaos.testbed.proxies import ADMIN_PORT, NodeProcess, ProxyProcessError, fleet_config, node_ip
from chaos.testbed.security import ClientSecurity, Protocol, TestbedSecurity
from proxy.admin_client import AdminError, ClusterAdmin
from proxy.status import FleetView


class LocalFleetError(AdminError):
    """The local fleet could not be started, found or acted on."""


class LocalFleet(ClusterAdmin):
    nodes: dict[str, NodeProcess]  # type: ignore[assignment]

    def __init__(self, state_dir: str | os.PathLike[str], config_path: Path, nodes: list[NodeProcess],
                 kafka: KafkaCluster | None, upstream: list[str], hosts: HostPlan | None = None,
                 testbed: TestbedSecurity | None = None) -> None:
        super().__init__(list(nodes), upstream)
        self.testbed = testbed
        self.state_dir = Path(state_dir).resolve()
        self.config_path = config_path
        self.kafka = kafka
        self.hosts = hosts

    @property
    def client_exec(self) -> tuple[str, ...]:
        """The command prefix that runs a client on the clients' host (empty on loopback)."""
        return self.hosts.exec_prefix("clients") if self.hosts is not None else ()

    @property
    def security(self) -> Protocol:
        """The brokers' protocol (PLAINTEXT: the fleet is not secured either)."""
        return Protocol.PLAINTEXT if self.testbed is None else self.testbed.protocol

    @property
    def client_security(self) -> ClientSecurity | None:
        """What a client of the fleet needs (TLS, SASL passed through); None for plaintext."""
        return None if self.testbed is None else self.testbed.proxy_client()

    @property
    def broker_security(self) -> ClientSecurity | None:
        """What a client of the brokers themselves needs; None for plaintext."""
        return None if self.testbed is None else self.testbed.client

    # ------------------------------------------------------------- set-up
    @classmethod
    def up(cls, state_dir: str | os.PathLike[str], brokers: int = 3, proxies: int = 3,
           kafka_bootstrap: str | list[str] | None = None, *, racks: list[str] | None = None,
           timeout: float = 90.0, kafka_base_port: int | None = None, first_ip: int = 11,
           extra_config: dict[str, Any] | None = None, hosts: str = LOOPBACK, workers: int = 1,
           security: Protocol = Protocol.PLAINTEXT, testbed: TestbedSecurity | None = None) -> "LocalFleet":
        """Proxies get 127.0.0.<first_ip>, <first_ip+1>, … (default .11, .12, …); with
        ``hosts="netns"`` each its own emulated host (``chaos.testbed.hosts``), each with ``workers``
        data-path processes. ``security``: the local Kafka's protocol; ``testbed``: that of an
        existing Kafka (``kafka_bootstrap``) (see the module doc)."""
        if hosts not in (LOOPBACK, NETNS):
            raise LocalFleetError(f"unknown hosts mode {hosts!r} (one of {LOOPBACK}, {NETNS})")
        if kafka_bootstrap is None and testbed is not None:
            raise LocalFleetError("testbed is the security of an existing Kafka: give its kafka_bootstrap")
        if kafka_bootstrap is not None and security is not Protocol.PLAINTEXT and testbed is None:
            raise LocalFleetError("in front of an existing secured Kafka the fleet needs its test bed "
                                  "(CA, users): give testbed")
        state = Path(state_dir).resolve()
        state.mkdir(parents=True, exist_ok=True)
        if (state / "fleet.json").exists():
            old = cls.load(state)
            if any(n.alive() for n in old.nodes.values()):
                raise LocalFleetError(f"a fleet from {state} is still running: run `kproxy fleet down` first")
            old.remove_hosts()
        node_ids = [f"p{i + 1}" for i in range(proxies)]
        plan = plan_hosts(tag_for(state), node_ids) if hosts == NETNS else None
        if plan is not None and kafka_bootstrap is not None:
            for address in _split(kafka_bootstrap):
                plan.require_owned(address)  # an outside Kafka is not on a link the launcher made: refused
        if plan is not None and (reason := unavailable_reason()) is not None:
            raise HostsError(f"emulated hosts (--hosts netns) cannot be made here: {reason}")
        fleet = cls(state, state / "fleet.toml", [], None, [], plan, testbed)
        fleet._save()  # the plan is on disk before anything exists: `fleet down` can always undo it
        try:
            if plan is not None:
                HostNet(plan).create()
            kafka = None
            addresses = [plan.host(n).address for n in node_ids] if plan is not None else None
            extra = dict(extra_config or {})
            secrets_env: dict[str, str] = {}
            if kafka_bootstrap is None:
                kwargs: dict[str, Any] = {"base_port": kafka_base_port} if kafka_base_port else {}
                if plan is not None:
                    kwargs.update(host=plan.host("kafka").address, exec_prefix=plan.exec_prefix("kafka"))
                node_hosts = tuple(addresses or (node_ip(i, first_ip) for i in range(proxies)))
                kafka = fleet.kafka = KafkaCluster(state / "kafka", brokers, security=security,
                                                   proxy_hosts=node_hosts, **kwargs)
                testbed = fleet.testbed = kafka.security
                fleet._save()
                kafka.start(timeout=timeout)
                upstream = kafka.bootstrap
            else:
                upstream = _split(kafka_bootstrap)
            floating = [str(plan.host(n).floating) for n in node_ids] if plan is not None else None
            if testbed is not None:
                extra["security"] = {**testbed.proxy_config(), **extra.get("security", {})}
                secrets_env = testbed.proxy_env()
            cfg = fleet_config(state / "fleet.toml", upstream, proxies,
                               racks=racks or [f"rack-{i}" for i in (1, 2, 3)], first_ip=first_ip,
                               extra=extra, hosts=addresses, floating=floating, workers=workers,
                               secrets_env=secrets_env)
            nodes = [NodeProcess(cfg, n, addresses[i] if addresses else node_ip(i, first_ip), ADMIN_PORT,
                                 state / "logs" / f"{n}.log",
                                 exec_prefix=plan.exec_prefix(n) if plan is not None else (),
                                 bootstrap_host=floating[i] if floating else None)
                     for i, n in enumerate(node_ids)]
            fleet = cls(state, cfg, nodes, kafka, upstream, plan, testbed)
            for n in nodes:
                n.start()
            fleet._save()
            for n in nodes:
                n.wait_ready(timeout)
            fleet.wait_healthy(timeout)
            fleet.wait_steady(timeout)  # nodes that joined last get their identities a moment later
        except BaseException:
            fleet.down()
            raise
        return fleet

    def wait_steady(self, timeout: float = 30.0) -> FleetView:
        """Balanced, and on emulated hosts every floating address on its own node again: a node
        back from a fault is fenced, then takes its address, then its survivor gives it up, all
        after the map that made the fleet balanced (up to a few seconds later; session 29 saw a
        one-way drill fault a node 0.1 s after it held its address again, its clients too new to
        be in its peers' lists: the drill charged the previous heal to that fault)."""
        deadline = time.monotonic() + timeout
        view = self.wait_balanced(timeout)
        if self.hosts is not None:
            self.wait_addresses_settled(max(0.0, deadline - time.monotonic()))
        return view

    def wait_addresses_settled(self, timeout: float) -> None:
        """Emulated hosts: wait until each node's host holds its own floating address and no
        other (a node that started without quorum may hold a peer's for a moment)."""
        assert self.hosts is not None
        net = HostNet(self.hosts)
        want = {h.floating: [h.name] for h in self.hosts.hosts if h.floating}
        deadline = time.monotonic() + timeout
        while (held := net.holders()) != want:
            if time.monotonic() > deadline:
                raise LocalFleetError(f"floating addresses not settled within {timeout}s: {held}")
            time.sleep(0.05)

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> "LocalFleet":
        state = Path(state_dir).resolve()
        path = state / "fleet.json"
        if not path.exists():
            raise LocalFleetError(f"no local fleet in {state} (missing fleet.json): run `kproxy fleet up` first")
        data = json.loads(path.read_text())
        cfg = Path(data["config"])
        nodes = [NodeProcess(cfg, n["id"], n["host"], n["admin_port"], n["log"], pid=n.get("pid"),
                             exec_prefix=tuple(n.get("exec_prefix", ())), bootstrap_host=n.get("bootstrap_host"))
                 for n in data["nodes"]]
        kafka_dir = data.get("kafka_state_dir")
        kafka = KafkaCluster.load(kafka_dir) if kafka_dir and (Path(kafka_dir) / "cluster.json").exists() else None
        hosts = HostPlan.from_json(data["hosts"]) if data.get("hosts") else None
        testbed = TestbedSecurity.load(data["security_dir"]) if data.get("security_dir") else None
        return cls(state, cfg, nodes, kafka, data["upstream"], hosts, testbed)

    def _save(self) -> None:
        data = {
            "config": str(self.config_path),
            "upstream": self.upstream,
            "kafka_state_dir": str(self.kafka.state_dir) if self.kafka else None,
            "nodes": [{"id": n.node_id, "host": n.host, "admin_port": n.admin_port, "log": str(n.log_path),
                       "pid": n.pid, "exec_prefix": list(n.exec_prefix), "bootstrap_host": n.bootstrap_host}
                      for n in self.nodes.values()],
            "hosts": self.hosts.to_json() if self.hosts is not None else None,
            "security": self.security.value,
            "security_dir": str(self.testbed.dir) if self.testbed is not None else None,
        }
        tmp = self.state_dir / "fleet.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.state_dir / "fleet.json")

    def down(self) -> None:
        """Stop the proxies and Kafka, then remove the emulated hosts (raises if any is left)."""
        self.adopt_saved_pids()
        for n in self.nodes.values():
            n.stop()
        if self.kafka is not None:
            self.kafka.stop()
        self._save()
        self.remove_hosts()

    def adopt_saved_pids(self) -> None:
        """A node restarted through another handle on this fleet (``kproxy drill run --state-dir``,
        ``cluster restart-node``) runs under the PID ``fleet.json`` names, not the one this object
        started: stop that one too."""
        path = self.state_dir / "fleet.json"
        if not path.exists():
            return
        for saved in json.loads(path.read_text()).get("nodes", []):
            node = self.nodes.get(saved["id"])
            if node is not None and saved.get("pid") and saved["pid"] != node.pid and not node.alive():
                node.adopt(saved["pid"])

    def remove_hosts(self) -> None:
        """Remove every namespace, link and address of the fleet's emulated hosts (none on loopback)."""
        if self.hosts is None:
            return
        left = HostNet(self.hosts).remove()
        if left:
            raise LocalFleetError(f"emulated hosts not fully removed: {', '.join(left)}")

    # ------------------------------------------------------------- actions
    def signal_node(self, node_id: str, sig: str) -> None:
        self.adopt_saved_pids()
        node = self._node(node_id)
        try:
            node.signal(sig.upper())
        except ProxyProcessError as exc:
            raise LocalFleetError(str(exc)) from None

    def restart_node(self, node_id: str, timeout: float = 60.0) -> None:
        self.adopt_saved_pids()
        node = self._node(node_id)
        if node.alive():
            node.stop()
        node.start()
        self._save()
        node.wait_ready(timeout)

    # ------------------------------------------------------ live membership
    def add_node(self, node_id: str, host: str, *, rack: str | None = None,
                 timeout: float = 60.0) -> dict[str, Any]:
        """Grow the running fleet by ``node_id`` on ``host`` (a loopback address here): the
        membership change first (Raft adds it), then its process, started from the fleet
        file that now lists it; returns once it serves and the fleet is balanced again
        (it got identities by planned moves). The answer gains ``timings_s``."""
        if self.hosts is not None:
            raise LocalFleetError("adding a node to a fleet on emulated hosts is not supported (loopback only)")
        if node_id in self.nodes:
            raise LocalFleetError(f"node {node_id!r} is already in this fleet")
        started = time.monotonic()
        answer = self.add_node_action(node_id, host, rack=rack)
        committed = time.monotonic()
        entry = self._edit_config(add={"id": node_id, "host": host, "rack": rack})
        node = NodeProcess(self.config_path, node_id, host, int(entry.get("admin_port") or ADMIN_PORT),
                           self.state_dir / "logs" / f"{node_id}.log")
        self.nodes[node_id] = node
        node.start()
        self._save()
        node.wait_ready(timeout)
        serving = time.monotonic()
        self.wait_balanced(timeout)
        done = time.monotonic()
        answer["timings_s"] = {"committed": round(committed - started, 3), "serving": round(serving - started, 3),
                               "balanced": round(done - started, 3)}
        return answer

    def add_node_action(self, node_id: str, host: str, *, rack: str | None = None) -> dict[str, Any]:
        """The admin action alone (ports as the other nodes'), for callers starting the process themselves."""
        first = tomllib.loads(self.config_path.read_text())["nodes"][0]
        return super().add_node(node_id, host, bootstrap_port=first.get("bootstrap_port"),
                                raft_port=first.get("raft_port"), rack=rack)

    def remove_node(self, node_id: str, timeout: float = 60.0) -> dict[str, Any]:  # type: ignore[override]
        """Shrink the running fleet: drain ``node_id`` (planned moves), remove it from Raft and the
        fleet (another member runs it), then stop its process and strike it from the fleet file."""
        node = self._node(node_id)
        started = time.monotonic()
        answer = super().remove_node(node_id, timeout=timeout)
        removed = time.monotonic()
        node.stop()
        del self.nodes[node_id]
        self._edit_config(remove=node_id)
        self._save()
        answer["timings_s"] = {"removed": round(removed - started, 3), "stopped": round(time.monotonic() - started, 3)}
        return answer

    def _edit_config(self, add: dict[str, Any] | None = None, remove: str | None = None) -> dict[str, Any]:
        """Add a node to the fleet file (its ports and workers as the first node's) or strike one."""
        doc = tomllib.loads(self.config_path.read_text())
        nodes = doc["nodes"]
        entry: dict[str, Any] = {}
        if add is not None:
            entry = {k: v for k, v in nodes[0].items() if k not in ("id", "host", "rack")}
            entry.update({k: v for k, v in add.items() if v is not None})
            nodes.append(entry)
        if remove is not None:
            doc["nodes"] = [n for n in nodes if n["id"] != remove]
        tmp = self.config_path.with_suffix(".toml.tmp")
        tmp.write_text(tomli_w.dumps(doc))
        tmp.replace(self.config_path)
        return entry


def _split(bootstrap: str | list[str]) -> list[str]:
    return bootstrap.split(",") if isinstance(bootstrap, str) else list(bootstrap)


__all__ = ["LocalFleet", "LocalFleetError", "KafkaError", "HostsError"]
