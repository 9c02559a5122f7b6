"""The consumer workloads' commit retry: back off on errors a retry can cure, give up at once
on those only a poll cures (the group is rebalancing), bounded by COMMIT_RETRY_S."""

from __future__ import annotations

import pytest

from chaos.clients import paced, settings
from chaos.clients.confluent_client import confluent_rebalancing
from chaos.clients.paced import CommitRetry, commit_with_retry, is_instance

pytestmark = pytest.mark.unit


class _Trace:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, detail: str) -> None:
        self.errors.append(detail)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(paced.time, "monotonic", c.monotonic)
    monkeypatch.setattr(paced.time, "sleep", c.sleep)
    return c


class _Flaky:
    """A commit() that raises the given exceptions in turn, then succeeds."""

    def __init__(self, *excs: BaseException) -> None:
        self.excs = list(excs)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.excs:
            raise self.excs.pop(0)


def test_kafka_python_rebalance_gives_up_at_once(clock):
    from kafka import errors

    rebalancing = is_instance(errors.CommitFailedError, errors.RebalanceInProgressError)
    t = _Trace()
    commit = _Flaky(errors.RebalanceInProgressError("rebalancing"), errors.RebalanceInProgressError("again"))
    commit_with_retry(commit, t, rebalancing)  # type: ignore[arg-type]
    assert commit.calls == 1
    assert clock.sleeps == []
    assert len(t.errors) == 1 and "RebalanceInProgressError" in t.errors[0]


def test_retriable_error_backs_off_then_succeeds(clock):
    from kafka import errors

    rebalancing = is_instance(errors.RebalanceInProgressError)
    t = _Trace()
    commit = _Flaky(*(errors.NotCoordinatorError("moved") for _ in range(5)))
    commit_with_retry(commit, t, rebalancing)  # type: ignore[arg-type]
    assert commit.calls == 6
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])
    assert len(t.errors) == 5


def test_retries_end_at_the_deadline(clock):
    t = _Trace()
    commit = _Flaky(*(TimeoutError("slow") for _ in range(100)))
    commit_with_retry(commit, t, lambda exc: False)  # type: ignore[arg-type]
    assert sum(clock.sleeps) <= settings.COMMIT_RETRY_S
    assert sum(clock.sleeps) > settings.COMMIT_RETRY_S - settings.RETRY_BACKOFF_MAX_MS / 1000
    assert commit.calls == len(clock.sleeps) + 1 < 100


def test_confluent_rebalance_codes_give_up():
    from confluent_kafka import KafkaError, KafkaException

    retry = CommitRetry(_Trace(), confluent_rebalancing)  # type: ignore[arg-type]
    assert retry.failed(KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))) is None
    retry = CommitRetry(_Trace(), confluent_rebalancing)  # type: ignore[arg-type]
    assert retry.failed(KafkaException(KafkaError(KafkaError.REQUEST_TIMED_OUT))) == pytest.approx(0.1)



def test_stop_aiokafka_survives_its_fetcher_cancelled_error_but_not_ours():
    import asyncio

    from chaos.clients.aiokafka_client import stop_aiokafka

    class Client:
        def __init__(self) -> None:
            self.stopped = False

        async def stop(self) -> None:
            self.stopped = True
            task = asyncio.ensure_future(asyncio.sleep(10))  # like aiokafka's pending fetch task
            await asyncio.sleep(0)
            task.cancel()
            await task  # raises CancelledError out of stop()

    async def ok() -> bool:
        client = Client()
        await stop_aiokafka(client)
        return client.stopped

    assert asyncio.run(ok())

    async def cancelled_outside() -> str:
        async def stopper() -> None:
            class Slow:
                async def stop(self) -> None:
                    await asyncio.sleep(10)

            await stop_aiokafka(Slow())

        task = asyncio.ensure_future(stopper())
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "propagated"
        return "swallowed"

    assert asyncio.run(cancelled_outside()) == "propagated"
