"""The cyclic garbage collector once a node's data path serves (proxy.worker and, with
``workers = 1``, proxy.runtime): start-up frozen, full collections ten times rarer."""

from __future__ import annotations

import gc

__all__ = ("GC_THRESHOLDS", "settle_heap")

# The cyclic garbage collector's thresholds once the data path serves (see settle_heap).
GC_THRESHOLDS = (700, 10, 100)


def settle_heap() -> None:
    """Once the node's data path serves (a worker's, or a one-process node's): freeze what
    start-up made, and consider a full collection ten times less often (Python's default
    third threshold is 10).

    The data path makes no reference cycles to speak of (in a 10,000-client storm the
    collector found nothing; proxy.profiling), yet every full collection walks every
    tracked object: the ~90,000 of start-up (imports, schemas, the rewriter's tables) and
    those of every connection held, 70-150 ms per pass at 5,000 connections, the loop
    stopped meanwhile (accepts wait, queues fill). Frozen objects are never walked again; the
    young generations are collected as before, so short-lived cycles still go at once."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
