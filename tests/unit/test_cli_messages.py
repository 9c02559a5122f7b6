"""What an operator reads: messages without Python reprs, one exit code per kind of failure.

The admin endpoint is a real ``proxy.admin.AdminServer`` on loopback answering a canned status,
so the CLI's discovery, token and node checks run for real without a fleet.
"""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from cli.main import cli
from proxy.admin import AdminServer
from proxy.logs import describe_error
from tests.unit.test_status import node_json

pytestmark = pytest.mark.unit

TOKEN = "the-right-token"
REPR_MARKERS = ("Error(", "Exception(", "[Errno")


@pytest.fixture
def admin_url():
    drained: list[str] = []
    holder: dict[str, str] = {}

    def status() -> dict:
        d = node_json("p1", role="leader", term=3, epoch=7, assignment={"1": "p1", "2": "p2", "3": "p3"})
        d["admin_endpoints"] = {p: holder["url"] for p in ("p1", "p2", "p3")}
        return d

    def drain(body: dict) -> dict:
        drained.append(body["node"])
        return {"node": body["node"], "epoch": 8}

    server = AdminServer("127.0.0.1", 0, token=TOKEN, status=status, metrics=lambda: b"", ready=lambda: True,
                         actions={"drain": drain})
    holder["url"] = f"http://{server.address}"
    server.start()
    try:
        yield holder["url"], drained
    finally:
        server.stop()


def _no_repr(output: str) -> None:
    for marker in REPR_MARKERS:
        assert marker not in output, output


def test_an_unreachable_admin_endpoint_exits_2_saying_connection_refused():
    result = CliRunner().invoke(cli, ["cluster", "status", "--admin", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "no fleet status from http://127.0.0.1:9: connection refused" in result.output
    _no_repr(result.output)


def test_unknown_node_missing_token_and_wrong_token_all_exit_2(admin_url):
    url, drained = admin_url
    runner = CliRunner()
    unknown = runner.invoke(cli, ["cluster", "drain", "p9", "--admin", url], env={"KPROXY_ADMIN_TOKEN": TOKEN})
    assert unknown.exit_code == 2 and "no node 'p9' in this fleet (nodes: p1, p2, p3)" in unknown.output
    missing = runner.invoke(cli, ["cluster", "drain", "p2", "--admin", url], env={"KPROXY_ADMIN_TOKEN": ""})
    assert missing.exit_code == 2 and "no admin token" in missing.output
    wrong = runner.invoke(cli, ["cluster", "drain", "p2", "--admin", url], env={"KPROXY_ADMIN_TOKEN": "nope"})
    assert wrong.exit_code == 2 and "HTTP 401: missing or wrong bearer token" in wrong.output
    kill = runner.invoke(cli, ["cluster", "kill-node", "p9", "--admin", url, "--yes"])
    assert kill.exit_code == 2 and "no node 'p9'" in kill.output
    for result in (unknown, missing, wrong, kill):
        _no_repr(result.output)
    assert drained == []
    ok = runner.invoke(cli, ["cluster", "drain", "p2", "--admin", url], env={"KPROXY_ADMIN_TOKEN": TOKEN})
    assert ok.exit_code == 0 and "drained p2 at epoch 8" in ok.output
    assert drained == ["p2"]


def test_io_errors_read_as_words():
    assert describe_error(ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")) == "connection refused"
    assert describe_error(TimeoutError()) == "timed out"
    assert describe_error(asyncio.IncompleteReadError(b"ab", 4)) == "connection closed after 2 of 4 bytes"
    assert describe_error(ValueError("bad metadata")) == "bad metadata"
