"""Graceful drain at the byte level: one in-process proxy node (127.0.0.22) in front of the real cluster.

When an identity moves away, a client connection is closed at its first idle
moment: never before the responses it waits for are delivered, at once when
nothing is in flight, and requests written during the grace still get answered.
"""

from __future__ import annotations

import asyncio
import datetime
import struct
import time

import pytest
import uvloop
from kio.schema.api_versions.v0.request import ApiVersionsRequest
from kio.schema.fetch.v12.request import FetchPartition, FetchRequest, FetchTopic
from kio.schema.fetch.v12.response import FetchResponse
from kio.schema.heartbeat.v4.request import HeartbeatRequest
from kio.static.primitive import i32Timedelta

from chaos.bench.frames import decode_response, make, request_frame
from membership.serving import ServingMap, StandIn
from proxy import drain as drain_core
from proxy import registry as proxy_registry
from proxy.config import parse, proxy_node
from proxy.datapath import DataPath
from proxy.drain import DrainState, RedirectBudget
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.22"
STAND_IN_HOST = "127.0.0.29"  # a vacant node's address this node stands in on
LONG_POLL_MS = 1500


async def _read_frame(reader: asyncio.StreamReader, timeout: float) -> bytes:
    head = await asyncio.wait_for(reader.readexactly(4), timeout)
    (size,) = struct.unpack(">i", head)
    return head + await asyncio.wait_for(reader.readexactly(size), timeout)


async def _eof_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), timeout) == b""
    except asyncio.TimeoutError:
        return False


async def _until_fetchable(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, topic: str,
                           timeout: float = 15.0) -> None:
    """Until a Fetch of the new topic's partition is answered without error: a leader that does
    not know the partition yet answers the long poll at once, and the test would then drain a
    connection with nothing in flight."""
    deadline = time.monotonic() + timeout
    while True:
        writer.write(_long_poll(topic, 2, wait_ms=0))
        _, body = decode_response(FetchResponse, await _read_frame(reader, 10))
        error = int(body.error_code) or int(body.responses[0].partitions[0].error_code)
        if error == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{topic}: Fetch still answers error {error} after {timeout} s")
        await asyncio.sleep(0.1)  # the next attempt; the condition is checked above


def _long_poll(topic: str, correlation_id: int, wait_ms: int = LONG_POLL_MS) -> bytes:
    """A Fetch at the log end of an empty partition: the broker holds it for ``wait_ms``."""
    body = make(FetchRequest, replica_id=-1, max_wait=i32Timedelta.parse(datetime.timedelta(milliseconds=wait_ms)),
                min_bytes=1, max_bytes=1 << 20, session_epoch=-1,
                topics=(make(FetchTopic, topic=topic, partitions=(
                    make(FetchPartition, partition=0, fetch_offset=0, current_leader_epoch=-1, log_start_offset=-1,
                         partition_max_bytes=1 << 20),)),))
    return request_frame(body, correlation_id)


def _node_config_and_leader(kafka_cluster, topic_name: str):  # type: ignore[no-untyped-def]
    """A one-partition topic; the config of a lone node on HOST; the partition's leader."""
    kafka_cluster.create_topic(topic_name, 1, 3)
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap_servers})

    def led_partition():  # type: ignore[no-untyped-def]
        partition = admin.list_topics(topic_name, timeout=10).topics[topic_name].partitions.get(0)
        return partition if partition is not None and partition.leader >= 0 else None

    # create_topic saw it on one broker; the broker this client asks may learn of it a moment later
    partition = wait_for(led_partition, f"a leader of {topic_name} in this client's metadata", timeout=15, interval=0.1)
    config = parse({"upstream": {"bootstrap": kafka_cluster.bootstrap}, "ports": {"base": 9100},
                    "nodes": [{"id": "p1", "host": HOST, "bootstrap_port": 9092}],
                    "logging": {"level": "WARNING"}})
    return config, partition.leader


def test_drain_closes_each_connection_at_its_first_idle_moment(kafka_cluster, topic_name):
    config, leader = _node_config_and_leader(kafka_cluster, topic_name)
    api_versions = request_frame(make(ApiVersionsRequest), 7)

    async def scenario() -> dict[str, float | bool | int]:
        node = DataPath(config, "p1")
        await node.start()
        try:
            port = proxy_node(config, "p1").address_for(leader)[1]
            busy_r, busy_w = await asyncio.open_connection(HOST, port)
            idle_r, idle_w = await asyncio.open_connection(HOST, port)
            # Both connections work; then the busy one parks a long poll at the broker.
            for r, w in ((busy_r, busy_w), (idle_r, idle_w)):
                w.write(api_versions)
                await _read_frame(r, 10)
            await _until_fetchable(busy_r, busy_w, topic_name)
            busy_w.write(_long_poll(topic_name, 1))
            await busy_w.drain()
            deadline = time.monotonic() + 5
            while sum(p.codec.in_flight for p in node.registry.pairs) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            in_flight = sum(p.codec.in_flight for p in node.registry.pairs)

            t0 = time.monotonic()
            drained = node.drain_identities({leader})
            moving_during = node.status().moving  # the idle one closed at once, the busy one is moving
            # Written during the grace: forwarded and answered before the close.
            busy_w.write(api_versions)
            idle_closed = await _eof_within(idle_r, 0.2)
            idle_s = time.monotonic() - t0
            first = await _read_frame(busy_r, LONG_POLL_MS / 1000 + 5)
            second = await _read_frame(busy_r, 5)
            answered_s = time.monotonic() - t0
            busy_closed = await _eof_within(busy_r, 2)
            closed_s = time.monotonic() - t0
            deadline = time.monotonic() + 5
            while node.registry.pairs and time.monotonic() < deadline:  # the close reaches the registry
                await asyncio.sleep(0.01)
            moving_after = node.status().moving
            cids = sorted(struct.unpack(">i", f[4:8])[0] for f in (first, second))
            fetch = next(f for f in (first, second) if struct.unpack(">i", f[4:8])[0] == 1)
            _, fetch_body = decode_response(FetchResponse, fetch)
            for w in (busy_w, idle_w):
                w.close()
            return {"in_flight": in_flight, "drained": drained, "idle_closed": idle_closed, "idle_s": idle_s,
                    "cids": cids, "answered_s": answered_s, "busy_closed": busy_closed, "closed_s": closed_s,
                    "fetch_error": int(fetch_body.responses[0].partitions[0].error_code),
                    "moving_during": moving_during, "moving_after": moving_after}
        finally:
            await node.stop()

    r = uvloop.run(scenario())
    assert r["in_flight"] == 1 and r["drained"] == 2, r
    assert r["idle_closed"] and r["idle_s"] < 0.2, r  # nothing in flight: closed at once
    assert r["cids"] == [1, 7] and r["fetch_error"] == 0, r  # the long poll and the request sent while draining
    # The long poll was answered by the broker (not cut short), then the connection closed right after.
    assert r["answered_s"] >= drain_core.DRAIN_IDLE_GRACE_S, r
    assert r["busy_closed"] and r["closed_s"] - r["answered_s"] < 0.5, r
    assert (r["moving_during"], r["moving_after"]) == (1, 0), r  # /status "moving": draining, not closed yet


def test_drain_never_closes_over_an_unread_request(kafka_cluster, topic_name):
    """The connection looks idle (nothing in flight) but the client's next request already sits,
    unread, in the proxy's socket. Closing then would lose it (and reset the connection: close()
    with unread bytes sends RST); the drain reads it, delivers its response, and closes after."""
    config, leader = _node_config_and_leader(kafka_cluster, topic_name)

    async def scenario() -> dict[str, object]:
        node = DataPath(config, "p1")
        await node.start()
        try:
            r, w = await asyncio.open_connection(HOST, proxy_node(config, "p1").address_for(leader)[1])
            w.write(request_frame(make(ApiVersionsRequest), 1))
            await _read_frame(r, 10)
            (pair,) = [p for p in node.registry.pairs if p.listener == leader]
            w.write(request_frame(make(ApiVersionsRequest), 2))
            # Without yielding to the loop (so the proxy cannot read it): wait, bounded, until the
            # request is in the proxy's socket; blocking the loop here is the point.
            deadline = time.monotonic() + 2
            while not proxy_registry.unread_bytes(pair.client) and time.monotonic() < deadline:
                time.sleep(0.001)
            unread = proxy_registry.unread_bytes(pair.client)
            idle = pair.codec.idle
            node.drain_identities({leader})
            try:
                frame = await _read_frame(r, 5)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:  # the request was lost
                cid: object = repr(exc)
                closed = True
            else:
                cid = struct.unpack(">i", frame[4:8])[0]
                closed = await _eof_within(r, 2)
            w.close()
            return {"unread": unread, "idle": idle, "cid": cid, "closed": closed,
                    "deferred": node.metrics.drain_deferred._value.get()}
        finally:
            await node.stop()

    result = uvloop.run(scenario())
    assert result["unread"] > 0 and result["idle"], result  # the situation under test
    assert result["cid"] == 2, result  # answered, not lost
    assert result["closed"] and result["deferred"] >= 1, result


def test_group_coordinator_connections_move_last(kafka_cluster, topic_name):
    """A connection that carried group-coordinator requests is drained DRAIN_COORDINATOR_DELAY_S
    after the others (its close sends the client looking for the coordinator, which should
    happen once the client follows the new map), and not at all if the identity comes back
    meanwhile."""
    config, leader = _node_config_and_leader(kafka_cluster, topic_name)
    api_versions = request_frame(make(ApiVersionsRequest), 1)
    heartbeat = request_frame(make(HeartbeatRequest, group_id="kproxy-test-nogroup", generation_id=-1,
                                   member_id="nobody"), 2)

    async def scenario() -> dict[str, object]:
        node = DataPath(config, "p1")
        await node.start()
        try:
            port = proxy_node(config, "p1").address_for(leader)[1]
            conns = {}
            for name, frames in (("plain", [api_versions]), ("group", [api_versions, heartbeat])):
                r, w = await asyncio.open_connection(HOST, port)
                for frame in frames:
                    w.write(frame)
                    await _read_frame(r, 10)  # the broker answers the heartbeat with an error: fine
                conns[name] = (r, w)
            by_port = {p.client.get_extra_info("peername")[1]: p for p in node.registry.pairs}
            pair = {name: by_port[w.get_extra_info("sockname")[1]] for name, (_, w) in conns.items()}
            out: dict[str, object] = {"flags": {name: p.group for name, p in pair.items()}}

            # 1. The identity moves away and comes back within the delay: the group connection stays.
            node.apply_map(ServingMap(epoch=1, owners={leader: "p2"}))  # drains what moved away
            out["due"] = {name: p.drain is not None and p.drain.state is DrainState.DRAIN_DUE
                          for name, p in pair.items()}
            node.apply_map(ServingMap(epoch=2, owners={leader: "p1"}))
            out["plain_closed"] = await _eof_within(conns["plain"][0], 0.5)
            deadline = time.monotonic() + 2
            while pair["group"].drain.state is DrainState.DRAIN_DUE and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            r, w = conns["group"]
            w.write(request_frame(make(ApiVersionsRequest), 3))
            out["stayed_cid"] = struct.unpack(">i", (await _read_frame(r, 5))[4:8])[0]
            out["stayed_draining"] = pair["group"].draining

            # 2. It moves away for good: the group connection goes, after the delay.
            node.apply_map(ServingMap(epoch=3, owners={leader: "p2"}))
            out["open_at_once"] = not pair["group"].closed and pair["group"].drain.state is DrainState.DRAIN_DUE
            out["group_closed"] = await _eof_within(r, 2)
            for _, w in conns.values():
                w.close()
            return out
        finally:
            await node.stop()

    r = uvloop.run(scenario())
    assert r["flags"] == {"plain": False, "group": True}, r
    assert r["due"] == {"plain": False, "group": True}, r  # the plain one drains at once, the group one later
    assert r["plain_closed"], r
    assert r["stayed_cid"] == 3 and not r["stayed_draining"], r  # its identity came back: it stayed and serves
    assert r["open_at_once"] and r["group_closed"], r


def test_group_request_for_an_identity_served_elsewhere_sends_the_client_to_look_it_up(kafka_cluster, topic_name):
    """A connection made to this node for an identity the map gives to another node (the
    address came from an older map: clients keep the coordinator's address from FindCoordinator)
    is served until its first group-coordinator request, which is not forwarded: the connection
    closes with it in flight, and the client looks its coordinator up again. A connection made
    while the node owned the identity is the drain's business, not this rule's; without a group
    request nothing changes; once the identity is back, group requests are forwarded again."""
    config, leader = _node_config_and_leader(kafka_cluster, topic_name)

    def heartbeat(cid: int) -> bytes:
        return request_frame(make(HeartbeatRequest, group_id="kproxy-test-nogroup", generation_id=-1,
                                  member_id="nobody"), cid)

    async def scenario() -> dict[str, object]:
        node = DataPath(config, "p1", fleet=True)
        await node.start()
        try:
            node.apply_map(ServingMap(epoch=1, owners={leader: "p1"}))
            port = proxy_node(config, "p1").address_for(leader)[1]
            out: dict[str, object] = {}
            # Made while this node owns the identity: its heartbeat is answered.
            r, w = await asyncio.open_connection(HOST, port)
            w.write(heartbeat(1))
            out["owned_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            w.close()

            node.apply_map(ServingMap(epoch=2, owners={leader: "p2"}))
            node.registry.redirects = RedirectBudget(limit=1)  # one lookup per host and identity
            redirects0 = node.metrics.coordinator_redirects._value.get()
            # Made after the identity moved on: ApiVersions is served, the heartbeat closes it.
            r, w = await asyncio.open_connection(HOST, port)
            w.write(request_frame(make(ApiVersionsRequest), 2))
            out["elsewhere_api_versions_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            w.write(heartbeat(3))
            out["elsewhere_closed"] = await _eof_within(r, 5)
            out["redirects"] = node.metrics.coordinator_redirects._value.get() - redirects0
            w.close()
            # The same host back again at once, its budget spent by the redirect above: a loop
            # of lookups is not made, the heartbeat is forwarded and answered.
            declined0 = node.metrics.coordinator_redirects_declined._value.get()
            r, w = await asyncio.open_connection(HOST, port)
            w.write(heartbeat(8))
            out["looping_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            out["declined"] = node.metrics.coordinator_redirects_declined._value.get() - declined0
            w.close()
            node.registry.redirects = RedirectBudget()
            # Without a group request such a connection is served on (for DRAIN_ELSEWHERE_S: the
            # next test).
            r, w = await asyncio.open_connection(HOST, port)
            for cid in (4, 5):
                w.write(request_frame(make(ApiVersionsRequest), cid))
                out[f"plain_cid_{cid}"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            w.close()

            # On a stand-in (a vacant node's address) the client reached the right broker: served.
            await node.listeners.stand_in([StandIn("p1", "p9", leader, STAND_IN_HOST, port)])
            r, w = await asyncio.open_connection(STAND_IN_HOST, port)
            w.write(heartbeat(7))
            out["stand_in_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            w.close()
            await node.listeners.stand_in([])

            node.apply_map(ServingMap(epoch=3, owners={leader: "p1"}))
            r, w = await asyncio.open_connection(HOST, port)
            w.write(heartbeat(6))
            out["back_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            w.close()
            return out
        finally:
            await node.stop()

    r = uvloop.run(scenario())
    assert r["owned_cid"] == 1, r
    assert r["elsewhere_api_versions_cid"] == 2 and r["elsewhere_closed"] and r["redirects"] == 1, r
    assert r["looping_cid"] == 8 and r["declined"] == 1, r
    assert r["plain_cid_4"] == 4 and r["plain_cid_5"] == 5, r
    assert r["stand_in_cid"] == 7, r
    assert r["back_cid"] == 6, r


def test_a_connection_made_for_an_identity_served_elsewhere_is_drained_a_while_later(kafka_cluster, topic_name,
                                                                                       monkeypatch):
    """A connection made to this node's own address for an identity the map gives to another
    node (a client reconnecting to an address from an older map; aiokafka and kafka-python keep
    such a connection whatever later Metadata says) is served, then drained DRAIN_ELSEWHERE_S
    later, so that the client reconnects to the owner; one whose identity came back to this
    node meanwhile stays."""
    config, leader = _node_config_and_leader(kafka_cluster, topic_name)
    monkeypatch.setattr(drain_core, "DRAIN_ELSEWHERE_S", 0.5)

    async def scenario() -> dict[str, object]:
        node = DataPath(config, "p1", fleet=True)
        await node.start()
        try:
            port = proxy_node(config, "p1").address_for(leader)[1]
            node.apply_map(ServingMap(epoch=1, owners={leader: "p2"}))
            out: dict[str, object] = {}
            drained0 = node.metrics.drained.labels("p1")._value.get()
            r, w = await asyncio.open_connection(HOST, port)
            t0 = time.monotonic()
            w.write(request_frame(make(ApiVersionsRequest), 1))
            out["served_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            out["closed"] = await _eof_within(r, 5)
            out["closed_after_s"] = time.monotonic() - t0
            out["drained"] = node.metrics.drained.labels("p1")._value.get() - drained0
            w.close()

            # Made while served elsewhere, the identity back here before the delay is over: kept.
            r, w = await asyncio.open_connection(HOST, port)
            w.write(request_frame(make(ApiVersionsRequest), 2))
            out["kept_first_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            node.apply_map(ServingMap(epoch=2, owners={leader: "p1"}))
            out["kept_closed"] = await _eof_within(r, drain_core.DRAIN_ELSEWHERE_S + 1.0)
            w.write(request_frame(make(ApiVersionsRequest), 3))
            out["kept_cid"] = struct.unpack(">i", (await _read_frame(r, 10))[4:8])[0]
            w.close()
            return out
        finally:
            await node.stop()

    r = uvloop.run(scenario())
    assert r["served_cid"] == 1 and r["closed"] and r["drained"] == 1, r
    assert 0.5 <= r["closed_after_s"] < 4.0, r
    assert r["kept_first_cid"] == 2 and not r["kept_closed"] and r["kept_cid"] == 3, r
