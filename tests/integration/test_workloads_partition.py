"""The partition fault's mechanism on this machine: nftables drops every packet of one loopback address.

Skipped (with the reason) where nft or CAP_NET_ADMIN is missing, exactly as the partition drill is.
"""

from __future__ import annotations

import socket
import threading

import pytest

from chaos.drills.netfault import Partition, PartitionError, partition_support

pytestmark = pytest.mark.integration

ADDRESS = "127.0.0.250"  # no proxy, Kafka or test uses it


@pytest.fixture
def supported():
    ok, why = partition_support()
    if not ok:
        pytest.skip(f"partition fault unavailable here: {why}")


def _connect(port: int, timeout_s: float) -> str:
    try:
        with socket.create_connection((ADDRESS, port), timeout=timeout_s) as s:
            s.sendall(b"x")
        return "connected"
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"


def test_partition_silently_drops_new_and_established_connections(supported):
    with socket.socket() as server:
        server.bind((ADDRESS, 0))
        server.listen(8)
        port = server.getsockname()[1]
        accepted: list[socket.socket] = []
        acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
        acceptor.start()
        established = socket.create_connection((ADDRESS, port), timeout=2)
        acceptor.join(5)
        (peer,) = accepted
        peer.settimeout(1.0)
        cut = Partition(ADDRESS)
        try:
            cut.apply()
            # A new connection hangs (no RST): the client only learns by its own timeout.
            assert _connect(port, 1.0) == "timeout"
            # An established connection goes silent too.
            established.sendall(b"ping")
            with pytest.raises(TimeoutError):
                peer.recv(4)
        finally:
            cut.heal()
        cut.heal()  # idempotent
        # Healed: TCP retransmits the held-back bytes, new connections work.
        peer.settimeout(10.0)
        assert peer.recv(4) == b"ping"
        assert _connect(port, 2.0) == "connected"
        established.close()
        peer.close()


def test_partition_refuses_the_shared_address():
    with pytest.raises(PartitionError):
        Partition("127.0.0.1")
