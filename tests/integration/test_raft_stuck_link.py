"""``membership.raft.stuck_backoff`` against the kernel: a connection whose segments are dropped
backs its retransmission timer off, and the helper says so; once they flow again it does not.

Runs in a network namespace of its own (``unshare -n``: its own loopback, nothing else can reach
it or be reached from it) with an nftables rule dropping the server's inbound segments; skips
with the reason where either cannot be had (not root, no ``unshare`` or ``nft``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SCRIPT = textwrap.dedent("""
    import json, socket, subprocess, time
    from membership.raft import STUCK_BACKOFF, stuck_backoff

    def nft(*args):
        subprocess.run(["nft", *args], check=True, capture_output=True, timeout=10)

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    peer, _ = server.accept()
    client.sendall(b"x"); assert peer.recv(1) == b"x"
    healthy = stuck_backoff(client)
    nft("add", "table", "inet", "t")
    nft("add", "chain", "inet", "t", "in", "{ type filter hook input priority 0; }")
    nft("add", "rule", "inet", "t", "in", "tcp", "dport", str(port), "drop")
    client.sendall(b"y" * 100)
    deadline, seen = time.monotonic() + 10, 0
    while time.monotonic() < deadline and not seen:
        time.sleep(0.05)
        seen = stuck_backoff(client)
    nft("delete", "table", "inet", "t")
    print(json.dumps({"healthy": healthy, "stuck": seen, "threshold": STUCK_BACKOFF,
                      "stuck_after_s": round(10 - (deadline - time.monotonic()), 2)}))
""")


def test_a_connection_whose_segments_are_dropped_is_seen_stuck_and_a_healthy_one_is_not():
    missing = [t for t in ("unshare", "nft", "ip") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace and an nftables rule of its own)")
    proc = subprocess.run(["unshare", "-n", sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=40, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if proc.returncode != 0 and "unshare" in proc.stderr and "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot make a network namespace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["healthy"] == 0
    assert result["stuck"] >= result["threshold"], result
