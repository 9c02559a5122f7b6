"""The broker roster: new brokers at once, gone ones only after the grace period and two
missed refreshes; a rolling restart (a broker missing for a while) keeps its identity."""

from __future__ import annotations

import pytest

from proxy.broker_roster import BrokerRoster, RosterChange
from proxy.upstream import UpstreamBroker

pytestmark = pytest.mark.unit

B = {i: UpstreamBroker(i, "127.0.0.1", 19090 + i, f"rack-{i}") for i in range(1, 6)}


def listed(*ids: int) -> list[UpstreamBroker]:
    return [B[i] for i in ids]


def test_first_answer_learns_every_broker_and_releases_none():
    roster = BrokerRoster(release_after=30.0)
    change = roster.polled(listed(1, 2, 3), now=0.0)
    assert change == RosterChange(tuple(listed(1, 2, 3)), ())
    assert sorted(roster.brokers) == [1, 2, 3]
    assert not roster.polled(listed(3, 1, 2), now=1.0)  # same set, any order: no change


def test_a_new_broker_is_learnt_at_once():
    roster = BrokerRoster(release_after=30.0)
    roster.polled(listed(1, 2), now=0.0)
    assert roster.polled(listed(1, 2, 3), now=5.0) == RosterChange((B[3],), ())
    moved = UpstreamBroker(3, "127.0.0.9", 19999, "rack-3")
    assert roster.sighted([moved]) == RosterChange((moved,), ())  # a new address is learnt too
    assert roster.brokers[3] == moved


def test_one_missed_poll_never_releases_even_past_the_grace_period():
    roster = BrokerRoster(release_after=1.0)
    roster.polled(listed(1, 2, 3), now=0.0)
    # A refresh interval longer than the grace period: the first miss alone does not count.
    assert roster.polled(listed(1, 2), now=60.0) == RosterChange()
    assert 3 in roster.brokers and roster.missing_for(3, 61.0) == 1.0
    assert roster.polled(listed(1, 2), now=120.0) == RosterChange((), (3,))
    assert sorted(roster.brokers) == [1, 2]


def test_release_waits_for_the_grace_period_whatever_the_number_of_misses():
    roster = BrokerRoster(release_after=30.0)
    roster.polled(listed(1, 2, 3), now=0.0)
    for t in range(1, 31):  # missing from 30 consecutive answers, first missed at t=1
        assert roster.polled(listed(1, 2), now=float(t)).released == ()
    assert roster.missing_for(3, 30.0) == 29.0
    assert roster.polled(listed(1, 2), now=31.0).released == (3,)


def test_a_rolling_restart_shorter_than_the_grace_period_keeps_the_broker():
    roster = BrokerRoster(release_after=30.0)
    roster.polled(listed(1, 2, 3), now=0.0)
    for t in range(1, 20):  # broker 2 restarting for 19 s
        assert roster.polled(listed(1, 3), now=float(t)).released == ()
    assert not roster.polled(listed(1, 2, 3), now=20.0)  # back: nothing to learn, nothing released
    assert roster.missing_for(2, 20.0) == 0.0
    # Its count starts over: missing again for less than the grace period releases nothing.
    for t in range(21, 45):
        assert roster.polled(listed(1, 3), now=float(t)).released == ()
    assert roster.polled(listed(1, 3), now=51.0).released == (2,)


def test_a_partial_sighting_resets_the_count_but_never_releases():
    roster = BrokerRoster(release_after=10.0)
    roster.polled(listed(1, 2, 3), now=0.0)
    roster.polled(listed(1, 2), now=1.0)
    assert roster.sighted(listed(1)) == RosterChange()  # broker 3 not named: a partial answer says nothing
    assert roster.missing_for(3, 5.0) == 4.0
    assert roster.sighted(listed(3)) == RosterChange()  # named by a response passing through: it is there
    assert roster.missing_for(3, 5.0) == 0.0
    assert roster.polled(listed(1, 2), now=12.0).released == ()  # the grace period starts over
    assert roster.polled(listed(1, 2), now=22.0).released == (3,)


def test_an_empty_or_failed_answer_counts_nothing():
    roster = BrokerRoster(release_after=0.0)
    roster.polled(listed(1, 2), now=0.0)
    for t in (1.0, 2.0, 3.0):
        assert roster.polled([], now=t) == RosterChange()
    assert sorted(roster.brokers) == [1, 2]


def test_several_brokers_gone_at_once_are_released_together_and_may_return():
    roster = BrokerRoster(release_after=5.0)
    roster.polled(listed(1, 2, 3, 4), now=0.0)
    roster.polled(listed(1, 2), now=1.0)
    assert roster.polled(listed(1, 2), now=6.0) == RosterChange((), (3, 4))
    assert roster.polled(listed(1, 2, 4), now=7.0) == RosterChange((B[4],), ())  # re-added: a new broker again


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        BrokerRoster(release_after=-1.0)
    with pytest.raises(ValueError):
        BrokerRoster(release_after=1.0, misses_to_release=0)


def test_the_grace_period_is_configured_in_upstream():
    from proxy.config import ConfigError, parse

    base = {"ports": {"base": 9100}, "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092}]}
    assert parse({**base, "upstream": {"bootstrap": ["k:9092"]}}).release_after_s == 300.0
    assert parse({**base, "upstream": {"bootstrap": ["k:9092"], "release_after_s": 30}}).release_after_s == 30.0
    with pytest.raises(ConfigError) as err:
        parse({**base, "upstream": {"bootstrap": ["k:9092"], "release_after_s": -1}})
    assert err.value.field == "upstream.release_after_s"
    with pytest.raises(ConfigError) as err:
        parse({**base, "upstream": {"bootstrap": ["k:9092"], "release_after": 30}})
    assert "release_after_s" in str(err.value)  # the typo's closest known name
