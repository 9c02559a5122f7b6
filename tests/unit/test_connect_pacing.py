"""proxy.connect_pacing: a bounded, adaptive number of upstream connects in flight per broker."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from proxy.connect_pacing import Admission, ConnectPacer, ConnectTurns, PacingSettings, pacing_for_workers
from proxy.sockets import first_connection

pytestmark = [pytest.mark.unit]
A, B = ("10.0.0.1", 9092), ("10.0.0.2", 9092)


def _limit_only(**settings: float) -> PacingSettings:
    """No turns above the limit (sparse_reserve 0) unless a test asks for them."""
    return PacingSettings(**{"sparse_reserve": 0, **settings})  # type: ignore[arg-type]


def test_the_initial_limit_is_the_brokers_queue_shared_by_the_workers() -> None:
    assert pacing_for_workers(1).initial == 40
    assert pacing_for_workers(2).initial == 20
    assert pacing_for_workers(64).initial == 2  # never under the floor
    with pytest.raises(ValueError):
        _limit_only(initial=1, floor=2)


def test_beyond_the_limit_waiters_queue_and_start_in_order_as_turns_come_back() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=2, floor=1))
    assert [p.admit(A, w) for w in "abcd"] == [True, True, False, False]
    assert p.admit(B, "x") is Admission.TURN  # another broker has its own turns
    assert (p.in_flight(A), p.waiting(A)) == (2, 2)
    assert p.release(A) == ["c"]
    assert p.release(A) == ["d"]
    assert p.release(A) == [] and p.in_flight(A) == 1


def test_a_newcomer_does_not_jump_the_queue() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=1, floor=1))
    assert p.admit(A, "a") and not p.admit(A, "b")
    p.observe(A, 0.0, 0.01)  # the limit grows to 2, but "b" waits first
    assert p.admit(A, "c") is Admission.QUEUED
    assert p.release(A) == ["b", "c"]


def test_a_withdrawn_waiter_never_gets_a_turn() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=1, floor=1))
    p.admit(A, "a"), p.admit(A, "b"), p.admit(A, "c")
    p.withdraw(A, "b")
    p.withdraw(A, "zz")  # unknown: nothing happens
    assert p.release(A) == ["c"]


def test_busy_sources_take_turns_round_robin_so_one_host_cannot_starve_another() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=1, floor=1, sparse_turns=0))
    assert p.admit(A, "busy-0", "127.0.0.100")
    for i in range(1, 5):
        assert not p.admit(A, f"busy-{i}", "127.0.0.100")
    assert not p.admit(A, "app-0", "127.0.0.1")  # another host, queued after four of the busy one's
    assert not p.admit(A, "app-1", "127.0.0.1")
    assert p.waiting(A) == 6
    started = [w for _ in range(6) for w in p.release(A)]
    assert started == ["busy-1", "app-0", "busy-2", "app-1", "busy-3", "busy-4"]
    assert p.waiting(A) == 0 and p.in_flight(A) == 1


def test_a_host_with_few_connects_waiting_goes_before_the_busy_hosts_round() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=1, floor=1, sparse_turns=2))
    assert p.admit(A, "busy-0", "h1")
    p.admit(A, "few-0", "h0"), p.admit(A, "few-1", "h0")  # a line that fits in its two sparse turns
    assert [w for w in p.release(A)] == ["few-0"]
    for i in range(1, 6):
        p.admit(A, f"busy-{i}", "h1")
    p.admit(A, "other-0", "h2")
    assert [w for w in p.release(A) + p.release(A)] == ["few-1", "other-0"]  # h1 never was sparse
    p.admit(A, "app-0", "h3"), p.admit(A, "app-1", "h3")
    started = [w for _ in range(4) for w in p.release(A)]
    # h3's two sparse turns, then the round: h1 only
    assert started == ["app-0", "app-1", "busy-1", "busy-2"]
    p.admit(A, "late-0", "h4"), p.admit(A, "late-1", "h4"), p.admit(A, "late-2", "h4")
    # h4's three do not fit in two sparse turns: it joins the round behind h1 at once
    started = [w for _ in range(5) for w in p.release(A)]
    assert started == ["busy-3", "late-0", "busy-4", "late-1", "busy-5"]
    assert p.release(A) == ["late-2"] and p.waiting(A) == 0


def test_a_storms_hosts_whose_lines_outgrow_their_sparse_turns_go_behind_an_application_host() -> None:
    """Every host's line is new when a storm begins; the application host asks a little later."""
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=1, floor=1, sparse_turns=8))
    assert p.admit(A, "first", "h0")
    for host in range(20):
        for i in range(30):
            p.admit(A, f"storm-{host}-{i}", f"10.0.0.{host}")
    p.admit(A, "app-0", "127.0.0.1")
    assert p.release(A) == ["app-0"]
    assert p.release(A) == ["storm-0-0"] and p.release(A) == ["storm-1-0"]  # then the round


def test_a_source_with_nothing_in_line_goes_ahead_on_a_reserve_turn_beside_the_limit() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(PacingSettings(initial=1, floor=1, sparse_reserve=1))
    assert p.admit(A, "busy-0", "h1") is Admission.TURN
    assert p.admit(A, "busy-1", "h1") is Admission.RESERVE  # h1 had nothing in line
    assert p.admit(A, "busy-2", "h1") is Admission.QUEUED  # the reserve is out: h1 is in line now
    assert p.admit(A, "busy-3", "h1") is Admission.QUEUED  # h1 has a line: it waits, reserve or not
    assert p.release(A, reserved=True) == ["busy-2"]  # h1 is within its front turns: the reserve passes on
    assert p.admit(A, "app-0", "h2") is Admission.QUEUED  # the reserve is out again
    assert (p.in_flight(A), p.reserved(A), p.waiting(A)) == (1, 1, 2)
    p.observe(A, 0.0, 2.0)  # a cut (the floor here) does not take the reserve away
    assert p.release(A, reserved=True) == ["busy-3"]  # h1 still within its front turns, ahead of h2
    assert p.release(A, reserved=True) == ["app-0"]
    assert p.release(A, reserved=True) == [] and p.reserved(A) == 0
    assert p.admit(A, "app-1", "h3") is Admission.RESERVE


def test_a_reserve_turn_given_back_never_goes_to_the_busy_hosts_round() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(
        PacingSettings(initial=1, floor=1, sparse_turns=2, sparse_reserve=1))
    assert p.admit(A, "s0", "storm") is Admission.TURN
    assert p.admit(A, "s1", "storm") is Admission.RESERVE
    for i in range(2, 5):  # three in line, more than its two front turns: in the round
        assert p.admit(A, f"s{i}", "storm") is Admission.QUEUED
    assert p.release(A, reserved=True) == [] and p.reserved(A) == 0  # the round does not get it
    assert p.admit(A, "app-0", "app") is Admission.RESERVE
    assert p.admit(A, "app-1", "app") is Admission.QUEUED
    assert p.release(A, reserved=True) == ["app-1"] and p.reserved(A) == 1
    assert p.release(A) == ["s2"]  # a turn under the limit: the round's


def test_a_withdrawn_waiter_leaves_its_sources_line_and_the_round() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=1, floor=1))
    p.admit(A, "a", "h1"), p.admit(A, "b", "h1"), p.admit(A, "c", "h2"), p.admit(A, "d", "h1")
    p.withdraw(A, "c", "h2")
    p.withdraw(A, "c", "h1")  # not in that line: nothing happens
    assert p.waiting(A) == 2
    assert p.release(A) == ["b"] and p.release(A) == ["d"] and p.release(A) == []


def test_fast_answers_grow_the_limit_additively_up_to_the_ceiling() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=4, floor=2, ceiling=6))
    for _ in range(4):  # 1/limit each: 4.25, 4.49, 4.71, 4.92
        p.observe(A, 0.0, 0.01)
    assert p.limit(A) == 4
    p.observe(A, 0.0, 0.01)  # 5.12: one more turn for about a limit's worth of fast answers
    assert p.limit(A) == 5
    for _ in range(100):
        p.observe(A, 0.0, 0.01)
    assert p.limit(A) == 6


def test_a_slow_turn_or_a_timeout_halves_the_limit_once_per_interval() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(
        _limit_only(initial=32, floor=3, slow_s=0.5, cut_every_s=1.0))
    p.observe(A, 10.0, 1.2)  # a retransmitted SYN
    assert p.limit(A) == 16
    p.observe(A, 10.5, 3.0, timed_out=True)  # the same full queue: not cut again
    assert p.limit(A) == 16
    p.observe(A, 11.0, 0.0, timed_out=True)
    assert p.limit(A) == 8
    for t in (12.0, 13.0, 14.0):
        p.observe(A, t, 0.6)
    assert p.limit(A) == 3  # the floor
    assert p.limit(B) == 32  # per broker


def test_a_lower_limit_lets_the_turns_in_flight_finish_before_anyone_starts() -> None:
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=4, floor=1))
    for w in "abcd":
        p.admit(A, w)
    p.admit(A, "e")
    p.observe(A, 0.0, 2.0)  # limit 2, four in flight
    assert p.release(A) == [] and p.release(A) == []
    assert p.release(A) == ["e"]


def test_a_broker_whose_connects_time_out_is_not_paced_until_it_answers_again() -> None:
    """Its host is cut off: waiting in line would only delay each client's own timeout (and a
    bootstrap connection's move to the next broker)."""
    p: ConnectPacer[tuple[str, int], str] = ConnectPacer(_limit_only(initial=2, floor=2))
    assert [p.admit(A, w) for w in "abcd"] == [True, True, False, False]
    p.observe(A, 5.0, 5.0, timed_out=True)
    assert p.release(A) == ["c", "d"]  # everyone queued goes
    assert p.admit(A, "e") is Admission.TURN and p.in_flight(A) == 4
    p.observe(A, 6.0, 0.01)  # answered again: paced again
    assert p.admit(A, "f") is Admission.QUEUED
    assert [p.release(A) for _ in range(3)] == [[], [], ["f"]]


async def _turns_in_order(turns: ConnectTurns) -> list[str]:
    order: list[str] = []

    async def client(name: str) -> None:
        turn = await turns.wait(A)
        order.append(name)
        await asyncio.sleep(0)
        turn.connected()
        await asyncio.sleep(0)
        turn.answered()

    await asyncio.gather(*(client(str(i)) for i in range(6)))
    return order


def test_the_shell_never_has_more_than_the_limit_in_flight() -> None:
    waits = []
    turns = ConnectTurns(_limit_only(initial=2, floor=1, ceiling=2), on_wait=lambda: waits.append(1))
    peak = 0
    real_admit = turns.pacer.admit

    def admit(key: object, waiter: asyncio.Future[None], source: object = None) -> bool:
        nonlocal peak
        started = real_admit(key, waiter, source)
        peak = max(peak, turns.pacer.in_flight(key))
        return started

    turns.pacer.admit = admit  # type: ignore[method-assign]
    order = uvloop.run(_turns_in_order(turns))
    assert order == [str(i) for i in range(6)]
    assert peak == 2 and turns.pacer.in_flight(A) == 0
    assert len(waits) == 4  # all but the first two waited


def test_a_connected_turn_without_an_answer_is_given_back_after_hold_s() -> None:
    async def main() -> tuple[int, int, int]:
        turns = ConnectTurns(_limit_only(initial=1, floor=1, hold_s=0.05))
        first = await turns.wait(A)
        first.connected()
        second = asyncio.ensure_future(turns.wait(A))
        await asyncio.sleep(0.01)
        waiting = turns.pacer.waiting(A)
        turn = await asyncio.wait_for(second, 5.0)  # the hold ran out: the next one goes
        in_flight = turns.pacer.in_flight(A)
        first.answered()  # late: observed, but its turn is not given back twice
        turn.abandon()
        return waiting, in_flight, turns.pacer.in_flight(A)

    assert uvloop.run(main()) == (1, 1, 0)


def test_a_reserve_turn_passed_on_to_a_waiting_connect_is_a_reserve_turn_when_given_back() -> None:
    async def main() -> tuple[bool, int, int, int]:
        turns = ConnectTurns(PacingSettings(initial=1, floor=1, sparse_reserve=1))
        regular = await turns.wait(A, "storm")
        reserve = await turns.wait(A, "app")  # nothing in line: the reserve
        later = asyncio.ensure_future(turns.wait(A, "app"))  # the reserve is out: in line
        await asyncio.sleep(0)
        reserve.answered()  # the reserve turn passes on to the app's waiting connect
        turn = await asyncio.wait_for(later, 5.0)
        in_flight, out_of_reserve = turns.pacer.in_flight(A), turns.pacer.reserved(A)
        turn.answered()
        regular.answered()
        return turn.reserved, in_flight, out_of_reserve, turns.pacer.reserved(A) + turns.pacer.in_flight(A)

    assert uvloop.run(main()) == (True, 1, 1, 0)


def test_each_turn_given_back_is_traced_once_with_its_wait_in_line_and_how_it_ended() -> None:
    now = [10.0]
    traced: list[tuple[str, object, float]] = []

    async def main() -> None:
        turns = ConnectTurns(_limit_only(initial=1, floor=1), clock=lambda: now[0],
                             on_given_back=lambda t, how: traced.append((how, t.source, t.began - t.asked)))
        first = await turns.wait(A, "h1")
        second = asyncio.ensure_future(turns.wait(A, "h2"))
        await asyncio.sleep(0)
        now[0] += 0.3
        first.connected()
        first.answered()
        first.abandon()  # the pair closes later: given back already, not traced again
        turn = await asyncio.wait_for(second, 5.0)
        turn.failed(timed_out=False)

    uvloop.run(main())
    assert traced == [("answered", "h1", 0.0), ("failed", "h2", pytest.approx(0.3))]


def test_a_late_answer_or_a_timeout_cuts_the_limit_on_the_injected_clock() -> None:
    now = [100.0]

    async def main() -> list[int]:
        turns = ConnectTurns(_limit_only(initial=8, floor=1, slow_s=0.5, cut_every_s=1.0), clock=lambda: now[0])
        limits = []
        turn = await turns.wait(A)
        turn.connected()
        now[0] += 0.1
        turn.answered()  # 0.1 s: fast
        limits.append(turns.pacer.limit(A))
        turn = await turns.wait(A)
        now[0] += 1.5
        turn.connected()  # 1.5 s to connect: slow, cut at once
        limits.append(turns.pacer.limit(A))
        turn.answered()  # observed already: no second verdict
        limits.append(turns.pacer.limit(A))
        turn = await turns.wait(A)
        now[0] += 5.0
        turn.failed(timed_out=True)
        limits.append(turns.pacer.limit(A))
        turn = await turns.wait(A)
        turn.failed(timed_out=False)  # refused: says nothing about the queue
        limits.append(turns.pacer.limit(A))
        return limits + [turns.pacer.in_flight(A)]

    assert uvloop.run(main()) == [8, 4, 4, 2, 2, 0]


def test_a_busy_brokers_slow_answer_is_no_cut_but_one_after_a_resent_syn_ack_is() -> None:
    now = [100.0]

    async def main() -> list[int]:
        turns = ConnectTurns(_limit_only(initial=8, floor=1, slow_s=0.5, late_answer_s=1.0, cut_every_s=1.0),
                             clock=lambda: now[0])
        limits = []
        for answer_after in (0.7, 1.2):  # under, then over late_answer_s
            turn = await turns.wait(A)
            now[0] += 0.01
            turn.connected()
            now[0] += answer_after
            turn.answered()
            limits.append(turns.pacer.limit(A))
        return limits

    assert uvloop.run(main()) == [8, 4]


def test_a_resent_syn_cuts_the_limit_like_a_slow_connect_and_its_answer_adds_nothing() -> None:
    now = [100.0]

    async def main() -> list[int]:
        turns = ConnectTurns(_limit_only(initial=8, floor=1, slow_s=0.5, cut_every_s=1.0), clock=lambda: now[0])
        limits = []
        turn = await turns.wait(A)
        now[0] += 0.3
        turn.syn_resent()  # its SYN dropped: the broker's accept queue was full
        limits.append(turns.pacer.limit(A))
        turn.connected()  # 0.3 s in all: under slow_s, yet no additive increase either
        turn.answered()
        limits.append(turns.pacer.limit(A))
        return limits

    assert uvloop.run(main()) == [4, 4]


def test_a_waiter_cancelled_in_the_queue_leaves_no_turn_behind() -> None:
    async def main() -> tuple[int, int]:
        turns = ConnectTurns(_limit_only(initial=1, floor=1))
        held = await turns.wait(A)
        doomed = asyncio.ensure_future(turns.wait(A))
        after = asyncio.ensure_future(turns.wait(A))
        await asyncio.sleep(0)
        doomed.cancel()
        held.abandon()  # the turn goes past the cancelled waiter to the next
        turn = await asyncio.wait_for(after, 5.0)
        assert doomed.cancelled()
        in_flight = turns.pacer.in_flight(A)
        turn.abandon()
        return in_flight, turns.pacer.in_flight(A)

    assert uvloop.run(main()) == (1, 0)


def test_first_connection_waits_for_a_turn_outside_the_connect_timeout() -> None:
    """A turn that takes longer than the connect timeout does not time the connect out."""
    async def main() -> tuple[object, list[str]]:
        turns = ConnectTurns(_limit_only(initial=1, floor=1))
        held = await turns.wait(A)
        asyncio.get_running_loop().call_later(0.2, held.abandon)
        failures: list[str] = []

        async def wait_turn(address: tuple[str, int]) -> None:
            await turns.wait(address)

        async def connect(address: tuple[str, int]) -> str:
            return "connected"

        reached = await first_connection(connect, [A], timeout_s=0.05, timeout_retries=0, stop=lambda: False,
                                         failed=lambda a, e: failures.append(repr(e)), wait_turn=wait_turn)
        return reached, failures

    assert uvloop.run(main()) == (("connected", A), [])


def test_a_bootstrap_connection_goes_to_the_broker_with_the_fewest_connects_waiting_or_in_flight() -> None:
    p: ConnectPacer[str, str] = ConnectPacer(_limit_only(initial=2, floor=1))
    for i in range(5):  # b2: two in flight, three waiting
        p.admit("b2", f"w{i}", "h1")
    p.admit("b3", "x", "h1")  # b3: one in flight
    assert p.least_loaded_first(["b2", "b3", "b1"]) == ["b1", "b3", "b2"]
    assert p.least_loaded_first(["b3", "b1"]) == ["b1", "b3"]
    assert p.least_loaded_first(["b4", "b1"]) == ["b4", "b1"]  # a tie keeps the round robin's order
    p.release("b2"), p.release("b2"), p.release("b2")  # three waiting start: two in flight again
    assert p.least_loaded_first(["b2", "b3"]) == ["b3", "b2"]
    p.release("b2"), p.release("b2")
    assert p.least_loaded_first(["b2", "b3"]) == ["b2", "b3"]
