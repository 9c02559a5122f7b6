"""MemberConfig validation and the heartbeat's socket-free logic."""

from __future__ import annotations

import pytest

from membership.config import ConfigError, MemberConfig, MemberSpec
from membership.heartbeat import Heartbeat
from membership.liveness import Beat, decode, encode, heartbeat_key
from topology import PortScheme, ProxyNode

pytestmark = pytest.mark.unit


def specs():
    return [
        MemberSpec(ProxyNode("p1", "127.0.0.11", 9092), "127.0.0.11", 7001),
        MemberSpec(ProxyNode("p2", "127.0.0.12", 9092), "127.0.0.12", 7001),
    ]


def make(**kw):
    kw.setdefault("node_id", "p1")
    kw.setdefault("members", specs())
    kw.setdefault("password", "pw")
    return MemberConfig(**kw)


def test_password_is_required_and_named():
    for bad in (None, ""):
        with pytest.raises(ConfigError) as exc:
            make(password=bad)
        assert exc.value.field == "password"
        assert "password" in str(exc.value) and "required" in str(exc.value)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"raft_min_timeout": 0.15}, "raft_min_timeout"),  # < heartbeat_interval 0.2
        ({"raft_backstop_timeout": 2.25}, "raft_backstop_timeout"),  # not > 3 * 0.75
        ({"raft_backstop_timeout": 0.8, "append_entries_period": 0.2}, "raft_backstop_timeout"),  # not > 0.6 + 0.2
        ({"raft_max_timeout": 0.3}, "raft_max_timeout"),  # not > min 0.3
        ({"connection_timeout": 0.5}, "connection_timeout"),  # < max 0.6
        ({"leader_fallback_timeout": 1.5}, "leader_fallback_timeout"),  # not > 2 * 0.75
        ({"heartbeat_interval": 0.15}, "heartbeat_interval"),  # < autotick 0.2
        ({"suspect_timeout": 0.55}, "suspect_timeout"),  # < 3 * 0.2
        ({"quorum_lease": 1.0}, "quorum_lease"),  # < 2 * 0.6
        ({"commit_timeout": 0.5}, "commit_timeout"),  # not > 0.6
        ({"rebalance_delay": -1}, "rebalance_delay"),
        ({"append_entries_period": 0}, "append_entries_period"),
        ({"node_id": "p9"}, "node_id"),
    ],
)
def test_timeout_relationships(changes, field):
    with pytest.raises(ConfigError) as exc:
        make(**changes)
    assert exc.value.field == field


def test_member_table_checks():
    dup = [*specs(), MemberSpec(ProxyNode("p1", "127.0.0.13", 9092), "127.0.0.13", 7001)]
    with pytest.raises(ConfigError, match="duplicate"):
        make(members=dup)
    same_raft = [specs()[0], MemberSpec(ProxyNode("p2", "127.0.0.12", 9092), "127.0.0.11", 7001)]
    with pytest.raises(ConfigError, match="Raft address"):
        make(members=same_raft)
    same_bootstrap = [specs()[0], MemberSpec(ProxyNode("p2", "127.0.0.11", 9092), "127.0.0.12", 7001)]
    with pytest.raises(ConfigError, match="9092"):
        make(members=same_bootstrap)
    # Heartbeat defaults to the Raft port number; an explicit one may clash with a peer's.
    clash = [
        MemberSpec(ProxyNode("p1", "h1", 9092), "127.0.0.11", 7001, heartbeat_port=7002),
        MemberSpec(ProxyNode("p2", "h2", 9092), "127.0.0.11", 7002),
    ]
    with pytest.raises(ConfigError, match="heartbeat"):
        make(members=clash)


def test_dict_round_trip():
    members = [
        MemberSpec(ProxyNode("p1", "127.0.0.11", 9092, "r1", PortScheme.explicit_map({1: 7100}, base=8000)),
                   "127.0.0.11", 7001, heartbeat_port=7002),
        specs()[1],
    ]
    cfg = make(members=members, suspect_timeout=0.9)
    again = MemberConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert MemberConfig.from_dict(cfg.to_dict(), node_id="p2").me.id == "p2"
    data = cfg.to_dict()
    data["bogus"] = 1
    with pytest.raises(ConfigError) as exc:
        MemberConfig.from_dict(data)
    assert exc.value.field == "bogus"
    data = cfg.to_dict()
    data["suspect_timout"] = 1.0
    with pytest.raises(ConfigError) as exc:
        MemberConfig.from_dict(data)
    assert exc.value.field == "suspect_timout" and "did you mean 'suspect_timeout'?" in str(exc.value)
    data = cfg.to_dict()
    data["members"][0]["raft_prot"] = 1
    with pytest.raises(ConfigError) as exc:
        MemberConfig.from_dict(data)
    assert exc.value.field == "members[0].raft_prot" and "did you mean 'raft_port'?" in str(exc.value)


def test_heartbeat_codec():
    key = heartbeat_key("pw")
    data = encode(key, "p1", b"12345678", 42)
    assert decode(key, data) == Beat("p1", b"12345678", 42, True)
    assert decode(heartbeat_key("other"), data) is None
    tampered = bytearray(data)
    tampered[-20] ^= 1
    assert decode(key, bytes(tampered)) is None
    assert decode(key, data[:10]) is None
    assert decode(key, b"garbage" * 10) is None


def test_heartbeat_liveness_rules():
    hb = Heartbeat("a", ("127.0.0.1", 1), {"b": ("127.0.0.2", 1), "c": ("127.0.0.3", 1)},
                   "pw", interval=0.1, suspect_timeout=1.0)
    key = heartbeat_key("pw")
    assert hb.live(0.0) == {"a"}
    hb.receive(encode(key, "b", b"inc-0001", 1), "127.0.0.2", now=10.0)
    assert hb.live(10.5) == {"a", "b"}
    assert hb.live(11.0) == {"a", "b"}  # exactly the timeout: still live
    assert hb.live(11.01) == {"a"}  # silence past the timeout
    # A refusal (the peer's port is closed: its process died) kills at once...
    hb.receive(encode(key, "b", b"inc-0001", 2), "127.0.0.2", now=20.0)
    hb.view.refused("b", 20.1)
    assert hb.live(20.2) == {"a"}
    # ...until the peer is heard again (restarted: a new incarnation, seq from 1).
    hb.receive(encode(key, "b", b"inc-0002", 1), "127.0.0.2", now=20.5)
    assert hb.live(20.6) == {"a", "b"}
    # Replays and reorders within an incarnation are no news.
    hb.receive(encode(key, "b", b"inc-0002", 1), "127.0.0.2", now=30.0)
    assert not hb.is_live("b", 30.0)
    # Wrong origin host, unknown node, wrong key: rejected.
    hb.receive(encode(key, "c", b"inc-0001", 1), "127.0.0.9", now=40.0)
    hb.receive(encode(key, "zz", b"inc-0001", 1), "127.0.0.3", now=40.0)
    hb.receive(encode(heartbeat_key("x"), "c", b"inc-0001", 1), "127.0.0.3", now=40.0)
    assert hb.live(40.0) == {"a"} and hb.rejected == 3
    assert hb.has_heard("b") and not hb.has_heard("c")


def test_syncobj_conf_is_what_the_design_asks_of_pysyncobj():
    """DESIGN §9: a password (pickle on the wire), the member's own bind address (not 0.0.0.0),
    no batching (~100 ms per commit), dynamic membership (live add-node/remove-node), and the tuned timeouts, not pysyncobj's
    defaults (leaderFallbackTimeout 30 s, connectionRetryTime 5 s)."""
    from membership.raft import syncobj_conf

    config = make()
    conf = syncobj_conf(config)
    assert conf.password == "pw"
    assert conf.bindAddress == "127.0.0.11:7001" == config.me.raft_address
    assert conf.appendEntriesUseBatch is False and conf.dynamicMembershipChange is True  # live membership (membership.roster)
    # pysyncobj's election timer is the backstop (membership.election): 3 to 4.5 s.
    assert (conf.raftMinTimeout, conf.raftMaxTimeout) == (3.0, 4.5) == (config.raft_backstop_timeout, 4.5)
    assert conf.appendEntriesPeriod == config.append_entries_period == 0.75
    assert conf.connectionTimeout == 4.5  # pysyncobj: >= its election timeout
    assert conf.connectionRetryTime == config.connection_retry_time <= 0.25
    assert conf.leaderFallbackTimeout == config.leader_fallback_timeout == 2.25  # 3 idle append_entries


def test_an_idle_leader_sends_append_entries_rarely_and_the_backstop_follows():
    """The leader's beat holds elections off, so an idle leader's append_entries are 0.75 s
    apart and pysyncobj's own election timeout is 4 of them (at least two beats after the last
    follower's election); while a peer from before the
    leader's beat is in the fleet, the leader sends them as often as that peer's election
    timeout (raft_min_timeout) needs: under a third of it."""
    config = make()
    assert (config.append_entries_period, config.raft_backstop_timeout) == (0.75, 3.0)
    assert config.legacy_append_entries_period == pytest.approx(0.3 / 3.5, abs=1e-4)
    fast = make(append_entries_period=0.25)  # the backstop stays behind the beat's last election (0.6 + 2 beats of 0.2)
    assert (fast.raft_backstop_timeout, fast.leader_fallback_timeout) == (1.0, 1.0)
