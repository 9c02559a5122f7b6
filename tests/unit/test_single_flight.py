"""proxy.single_flight: identical Metadata requests in flight at once share one answer."""

from __future__ import annotations

import struct

import pytest

from proxy.single_flight import Flights

pytestmark = [pytest.mark.unit]

BODY = b"\0\0\0\0" + b"\x02\0\0\0\x01" + b"broker-addresses-rewritten"  # whatever the rewriter produced


def payload(correlation_id: int, body: bytes) -> list[memoryview]:
    """A rewritten answer as the splitter hands it over: pieces, views of a reused buffer."""
    whole = bytearray(struct.pack(">i", correlation_id) + body)
    return [memoryview(whole)[:6], memoryview(whole)[6:]]


def test_requests_that_join_get_the_leaders_answer_with_their_own_correlation_id():
    flights: Flights[str] = Flights(True)
    key = Flights.key(0, 12, memoryview(b"\x01\x00\x00"))
    assert not flights.join(key, "a", 7)  # none in flight: "a" leads
    flight = flights.lead(key)
    assert flights.join(Flights.key(0, 12, b"\x01\x00\x00"), "b", 40)  # same listener, version and body
    assert flights.join(key, "c", -3)
    assert not flights.join(Flights.key(0, 11, b"\x01\x00\x00"), "d", 1)  # another version
    assert not flights.join(Flights.key(1, 12, b"\x01\x00\x00"), "d", 1)  # another listener
    assert not flights.join(Flights.key(0, 12, b"\x01\x00\x01"), "d", 1)  # another body (topics, flags)
    pieces = payload(7, BODY)
    answers = list(flights.land(flight, pieces))
    for view in pieces:  # the buffer is reused after the call: the answers were copied
        view[:] = b"\xff" * len(view)
    assert [(w, head + body) for w, head, body in answers] == [("b", struct.pack(">ii", 4 + len(BODY), 40) + BODY),
                                                               ("c", struct.pack(">ii", 4 + len(BODY), -3) + BODY)]
    assert answers[0][2] is answers[1][2]  # one copy of the body, shared
    assert len(flights) == 0
    assert not flights.join(key, "e", 2)  # it landed: the next request leads a new flight


def test_a_flight_whose_leader_closed_hands_its_waiters_back_and_ends():
    flights: Flights[str] = Flights(True)
    key = Flights.key(5, 12, b"")
    flight = flights.lead(key)
    assert flights.join(key, "b", 1) and flights.join(key, "c", 2)
    assert flights.fail(flight) == ["b", "c"]
    assert len(flights) == 0
    assert list(flights.land(flight, payload(1, BODY))) == []  # late: nobody waits any more


def test_an_old_flight_ending_leaves_a_newer_one_for_the_same_request_alone():
    flights: Flights[str] = Flights(True)
    key = Flights.key(0, 12, b"x")
    old = flights.lead(key)
    flights.fail(old)
    new = flights.lead(key)
    assert flights.join(key, "b", 1)
    assert list(flights.land(old, payload(1, BODY))) == []  # the old flight's waiters, none
    assert len(flights) == 1
    assert [w for w, _, _ in flights.land(new, payload(1, BODY))] == ["b"]
