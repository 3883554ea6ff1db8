"""Chunk selection, grouping and in-partition ordering shared by ROS 1 and MCAP.

The driver knows every chunk's byte range, time range and per-connection counts
from the bag's index.  Chunks that hold no selected connection or lie outside the
time filter are dropped first; the rest are grouped into partitions of consecutive
chunks.  A group never reorders chunks, so partition indexes follow file order.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Generic, NamedTuple, TypeVar

from adcloud.binpipe.bags_model import (
    BagFormat,
    BagPartition,
    BagSummary,
    ChunkRef,
    Connection,
    PlanRequest,
    RawMessage,
    TopicSummary,
)

__all__ = [
    "SortKey",
    "SortedRun",
    "chunk_partitions",
    "group_chunks",
    "merge_chunk_messages",
    "merge_sorted_runs",
    "select_chunks",
    "select_connections",
    "summary_from_chunks",
    "time_floors",
]


def select_connections(
    connections: Sequence[Connection], topics: tuple[str, ...] | None
) -> tuple[Connection, ...]:
    """The connections of ``topics`` (all if ``None``), in the bag's order."""
    if topics is None:
        return tuple(connections)
    wanted = set(topics)
    return tuple(c for c in connections if c.topic in wanted)


def select_chunks(
    chunks: Sequence[ChunkRef],
    conn_ids: frozenset[int] | None,
    start: int | None,
    end: int | None,
) -> list[ChunkRef]:
    """Chunks that may hold a message of ``conn_ids`` (any if ``None``) in ``[start, end)``.

    Chunks whose index has no per-connection counts are kept whatever the topics;
    chunks whose index counts no message at all are dropped.
    """
    kept = []
    for chunk in chunks:
        if chunk.counts is not None and not any(chunk.counts.values()):
            continue  # no messages at all (e.g. a chunk of connection records only)
        if start is not None and chunk.end_time <= start:
            continue
        if end is not None and chunk.start_time >= end:
            continue
        if (
            conn_ids is not None
            and chunk.counts is not None
            and not any(chunk.counts.get(cid, 0) for cid in conn_ids)
        ):
            continue
        kept.append(chunk)
    return kept


def _runs(chunks: Sequence[ChunkRef], k: int) -> list[list[ChunkRef]]:
    """Maximal byte-contiguous runs of chunks, the closest merged until at most ``k``.

    Merging two runs makes one partition read the bytes of the dropped chunks between
    them (the reader skips their decompression); it happens only when the filters
    leave more separate runs than partitions were asked for.
    """
    runs: list[list[ChunkRef]] = []
    for chunk in chunks:
        if runs and runs[-1][-1].end_offset == chunk.start_offset:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    if len(runs) <= k:
        return runs
    gaps = sorted(
        range(len(runs) - 1),
        key=lambda i: (runs[i + 1][0].start_offset - runs[i][-1].end_offset, i),
    )
    merge_after = set(gaps[: len(runs) - k])
    merged: list[list[ChunkRef]] = [list(runs[0])]
    for i in range(1, len(runs)):
        if i - 1 in merge_after:
            merged[-1].extend(runs[i])
        else:
            merged.append(list(runs[i]))
    return merged


def _allot(sizes: Sequence[int], k: int) -> list[int]:
    """Split ``k`` partitions over runs of ``sizes`` bytes: each at least one, else by size."""
    n = len(sizes)
    total = sum(sizes) or 1
    extra = k - n
    ideal = [max(0.0, k * s / total - 1.0) for s in sizes]
    ideal_total = sum(ideal) or 1.0
    wants = [extra * x / ideal_total for x in ideal]
    shares = [int(w) for w in wants]
    left = extra - sum(shares)
    order = sorted(range(n), key=lambda i: (-(wants[i] - shares[i]), i))
    for i in order[:left]:
        shares[i] += 1
    return [1 + s for s in shares]


def group_chunks(chunks: Sequence[ChunkRef], k: int | None) -> list[list[ChunkRef]]:
    """Group chunks (sorted by offset) into partitions.

    ``k=None``: one partition per chunk.  ``k``: at most ``k`` groups of consecutive
    chunks of about equal byte size; a group spans a gap of dropped chunks only when
    there are more gaps than partitions.
    """
    if not chunks:
        return []
    if k is None:
        return [[c] for c in chunks]
    runs = _runs(chunks, k)
    sizes = [run[-1].end_offset - run[0].start_offset for run in runs]
    groups: list[list[ChunkRef]] = []
    for run, size, n in zip(runs, sizes, _allot(sizes, k), strict=True):
        base = run[0].start_offset
        run_groups: list[list[ChunkRef]] = [[] for _ in range(n)]
        for chunk in run:
            mid = (chunk.start_offset - base) + chunk.size / 2
            g = min(n - 1, int(mid * n / size)) if size > 0 else 0
            run_groups[g].append(chunk)
        groups.extend(g for g in run_groups if g)
    return groups


def chunk_partitions(
    uri: str,
    fmt: BagFormat,
    chunks: Sequence[ChunkRef],
    connections: Sequence[Connection],
    request: PlanRequest,
    *,
    member: str = "",
    first_index: int = 0,
) -> list[BagPartition]:
    """Partitions of one chunked file: select connections and chunks, group, describe.

    ``first_index`` numbers the partitions on from earlier storage files of the same
    bag (rosbag2 directories with several MCAP files).
    """
    selected = select_connections(connections, request.topics)
    if not selected:
        return []
    ids = None if request.topics is None else frozenset(c.id for c in selected)
    kept = select_chunks(
        sorted(chunks, key=lambda c: c.start_offset), ids, request.start, request.end
    )
    selected_ids = frozenset(c.id for c in selected)
    parts = []
    for i, group in enumerate(group_chunks(kept, request.partitions_per_bag)):
        count = sum(
            n
            for chunk in group
            if chunk.counts is not None
            for cid, n in chunk.counts.items()
            if cid in selected_ids
        )
        parts.append(
            BagPartition(
                uri=uri,
                format=fmt,
                index=first_index + i,
                start_offset=group[0].start_offset,
                end_offset=group[-1].end_offset,
                connections=selected,
                topics=request.topics,
                start=request.start,
                end=request.end,
                time_source=request.time_source,
                message_count=count,
                storage_options=request.storage_options,
                member=member,
                time_floors=time_floors(group),
            )
        )
    return parts


def time_floors(chunks: Sequence[ChunkRef]) -> tuple[tuple[int, int], ...]:
    """``(start offset, floor)`` of each of ``chunks`` (in file order), where the floor is
    the least start time of that chunk and every later one; ``()`` when the start times
    never decrease, so that each chunk's own start time is its floor.

    A streaming reader may yield the messages it holds that are older than the floor of
    the next chunk: no chunk still to come can hold an earlier one.
    """
    starts = [c.start_time for c in chunks]
    if all(a <= b for a, b in itertools.pairwise(starts)):
        return ()
    floors: list[tuple[int, int]] = []
    low: int | None = None
    for chunk in reversed(chunks):
        low = chunk.start_time if low is None else min(low, chunk.start_time)
        floors.append((chunk.start_offset, low))
    return tuple(reversed(floors))


#: Sort key of a message inside a partition: (record time, connection rank, chunk
#: sequence number, position in the chunk).
SortKey = tuple[int, int, int, int]


def merge_chunk_messages(
    chunks: Iterable[tuple[int | None, Callable[[], list[tuple[SortKey, RawMessage]]]]],
) -> Iterator[RawMessage]:
    """Yield the messages of consecutive chunks in sort-key order, streaming.

    ``chunks`` yields ``(min_time, load)`` per chunk, where ``min_time`` is a lower
    bound of the chunk's record times known before loading it (``None`` if unknown)
    and ``load()`` decodes it.  Messages of earlier chunks strictly older than the
    next chunk's ``min_time`` are yielded before that chunk is loaded, so chunks that
    do not overlap in time are held in memory one or two at a time.
    """
    heap: list[tuple[SortKey, RawMessage]] = []
    for min_time, load in chunks:
        if min_time is not None:
            while heap and heap[0][0][0] < min_time:
                yield heapq.heappop(heap)[1]
        for item in load():
            heapq.heappush(heap, item)
    while heap:
        yield heapq.heappop(heap)[1]


_T = TypeVar("_T")


class SortedRun(NamedTuple, Generic[_T]):
    """The selected messages of one chunk, already in sort-key order.

    ``times`` are their record times (non-decreasing, as the keys start with it);
    ``keys()`` computes their full :data:`SortKey` values, only needed when the
    runs of two chunks overlap.
    """

    times: list[int]
    items: list[_T]
    keys: Callable[[], list[SortKey]]


def merge_sorted_runs(
    chunks: Iterable[tuple[int | None, Callable[[], SortedRun[_T]]]],
) -> Iterator[_T]:
    """:func:`merge_chunk_messages` for chunks that load as :class:`SortedRun`.

    Yields the same items in the same order, at the same points (before each load,
    every held item strictly older than the chunk's ``min_time``), but without a heap:
    held runs are kept as a list of sorted runs in key order, so chunks that do not
    overlap cost a ``bisect`` and a slice each, not a heap operation per message.
    Runs that overlap are merged by their full keys.
    """
    held: list[SortedRun[_T]] = []  # in key order: every key of held[i] < held[i+1]'s
    cursor = 0  # items of held[0] before this one have been yielded
    for min_time, load in chunks:
        if min_time is not None:
            while held:
                run = held[0]
                stop = bisect_left(run.times, min_time, cursor)
                if stop > cursor:
                    yield from run.items[cursor:stop]
                if stop < len(run.items):
                    cursor = stop
                    break
                held.pop(0)
                cursor = 0
        run = load()
        if not run.items:
            continue
        if not held:
            held.append(run)
            cursor = 0
        elif held[-1].times[-1] < run.times[0] or (
            held[-1].times[-1] == run.times[0] and held[-1].keys()[-1] < run.keys()[0]
        ):
            held.append(run)
        else:
            held, cursor = [_merged(held, cursor, run)], 0
    for i, run in enumerate(held):
        yield from run.items[cursor:] if i == 0 else run.items


def _merged(held: list[SortedRun[_T]], cursor: int, run: SortedRun[_T]) -> SortedRun[_T]:
    """One run of the unyielded items of ``held`` and of ``run``, by full sort key."""
    keys: list[SortKey] = []
    items: list[_T] = []
    for i, old in enumerate(held):
        skip = cursor if i == 0 else 0
        keys.extend(old.keys()[skip:])
        items.extend(old.items[skip:])
    keys.extend(run.keys())
    items.extend(run.items)
    # Keys are unique (they end in chunk sequence and position), so items never compare.
    pairs = sorted(zip(keys, items, strict=True), key=itemgetter(0))
    merged_keys = [k for k, _ in pairs]
    return SortedRun([k[0] for k in merged_keys], [item for _, item in pairs], lambda: merged_keys)


def summary_from_chunks(
    uri: str,
    fmt: BagFormat,
    size: int,
    connections: tuple[Connection, ...],
    chunks: tuple[ChunkRef, ...],
    compression: str,
) -> BagSummary:
    """A :class:`BagSummary` of a chunked bag from its connections and chunk index."""
    topics: dict[str, list[Connection]] = {}
    for conn in connections:
        topics.setdefault(conn.topic, []).append(conn)
    summaries = []
    for topic, conns in topics.items():
        ids = {c.id for c in conns}
        holding = [
            ch for ch in chunks if ch.counts is not None and any(ch.counts.get(i) for i in ids)
        ]
        count = sum(n for ch in holding for i, n in (ch.counts or {}).items() if i in ids)
        freq = None
        if count > 1 and holding:
            span = max(ch.end_time for ch in holding) - min(ch.start_time for ch in holding)
            freq = (count - 1) / (span / 1e9) if span > 0 else None
        summaries.append(TopicSummary(topic, conns[0].msgtype, count, freq))
    nonempty = [
        ch
        for ch in chunks
        if ch.end_time > ch.start_time and (ch.counts is None or any(ch.counts.values()))
    ]
    start = min((ch.start_time for ch in nonempty), default=0)
    end = max((ch.end_time for ch in nonempty), default=0)
    total = sum(n for ch in chunks if ch.counts is not None for n in ch.counts.values())
    return BagSummary(
        uri=uri,
        format=fmt,
        size=size,
        start=start,
        end=end,
        message_count=total,
        topics=tuple(sorted(summaries, key=lambda t: t.topic)),
        chunk_count=len(chunks),
        compression=compression,
        indexed=True,
    )
