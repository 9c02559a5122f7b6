"""The drain and takeover control cores (proxy.drain, proxy.takeover), driven with a fake clock."""

from __future__ import annotations

import pytest

from membership.serving import BOOTSTRAP, ServingMap, StandIn
from proxy import drain as d
from proxy.drain import (
    Close,
    ConnectionDrain,
    CountDeferred,
    CountDrained,
    DrainEvent,
    DrainState,
    NodeDrain,
    Observation,
    PauseReading,
    ScheduleTimer,
)
from proxy.takeover import Bind, Release, TakeoverReconciler, wanted_stand_ins

pytestmark = pytest.mark.unit

S, E = DrainState, DrainEvent
T0 = 100.0


def obs(*, idle: bool = False, reading: bool = True, done: bool = False, unread: int = 0) -> Observation:
    return Observation(idle=idle, reading=reading, responses_done=done, unread=lambda: unread)


BUSY = obs()
IDLE = obs(idle=True)


def at(state: DrainState) -> ConnectionDrain:
    c = ConnectionDrain()
    c.state = state
    return c


# ------------------------------------------------------------- classify
@pytest.mark.parametrize(("o", "event"), [
    (obs(idle=True), E.IDLE),
    (obs(idle=True, unread=12), E.UNREAD_PENDING),
    (obs(idle=True, reading=False, unread=12), E.IDLE),  # reads stopped: unread bytes are not ours to answer
    (obs(reading=False, done=True), E.RESPONSES_DONE),
    (obs(reading=True, done=True), E.BUSY),  # still reading: a partial request may be on its way
    (obs(), E.BUSY),
])
def test_classify(o: Observation, event: DrainEvent) -> None:
    assert d.classify(o) is event


def test_unread_is_asked_only_when_idle_and_reading() -> None:
    asked: list[int] = []

    def unread() -> int:
        asked.append(1)
        return 0

    d.classify(Observation(idle=False, reading=True, responses_done=False, unread=unread))
    d.classify(Observation(idle=True, reading=False, responses_done=True, unread=unread))
    assert asked == []
    d.classify(Observation(idle=True, reading=True, responses_done=True, unread=unread))
    assert asked == [1]


# ------------------------------------------------------- the table, row by row
def test_start_on_a_busy_connection_counts_and_arms_grace_and_deadline() -> None:
    c = ConnectionDrain()
    actions = c.start(T0, False, BUSY)
    assert c.state is S.DRAINING and c.draining
    assert actions == [CountDrained(), ScheduleTimer(E.IDLE_GRACE_DUE, T0 + 0.25), ScheduleTimer(E.DEADLINE_DUE, T0 + 5.0)]


def test_start_on_an_idle_connection_closes_at_once_without_timers() -> None:
    c = ConnectionDrain()
    assert c.start(T0, False, IDLE) == [CountDrained(), Close(d.DRAINED)]
    assert c.state is S.CLOSED


def test_start_with_a_request_unread_defers_and_arms_timers() -> None:
    c = ConnectionDrain()
    actions = c.start(T0, False, obs(idle=True, unread=40))
    assert actions == [CountDrained(), CountDeferred(), ScheduleTimer(E.IDLE_GRACE_DUE, T0 + d.DRAIN_IDLE_GRACE_S),
                       ScheduleTimer(E.DEADLINE_DUE, T0 + d.DRAIN_TIMEOUT_S)]
    assert c.state is S.DRAINING


def test_group_connection_is_put_off_by_the_coordinator_delay() -> None:
    c = ConnectionDrain()
    assert c.start(T0, True, IDLE) == [ScheduleTimer(E.DELAY_DUE_MOVE, T0 + 0.2)]
    assert c.state is S.DRAIN_DUE and not c.draining
    assert c.start(T0 + 0.1, True, IDLE) == [] and c.state is S.DRAIN_DUE  # already due: once
    assert c.start(T0 + 0.1, False, IDLE) == [] and c.state is S.DRAIN_DUE


def test_delay_due_and_still_to_move_drains() -> None:
    c = at(S.DRAIN_DUE)
    now = T0 + d.DRAIN_COORDINATOR_DELAY_S
    assert c.handle(E.DELAY_DUE_MOVE, now, BUSY) == [
        CountDrained(), ScheduleTimer(E.IDLE_GRACE_DUE, now + 0.25), ScheduleTimer(E.DEADLINE_DUE, now + 5.0)]
    assert c.state is S.DRAINING
    c = at(S.DRAIN_DUE)
    assert c.handle(E.DELAY_DUE_MOVE, now, IDLE) == [CountDrained(), Close(d.DRAINED)]


def test_delay_due_but_kept_serves_on_and_can_drain_later() -> None:
    c = at(S.DRAIN_DUE)
    assert c.handle(E.DELAY_DUE_KEEP, T0) == [] and c.state is S.SERVING
    assert c.start(T0 + 1, True, BUSY) == [ScheduleTimer(E.DELAY_DUE_MOVE, T0 + 1.2)]


@pytest.mark.parametrize("state", [S.DRAINING, S.READS_STOPPED])
def test_progress_while_draining(state: DrainState) -> None:
    c = at(state)
    assert c.progress(T0, BUSY) == [] and c.state is state
    c = at(state)
    reading = state is S.DRAINING  # the shell paused reads on entering READS_STOPPED
    assert c.progress(T0, obs(idle=True, reading=reading, unread=9)) == (
        [CountDeferred()] if reading else [Close(d.DRAINED)])
    c = at(state)
    assert c.progress(T0, IDLE) == [Close(d.DRAINED)] and c.state is S.CLOSED
    c = at(state)
    assert c.progress(T0, obs(reading=False, done=True)) == [Close(d.DRAINED)] and c.state is S.CLOSED


def test_unread_pending_in_reads_stopped_counts_a_deferral() -> None:
    """Reads paused by the shell's flow control and resumed: the table still defers."""
    c = at(S.READS_STOPPED)
    assert c.handle(E.UNREAD_PENDING, T0) == [CountDeferred()] and c.state is S.READS_STOPPED


def test_idle_grace_stops_reads_then_checks() -> None:
    c = at(S.DRAINING)
    assert c.handle(E.IDLE_GRACE_DUE, T0, BUSY) == [PauseReading()] and c.state is S.READS_STOPPED
    c = at(S.DRAINING)
    assert c.handle(E.IDLE_GRACE_DUE, T0, obs(reading=False, done=True)) == [PauseReading(), Close(d.DRAINED)]
    assert c.state is S.CLOSED


@pytest.mark.parametrize("state", [S.DRAINING, S.READS_STOPPED])
def test_deadline_closes_with_a_warning(state: DrainState) -> None:
    c = at(state)
    assert c.handle(E.DEADLINE_DUE, T0) == [Close(d.DEADLINE_REACHED, warning=True)] and c.state is S.CLOSED


@pytest.mark.parametrize("state", [S.SERVING, S.DRAIN_DUE, S.DRAINING, S.READS_STOPPED])
def test_closed_elsewhere_ends_the_machine(state: DrainState) -> None:
    c = at(state)
    assert c.handle(E.CLOSED, T0) == [] and c.state is S.CLOSED


@pytest.mark.parametrize("event", list(DrainEvent))
def test_closed_is_final(event: DrainEvent) -> None:
    c = at(S.CLOSED)
    assert c.handle(event, T0, IDLE) == [] and c.state is S.CLOSED


@pytest.mark.parametrize(("state", "event"), [
    (S.SERVING, E.IDLE_GRACE_DUE), (S.SERVING, E.DEADLINE_DUE), (S.SERVING, E.IDLE), (S.SERVING, E.DELAY_DUE_MOVE),
    (S.DRAIN_DUE, E.IDLE), (S.DRAIN_DUE, E.DEADLINE_DUE),
    (S.DRAINING, E.START), (S.DRAINING, E.START_GROUP), (S.DRAINING, E.DELAY_DUE_KEEP), (S.DRAINING, E.DELAY_DUE_MOVE),
    (S.READS_STOPPED, E.IDLE_GRACE_DUE), (S.READS_STOPPED, E.START), (S.READS_STOPPED, E.BUSY),
])
def test_late_or_repeated_events_change_nothing(state: DrainState, event: DrainEvent) -> None:
    c = at(state)
    assert c.handle(event, T0, IDLE) == [] and c.state is state


def test_every_state_event_pair_has_a_row() -> None:
    assert set(d.TRANSITIONS) == {(s, e) for s in DrainState for e in DrainEvent}


def test_a_long_poll_drains_after_its_response() -> None:
    """The measured story: busy at the start, the grace stops reads, the answer makes it idle."""
    c = ConnectionDrain()
    timers = [a for a in c.start(T0, False, BUSY) if isinstance(a, ScheduleTimer)]
    assert [t.at for t in timers] == [T0 + 0.25, T0 + 5.0]
    assert c.handle(timers[0].event, timers[0].at, BUSY) == [PauseReading()]
    assert c.progress(T0 + 1.5, obs(reading=False, done=True)) == [Close(d.DRAINED)]
    assert c.handle(timers[1].event, timers[1].at) == []  # the deadline after the close: nothing


# ------------------------------------------------------------ the node
def test_node_drain_without_takeover_closes_listeners_now_and_refuses() -> None:
    n = NodeDrain(takeover=False)
    assert n.accepted() == [] and n.connected(T0) == []
    assert n.drain_all(T0) == [d.CloseListeners(T0), d.DrainConnections()]
    assert n.accepted() == [d.Refuse(d.REFUSED_WHILE_DRAINING)]


def test_node_drain_with_takeover_lingers_and_serves_new_connections_a_moment() -> None:
    n = NodeDrain(takeover=True)
    assert n.drain_all(T0) == [d.CloseListeners(T0 + d.DRAIN_LISTENER_LINGER_S), d.DrainConnections()]
    assert n.accepted() == []
    assert n.connected(T0 + 0.5) == [d.DrainAt(T0 + 0.5 + d.DRAIN_NEW_CONNECTION_S)]


def test_a_connection_made_for_an_identity_served_elsewhere_is_moved_a_while_later() -> None:
    """Made on this node's own address for an identity another node serves: drained
    DRAIN_ELSEWHERE_S later if it is still served there then (the shell checks); a draining
    node's own rule comes first; an owned identity's connection is left alone."""
    n = NodeDrain(takeover=True)
    assert n.connected(T0, elsewhere=False) == []
    assert n.connected(T0, elsewhere=True) == [d.DrainAt(T0 + d.DRAIN_ELSEWHERE_S, if_elsewhere=True)]
    assert d.DRAIN_ELSEWHERE_S > d.DRAIN_NEW_CONNECTION_S  # time for the client's metadata refresh
    n.drain_all(T0)
    assert n.connected(T0 + 0.5, elsewhere=True) == [d.DrainAt(T0 + 0.5 + d.DRAIN_NEW_CONNECTION_S)]


def test_node_undrain_rebinds_once() -> None:
    n = NodeDrain(takeover=True)
    assert n.undrain() == []
    n.drain_all(T0)
    assert n.undrain() == [d.Rebind()] and not n.draining
    assert n.connected(T0) == [] and n.undrain() == []


@pytest.mark.parametrize(("draining", "owned_here", "expected"), [
    (False, True, False), (False, False, True), (True, True, True), (True, False, True)])
def test_still_to_move(draining: bool, owned_here: bool, expected: bool) -> None:
    n = NodeDrain(takeover=True)
    n.draining = draining
    assert n.still_to_move(owned_here) is expected


# ------------------------------------------------------------ takeover
def duties() -> ServingMap:
    return ServingMap(epoch=3, owners={1: "p1", 2: "p1", 3: "p2"}, stand_ins=(
        StandIn("p1", "p3", BOOTSTRAP, "127.0.0.13", 9092),
        StandIn("p1", "p3", 1, "127.0.0.13", 9101),
        StandIn("p1", "p3", 2, "127.0.0.13", 9102),
        StandIn("p2", "p3", BOOTSTRAP, "127.0.0.13", 9092),
        StandIn("p2", "p3", 3, "127.0.0.13", 9103)))


def test_wanted_stand_ins_are_the_map_duties_on_listeners_bound_here() -> None:
    wanted = wanted_stand_ins(duties(), "p1", {1}, draining=False)
    assert [(s.vacant, s.listener, s.port) for s in wanted] == [("p3", BOOTSTRAP, 9092), ("p3", 1, 9101)]
    assert wanted_stand_ins(duties(), "p1", {1, 2}, draining=True) == ()
    assert wanted_stand_ins(ServingMap(), "p1", {1}, draining=False) == ()


def test_reconciler_binds_what_is_wanted_and_releases_what_is_not() -> None:
    r = TakeoverReconciler()
    wanted = wanted_stand_ins(duties(), "p1", {1, 2}, draining=False)
    plan = r.plan(wanted)
    assert plan == [Bind(("p3", BOOTSTRAP), "127.0.0.13", 9092), Bind(("p3", 1), "127.0.0.13", 9101),
                    Bind(("p3", 2), "127.0.0.13", 9102)]
    for a in plan:
        r.bound(a.key)
    assert r.plan(wanted) == []  # nothing to do: idempotent
    assert r.plan(wanted[:2]) == [Release(("p3", 2))]
    r.released(("p3", 2))
    assert r.plan(()) == [Release(("p3", BOOTSTRAP)), Release(("p3", 1))]
    assert r.clear() == [Release(("p3", BOOTSTRAP)), Release(("p3", 1))]


def test_a_failed_bind_is_reported_once_per_vacancy_and_retried() -> None:
    r = TakeoverReconciler()
    wanted = wanted_stand_ins(duties(), "p2", {3}, draining=False)
    key = ("p3", BOOTSTRAP)
    assert Bind(key, "127.0.0.13", 9092) in r.plan(wanted)
    assert r.bind_failed(key) is True
    assert Bind(key, "127.0.0.13", 9092) in r.plan(wanted)  # tried again on every reconcile
    assert r.bind_failed(key) is False  # but logged once
    r.plan(())  # the vacancy ended
    r.plan(wanted)
    assert r.bind_failed(key) is True  # a new vacancy logs again


# ------------------------------------------------------- coordinator redirects
def test_a_redirect_budget_is_per_host_and_identity_and_refills_after_its_window() -> None:
    from proxy.drain import RedirectBudget

    budget = RedirectBudget(limit=2, window_s=10.0)
    assert [budget.allow("10.0.0.1", 1, t) for t in (0.0, 1.0, 2.0)] == [True, True, False]
    assert budget.allow("10.0.0.1", 2, 2.0) is True  # another identity: its own budget
    assert budget.allow("10.0.0.2", 1, 2.0) is True  # another host: its own budget
    assert budget.allow("10.0.0.1", 1, 9.9) is False  # the window opened at 0.0 still runs
    assert budget.allow("10.0.0.1", 1, 10.0) is True  # a new window
    assert budget.allow("10.0.0.1", 1, 10.5) is True and budget.allow("10.0.0.1", 1, 11.0) is False


def test_a_redirect_budget_forgets_expired_hosts_when_it_holds_too_many(monkeypatch) -> None:
    from proxy import drain

    monkeypatch.setattr(drain, "REDIRECT_SOURCES_KEPT", 3)
    budget = drain.RedirectBudget(limit=1, window_s=10.0)
    for i in range(3):
        assert budget.allow(f"10.0.0.{i}", 1, 0.0)
    assert budget.allow("10.0.0.9", 1, 5.0)  # full, none expired: kept anyway (4)
    assert len(budget._spent) == 4
    assert budget.allow("10.0.0.10", 1, 12.0)  # the three of t=0 expired: dropped
    assert sorted(budget._spent) == [("10.0.0.10", 1), ("10.0.0.9", 1)]
    assert budget.allow("10.0.0.9", 1, 12.0) is False  # its window (from 5.0) still runs, spent
