"""proxy.admission: the node cap, the per-source token bucket and the log throttle, on a fake clock."""

from __future__ import annotations

import asyncio
import logging

import pytest
import uvloop

from proxy.admission import FORGET_LOG_S, LOG_INTERVAL_S, PRUNE_INTERVAL_S, Admission, RefusalReason
from tests.waiting import until

pytestmark = [pytest.mark.unit]


def test_the_node_cap_refuses_only_beyond_it() -> None:
    a = Admission(max_connections=3, accepts_per_source_per_s=0)
    assert a.admit("10.0.0.1", 0, 0.0) is None
    assert a.admit("10.0.0.1", 2, 0.0) is None
    refusal = a.admit("10.0.0.2", 3, 0.0)
    assert refusal is not None and refusal.reason is RefusalReason.NODE_CAP and refusal.source == "10.0.0.2"
    assert a.admit("10.0.0.2", 2, 0.0) is None  # one closed meanwhile: room again
    assert a.refused == {RefusalReason.NODE_CAP: 1, RefusalReason.SOURCE_RATE: 0}


def test_a_source_gets_one_seconds_worth_at_once_then_the_rate() -> None:
    a = Admission(max_connections=1000, accepts_per_source_per_s=5)
    taken = [a.admit("10.0.0.1", 0, 0.0) is None for _ in range(8)]
    assert taken == [True] * 5 + [False] * 3
    assert a.admit("10.0.0.1", 0, 0.1) is not None  # half a token back: not enough
    assert a.admit("10.0.0.1", 0, 0.2) is None  # one token (0.2 s x 5/s)
    assert a.admit("10.0.0.1", 0, 0.2) is not None
    # Another source has its own bucket.
    assert all(a.admit("10.0.0.2", 0, 0.2) is None for _ in range(5))
    # A long pause refills to one second's worth, never more.
    assert [a.admit("10.0.0.1", 0, 100.0) is None for _ in range(6)] == [True] * 5 + [False]
    assert a.refused[RefusalReason.SOURCE_RATE] == 3 + 1 + 1 + 1


def test_the_source_rate_is_checked_before_the_cap_and_zero_turns_it_off() -> None:
    a = Admission(max_connections=1, accepts_per_source_per_s=1)
    assert a.admit("s", 0, 0.0) is None
    r = a.admit("s", 1, 0.0)
    assert r is not None and r.reason is RefusalReason.SOURCE_RATE
    off = Admission(max_connections=10_000, accepts_per_source_per_s=0)
    assert all(off.admit("s", 0, 0.0) is None for _ in range(5000))
    assert off.tracked_sources == 0


def test_refusals_are_logged_once_per_source_and_interval_with_the_count() -> None:
    a = Admission(max_connections=1, accepts_per_source_per_s=0)
    first = a.admit("s1", 1, 0.0)
    assert first is not None and first.log and first.refused_since_log == 1
    quiet = [a.admit("s1", 1, t) for t in (1.0, 2.0, 3.0)]
    assert [r.log for r in quiet if r] == [False, False, False]
    other = a.admit("s2", 1, 3.0)  # another source logs its own line
    assert other is not None and other.log
    again = a.admit("s1", 1, LOG_INTERVAL_S)
    assert again is not None and again.log and again.refused_since_log == 4  # 3 quiet ones + this one
    after = a.admit("s1", 1, LOG_INTERVAL_S + 1)
    assert after is not None and not after.log and after.refused_since_log == 1


def test_full_buckets_and_quiet_log_states_are_forgotten() -> None:
    a = Admission(max_connections=1, accepts_per_source_per_s=10)
    for i in range(100):
        assert a.admit(f"10.0.{i}.1", 0, 0.0) is None
    a.admit("busy", 0, 0.0)
    assert a.tracked_sources == 101
    for _ in range(9):
        a.admit("busy", 0, PRUNE_INTERVAL_S - 0.5)  # tokens left: 10 -1 ... refilled, then 9 taken
    assert a.admit("busy", 0, PRUNE_INTERVAL_S) is None
    assert a.tracked_sources == 1  # only "busy" is not full
    refused = a.admit("x", 1, PRUNE_INTERVAL_S + 1)
    assert refused is not None and refused.log
    assert a.admit("x", 1, PRUNE_INTERVAL_S + 2) is not None  # counted, not logged yet
    # Quiet past FORGET_LOG_S: the next refusal is a new first line.
    later = PRUNE_INTERVAL_S + 2 + FORGET_LOG_S + PRUNE_INTERVAL_S
    a.admit("y", 0, later)  # any call lets it prune
    fresh = a.admit("x", 1, later + 0.1)
    assert fresh is not None and fresh.log and fresh.refused_since_log == 1


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError):
        Admission(max_connections=0, accepts_per_source_per_s=1)
    with pytest.raises(ValueError):
        Admission(max_connections=1, accepts_per_source_per_s=-1)


# ------------------------------------------------------ the shell: accept path
def test_listen_backlog_is_capped_by_somaxconn_and_the_cap_logged(tmp_path, caplog) -> None:
    from proxy.listeners import listen_backlog, somaxconn

    path = tmp_path / "somaxconn"
    path.write_text("128\n")
    assert somaxconn(str(path)) == 128
    assert somaxconn(str(tmp_path / "absent")) is None
    with caplog.at_level(logging.WARNING, logger="kproxy.proxy"):
        assert listen_backlog(4096, 128) == 128
    [record] = caplog.records
    assert (record.listen_backlog, record.somaxconn) == (4096, 128)  # type: ignore[attr-defined]
    caplog.clear()
    assert listen_backlog(100, 4096) == 100
    assert listen_backlog(4096, None) == 4096
    assert not caplog.records


async def _refused(port: int) -> bool:
    """Connect; True if the proxy closed the connection without a byte."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True
    finally:
        writer.close()


def _refused_metric(metrics, reason: str) -> float:  # type: ignore[no-untyped-def]
    line = f'kproxy_connections_refused_total{{node="t",reason="{reason}"}} '
    return next(float(x[len(line):]) for x in metrics.render().decode().splitlines() if x.startswith(line))


def test_beyond_the_node_cap_a_connection_is_closed_at_once_and_the_others_stay(caplog) -> None:
    from membership.serving import BOOTSTRAP
    from proxy.config import Limits
    from proxy.connection import ClientSide
    from proxy.drain import NodeDrain
    from proxy.metrics import ProxyMetrics
    from proxy.registry import ConnectionRegistry

    async def scenario() -> None:
        registry = ConnectionRegistry("t", Limits(max_connections=2, accepts_per_source_per_s=0),
                                      ProxyMetrics("t"), None, NodeDrain(takeover=False))
        upstream_asked = []

        async def connect(pair) -> None:  # type: ignore[no-untyped-def]
            upstream_asked.append(pair)  # no broker here: the pair stays paused, open

        registry.connect = connect
        server = await asyncio.get_running_loop().create_server(lambda: ClientSide(registry, BOOTSTRAP),
                                                                "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await until(lambda: len(registry.pairs) == 2, "two connections admitted")
        assert [await _refused(port) for _ in range(3)] == [True] * 3
        assert len(registry.pairs) == 2 and not any(p.closed for p in registry.pairs)
        for _, writer in kept:  # a request: each asks for its broker connection
            writer.write(b"\0\0\0\x0a")
        await until(lambda: len(upstream_asked) == 2, "the admitted connections ask for a broker connection")
        assert set(upstream_asked) == registry.pairs  # a refused connection never reaches the upstream side
        assert _refused_metric(registry.metrics, "max_connections") == 3
        assert _refused_metric(registry.metrics, "accepts_per_source_per_s") == 0
        kept[0][1].close()
        await until(lambda: len(registry.pairs) == 1, "the closed client discarded")
        again = await asyncio.open_connection("127.0.0.1", port)  # room again
        await until(lambda: len(registry.pairs) == 2, "the new connection admitted")
        for _, writer in (kept[1], again):
            writer.close()
        server.close()
        await registry.stop()

    with caplog.at_level(logging.WARNING, logger="kproxy.proxy"):
        uvloop.run(scenario())
    refusals = [r for r in caplog.records if r.getMessage() == "refusing new client connections"]
    assert len(refusals) == 1  # three refused, one line
    assert refusals[0].limit_name == "limits.max_connections" and refusals[0].limit == 2  # type: ignore[attr-defined]


def test_client_capacity_raises_the_soft_descriptor_limit_and_caps_the_node(monkeypatch, caplog) -> None:
    from proxy import listeners

    limits = {"now": (1000, 5000)}
    monkeypatch.setattr(listeners.resource, "getrlimit", lambda which: limits["now"])

    def setrlimit(which, value) -> None:  # type: ignore[no-untyped-def]
        limits["now"] = value

    monkeypatch.setattr(listeners.resource, "setrlimit", setrlimit)
    allowed = (5000 - listeners.RESERVED_DESCRIPTORS) // 2
    with caplog.at_level(logging.INFO, logger="kproxy.proxy"):
        assert listeners.client_capacity(100) == 100
        assert limits["now"] == (5000, 5000)
        assert not caplog.records
        assert listeners.client_capacity(50_000) == allowed
    [record] = caplog.records
    assert (record.max_connections, record.clients) == (50_000, allowed)  # type: ignore[attr-defined]

    def refuse(which, value) -> None:  # type: ignore[no-untyped-def]
        raise ValueError("not allowed")

    limits["now"] = (1000, 5000)
    monkeypatch.setattr(listeners.resource, "setrlimit", refuse)
    assert listeners.client_capacity(50_000) == (1000 - listeners.RESERVED_DESCRIPTORS) // 2


@pytest.mark.parametrize(("max_connections", "workers", "share"), [
    (50_000, 1, 50_000), (50_000, 2, 25_000), (10_001, 2, 5001), (1, 2, 1), (7, 3, 3)])
def test_a_worker_admits_its_share_of_the_node_cap_rounded_up(max_connections, workers, share) -> None:
    from proxy.listeners import worker_share

    assert worker_share(max_connections, workers) == share
    assert max_connections <= workers * share < max_connections + workers


def test_client_capacity_of_a_worker_is_its_share_within_its_own_descriptor_limit(monkeypatch) -> None:
    from proxy import listeners

    monkeypatch.setattr(listeners.resource, "getrlimit", lambda which: (20_000, 20_000))
    per_process = (20_000 - listeners.RESERVED_DESCRIPTORS) // 2  # 9,872: the container's cap
    assert listeners.client_capacity(50_000, 1) == per_process
    assert listeners.client_capacity(50_000, 2) == per_process  # each worker's own limit
    assert listeners.client_capacity(10_000, 2) == 5000  # the node's 10,000, half each
    assert listeners.client_capacity(10_000, 1) == per_process
