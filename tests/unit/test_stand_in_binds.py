"""proxy.listeners.Listeners.stand_in: a vacant node's addresses bound together, real sockets on loopback."""

from __future__ import annotations

import asyncio
import logging
import socket

import attrs
import pytest
import uvloop

from membership.serving import BOOTSTRAP, StandIn
from proxy.listeners import Listeners
from proxy.metrics import ProxyMetrics
from proxy.sockets import high_descriptor_floor
from tests.integration.test_raft import free_port
from topology import ProxyNode

pytestmark = [pytest.mark.unit]

UNBINDABLE = "192.0.2.1"  # TEST-NET-1: no address of this host, the bind fails (EADDRNOTAVAIL)


class _Registry:
    """What a listener asks of the node's registry here: its backlog and way of accepting, and
    admission (refused: a connection accepted here is closed at once, the kernel's accept is
    what the test checks)."""

    pairs: set[object] = set()  # no client held: a release hands none back

    def __init__(self, fair_accept: bool) -> None:
        self.limits = attrs.make_class("Limits", ["listen_backlog", "fair_accept"])(128, fair_accept)
        self.metrics = ProxyMetrics("p1")

    @staticmethod
    def admit(source: str) -> bool:
        return False


@pytest.fixture(params=[False, True], ids=["loop-server", "fair-accept"])
def fair_accept(request) -> bool:
    return request.param


def _listeners(fair: bool = False) -> Listeners:
    registry = _Registry(fair)
    return Listeners(ProxyNode("p1", "127.0.0.91", 9092), registry, reuse_port=True,  # type: ignore[arg-type]
                     on_bound=lambda bound: None)


def test_every_bindable_stand_in_is_bound_in_one_call_and_a_failed_one_is_logged_once(caplog, fair_accept) -> None:
    vacant = "127.0.0.92"
    wanted = [StandIn("p1", "p2", BOOTSTRAP, vacant, free_port(vacant)),
              StandIn("p1", "p2", 1, vacant, free_port(vacant)),
              StandIn("p1", "p2", 2, UNBINDABLE, 9102),
              StandIn("p1", "p2", 3, vacant, free_port(vacant))]

    async def main() -> tuple[set[tuple[str, int]], list[bool]]:
        listeners = _listeners(fair_accept)
        await listeners.stand_in(wanted)
        held = set(listeners.takeover.held)
        floor = high_descriptor_floor()
        if floor is not None:  # a killed node releases them first (proxy.sockets.listening_socket)
            assert all(sock.fileno() >= floor for server in listeners._stand_ins.values() for sock in server.sockets)
        reachable = []
        for s in wanted:
            if s.host == UNBINDABLE:
                continue
            with socket.create_connection((s.host, s.port), timeout=2):
                reachable.append(True)
        await listeners.stand_in(wanted)  # the failed one is tried again, not logged again
        await listeners.stand_in([])  # all released
        assert not listeners.takeover.held
        return held, reachable

    with caplog.at_level(logging.WARNING, logger="kproxy.proxy"):
        held, reachable = uvloop.run(main())
    assert held == {("p2", BOOTSTRAP), ("p2", 1), ("p2", 3)}
    assert reachable == [True, True, True]
    failures = [r for r in caplog.records if r.getMessage() == "cannot stand in for a vacant node's address"]
    assert len(failures) == 1 and failures[0].address == f"{UNBINDABLE}:9102"  # type: ignore[attr-defined]


def test_a_stand_in_at_an_ip_address_listens_before_the_call_first_waits(fair_accept) -> None:
    """A client that kept the vacant node's address is not refused while the loop, busy with a
    reconnect storm, gets round to making the server: the socket listens from the call's first
    step, and the kernel completes the client's connect meanwhile (checked without letting the
    loop run again: a blocking connect from the loop's own thread)."""
    vacant = "127.0.0.92"
    port = free_port(vacant)

    async def main() -> int:
        listeners = _listeners(fair_accept)
        task = asyncio.ensure_future(listeners.stand_in([StandIn("p1", "p2", 1, vacant, port)]))
        await asyncio.sleep(0)  # the call's first step, up to its first wait; nothing after it
        assert not task.done()
        with socket.socket() as client:
            client.settimeout(2)
            outcome = client.connect_ex((vacant, port))
        await task
        assert listeners.takeover.held == {("p2", 1)}
        await listeners.stand_in([])
        return outcome

    assert uvloop.run(main()) == 0  # connected (ECONNREFUSED before the change)
