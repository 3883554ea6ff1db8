"""A separate process for the store's crash and concurrency tests.

    python tests/store/_worker.py MODE ARGS...

It opens the local store from the environment (``ADCLOUD_STORE_ROOT``) exactly as a Spark
executor would, does one thing, and reports progress on stdout, one word per line, so the
test can kill it at a precise moment.
"""

from __future__ import annotations

import errno
import os
import random
import sys
import time
import zlib

from adcloud.store import LocalStore, StoreError, WriteType


def payload(seed: int, size: int) -> bytes:
    """Self-describing content: 8-byte seed, 4-byte size, bytes drawn from the seed."""
    body = random.Random(seed).randbytes(size)
    return seed.to_bytes(8, "little") + size.to_bytes(4, "little") + body


def check_payload(data: bytes) -> str | None:
    """``None`` if ``data`` is one complete payload, else what is wrong with it."""
    if len(data) < 12:
        return f"only {len(data)} bytes"
    seed = int.from_bytes(data[:8], "little")
    size = int.from_bytes(data[8:12], "little")
    if len(data) != 12 + size:
        return f"length {len(data)} but header says {12 + size}"
    if data[12:] != random.Random(seed).randbytes(size):
        return f"content of seed {seed} is not what the seed produces"
    return None


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "slow-write":
        key = argv[1]
        write_type = WriteType.parse(argv[2]) if len(argv) > 2 else WriteType.MUST_CACHE
        store = LocalStore("local://", background=False)
        with store.open(key, "wb", write_type=write_type) as stream:
            for i in range(100_000):
                stream.write(os.urandom(256 << 10))
                if i == 3:
                    print("writing", flush=True)
                time.sleep(0.005)
        return 1  # never reached: the test kills us
    if mode == "async-put":
        key, size, seed = argv[1], int(argv[2]), int(argv[3])
        store = LocalStore("local://", background=False)
        store.put(key, payload(seed, size), write_type=WriteType.ASYNC_THROUGH)
        print("acked", flush=True)
        time.sleep(3600)
        return 1
    if mode == "slow-persist":
        key, size, seed = argv[1], int(argv[2]), int(argv[3])
        store = LocalStore("local://", background=False)
        store.put(key, payload(seed, size), write_type=WriteType.ASYNC_THROUGH)
        from adcloud.store import _understore  # noqa: PLC0415

        real_write = _understore.UfsStaging.write

        def stalled(self: _understore.UfsStaging, data: bytes | memoryview) -> None:
            real_write(self, data)
            print("persisting", flush=True)
            time.sleep(3600)

        _understore.UfsStaging.write = stalled  # type: ignore[method-assign]
        store.maintain()
        return 1
    if mode == "through-stalled":
        # a THROUGH put that stalls (to be killed) just before or just after its copy
        # replaces the under-store file, i.e. before its catalog row commits
        key, size, seed, when = argv[1], int(argv[2]), int(argv[3]), argv[4]
        from adcloud.store import _understore  # noqa: PLC0415

        real_publish = _understore.UfsStaging.publish

        def stalled_publish(self: _understore.UfsStaging) -> None:
            if when == "after":
                real_publish(self)
            print("stalled", flush=True)
            time.sleep(3600)

        _understore.UfsStaging.publish = stalled_publish  # type: ignore[method-assign]
        store = LocalStore("local://", background=False)
        store.put(key, payload(seed, size), write_type=WriteType.THROUGH)
        return 1
    if mode == "rename-stalled":
        # a rename that stalls (to be killed) just before or just after it moves the
        # under-store copy, i.e. before its catalog change commits
        src, dst, when = argv[1], argv[2], argv[3]
        from adcloud.store import _understore  # noqa: PLC0415

        real_rename = _understore.UnderStore.rename

        def stalled_rename(self: _understore.UnderStore, s: str, d: str) -> None:
            if when == "after":
                real_rename(self, s, d)
            print("stalled", flush=True)
            time.sleep(3600)

        _understore.UnderStore.rename = stalled_rename  # type: ignore[method-assign]
        store = LocalStore("local://", background=False)
        store.rename(src, dst)
        return 1
    if mode == "delete-stalled":
        # a delete that stalls (to be killed) after its catalog change committed, before
        # it removes the under-store copies
        key, recursive = argv[1], argv[2] == "recursive"

        def stalled_removal(self: LocalStore, *args: object, **kwargs: object) -> None:
            print("stalled", flush=True)
            time.sleep(3600)

        LocalStore._delete_ufs_copies = stalled_removal  # type: ignore[method-assign,assignment]
        store = LocalStore("local://", background=False)
        store.delete(key, recursive=recursive)
        return 1
    if mode == "through-writer":
        key, size, seconds = argv[1], int(argv[2]), float(argv[3])
        store = LocalStore("local://", background=False)
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            store.put(key, payload(n, size), write_type=WriteType.THROUGH)
            n += 1
            if n == 1:
                print("writing", flush=True)
        store.close()
        print(f"done {n}", flush=True)
        return 0
    if mode == "hold-space-lock":
        store = LocalStore("local://", background=False)
        with store._space.hold():
            print("locked", flush=True)
            time.sleep(3600)
        return 1
    if mode == "enospc-put":
        # Every write into a staging file of the MEM or SSD tier fails with ENOSPC, as on
        # a full filesystem; used where this sandbox cannot mount a tiny tmpfs.
        key, size, seed = argv[1], int(argv[2]), int(argv[3])
        full_dirs = tuple(argv[4:])
        real_write = os.write

        def full_write(fd: int, data: bytes | memoryview) -> int:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(full_dirs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        os.write = full_write
        store = LocalStore("local://", background=False)
        try:
            store.put(key, payload(seed, size), write_type=WriteType.MUST_CACHE)
        except StoreError as err:
            print(f"error {type(err).__name__}: {err}", flush=True)
            return 3
        print(f"stored {store.stat(key).tier}", flush=True)
        return 0
    if mode == "writer":
        ident, rounds, nkeys, size = (int(a) for a in argv[1:5])
        store = LocalStore("local://")
        rng = random.Random(ident)
        for r in range(rounds):
            key = f"/shared/k{rng.randrange(nkeys)}"
            seed = ident * 1_000_000 + r
            wt = rng.choice([WriteType.MUST_CACHE, WriteType.ASYNC_THROUGH])
            store.put(key, payload(seed, size + rng.randrange(size)), write_type=wt)
        store.flush(timeout=60)
        store.close()
        print("done", flush=True)
        return 0
    if mode == "reader":
        rounds, nkeys = int(argv[1]), int(argv[2])
        store = LocalStore("local://")
        rng = random.Random(os.getpid())
        seen = done = 0
        # until the first key appears, rounds do not count: a reader that starts before the
        # writers (a loaded machine starts processes slowly) would otherwise read nothing
        deadline = time.monotonic() + 60
        while done < rounds:
            key = f"/shared/k{rng.randrange(nkeys)}"
            try:
                if rng.random() < 0.5:
                    data = store.get(key)
                else:
                    with store.open(key) as stream:
                        data = stream.read()
            except StoreError as err:
                if "does not exist" in str(err):
                    if seen == 0 and time.monotonic() < deadline:
                        time.sleep(0.002)
                    else:
                        done += 1
                    continue
                print(f"error {type(err).__name__}: {err}", flush=True)
                return 2
            problem = check_payload(data)
            if problem is not None:
                print(f"torn read of {key}: {problem} (crc {zlib.crc32(data):08x})", flush=True)
                return 2
            seen += 1
            done += 1
        store.close()
        print(f"done {seen}", flush=True)
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
