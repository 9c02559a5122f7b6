"""The final read (chaos.drills.verify) and the comparison it feeds (chaos.measures): lost is
"acknowledged and not in the log", on hand-made traces whose answers were worked out by hand."""

from __future__ import annotations

import json

import pytest

from chaos import measures
from chaos.drills import summary
from chaos.drills.verify import (VIA_BROKERS, VIA_FLEET, FinalRead, LogRecord, ReadProgress, VerifyError, read_final,
                                 write_final_read)
from chaos.testbed.security import ClientSecurity, Protocol
from chaos.trace import TraceWriter, load_events, make_event, validate_trace

pytestmark = pytest.mark.unit

MS = 1_000_000


def ack(ts_ms: int, key: str, topic: str = "t") -> dict:
    return make_event("client", "ack", ts_ns=ts_ms * MS, run_id="r1", client_id="ap", family="aiokafka", topic=topic,
                      key=key, seq=int(key.split(".")[1]), partition=0, offset=0)


def consume(ts_ms: int, key: str, group: str = "g") -> dict:
    return make_event("client", "consume", ts_ns=ts_ms * MS, run_id="r1", client_id="ac", family="aiokafka",
                      topic="t", key=key, seq=int(key.split(".")[1]), partition=0, offset=0, group=group)


def read(ts_ms: int, key: str, offset: int, topic: str = "t") -> dict:
    return make_event("verifier", "read", ts_ns=ts_ms * MS, run_id="r1", topic=topic, partition=0, offset=offset,
                      key=key, seq=int(key.split(".")[1]))


def read_end(ts_ms: int, topic: str = "t") -> dict:
    return make_event("verifier", "read_end", ts_ns=ts_ms * MS, run_id="r1", topic=topic, detail="{}")


def test_producers_only_with_a_final_read_lose_nothing():
    # Three acks, no consumer at all; the final read finds all three: 0 lost (without the read
    # every one of them would count as lost, the bug this fixes).
    events = [ack(1, "1.0"), ack(2, "1.1"), ack(3, "1.2"),
              read(10, "1.0", 0), read(10, "1.1", 1), read(10, "1.2", 2), read_end(11)]
    s = summary.summarize_events(events)
    assert (s["lost"], s["duplicated"], s["healthy"]) == (0, 0, True)
    assert s["records"]["final_read"] == 3 and s["verified_topics"] == ["t"]
    assert s["missed_by_group"] == {}
    without_read = summary.summarize_events(events[:3])
    assert without_read["lost"] == 3 and without_read["healthy"] is False


def test_lost_is_acked_and_not_in_the_log_even_if_a_group_read_it():
    # Acked 1.0-1.3. Group g read 1.0, 1.1 and 1.3. The log (final read) holds 1.0, 1.2 and 1.2
    # again at another offset. Lost: 1.1 and 1.3 (read by g, gone from the log: a truncated
    # partition). Duplicated: 1.2 twice in the log. g missed 1.2 (missed_by_group 1).
    events = [ack(1, "1.0"), ack(2, "1.1"), ack(3, "1.2"), ack(4, "1.3"),
              consume(5, "1.0"), consume(5, "1.1"), consume(5, "1.3"),
              read(10, "1.0", 0), read(10, "1.2", 1), read(10, "1.2", 2), read_end(11)]
    records = measures.record_outcomes(events)
    assert [r[2] for r in records.lost] == ["1.1", "1.3"]
    assert [(r[2], reader, n) for r, reader, n in records.duplicated] == [("1.2", measures.FINAL_READ, 2)]
    assert records.missed_by_group == {"g": 1}
    assert records.final_read == 2 and records.verified_topics == [("r1", "t")]


def test_a_read_that_did_not_reach_the_end_verifies_nothing():
    # read events without a read_end (a verifier cut short): the topic is not verified, lost
    # falls back to "consumed by no group": 1.1 (1.0 was consumed by g).
    events = [ack(1, "1.0"), ack(2, "1.1"), consume(5, "1.0"), read(10, "1.1", 1)]
    records = measures.record_outcomes(events)
    assert [r[2] for r in records.lost] == ["1.1"]
    assert records.verified_topics == []


def test_verification_is_per_topic():
    # Topic u read to the end (holds 2.0, not 2.1); topic t not read at all: its acked 1.0 was
    # consumed, so not lost; u's 2.1 is lost.
    events = [ack(1, "1.0"), ack(1, "2.0", topic="u"), ack(1, "2.1", topic="u"), consume(5, "1.0"),
              read(10, "2.0", 0, topic="u"), read_end(11, topic="u")]
    assert [(r[1], r[2]) for r in measures.record_outcomes(events).lost] == [("u", "2.1")]


def test_read_progress_ends_at_the_high_watermark_of_every_partition():
    progress = ReadProgress({0: 0, 1: 3}, {0: 2, 1: 5, 2: 0})
    assert progress.remaining() == {0: 2, 1: 2}
    assert progress.wanted(0, 1) and not progress.wanted(0, 2)  # offset 2 came after the read started
    progress.advance(0, 2)
    progress.advance(1, 4)
    assert progress.remaining() == {1: 1} and not progress.done()
    progress.advance(1, 5)  # end of partition reached (EOF): a control record may fill the last offset
    assert progress.done()


def _final(via: str) -> FinalRead:
    return FinalRead("t", via, {0: 0}, {0: 2}, (LogRecord(0, 0, "1.0", 0), LogRecord(0, 1, "1.1", 1)), 0)


def test_read_final_falls_back_to_the_brokers_when_the_fleet_fails():
    tried = []

    def fake_read(bootstrap, topic, timeout_s, *, via, security):
        tried.append((via, bootstrap, security))
        if via == VIA_FLEET:
            raise VerifyError("fleet: timed out")
        return _final(via)

    to_fleet, to_brokers = ClientSecurity(Protocol.SASL_SSL), ClientSecurity(Protocol.SSL)
    final = read_final("t", ["127.0.0.11:9092"], ["127.0.0.1:19092"], 5.0, read=fake_read,
                       fleet_security=to_fleet, broker_security=to_brokers)
    assert final.via == VIA_BROKERS
    assert tried == [(VIA_FLEET, ["127.0.0.11:9092"], to_fleet), (VIA_BROKERS, ["127.0.0.1:19092"], to_brokers)]


def test_read_final_names_every_path_that_failed():
    def failing(bootstrap, topic, timeout_s, *, via, security):
        raise VerifyError(f"{via}: down")

    with pytest.raises(VerifyError, match="fleet: down; brokers: down"):
        read_final("t", ["a:1"], ["b:2"], 5.0, read=failing)
    with pytest.raises(VerifyError, match="no bootstrap"):
        read_final("t", None, None, 5.0, read=failing)


def test_written_final_read_fits_the_schema_and_verifies_the_topic(tmp_path):
    with TraceWriter(tmp_path, "ap", "r1") as w:
        w.client("ack", client_id="ap", family="aiokafka", topic="t", key="1.0", seq=0, partition=0, offset=0)
        w.client("ack", client_id="ap", family="aiokafka", topic="t", key="1.1", seq=1, partition=0, offset=1)
    with TraceWriter(tmp_path, "verifier", "r1") as w:
        write_final_read(w, _final(VIA_FLEET))
    assert validate_trace(tmp_path) == []
    events = load_events(tmp_path)
    end = [e for e in events if e["event"] == "read_end"]
    assert len(end) == 1 and json.loads(end[0]["detail"])["end_offsets"] == {"0": 2}
    s = summary.summarize_events(events)
    assert (s["lost"], s["records"]["final_read"], s["healthy"]) == (0, 2, True)


def test_schema_refuses_a_verifier_event_it_does_not_know():
    with pytest.raises(ValueError, match="unknown verifier event 'consume'"):
        make_event("verifier", "consume", run_id="r1", topic="t")
