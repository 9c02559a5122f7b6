"""LocalFleet.wait_steady: what a drill waits for before its next fault. No processes: the
waits it is made of are replaced by recorders."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.testbed.fleet import LocalFleet

pytestmark = pytest.mark.unit


class Recording(LocalFleet):
    def __init__(self, hosts: object | None) -> None:
        super().__init__(Path("/nonexistent"), Path("/nonexistent/fleet.toml"), [], None, [], hosts)  # type: ignore[arg-type]
        self.calls: list[tuple[str, float]] = []

    def wait_balanced(self, timeout: float = 30.0):  # type: ignore[override]
        self.calls.append(("balanced", timeout))
        return "view"

    def wait_addresses_settled(self, timeout: float) -> None:
        self.calls.append(("addresses", timeout))


def test_on_emulated_hosts_steady_waits_for_every_address_back_on_its_node_after_the_balance():
    fleet = Recording(hosts=object())
    assert fleet.wait_steady(20.0) == "view"
    assert [name for name, _ in fleet.calls] == ["balanced", "addresses"]
    assert fleet.calls[0][1] == 20.0 and 0 < fleet.calls[1][1] <= 20.0  # one deadline for both


def test_on_loopback_steady_is_balanced():
    fleet = Recording(hosts=None)
    assert fleet.wait_steady(20.0) == "view"
    assert fleet.calls == [("balanced", 20.0)]
