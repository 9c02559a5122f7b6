"""The aiokafka family (asyncio): a batch produce/consume, a transaction, and the paced workload loops."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from chaos.clients.batch import Ack, Consumed, values
from chaos.clients.paced import CommitRetry, ConsumerTrace, Pacer, ProducerTrace, Stop, is_instance, record_value, wire_key
from chaos.testbed.security import ClientSecurity, client_settings
from chaos.clients.settings import FLUSH_TIMEOUT_S, POLL_TIMEOUT_S, SETTINGS

log = logging.getLogger("kproxy.workloads")


# ------------------------------------------------------------------ batch
def produce(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float,
            security: ClientSecurity | None = None) -> list[Ack]:
    from aiokafka import AIOKafkaProducer

    async def run() -> list[Ack]:
        producer = AIOKafkaProducer(bootstrap_servers=bs, acks="all", enable_idempotence=idempotent,
                                    request_timeout_ms=int(timeout * 1000),
                                    **client_settings(security, "aiokafka"))
        await producer.start()
        try:
            futs = [await producer.send(topic, key=str(i).encode(), value=v.encode())
                    for i, v in enumerate(values(prefix, n))]
            metas = await asyncio.wait_for(asyncio.gather(*futs), timeout)
        finally:
            await producer.stop()
        return [Ack(str(i), v, m.partition, m.offset) for i, (v, m) in enumerate(zip(values(prefix, n), metas))]

    return asyncio.run(run())


def consume(bs: str, topic: str, group: str, n: int, timeout: float,
            security: ClientSecurity | None = None) -> list[Consumed]:
    from aiokafka import AIOKafkaConsumer

    async def run() -> list[Consumed]:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bs, group_id=group, auto_offset_reset="earliest",
                                    enable_auto_commit=False, **client_settings(security, "aiokafka"))
        await consumer.start()
        out: list[Consumed] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) < n and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    out.extend(Consumed(r.key.decode() if r.key else None, r.value.decode(), r.partition, r.offset)
                               for r in records)
                if batch:
                    await consumer.commit()
        finally:
            await consumer.stop()
        return out

    return asyncio.run(run())


def transactional_produce(bs: str, topic: str, tid: str, n: int, prefix: int, commit: bool, timeout: float,
                          security: ClientSecurity | None = None) -> None:
    from aiokafka import AIOKafkaProducer

    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bs, transactional_id=tid, enable_idempotence=True,
                                    **client_settings(security, "aiokafka"))
        await producer.start()
        try:
            await producer.begin_transaction()
            for i, v in enumerate(values(prefix, n)):
                await producer.send(topic, key=str(i).encode(), value=v.encode())
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
        finally:
            await producer.stop()

    asyncio.run(asyncio.wait_for(run(), timeout))


# ------------------------------------------------------------------ paced
def produce_paced(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> None:
    from aiokafka import AIOKafkaProducer

    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=a.bootstrap, client_id=a.client_id,
                                    **SETTINGS["aiokafka"]["producer"], **client_settings(a.security, "aiokafka"))
        await producer.start()
        pacer = Pacer(a.rate)
        pending: set[asyncio.Future[Any]] = set()

        def done(seq: int, fut: asyncio.Future[Any]) -> None:
            pending.discard(fut)
            if fut.cancelled():
                t.error("cancelled", seq)
            elif fut.exception() is not None:
                t.error(f"{type(fut.exception()).__name__}: {fut.exception()}", seq)
            else:
                md = fut.result()
                t.ack(seq, md.partition, md.offset)

        try:
            seq = 0
            while not stop.requested():
                delay = pacer.delay_s()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing; SIGTERM is seen at the next send slot
                    continue
                t.send(seq)
                try:
                    fut = await producer.send(a.topic, key=wire_key(seq), value=record_value(a.prefix, seq).encode())
                except Exception as exc:  # no metadata within request_timeout_ms, buffer full, ...
                    t.error(f"{type(exc).__name__}: {exc}", seq)
                else:
                    pending.add(fut)
                    fut.add_done_callback(lambda f, s=seq: done(s, f))
                seq += 1
                pacer.advance()
            if pending:
                await asyncio.wait(set(pending), timeout=FLUSH_TIMEOUT_S)
        finally:
            await asyncio.wait_for(producer.stop(), FLUSH_TIMEOUT_S)

    asyncio.run(run())


def consume_paced(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> None:
    from aiokafka import AIOKafkaConsumer
    from aiokafka import errors

    rebalancing = is_instance(errors.CommitFailedError, errors.RebalanceInProgressError,
                               errors.IllegalGenerationError, errors.UnknownMemberIdError)

    async def run() -> None:
        consumer = AIOKafkaConsumer(a.topic, bootstrap_servers=a.bootstrap, group_id=a.group, client_id=a.client_id,
                                    **SETTINGS["aiokafka"]["consumer"], **client_settings(a.security, "aiokafka"))
        await consumer.start()
        try:
            while not stop.requested():
                batch = await consumer.getmany(timeout_ms=int(POLL_TIMEOUT_S * 1000))
                if not batch:
                    continue
                offsets = {}
                for tp, records in batch.items():
                    for r in records:
                        t.consume(r.value, r.partition, r.offset)
                    offsets[tp] = records[-1].offset + 1
                retry = CommitRetry(t, rebalancing)
                while True:
                    try:
                        await consumer.commit(offsets)
                        break
                    except Exception as exc:
                        delay = retry.failed(exc)
                        if delay is None:
                            break
                        await asyncio.sleep(delay)
        finally:
            await stop_aiokafka(consumer)

    asyncio.run(run())


async def stop_aiokafka(client: Any) -> None:
    """``await client.stop()`` within FLUSH_TIMEOUT_S. aiokafka 0.14's Fetcher.close() cancels its
    pending fetch tasks and awaits them without suppressing their CancelledError: a fetch in its
    retry backoff at stop (its broker connection had just closed) made stop() raise although the
    consumer is stopped. That is logged; our own task being cancelled still propagates."""
    try:
        await asyncio.wait_for(client.stop(), FLUSH_TIMEOUT_S)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("aiokafka stop() raised CancelledError from inside; stopped anyway")
