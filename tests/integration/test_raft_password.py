"""The Raft traffic is authenticated and encrypted (pysyncobj's password): a member with a wrong
password is refused by the others, the same member with the right one joins. Hosts 127.0.0.51-53."""

from __future__ import annotations

import time

import attrs
import pytest

from membership.raft import RaftReplica
from tests.integration.test_raft_inprocess import wait_until
from tests.integration.test_raft_private import _configs, _destroy, election_wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_a_member_with_a_wrong_password_is_refused():
    configs = _configs({"a": "127.0.0.51", "b": "127.0.0.52", "c": "127.0.0.53"})
    rafts = {p: RaftReplica(configs[p]) for p in ("a", "b")}
    intruder = RaftReplica(attrs.evolve(configs["c"], password="not-the-fleet-password"))
    try:
        wait_until("a and b elect a leader", lambda: sorted(r.role() for r in rafts.values()) == ["follower", "leader"],
                   timeout=election_wait(configs["a"]))
        leader = next(p for p, r in rafts.items() if r.role() == "leader")
        # Longer than its own election timeout (the backstop, 3-4.5 s): it never learns the
        # leader, never wins a vote.
        end = time.monotonic() + election_wait(configs["c"]) / 3 + 1.0
        while time.monotonic() < end:
            assert intruder.leader_address() is None, "a member with a wrong password joined the group"
            assert rafts[leader].role() == "leader"
            time.sleep(0.05)
        _destroy(intruder)
        intruder = RaftReplica(configs["c"])  # the same member, the right password
        wait_until("it follows the leader",
                   lambda: intruder.leader_address() == configs[leader].me.raft_address,
                   timeout=election_wait(configs["c"]))
    finally:
        for r in [*rafts.values(), intruder]:
            _destroy(r)
