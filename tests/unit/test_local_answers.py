"""proxy.local_answers: ApiVersions answers kept per listener and version, for a while."""

from __future__ import annotations

import struct

import pytest

from proxy.local_answers import LocalAnswers

pytestmark = [pytest.mark.unit]

BODY = b"\0\0" + b"\x02\0\x12\0\0\0\x04\0"  # error_code 0, then whatever the broker said
ERROR_BODY = b"\0\x23" + b"\0\0\0\0"  # UNSUPPORTED_VERSION


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def payload(correlation_id: int, body: bytes) -> list[memoryview]:
    """A response payload as the splitter hands it over: pieces, views of a reused buffer."""
    whole = bytearray(struct.pack(">i", correlation_id) + body)
    return [memoryview(whole)[:3], memoryview(whole)[3:]]


def test_an_answer_learned_is_given_with_the_new_correlation_id_until_it_expires():
    clock = Clock()
    answers = LocalAnswers(clock, 5.0)
    assert answers.answer(2, 3, 77) is None  # nothing learned yet: ask the broker
    pieces = payload(9, BODY)
    answers.learn(2, 18, 3, pieces)
    for view in pieces:  # the buffer is reused after the call: the answer was copied
        view[:] = b"\xff" * len(view)
    frame = answers.answer(2, 3, 77)
    assert frame == struct.pack(">ii", 4 + len(BODY), 77) + BODY
    assert answers.answer(2, 0, 77) is None  # another version: another answer
    assert answers.answer(1, 3, 77) is None  # another listener: another broker
    clock.now += 4.9
    assert answers.answer(2, 3, 78) is not None
    clock.now += 0.1
    assert answers.answer(2, 3, 79) is None  # expired: asked again
    assert len(answers) == 0


def test_errors_other_apis_and_a_zero_lifetime_are_not_kept():
    clock = Clock()
    answers = LocalAnswers(clock, 5.0)
    answers.learn(2, 18, 3, payload(1, ERROR_BODY))
    answers.learn(2, 3, 12, payload(1, BODY))  # a Metadata answer
    answers.learn(2, 18, 3, payload(1, b"\0"))  # too short to tell
    assert len(answers) == 0
    answers.learn(2, 18, 3, payload(1, BODY))
    assert len(answers) == 1
    answers.retune(0)  # a reload turned it off: what was kept goes too
    assert answers.answer(2, 3, 5) is None
    answers.learn(2, 18, 3, payload(1, BODY))
    assert len(answers) == 0
