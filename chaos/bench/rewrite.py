"""Benchmark of the Metadata rewrite (splice of the brokers array).

    python -m chaos.bench.rewrite [--version 12] [--brokers 6] [--repeat 200]

Prints microseconds per rewrite (median of N) for each partition count, for
the rewrite itself (result as pieces, what the splitter emits) and with the
pieces joined into one bytes object. Target: <= 1000 µs at 10,000 partitions.
The responses are built once with kio's encoder (slow: that is not measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from collections.abc import Sequence

from kio.index import load_response_schema

from chaos.bench import frames as fx
from proxy.codec import CorrelationTable
from proxy.codec import ResponseSplitter
from proxy.codec import encode_frame
from proxy.rewrite import ResponseRewriter

__all__ = ("bench_metadata_rewrite", "bench_metadata_splitter", "main")

DEFAULT_PARTITIONS: tuple[int, ...] = (100, 1000, 10000, 50000)


def _payload(version: int, partitions: int, brokers: int) -> bytes:
    body_type = load_response_schema(3, version)
    broker_list = [(n, f"kafka-{n}.internal.example.com", 9092, f"rack-{n % 3}") for n in range(1, brokers + 1)]
    topics = max(1, partitions // 100)  # 100 partitions a topic
    body = fx.metadata_response(body_type, broker_list, partitions=partitions, topics=topics)
    return fx.response_payload(body, 12345)


def _time_us(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples)


def bench_metadata_rewrite(
    partitions_list: Sequence[int] = DEFAULT_PARTITIONS,
    *,
    version: int = 12,
    brokers: int = 6,
    repeat: int = 200,
    joined: bool = False,
) -> dict[int, float]:
    """Median microseconds per Metadata rewrite, by partition count.

    ``joined=False`` measures ``rewrite()`` (pieces, as the splitter emits
    them); ``joined=True`` adds joining the pieces into one bytes object.
    """
    mapping = {n: ("127.0.0.11", 19000 + n) for n in range(1, brokers + 1)}
    rewriter = ResponseRewriter(mapping.get)
    results: dict[int, float] = {}
    for partitions in partitions_list:
        payload = _payload(version, partitions, brokers)
        rewriter.rewrite(3, version, payload)  # warm caches (plan compile)
        if joined:
            results[partitions] = _time_us(lambda: rewriter.rewrite(3, version, payload).to_bytes(), repeat)
        else:
            results[partitions] = _time_us(lambda: rewriter.rewrite(3, version, payload), repeat)
    return results


def bench_metadata_splitter(
    partitions_list: Sequence[int] = DEFAULT_PARTITIONS,
    *,
    version: int = 12,
    brokers: int = 6,
    repeat: int = 200,
    chunk_size: int | None = None,
) -> dict[int, float]:
    """Median microseconds for the splitter to take one Metadata frame from
    the broker and emit the rewritten frame: fed as one chunk (rewritten in
    place) or in ``chunk_size`` chunks (collected first, one copy)."""
    mapping = {n: ("127.0.0.11", 19000 + n) for n in range(1, brokers + 1)}
    rewriter = ResponseRewriter(mapping.get)
    results: dict[int, float] = {}
    for partitions in partitions_list:
        frame = encode_frame(_payload(version, partitions, brokers))
        chunks = [frame] if chunk_size is None else [frame[i : i + chunk_size] for i in range(0, len(frame), chunk_size)]
        table = CorrelationTable()
        splitter = ResponseSplitter(table, rewriter)

        def once() -> None:
            table.add(12345, 3, version)
            for chunk in chunks:
                splitter.feed(chunk)

        once()
        results[partitions] = _time_us(once, repeat)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", type=int, default=12, help="Metadata response version (default 12)")
    parser.add_argument("--brokers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=200, help="rewrites per size (median)")
    parser.add_argument("--partitions", type=int, nargs="*", default=list(DEFAULT_PARTITIONS))
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    pieces = bench_metadata_rewrite(args.partitions, version=args.version, brokers=args.brokers, repeat=args.repeat)
    joined = bench_metadata_rewrite(
        args.partitions, version=args.version, brokers=args.brokers, repeat=args.repeat, joined=True
    )
    one_chunk = bench_metadata_splitter(args.partitions, version=args.version, brokers=args.brokers, repeat=args.repeat)
    chunked = bench_metadata_splitter(
        args.partitions, version=args.version, brokers=args.brokers, repeat=args.repeat, chunk_size=65536
    )
    if args.json:
        print(
            json.dumps(
                {
                    "version": args.version,
                    "brokers": args.brokers,
                    "rewrite_us": pieces,
                    "rewrite_joined_us": joined,
                    "splitter_one_chunk_us": one_chunk,
                    "splitter_64k_chunks_us": chunked,
                }
            )
        )
        return 0
    print(f"Metadata v{args.version}, {args.brokers} brokers, median of {args.repeat} (microseconds)")
    print(f"{'partitions':>10}  {'rewrite':>9}  {'+join':>9}  {'splitter 1 chunk':>16}  {'splitter 64K chunks':>19}")
    for p in args.partitions:
        print(f"{p:>10}  {pieces[p]:>9.1f}  {joined[p]:>9.1f}  {one_chunk[p]:>16.1f}  {chunked[p]:>19.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
