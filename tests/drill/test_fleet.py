"""A real fleet (3 proxies on 127.0.0.11-13) in front of the session's real Kafka."""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from click.testing import CliRunner

from chaos.clients import batch as clients
from chaos.testbed.fleet import LocalFleet
from cli.main import cli

pytestmark = [pytest.mark.drill, pytest.mark.integration]


@pytest.fixture(scope="module")
def fleet(kafka_cluster, tmp_path_factory):
    f = LocalFleet.up(tmp_path_factory.mktemp("fleet"), kafka_bootstrap=kafka_cluster.bootstrap, timeout=90)
    try:
        yield f
    finally:
        f.down()


def _metadata_brokers(bootstrap: str) -> list[tuple[int, str, int]]:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2})
    md = admin.list_topics(timeout=15)
    return sorted((b.id, b.host, b.port) for b in md.brokers.values())


def _wait(condition, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def test_every_node_answers_metadata_identically(fleet):
    view = fleet.wait_healthy(30)
    expected = sorted((int(b), fleet.node_address(owner), 9100 + int(b)) for b, owner in view.assignment.items())
    answers = {n: _metadata_brokers(bs) for n, bs in zip(fleet.node_ids, fleet.bootstrap)}
    assert all(a == expected for a in answers.values()), answers
    # Rack-aware: broker N (rack-N) is served by the node in rack-N.
    assert view.assignment == {"1": "p1", "2": "p2", "3": "p3"}


def test_admin_endpoint(fleet):
    node = fleet.nodes["p1"]
    assert node.get("/healthz").json() == {"ok": True}
    assert node.get("/readyz").status_code == 200
    metrics = node.get("/metrics").text
    assert 'kproxy_requests_total{api_key="3",node="p1"}' in metrics
    assert "kproxy_rewrites_total" in metrics
    status = node.get("/status").json()
    assert {"node", "role", "term", "leader", "has_quorum", "epoch", "assignment", "peers", "brokers"} <= set(status)
    # Actions need the bearer token.
    assert httpx.post(node.admin_url + "/drain/p2", timeout=5).status_code == 401
    bad = httpx.post(node.admin_url + "/drain/p2", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert bad.status_code == 401
    assert node.post("/drain/p9").status_code == 404
    assert fleet.fleet_view().assignment == {"1": "p1", "2": "p2", "3": "p3"}


def test_cli_status_json_shape(fleet):
    result = CliRunner().invoke(cli, ["cluster", "status", "--state-dir", str(fleet.state_dir), "--json"])
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert {"epoch", "leader", "nodes", "assignment", "brokers"} <= set(view)
    assert [n["id"] for n in view["nodes"]] == ["p1", "p2", "p3"]
    assert all({"id", "role", "alive", "identities"} <= set(n) for n in view["nodes"])
    assert sorted(view["assignment"]) == ["1", "2", "3"]
    assert [b["id"] for b in view["brokers"]] == [1, 2, 3]


def test_cli_kill_node_needs_confirmation(fleet):
    result = CliRunner().invoke(cli, ["cluster", "kill-node", "p2", "--state-dir", str(fleet.state_dir)], input="n\n")
    assert result.exit_code == 1  # aborted
    assert fleet.nodes["p2"].alive()
    bad = CliRunner().invoke(cli, ["cluster", "kill-node", "p7", "--state-dir", str(fleet.state_dir), "--yes"])
    assert bad.exit_code == 2 and "no node 'p7'" in bad.output


def test_drain_moves_identities_without_client_errors(fleet, topic_name):
    bs = fleet.bootstrap_servers
    acks = clients.produce("confluent", bs, topic_name, 20, prefix=1)
    result = CliRunner().invoke(cli, ["cluster", "drain", "p3", "--state-dir", str(fleet.state_dir)])
    assert result.exit_code == 0, result.output
    view = fleet.fleet_view()
    assert "p3" not in view.assignment.values()
    # The drained node's address keeps working: the survivors stand in for it.
    _wait(lambda: any(n.standing_in for n in fleet.fleet_view().nodes), 10, "stand-ins for p3")
    assert {h for _, h, _ in _metadata_brokers(f"{fleet.node_address('p3')}:9092")} == {
        fleet.node_address("p1"), fleet.node_address("p2")}
    acks += clients.produce("aiokafka", bs, topic_name, 20, prefix=2)
    assert CliRunner().invoke(cli, ["cluster", "undrain", "p3", "--state-dir", str(fleet.state_dir)]).exit_code == 0
    _wait(lambda: fleet.fleet_view().assignment.get("3") == "p3", 20, "p3 serving broker 3 again")
    got = clients.consume("kafka-python", bs, topic_name, f"g-{topic_name}", 40)
    assert sorted(c.value for c in got) == sorted(a.value for a in acks)


def _api_versions(host: str, port: int) -> socket.socket | None:
    """A client connection that got an answer to ApiVersions v0 (None if refused or closed)."""
    payload = struct.pack(">hhih", 18, 0, 1, 1) + b"t"
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        return None
    try:
        sock.sendall(struct.pack(">i", len(payload)) + payload)
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) == 4 and sock.recv(struct.unpack(">i", head)[0], socket.MSG_WAITALL):
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _accepting_pids(host: str, ports: set[int]) -> list[int]:
    """The pids of the processes holding the accepted side of every established connection to
    ``host`` on one of ``ports`` (ss -p), one entry per connection."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "src", host], capture_output=True, text=True,
                         check=True).stdout
    pids = []
    for line in out.splitlines():
        fields = line.split()
        local = fields[2] if len(fields) > 2 else ""
        if local.rsplit(":", 1)[-1].isdigit() and int(local.rsplit(":", 1)[-1]) in ports:
            pids += [int(p) for p in re.findall(r"pid=(\d+)", line)]
    return pids


def _process_tree(pid: int) -> set[int]:
    root = psutil.Process(pid)
    return {pid, *(c.pid for c in root.children(recursive=True))}


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_returned_node_gets_back_the_clients_survivors_accepted_at_its_address(fleet, topic_name):
    """SIGKILL p3: the survivors stand in on its address and accept clients there. Restart it:
    once it serves its address again, the survivors hand those clients back (closed at an idle
    moment); they reconnect to the same address and are p3's own. A producer that knew only p3's
    address loses nothing meanwhile."""
    fleet.wait_healthy(30)
    clients.produce("confluent", fleet.bootstrap_servers, topic_name, 1, prefix=0)
    p3 = fleet.node_address("p3")
    ports = {9092, 9101, 9102, 9103}
    fleet.signal_node("p3", "KILL")
    _wait(lambda: all(f"{p3}:9092" in n.standing_in for n in fleet.fleet_view().nodes if n.id != "p3"), 15,
          "both survivors standing in on p3's bootstrap port")
    socks = [_wait(lambda: _api_versions(p3, port), 10, f"an answer at {p3}:{port}") for port in (9092,) * 4]
    producer = _SteadyProducer(f"{p3}:9092", topic_name)  # its bootstrap connection: a stand-in's
    producer.start()
    try:
        producer.acks_since(50, 30)
        survivors = set().union(*(_process_tree(fleet.nodes[n].pid) for n in ("p1", "p2")))
        assert len([p for p in _accepting_pids(p3, ports) if p in survivors]) >= len(socks)
        for sock in socks:
            sock.settimeout(0.2)
            assert not _closed_by_peer(sock)  # held while p3 is down
        fleet.restart_node("p3")
        fleet.wait_healthy(60)
        for sock in socks:
            assert _wait(lambda: _closed_by_peer(sock), 20, "a stand-in's client handed back")
        _wait(lambda: not any(p in survivors for p in _accepting_pids(p3, ports)), 20,
              "no connection to p3's address left on a survivor")
        back = [_api_versions(p3, 9092) for _ in socks]
        assert all(back)
        mine = _process_tree(fleet.nodes["p3"].pid)
        pids = _accepting_pids(p3, ports)
        assert len([p for p in pids if p in mine]) >= len(back) and set(pids) <= mine, (pids, mine)
        assert fleet.status("p3").connections >= len(back)
        producer.acks_since(50, 30)
        for sock in back:
            assert sock is not None
            sock.close()
    finally:
        for sock in socks:
            sock.close()
        producer.stop_flag.set()
        producer.join(90)
    assert not producer.is_alive()
    assert producer.errors == []
    acked = set(producer.acked)
    got = clients.consume("confluent", fleet.bootstrap_servers, topic_name, f"g-{topic_name}", len(acked) + 1,
                          timeout=90)
    values = [c.value for c in got]
    assert acked <= set(values), f"lost: {sorted(acked - set(values))[:10]}"
    fleet.wait_balanced(30)


def test_cluster_commands_through_any_admin_endpoint(fleet):
    """`cluster ... --admin URL`: one node's admin endpoint is enough to see and act on the fleet."""
    from chaos.testbed.proxies import read_env

    runner = CliRunner()
    url = fleet.nodes["p2"].admin_url
    fleet.wait_balanced(30)
    local = json.loads(runner.invoke(cli, ["cluster", "status", "--state-dir", str(fleet.state_dir), "--json"]).output)
    result = runner.invoke(cli, ["cluster", "status", "--admin", url, "--json"])
    assert result.exit_code == 0, result.output
    remote = json.loads(result.output)
    assert remote["healthy"] is True and remote["problems"] == []
    assert (remote["epoch"], remote["leader"], remote["assignment"]) == (
        local["epoch"], local["leader"], local["assignment"])
    assert [(n["id"], n["address"], n["alive"], n["identities"]) for n in remote["nodes"]] == [
        (n["id"], n["address"], n["alive"], n["identities"]) for n in local["nodes"]]
    assert remote["bootstrap"] == fleet.bootstrap
    assert runner.invoke(cli, ["cluster", "status"]).exit_code == 2  # neither --state-dir nor --admin
    nowhere = runner.invoke(cli, ["cluster", "status", "--admin", "http://127.0.0.1:9"])
    assert nowhere.exit_code == 2 and "no fleet status" in nowhere.output
    # Actions need the fleet's token; without it nothing moves.
    no_token = runner.invoke(cli, ["cluster", "drain", "p3", "--admin", url, "--token-env", "KPROXY_TEST_NO_TOKEN"],
                             env={"KPROXY_TEST_NO_TOKEN": ""})
    assert no_token.exit_code == 2 and "no admin token" in no_token.output
    wrong = runner.invoke(cli, ["cluster", "drain", "p3", "--admin", url], env={"KPROXY_ADMIN_TOKEN": "wrong"})
    assert wrong.exit_code == 2 and "401" in wrong.output
    assert fleet.fleet_view().assignment == local["assignment"]
    env = {"KPROXY_ADMIN_TOKEN": read_env(fleet.config_path)["KPROXY_ADMIN_TOKEN"]}
    result = runner.invoke(cli, ["cluster", "drain", "p3", "--admin", url], env=env)
    assert result.exit_code == 0, result.output
    assert "p3" not in fleet.fleet_view().assignment.values()
    assert runner.invoke(cli, ["cluster", "undrain", "p3", "--admin", url], env=env).exit_code == 0
    fleet.wait_balanced(30)
    # The drill through the endpoint: the node signals itself (POST /kill); its identities move.
    epoch = fleet.fleet_view().epoch
    result = runner.invoke(cli, ["cluster", "kill-node", "p3", "--admin", url, "--yes"], env=env)
    assert result.exit_code == 0, result.output
    _wait(lambda: not fleet.nodes["p3"].alive(), 10, "p3's process gone")
    view = fleet.wait_healthy(30, allow_dead=True)
    assert view.epoch > epoch and "p3" not in view.assignment.values()
    fleet.restart_node("p3")
    fleet.wait_balanced(30)


class _SteadyProducer(threading.Thread):
    """One idempotent confluent producer, acks=all, producing until stopped; records every ack."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                                  "log_level": 2, "reconnect.backoff.max.ms": 500, "message.timeout.ms": 60000})
        self.topic = topic
        self.acked: list[str] = []
        self.errors: list[str] = []
        self.stop_flag = threading.Event()

    def _cb(self, err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is None:
            self.acked.append(msg.value().decode())
        else:
            self.errors.append(str(err))

    def run(self) -> None:
        i = 0
        while not self.stop_flag.is_set() and i < 100_000:
            self.producer.produce(self.topic, key=str(i).encode(), value=f"9.{i}".encode(), on_delivery=self._cb)
            self.producer.poll(0.01)
            i += 1
        self.producer.flush(60)

    def acks_since(self, n: int, timeout: float) -> None:
        start = len(self.acked)
        _wait(lambda: len(self.acked) >= start + n, timeout, f"{n} more acks")


@pytest.mark.slow
def test_kill_two_nodes_then_last_serves_everything_then_rebalance(fleet, topic_name):
    """SIGKILL the node with the most identities, then a second: the last node serves every
    identity; restart both: identities rebalance. A producer runs throughout; nothing acked is lost."""
    bs = fleet.bootstrap_servers
    clients.produce("confluent", bs, topic_name, 1, prefix=0)
    producer = _SteadyProducer(bs, topic_name)
    producer.start()
    try:
        producer.acks_since(50, 30)
        view = fleet.wait_healthy(30)
        before = view.epoch
        first = max(view.nodes, key=lambda n: (len(n.identities), n.id)).id
        result = CliRunner().invoke(cli, ["cluster", "kill-node", first, "--state-dir", str(fleet.state_dir), "--yes"])
        assert result.exit_code == 0, result.output
        moved = _wait(lambda: (v := fleet.fleet_view()).epoch > before and first not in v.assignment.values()
                      and v, 10, "identities moved off the first victim")
        assert len(set(moved.assignment.values())) == 2
        # Address takeover: the dead node's bootstrap port is served by both survivors, each
        # identity port by that identity's new owner; clients that kept the address get through.
        dead = fleet.node_address(first)
        standing = _wait(lambda: sorted(a for n in fleet.fleet_view().nodes for a in n.standing_in)
                         if all(n.standing_in for n in fleet.fleet_view().nodes if n.id != first) else None,
                         10, f"survivors standing in for {first}")
        assert standing == sorted([f"{dead}:9092"] * 2 + [f"{dead}:{9100 + b}" for b in (1, 2, 3)]), standing
        expected = sorted((int(b), fleet.node_address(owner), 9100 + int(b)) for b, owner in moved.assignment.items())
        for port in (9092, 9101, 9102, 9103):
            assert _metadata_brokers(f"{dead}:{port}") == expected
        status = CliRunner().invoke(cli, ["cluster", "status", "--state-dir", str(fleet.state_dir), "--json"])
        assert status.exit_code == 1  # a node is down: unhealthy
        producer.acks_since(50, 30)

        second = sorted(n for n in fleet.node_ids if n != first)[0]
        last = sorted(n for n in fleet.node_ids if n not in (first, second))[0]
        fleet.signal_node(second, "KILL")
        # No quorum any more: after its lease the last node advertises itself for everything.
        _wait(lambda: set(fleet.status(last).assignment.values()) == {last}, 15,
              f"{last} advertising every identity")
        assert _metadata_brokers(f"{fleet.node_address(last)}:9092") == [
            (b, fleet.node_address(last), 9100 + b) for b in (1, 2, 3)]
        producer.acks_since(50, 60)

        fleet.restart_node(first)
        fleet.restart_node(second)
        healed = fleet.wait_healthy(60)
        _wait(lambda: len(set(fleet.fleet_view().assignment.values())) == 3, 30, "identities rebalanced")
        _wait(lambda: not any(n.standing_in for n in fleet.fleet_view().nodes), 20, "stand-ins released")
        assert healed.leader is not None
        producer.acks_since(50, 30)
    finally:
        producer.stop_flag.set()
        producer.join(90)
    assert not producer.is_alive()
    assert producer.errors == []
    acked = set(producer.acked)
    got = clients.consume("confluent", bs, topic_name, f"g-{topic_name}", len(acked) + 1, timeout=90)
    values = [c.value for c in got]
    assert acked <= set(values), f"lost: {sorted(acked - set(values))[:10]}"
    assert len(values) == len(set(values)), "duplicates"
