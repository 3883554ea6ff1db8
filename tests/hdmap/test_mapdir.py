"""Map directories: content-hash plans, incremental and idempotent updates, the build lock,
and atomicity under SIGKILL (real child processes killed mid-build)."""

from __future__ import annotations

import builtins
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from fsspec.asyn import AsyncFileSystem

from adcloud.hdmap import mapdir as mapdir_module
from adcloud.hdmap.build import _parent_state
from adcloud.hdmap.diff import diff_versions
from adcloud.hdmap.errors import BuildError, HdmapError, MapFormatError
from adcloud.hdmap.mapdir import (
    CURRENT_NAME,
    LOCK_NAME,
    BuildPlan,
    LockInfo,
    Manifest,
    MapDir,
    MapDirSettings,
    Staging,
    content_hash,
    drive_name,
    find_bags,
)

REPO = Path(__file__).resolve().parents[2]


def make_bag(path: Path, seed: int, size: int = 4096) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry below root (files and directories) with its size and mtime in ns."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def record_build(calls: list[BuildPlan]):  # type: ignore[no-untyped-def]
    """A build step that writes one product per new drive on top of the parent's."""

    def build(plan: BuildPlan, staging: Staging) -> None:
        calls.append(plan)
        staging.copy_from_parent()
        (staging.path / "trajectory").mkdir(exist_ok=True)
        for d in plan.new_drives:
            (staging.path / "trajectory" / f"{d.name}.tum").write_text(d.sha256)

    return build


# --------------------------------------------------------------------------- hashing


def test_content_hash_of_file_and_rosbag2_directory(tmp_path: Path) -> None:
    bag = make_bag(tmp_path / "a.bag", 1, 100_000)
    digest, size = content_hash(bag, chunk_bytes=4096)  # streamed in small chunks
    assert digest == hashlib.sha256(bag.read_bytes()).hexdigest()
    assert size == 100_000
    r2 = tmp_path / "r2"
    make_bag(r2 / "metadata.yaml", 2, 100)
    make_bag(r2 / "r2_0.db3", 3, 1000)
    d1, s1 = content_hash(r2)
    assert s1 == 1100
    h = hashlib.sha256()
    for name in ("metadata.yaml", "r2_0.db3"):  # sorted, each as size + bytes
        data = (r2 / name).read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    assert d1 == h.hexdigest()
    make_bag(r2 / "r2_0.db3", 4, 1000)
    assert content_hash(r2)[0] != d1
    with pytest.raises(HdmapError, match="no such bag"):
        content_hash(tmp_path / "missing.bag")


def test_find_bags_and_drive_names(tmp_path: Path) -> None:
    root = tmp_path / "drives"
    make_bag(root / "2024-01-01" / "a.bag", 1)
    make_bag(root / "2024-01-02" / "b.mcap", 2)
    make_bag(root / "2024-01-02" / "notes.txt", 3)
    make_bag(root / "r2" / "metadata.yaml", 4)
    make_bag(root / "r2" / "r2_0.mcap", 5)  # part of the rosbag2 bag, not a bag itself
    make_bag(root / "x.bag.truth" / "poses.bag", 6)
    make_bag(root / ".partial" / "c.bag", 7)
    found = find_bags(root)
    assert found == [
        f"{root}/2024-01-01/a.bag",
        f"{root}/2024-01-02/b.mcap",
        f"{root}/r2",
    ]
    assert find_bags(root / "r2") == [str(root / "r2")]
    assert find_bags(root / "2024-01-01" / "a.bag") == [str(root / "2024-01-01" / "a.bag")]
    make_bag(tmp_path / "empty" / "x.txt", 1)
    with pytest.raises(HdmapError, match="no bags found"):
        find_bags(tmp_path / "empty")
    with pytest.raises(HdmapError, match="no such file"):
        find_bags(tmp_path / "nope")
    assert find_bags(f"{root}/2024-*/*.bag") == [f"{root}/2024-01-01/a.bag"]
    assert find_bags(f"{root}/*") == found  # each match searched like a --bags directory
    with pytest.raises(HdmapError, match="matches nothing"):
        find_bags(f"{root}/1999-*")
    fs = fsspec.filesystem("memory")
    base = f"/find-bags-{os.getpid()}-{time.monotonic_ns()}"
    fs.pipe_file(f"{base}/n1/x.bag", b"1")
    fs.pipe_file(f"{base}/n2/y.mcap", b"2")
    fs.pipe_file(f"{base}/n2/z.txt", b"3")
    assert [drive_name(u) for u in find_bags(f"memory://{base}/*")] == ["x", "y"]
    assert [drive_name(u) for u in found] == ["a", "b", "r2"]
    assert drive_name("s3://bucket/drives/run 7.bag") == "run_7"


def test_a_bag_named_with_glob_characters_is_found(tmp_path: Path) -> None:
    """A name that exists is taken literally, glob characters and all ("[2]" as a pattern
    matches only "2"); a name that does not exist is still a pattern."""
    root = tmp_path / "b sp"
    bracket = make_bag(root / "my drive [2].bag", 1)
    plain = make_bag(root / "my drive 2.bag", 2)  # what "[2]" matches as a pattern
    star = make_bag(root / "what*?.bag", 3)
    assert find_bags(bracket) == [str(bracket)]
    assert find_bags(star) == [str(star)]
    runs = tmp_path / "runs [old]"
    make_bag(runs / "a.bag", 4)
    assert find_bags(runs) == [f"{runs}/a.bag"]
    assert find_bags(f"{root}/my drive [0-9].bag") == [str(plain)]
    assert find_bags(f"{tmp_path}/*") == sorted(
        [str(bracket), str(plain), str(star), f"{runs}/a.bag"]
    )
    fs = fsspec.filesystem("memory")
    base = f"/glob-names-{os.getpid()}-{time.monotonic_ns()}"
    fs.pipe_file(f"{base}/x [2].bag", b"1")
    assert find_bags(f"memory://{base}/x [2].bag") == [f"memory://{base}/x [2].bag"]


# --------------------------------------------------------------------------- planning


def test_plan_compares_content_not_names(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    a = make_bag(tmp_path / "in" / "a.bag", 1)
    b = make_bag(tmp_path / "in" / "b.bag", 2)
    plan = md.plan([a, b])
    assert plan.parent is None and [d.name for d in plan.new_drives] == ["a", "b"]
    assert plan.new_drives[0].sha256 == hashlib.sha256(a.read_bytes()).hexdigest()
    calls: list[BuildPlan] = []
    md.update([a, b], record_build(calls), settings={"resolution": 0.05})

    moved = tmp_path / "elsewhere" / "a-renamed.bag"
    moved.parent.mkdir()
    a.rename(moved)  # same bytes under a new name: known
    make_bag(b, 99)  # new bytes under the old name: new, with a distinct drive name
    c = make_bag(tmp_path / "in" / "c.bag", 3)
    dup = tmp_path / "in" / "c-copy.bag"
    dup.write_bytes(c.read_bytes())
    plan = md.plan([moved, b, c, dup])
    assert [d.name for d in plan.known_drives] == ["a"]
    assert plan.renamed == ((str(a), str(moved)),)
    new_names = [d.name for d in plan.new_drives]
    sha_b = hashlib.sha256(b.read_bytes()).hexdigest()
    assert new_names == [f"b-{sha_b[:8]}", "c"]
    assert plan.duplicates == (str(dup),)
    assert [d.name for d in plan.removed] == ["b"]  # old b bytes are not among the inputs
    assert not plan.up_to_date


def test_trust_mtime_skips_reading_unchanged_bags(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    md = MapDir(tmp_path / "map")
    a = make_bag(tmp_path / "a.bag", 1)
    md.update([a], record_build([]))
    caplog.set_level(logging.INFO, logger="adcloud.hdmap.mapdir")
    caplog.clear()
    assert md.plan([a], trust_mtime=True).up_to_date
    assert "hashing" not in caplog.text
    assert md.plan([a]).up_to_date
    assert "hashing" in caplog.text
    # a bag rewritten in place: its size or mtime changed, so it is read, and it is new
    caplog.clear()
    a.write_bytes(random.Random(9).randbytes(4096))
    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert [d.name for d in md.plan([a], trust_mtime=True).new_drives] == [
        "a-" + content_hash(a)[0][:8]
    ]
    assert "hashing" in caplog.text


def test_trust_mtime_needs_a_modification_time_and_covers_held_out_bags(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    md = MapDir(tmp_path / "map")
    a, b = make_bag(tmp_path / "a.bag", 1), make_bag(tmp_path / "b.bag", 2)
    md.update([a], record_build([]))
    md.update([a, b], record_build([]))
    md.roll_back()  # b is held out
    caplog.set_level(logging.INFO, logger="adcloud.hdmap.mapdir")
    caplog.clear()
    plan = md.plan([a, b], trust_mtime=True)
    assert plan.up_to_date and plan.skipped == (str(b),) and "hashing" not in caplog.text
    # a store that gives no modification time: the bag is hashed, trusted or not
    files_type = type(md._files)
    monkeypatch.setattr(files_type, "size_mtime", lambda self, path: (4096, None))
    assert md.plan([a], trust_mtime=True).up_to_date
    assert f"hashing {a}" in caplog.text


def test_update_with_a_plan_hashes_the_bags_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``adcloud hdmap build`` plans first (to skip starting Spark when nothing is new) and
    hands that plan to the build; a build committed in between is still noticed."""
    md = MapDir(tmp_path / "map")
    a = make_bag(tmp_path / "a.bag", 1)
    b = make_bag(tmp_path / "b.bag", 2)
    caplog.set_level(logging.INFO, logger="adcloud.hdmap.mapdir")
    plan = md.plan([a])
    caplog.clear()
    calls: list[BuildPlan] = []
    result = md.update([a], record_build(calls), plan=plan)
    assert result.changed and [d.name for d in calls[-1].new_drives] == ["a"]
    assert "hashing" not in caplog.text
    stale = md.plan([a, b])  # made on version 000001 ...
    md.update([a, b], record_build(calls))  # ... which another build moves on
    caplog.clear()
    again = md.update([a, b], record_build(calls), plan=stale)
    assert not again.changed  # planned anew under the lock: b is in the map already
    assert "hashing" in caplog.text


def test_plan_hashes_several_bags_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bags a plan must read are hashed on ``hash_threads`` threads: two hashes wait for
    each other at a barrier (which breaks after 10 s if they run one after the other), and
    every digest lands on its own bag, in the order the bags were given."""
    bags = [make_bag(tmp_path / "in" / f"d{i}.bag", i, 50_000 + i) for i in range(4)]
    real = mapdir_module._content_hash
    barrier = threading.Barrier(2, timeout=10)

    def meet(files: Any, path: str, chunk: int, control: Any = None) -> tuple[str, int]:
        if Path(path).name in ("d1.bag", "d2.bag"):
            barrier.wait()  # raises BrokenBarrierError if d2 only starts after d1 ended
        return real(files, path, chunk, control)

    monkeypatch.setattr(mapdir_module, "_content_hash", meet)
    md = MapDir(tmp_path / "map", MapDirSettings(hash_threads=2, hash_chunk_bytes=4096))
    progress: list[tuple[int, int]] = []
    plan = md.plan(bags, progress=lambda done, total: progress.append((done, total)))
    assert [d.name for d in plan.new_drives] == ["d0", "d1", "d2", "d3"]
    total = sum(bag.stat().st_size for bag in bags)  # reported as it goes, and at the end
    assert progress and progress[-1] == (total, total)
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)
    for rec, bag in zip(plan.new_drives, bags, strict=True):
        assert rec.sha256 == hashlib.sha256(bag.read_bytes()).hexdigest()
        assert rec.size == bag.stat().st_size
    with pytest.raises(BuildError, match="hash_threads must be >= 1"):
        MapDirSettings(hash_threads=0)


def test_plan_hashes_bags_in_object_storage(
    tmp_path: Path, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bags in an S3 bucket (the S3 test server, through s3fs) hash several at a time to
    the digests of their bytes; with ``trust_mtime`` a bag whose size and S3 modification
    time the map recorded is not read again."""
    fs = fsspec.filesystem("s3")
    local = [make_bag(tmp_path / f"d{i}.bag", i, 300_000 + i) for i in range(3)]
    uris = [f"{s3_bucket}/drives/{bag.name}" for bag in local]
    fs.put([str(bag) for bag in local], uris)
    md = MapDir(tmp_path / "map", MapDirSettings(hash_threads=3, hash_chunk_bytes=65536))
    plan = md.plan(uris)
    assert [d.uri for d in plan.new_drives] == uris
    for rec, bag in zip(plan.new_drives, local, strict=True):
        assert rec.sha256 == hashlib.sha256(bag.read_bytes()).hexdigest()
        assert rec.size == bag.stat().st_size and rec.mtime is not None
    md.update(uris, record_build([]), plan=plan)
    caplog.set_level(logging.INFO, logger="adcloud.hdmap.mapdir")
    assert md.plan(uris, trust_mtime=True).up_to_date
    assert "hashing" not in caplog.text
    fs.pipe_file(uris[1], b"other bytes")  # rewritten: a new size and time, read again
    again = md.plan(uris, trust_mtime=True)
    assert [d.uri for d in again.new_drives] == [uris[1]] and "hashing" in caplog.text


def test_plan_stops_hashing_when_a_bag_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bag that cannot be read fails the plan with its name, and the bag being hashed
    beside it stops at its next chunk instead of being read to the end."""
    bad = make_bag(tmp_path / "bad.bag", 1)
    big = make_bag(tmp_path / "big.bag", 2, 8 << 20)  # 512k chunks of 16 bytes
    real = mapdir_module._content_hash
    started = threading.Event()
    outcome: list[str] = []

    def hashing(files: Any, path: str, chunk: int, control: Any = None) -> tuple[str, int]:
        if Path(path).name == "bad.bag":
            assert started.wait(10)
            raise OSError(errno.EIO, "Input/output error")
        started.set()
        try:
            return real(files, path, chunk, control)
        except BaseException as err:
            outcome.append(type(err).__name__)
            raise

    monkeypatch.setattr(mapdir_module, "_content_hash", hashing)
    md = MapDir(tmp_path / "map", MapDirSettings(hash_threads=2, hash_chunk_bytes=16))
    with pytest.raises(HdmapError, match=rf"{bad}: cannot read the bag: .*Input/output error"):
        md.plan([bad, big])
    assert outcome == ["_HashCancelledError"]
    assert md.current() is None


# --------------------------------------------------------------------------- updates


def test_update_is_incremental_and_idempotent(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    bags = [make_bag(tmp_path / "in" / f"d{i}.bag", i) for i in range(3)]
    calls: list[BuildPlan] = []
    build = record_build(calls)
    first = md.update(bags[:2], build, settings={"resolution": 0.05})
    assert first.changed and first.version is not None and first.version.id == "000001"
    assert [d.name for d in calls[-1].new_drives] == ["d0", "d1"]

    second = md.update(bags, build, settings={"resolution": 0.05})
    assert second.changed and second.version is not None and second.version.id == "000002"
    assert [d.name for d in calls[-1].new_drives] == ["d2"]  # only the new drive
    v2 = second.version
    assert v2.files() == [
        "manifest.json",
        "trajectory/d0.tum",
        "trajectory/d1.tum",
        "trajectory/d2.tum",
    ]
    man = v2.manifest
    assert man.version == "000002" and man.parent == "000001"
    assert [d.added_in for d in man.drives] == ["000001", "000001", "000002"]
    assert all(d.processed_at for d in man.drives)
    assert man.settings == {"resolution": 0.05}
    assert man.adcloud_version
    raw = json.loads((tmp_path / "map" / "versions" / "000002" / "manifest.json").read_text())
    assert raw["format"] == "adcloud.hdmap.manifest" and raw["format_version"] == 1
    assert raw["drives"][2]["size"] == 4096

    before = tree_state(tmp_path / "map")
    n_calls = len(calls)
    again = md.update(bags, build)
    assert not again.changed and again.version is not None and again.version.id == "000002"
    assert len(calls) == n_calls  # nothing processed
    assert tree_state(tmp_path / "map") == before  # and nothing written, not even the lock
    assert (tmp_path / "map" / CURRENT_NAME).read_text() == "000002\n"
    assert not (tmp_path / "map" / LOCK_NAME).exists()


def test_failed_build_leaves_the_map_untouched(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    a, b = make_bag(tmp_path / "a.bag", 1), make_bag(tmp_path / "b.bag", 2)
    md.update([a], record_build([]))
    before = tree_state(tmp_path / "map")

    def broken(plan: BuildPlan, staging: Staging) -> None:
        (staging.path / "half.bin").write_bytes(b"x" * 100)
        raise RuntimeError("stage 3 failed")

    with pytest.raises(RuntimeError, match="stage 3"):
        md.update([a, b], broken)
    after = tree_state(tmp_path / "map")
    assert {k for k in after if not k.startswith("versions")} == {
        k for k in before if not k.startswith("versions")
    }
    assert md.versions() == ["000001"]
    assert not list((tmp_path / "map" / "versions").glob(".staging-*"))
    assert md.lock_holder() is None
    assert md.update([a, b], record_build([])).version.id == "000002"  # type: ignore[union-attr]


def test_gc_keeps_the_last_versions(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map", MapDirSettings(keep_versions=2))
    for i in range(4):
        md.update([make_bag(tmp_path / f"d{i}.bag", i)], record_build([]))
    assert md.versions() == ["000003", "000004"]
    assert md.current().id == "000004"  # type: ignore[union-attr]
    # a version newer than CURRENT (a commit that died before switching) is removed by gc
    with md.begin(md.current()) as st:
        (st.path / "x").write_text("x")
        st.commit(Manifest())
    (tmp_path / "map" / CURRENT_NAME).write_text("000004\n")
    assert md.gc(3) == ["000005"]
    with pytest.raises(BuildError, match="at least 1"):
        md.gc(0)


def test_roll_back_restores_an_earlier_map_and_holds_its_drives_out(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map", MapDirSettings(keep_versions=0))
    # a mistyped --map: said so, and no folder made there (its lock made one)
    with pytest.raises(HdmapError, match=r"no version to roll back: .*no map there"):
        md.roll_back()
    assert not (tmp_path / "map").exists()
    bags = [make_bag(tmp_path / "in" / f"d{i}.bag", i) for i in range(5)]
    calls: list[BuildPlan] = []
    build = record_build(calls)
    v1 = md.update(bags[:2], build, settings={"resolution": 0.05}).version
    with pytest.raises(HdmapError, match="000001 is the first version"):
        md.roll_back()
    v2 = md.update(bags[:3], build, settings={"resolution": 0.1}).version
    assert v1 is not None and v2 is not None and v1.path is not None
    assert (v2.path / "trajectory" / "d2.tum").is_file()  # type: ignore[operator]

    assert md.version("2") == v2  # short ids name versions too
    v3 = md.roll_back()  # the bad build (d2) goes
    assert v3.id == "000003" and md.current() == v3 and v3.path is not None
    assert md.versions() == ["000001", "000002", "000003"]  # nothing deleted
    assert v3.files() == v1.files()
    assert all((v3.path / rel).samefile(v1.path / rel) for rel in v1.files()[1:])
    man = v3.manifest
    assert (man.parent, man.restores) == ("000002", "000001")
    assert man.drives == v1.manifest.drives and man.settings == {"resolution": 0.05}
    assert [d.name for d in man.held_out] == ["d2"]
    assert man.held_out[0].added_in == "000002"
    raw = json.loads((v3.path / "manifest.json").read_text())
    assert raw["format_version"] == 2 and raw["restores"] == "000001"

    # the nightly build with the same bags skips the held-out drive and changes nothing
    plan = md.plan(bags[:3])
    assert plan.up_to_date and plan.skipped == (str(bags[2]),)
    assert not md.update(bags[:3], build).changed
    # a new drive is built; the version still holds d2 out
    v4 = md.update(bags[:4], build).version
    assert v4 is not None and [d.name for d in calls[-1].new_drives] == ["d3"]
    assert [d.name for d in v4.manifest.held_out] == ["d2"]
    assert v4.manifest.restores is None
    # readmission: by name (or SHA-256 prefix), and the bag must be given
    with pytest.raises(HdmapError, match=r"no held-out drive is called 'd9' \(held out: d2"):
        md.plan(bags[:4], readmit=["d9"])
    with pytest.raises(HdmapError, match="d2 are not among the bags given"):
        md.plan([bags[0]], readmit=["d2"])
    sha = v4.manifest.held_out[0].sha256
    assert [d.name for d in md.plan(bags[:4], readmit=[sha[:8]]).new_drives] == ["d2"]
    v5 = md.update(bags[:4], build, readmit=["d2"]).version
    assert v5 is not None and [d.name for d in calls[-1].new_drives] == ["d2"]
    assert v5.manifest.held_out == () and [d.name for d in v5.manifest.drives] == [
        "d0",
        "d1",
        "d3",
        "d2",
    ]
    assert json.loads((v5.path / "manifest.json").read_text())["format_version"] == 1  # type: ignore[operator]

    # rolling back a rollback undoes it; any kept version can be named
    v6 = md.roll_back()
    assert v6.manifest.restores == "000004" and [d.name for d in v6.manifest.held_out] == ["d2"]
    v7 = md.roll_back()
    assert v7.manifest.restores == "000005" and v7.manifest.held_out == ()
    v8 = md.roll_back("1")  # as "000001"
    assert {d.name for d in v8.manifest.held_out} == {"d2", "d3"}
    with pytest.raises(HdmapError, match="000008 is current already"):
        md.roll_back("000008")
    md.gc(2)  # version 000001 goes; 000008, which restores it, keeps its own links
    assert md.versions() == ["000007", "000008"]
    assert v8.read_bytes("trajectory/d0.tum") == v1.manifest.drives[0].sha256.encode()
    with pytest.raises(HdmapError, match="no version 000001 to roll back to; the versions kept"):
        md.roll_back("000001")
    assert md.lock_holder() is None


def test_a_new_drive_is_not_named_like_a_held_out_one(tmp_path: Path) -> None:
    """After a rollback held drive d1 out, another bag also called d1.bag (a drive of
    other bytes: a re-recording, a copy from another car) was built as "d1" too: the map
    held a drive d1 and held out a drive d1, and ``hdmap diff`` between the version with
    the first and the one with the second said no drive was added or taken out. The new
    drive gets a name of its own; a readmitted drive takes its name back."""
    md = MapDir(tmp_path / "map")
    first = make_bag(tmp_path / "in" / "d0.bag", 0)
    held = make_bag(tmp_path / "in" / "d1.bag", 1)

    def build(plan: BuildPlan, staging: Staging) -> None:  # a trajectory per new drive
        staging.copy_from_parent()
        (staging.path / "trajectory").mkdir(exist_ok=True)
        for d in plan.new_drives:
            (staging.path / "trajectory" / f"{d.name}.tum").write_text("0.0 0 0 0 0 0 0 1\n")

    md.update([first], build)
    md.update([first, held], build)
    md.roll_back()  # d1 held out
    other = make_bag(tmp_path / "other" / "d1.bag", 2)
    v4 = md.update([first, other], build).version
    assert v4 is not None
    (new,) = (d for d in v4.manifest.drives if d.added_in == v4.id)
    assert new.name == f"d1-{new.sha256[:8]}" and [d.name for d in v4.manifest.held_out] == ["d1"]
    change = diff_versions(str(tmp_path / "map"), "2", "4")
    assert (change.drives_added, change.drives_removed) == ((new.name,), ("d1",))
    # readmitted, the held-out drive is d1 again
    v5 = md.update([first, held], build, readmit=["d1"]).version
    assert v5 is not None and v5.manifest.held_out == ()
    assert [d.name for d in v5.manifest.drives] == ["d0", new.name, "d1"]


def test_a_rollback_keeps_the_versions_the_builds_keep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``adcloud hdmap rollback`` run without the build's settings file once deleted the
    versions beyond its default 5 of a map whose nightly build keeps 8."""
    from adcloud.cli import main  # noqa: PLC0415

    map_dir = tmp_path / "map"
    md = MapDir(map_dir, MapDirSettings(keep_versions=8))
    for i in range(7):
        md.update(
            [make_bag(tmp_path / f"d{i}.bag", i)], record_build([]), settings={"keep_versions": 8}
        )
    assert len(md.versions()) == 7
    assert main(["hdmap", "rollback", "--map", str(map_dir)]) == 0
    capsys.readouterr()
    assert MapDir(map_dir).versions() == [f"{i:06d}" for i in range(1, 9)]  # none deleted
    # the Python API with its default settings keeps them too; a map that keeps all, all
    MapDir(map_dir).roll_back()
    assert MapDir(map_dir).versions() == [f"{i:06d}" for i in range(2, 10)]
    everything = tmp_path / "all"
    for i in range(7):
        MapDir(everything, MapDirSettings(keep_versions=0)).update(
            [make_bag(tmp_path / f"d{i}.bag", i)], record_build([]), settings={"keep_versions": 0}
        )
    MapDir(everything).roll_back()
    assert len(MapDir(everything).versions()) == 8
    # a settings file asking for more than the builds keep is followed
    small = tmp_path / "small"
    for i in range(4):
        MapDir(small, MapDirSettings(keep_versions=2)).update(
            [make_bag(tmp_path / f"d{i}.bag", i)], record_build([]), settings={"keep_versions": 2}
        )
    assert MapDir(small, MapDirSettings(keep_versions=3)).roll_back().id == "000005"
    assert MapDir(small).versions() == ["000003", "000004", "000005"]


def test_manifest_versions_1_to_3_are_read(tmp_path: Path) -> None:
    rec = {"name": "a", "uri": "/a.bag", "sha256": "ab" * 32, "size": 1}
    doc = {"format": "adcloud.hdmap.manifest", "format_version": 1, "drives": [rec]}
    assert Manifest.from_json(json.dumps(doc), "m").held_out == ()
    assert Manifest.from_json(json.dumps(doc), "m").labels is None
    doc |= {"format_version": 2, "held_out": [rec | {"name": "b"}], "restores": "000003"}
    man = Manifest.from_json(json.dumps(doc), "m")
    assert [d.name for d in man.held_out] == ["b"] and man.restores == "000003"
    assert Manifest.from_json(man.to_json(), "m") == man
    # a label import is recorded in version 3; a manifest without one stays version 1
    imported = Manifest(labels="/labels/fixes.geojson")
    assert json.loads(imported.to_json())["format_version"] == 3
    assert Manifest.from_json(imported.to_json(), "m") == imported
    assert json.loads(Manifest().to_json())["format_version"] == 1
    for bad, match in (
        ({"format_version": 4}, "format_version 4 is not 1 to 3"),
        ({"labels": 7}, "'labels' \\(7\\) is not a file name"),
        ({"held_out": {}}, "'held_out' must be a list"),
        ({"held_out": [{"name": "b"}]}, r"m: held_out\[0\]: missing field 'uri'"),
        ({"restores": "yesterday"}, "'restores'"),
    ):
        with pytest.raises(MapFormatError, match=match):
            Manifest.from_json(json.dumps(doc | bad), "m")


def test_staging_context_aborts_and_rejects_stale_parent(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    md.update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    v1 = md.current()
    with md.begin(v1) as st:
        (st.path / "f").write_text("partial")
        staging_dir = st.path
    assert not staging_dir.exists() and md.lock_holder() is None
    assert md.current() == v1
    st = md.begin(v1)
    with pytest.raises(BuildError, match="still being written"):
        md.begin(v1)
    # someone switched CURRENT behind the build's back: the commit refuses
    (tmp_path / "map" / CURRENT_NAME).write_text("000009\n")
    with pytest.raises(BuildError, match="CURRENT changed"):
        st.commit(Manifest())
    st.abort()
    (tmp_path / "map" / CURRENT_NAME).write_text("000001\n")
    with pytest.raises(BuildError, match="not current"):
        md.begin(None)


def test_copy_from_parent_copies_not_links(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    md.update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    v1 = md.current()
    assert v1 is not None and v1.path is not None
    with md.begin(v1) as st:
        assert st.copy_from_parent("trajectory/a.tum") == ["trajectory/a.tum"]
        (st.path / "trajectory" / "a.tum").write_text("rewritten in place")
        with pytest.raises(MapFormatError, match="nope"):
            st.copy_from_parent("nope")
        st.commit(Manifest())
    assert (v1.path / "trajectory" / "a.tum").read_text() != "rewritten in place"
    assert md.current().read_bytes("trajectory/a.tum") == b"rewritten in place"  # type: ignore[union-attr]


# --------------------------------------------------------------------------- bad directories


def test_broken_map_files_are_reported(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    md.update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    cur = tmp_path / "map" / CURRENT_NAME
    cur.write_text("garbage\n")
    with pytest.raises(MapFormatError, match=r"CURRENT.*not a version id"):
        md.current()
    cur.write_text("000007\n")
    with pytest.raises(MapFormatError, match=r"000007.*does not exist"):
        md.current()
    cur.write_text("000001\n")
    manifest = tmp_path / "map" / "versions" / "000001" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text("{not json")
    with pytest.raises(MapFormatError, match=r"manifest\.json: not valid JSON"):
        md.current()
    data = json.loads(text)
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(MapFormatError, match="format_version 99"):
        md.current()
    data["format_version"] = 1
    del data["drives"][0]["sha256"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(MapFormatError, match=r"drives\[0\]: missing field 'sha256'"):
        md.current()
    with pytest.raises(MapFormatError, match=r"version 000009 .*\(the versions kept: 000001"):
        md.version("9")
    # a path is no version id: export and info read outside the map with it
    (tmp_path / "other" / "versions" / "000001").mkdir(parents=True)
    for bad in ("../../other/versions/000001", "x", "-1"):
        with pytest.raises(MapFormatError, match=r"is not a version id .*ids are numbers"):
            md.version(bad)
    with pytest.raises(HdmapError, match="no such bag"):
        MapDir(tmp_path / "m2").plan([tmp_path / "missing.bag"])
    # a mistyped --map: a file, nothing at all, or a directory no build committed to
    with pytest.raises(HdmapError, match=r"a\.bag is a file, not a map directory"):
        MapDir(tmp_path / "a.bag")
    assert "no map there (nothing at that path)" in MapDir(tmp_path / "typo").no_version_text()
    (tmp_path / "empty").mkdir()
    assert "empty: no version yet" in MapDir(tmp_path / "empty").no_version_text()
    with pytest.raises(BuildError, match="keep_versions"):
        MapDirSettings(keep_versions=-1)


def test_committed_versions_without_current_are_a_damaged_map(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Taken for an empty map, such a map got "no version yet" from ``hdmap info`` and a
    build started a new map over it -- a new origin, no parent -- whose gc deleted the old
    versions. Every reader and the build refuse it, and say how to repair it."""
    from adcloud.cli import main  # noqa: PLC0415

    root = tmp_path / "map"
    md = MapDir(root, MapDirSettings(keep_versions=1))
    keep = MapDir(root, MapDirSettings(keep_versions=0))
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(3)]
    keep.update(bags[:1], record_build([]))
    keep.update(bags[:2], record_build([]))
    (root / CURRENT_NAME).unlink()
    before = tree_state(root)
    damaged = (
        r"CURRENT: missing, but the map holds committed versions 000001, 000002: the map is "
        r"damaged .* Write the id of the version to use into it -- e.g. 000002, the newest, "
        r'as one line "000002"'
    )
    with pytest.raises(MapFormatError, match=damaged):
        md.current()
    with pytest.raises(MapFormatError, match=damaged):
        md.plan(bags)
    with pytest.raises(MapFormatError, match=damaged):
        md.update(bags, record_build([]))
    with pytest.raises(MapFormatError, match=damaged):
        md.roll_back("1")
    assert main(["hdmap", "info", "--map", str(root)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "the map is damaged" in said and "no version yet" not in said
    assert tree_state(root) == before  # nothing deleted, nothing written
    # repaired as the message says, the map builds on its newest version again
    (root / CURRENT_NAME).write_text("000002\n")
    result = md.update(bags, record_build([]))
    assert result.version is not None and result.version.manifest.parent == "000002"


def test_a_failure_after_the_commit_does_not_fail_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Removing old versions comes after the new one is current: whatever fails there
    is logged, and the caller gets the committed version, not an error for a build that
    succeeded (a ``keep_versions=2.5`` once raised a TypeError there; the settings refuse
    it now)."""
    md = MapDir(tmp_path / "map", MapDirSettings(keep_versions=1))
    md.update([make_bag(tmp_path / "a.bag", 1)], record_build([]))

    def broken_gc(keep: int) -> list[str]:
        raise TypeError("slice indices must be integers or None or have an __index__ method")

    monkeypatch.setattr(md, "_gc", broken_gc)
    with caplog.at_level(logging.WARNING, logger="adcloud.hdmap.mapdir"):
        result = md.update([make_bag(tmp_path / "b.bag", 2)], record_build([]))
    assert result.changed and result.version is not None and result.version.id == "000002"
    assert md.current().id == "000002"  # type: ignore[union-attr]
    assert "could not remove old versions: slice indices" in caplog.text
    assert md.lock_holder() is None
    for field, value in (("keep_versions", 2.5), ("hash_threads", True), ("keep_versions", "3")):
        with pytest.raises(BuildError, match=rf"hdmap\.{field} must be a whole number"):
            MapDirSettings(**{field: value})


def test_mapdir_pickles_as_its_description(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map", MapDirSettings(keep_versions=3))
    md.update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    clone = pickle.loads(pickle.dumps(md))
    assert clone.uri == md.uri and clone.settings.keep_versions == 3
    assert clone.current() == md.current()


# --------------------------------------------------------------------------- the lock


def test_lock_excludes_a_second_build(tmp_path: Path) -> None:
    md1 = MapDir(tmp_path / "map")
    md2 = MapDir(tmp_path / "map")
    with md1.lock():
        holder = md2.lock_holder()
        assert holder is not None and holder.pid == os.getpid()
        with pytest.raises(
            BuildError, match=f"another build of this map is running \\(pid {os.getpid()}"
        ):
            md2.begin(None)
        with pytest.raises(BuildError, match="already holds"):
            md1.lock().acquire()
        st = md1.begin(None)  # the holder may build
        (st.path / "x").write_text("1")
        st.commit(Manifest())
        assert md1.lock_holder() is not None  # still held: the lock outlives the staging
    assert md1.lock_holder() is None
    assert md2.current().id == "000001"  # type: ignore[union-attr]


def test_lock_held_by_another_live_process(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from adcloud.hdmap.mapdir import MapDir
        with MapDir(sys.argv[1]).lock():
            Path(sys.argv[2]).write_text("locked")
            time.sleep(60)
        """
    )
    marker = tmp_path / "locked"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "map"), str(marker)], cwd=REPO
    )
    try:
        wait_for(marker, proc)
        with pytest.raises(BuildError, match=f"pid {proc.pid}"):
            MapDir(tmp_path / "map").begin(None)
    finally:
        proc.kill()
        proc.wait()
    # killed: the kernel dropped its flock, the next build takes over
    with MapDir(tmp_path / "map").lock() as lock:
        assert lock.taken_over is not None and lock.taken_over.pid == proc.pid


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_memory_backend_and_stale_locks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fs = fsspec.filesystem("memory")
    uri = f"memory://hdmap-test-{os.getpid()}-{time.monotonic_ns()}/map"
    stage = tmp_path / "stage"
    md = MapDir(uri, MapDirSettings(staging_dir=str(stage)))
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(2)]
    res = md.update(bags[:1], record_build([]))
    assert res.version is not None and res.version.path is None
    assert res.version.uri == f"{md.uri}/versions/000001"
    assert list(stage.iterdir()) == []  # the local staging copy is gone after the upload

    def broken(plan: BuildPlan, staging: Staging) -> None:
        assert staging.path.parent == stage
        (staging.path / "half").write_text("x")
        raise RuntimeError("killed stage")

    with pytest.raises(RuntimeError):
        md.update(bags, broken)
    assert list(stage.iterdir()) == [] and md.versions() == ["000001"]
    res = md.update(bags, record_build([]))
    assert res.version.files() == ["manifest.json", "trajectory/d0.tum", "trajectory/d1.tum"]  # type: ignore[union-attr]
    local = res.version.fetch(tmp_path / "copy")  # type: ignore[union-attr]
    assert (local / "trajectory" / "d1.tum").read_text() == res.plan.new_drives[0].sha256
    assert not md.update(bags, record_build([])).changed

    lock_path = md._path(LOCK_NAME)  # a lock left by a dead process of this host
    stale = LockInfo(dead_pid(), socket.gethostname(), "2024-01-01T00:00:00Z", md.uri)
    fs.pipe_file(lock_path, stale.to_json())
    caplog.set_level(logging.WARNING, logger="adcloud.hdmap.mapdir")
    with md.lock() as lock:
        assert lock.taken_over == stale
    assert f"left by pid {stale.pid}" in caplog.text and "no longer running" in caplog.text
    assert not fs.exists(lock_path)

    other = LockInfo(1, "build-host-7", "2024-01-01T00:00:00Z", md.uri)
    fs.pipe_file(lock_path, other.to_json())
    with pytest.raises(BuildError, match="if no build runs on build-host-7 any more, delete"):
        md.begin(md.current())
    fs.rm(lock_path)


def test_local_store_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(tmp_path / "store"))
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(2)]
    with MapDir("local:///maps/city") as md:
        assert md.uri == "local:///maps/city"
        md.update(bags[:1], record_build([]))
        res = md.update(bags, record_build([]))
        assert res.version is not None and res.version.id == "000002"
        assert (
            res.version.read_bytes("trajectory/d0.tum").decode() == res.plan.known_drives[0].sha256
        )
        assert not md.update(bags, record_build([])).changed
    with MapDir("local:///maps/city") as again:  # another process would see the same
        assert again.current().id == "000002"  # type: ignore[union-attr]
        assert again.versions() == ["000001", "000002"]


def off_the_local_disk(
    backend: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest | None = None,
) -> str:
    """A new map URI on fsspec's in-memory store, in a bucket of the S3 test server (through
    s3fs; ``request`` gives the fixture), or on a local:// adcloud store."""
    if backend == "memory":
        return f"memory://hdmap-test-{os.getpid()}-{time.monotonic_ns()}/map"
    if backend == "s3":
        assert request is not None
        return f"{request.getfixturevalue('s3_bucket')}/maps/map"
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(tmp_path / "store"))
    return "local:///maps/map"


def tile_build(files: dict[str, bytes]):  # type: ignore[no-untyped-def]
    """A build step that writes ``files`` into the new version."""

    def build(plan: BuildPlan, staging: Staging) -> None:
        for rel, data in files.items():
            (staging.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging.path / rel).write_bytes(data)

    return build


def batched(calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The calls of many files, after checking that at most two moved one file (the
    manifest and ``CURRENT``, each written atomically on its own, after the others)."""
    many = [call for call in calls if call[1] > 1]
    assert len(calls) - len(many) <= 2, calls
    return many


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_a_version_moves_to_and_from_an_object_store_in_whole_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, request: pytest.FixtureRequest
) -> None:
    """A version's upload, its download and its carried copies each reach fsspec as one
    call with every file (which s3fs, gcsfs and adlfs send as concurrent requests), not as
    one call per file; the files arrive whole and the manifest is written last."""
    uri = off_the_local_disk(backend, tmp_path, monkeypatch, request)
    tiles = {f"grid/{i}_0.tif": f"tile {i}".encode() for i in range(40)}
    calls: list[tuple[str, int]] = []
    fs_class = type(fsspec.core.url_to_fs(uri)[0])
    # s3fs makes its blocking methods per instance from the coroutines: spy on those
    prefix = "_" if issubclass(fs_class, AsyncFileSystem) else ""
    for name in ("put", "get", "copy"):
        real = getattr(fs_class, prefix + name)

        def count(a: Any, name: str = name) -> None:
            calls.append((name, len(a) if isinstance(a, list) else 1))

        def spy(
            self: Any, a: Any, *args: Any, _real: Any = real, _count: Any = count, **kw: Any
        ) -> Any:
            _count(a)
            return _real(self, a, *args, **kw)

        async def async_spy(
            self: Any, a: Any, *args: Any, _real: Any = real, _count: Any = count, **kw: Any
        ) -> Any:
            _count(a)
            return await _real(self, a, *args, **kw)

        monkeypatch.setattr(fs_class, prefix + name, async_spy if prefix else spy)
    fs_class.clear_instance_cache()  # an instance made before keeps the unwrapped coroutines
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(2)]
    with MapDir(uri) as md:
        md.update(bags[:1], tile_build(tiles))
        assert batched(calls) == [("put", 40)]
        parent = md.current()
        assert parent is not None and parent.files() == sorted([*tiles, "manifest.json"])
        calls.clear()
        with md.begin(parent) as staging:
            root = parent.fetch(tmp_path / "parent")
            assert batched(calls) == [("get", 41)]
            assert (root / "grid" / "7_0.tif").read_bytes() == b"tile 7"
            files = staging.parent_files(root)
            for rel in tiles:
                files.carry(rel, staging.path)
            calls.clear()
            staging.commit(md.plan(bags).manifest())
        assert batched(calls) == [("copy", 40)]
        new = md.current()
        assert new is not None and new.id == "000002"
        assert {rel: new.read_bytes(rel) for rel in tiles} == tiles


@pytest.mark.parametrize("backend", ["memory", "s3", "store"])
def test_a_parent_off_the_local_disk_is_read_and_carried_without_its_tile_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, request: pytest.FixtureRequest
) -> None:
    """A nightly build of a map on an object store downloads the parent version but its
    tile folders; it downloads a tile file only when it reads one, and the tiles it carries
    unchanged are copied on the storage at commit, never downloaded and uploaded again."""
    uri = off_the_local_disk(backend, tmp_path, monkeypatch, request)
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(2)]
    old = {
        "state/origin.json": b"{}",
        "grid/0_0.tif": b"tile 0_0",
        "grid/1_0.tif": b"tile 1_0",
        "grid/preview/1_0.png": b"preview 1_0",
        "state/tiles/0_0.npz": b"sums 0_0",
        "state/tiles/1_0.npz": b"sums 1_0",
    }
    with MapDir(uri) as md:
        md.update(bags[:1], tile_build(old))
        read: list[str] = []
        files_type = type(md._files)
        reading = files_type.open_read

        def spy(self: object, path: str):  # type: ignore[no-untyped-def]
            read.append(path)
            return reading(self, path)  # type: ignore[arg-type]

        monkeypatch.setattr(files_type, "open_read", spy)
        parent = md.current()
        assert parent is not None
        with md.begin(parent) as staging:
            root = parent.fetch(tmp_path / "parent", skip=("grid", "state/tiles"))
            got = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
            assert got == ["manifest.json", "state/origin.json"]
            files = staging.parent_files(root)
            assert files.names("grid") == ["0_0.tif", "1_0.tif"]
            assert files.names("state/tiles") == ["0_0.npz", "1_0.npz"]
            # a tile the build merges is downloaded when asked for
            assert files.local("state/tiles/0_0.npz").read_bytes() == b"sums 0_0"
            # the others are carried
            for rel in ("grid/1_0.tif", "grid/preview/1_0.png", "state/tiles/1_0.npz"):
                files.carry(rel, staging.path)
            with pytest.raises(MapFormatError, match=r"grid/2_0\.tif: missing from the previous"):
                files.carry("grid/2_0.tif", staging.path)
            (staging.path / "grid").mkdir()
            (staging.path / "grid" / "0_0.tif").write_bytes(b"tile 0_0, merged")
            staging.commit(md.plan(bags).manifest())
        new = md.current()
        assert new is not None and new.id == "000002"
        assert new.files() == [
            "grid/0_0.tif",
            "grid/1_0.tif",
            "grid/preview/1_0.png",
            "manifest.json",
            "state/tiles/1_0.npz",
        ]
        assert new.read_bytes("grid/1_0.tif") == b"tile 1_0"
        assert new.read_bytes("state/tiles/1_0.npz") == b"sums 1_0"
        assert new.read_bytes("grid/0_0.tif") == b"tile 0_0, merged"
        # the storage copies the carried files itself: fsspec's copy, a local:// tier's link
        assert [p for p in read if "1_0" in p and "/000001/" in p] == []
        if backend == "store":
            links = [p for p in (tmp_path / "store").rglob("objects/*/*") if p.stat().st_nlink == 2]
            assert len(links) == 2 * 3  # each carried file's object under both versions
        assert not [p for p in read if p.endswith("/000001/grid/0_0.tif")]  # never read

        # a file both carried and written: nothing is committed
        with md.begin(new) as staging:
            files = staging.parent_files(new.fetch(tmp_path / "again", skip=("grid",)))
            files.carry("grid/1_0.tif", staging.path)
            (staging.path / "grid").mkdir()
            (staging.path / "grid" / "1_0.tif").write_bytes(b"written too")
            with pytest.raises(BuildError, match=r"grid/1_0\.tif were both written and carried"):
                staging.commit(md.plan(bags).manifest())
        assert md.current().id == "000002"  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["memory", "s3", "store"])
def test_roll_back_off_the_local_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, request: pytest.FixtureRequest
) -> None:
    uri = off_the_local_disk(backend, tmp_path, monkeypatch, request)
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(2)]
    with MapDir(uri, MapDirSettings(staging_dir=str(tmp_path / "stage"))) as md:
        md.update(bags[:1], tile_build({"grid/0_0.tif": b"tile 0_0", "trajectory/d0.tum": b"0"}))
        md.update(bags, tile_build({"grid/0_0.tif": b"tile 0_0, merged"}))
        version = md.roll_back()
        assert version.id == "000003" and version.manifest.restores == "000001"
        assert version.files() == ["grid/0_0.tif", "manifest.json", "trajectory/d0.tum"]
        assert version.read_bytes("grid/0_0.tif") == b"tile 0_0"
        assert md.plan(bags).skipped == (md.plan(bags).held_out[0].uri,)
    with MapDir(uri) as again:
        assert again.current() == version


@pytest.mark.parametrize("backend", ["local", "memory", "s3"])
def test_export_copies_a_version_out_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, request: pytest.FixtureRequest
) -> None:
    uri = (
        str(tmp_path / "map")
        if backend == "local"
        else off_the_local_disk(backend, tmp_path, monkeypatch, request)
    )
    files = {"lanelet2_map.osm": b"<osm/>", "pointcloud_map/0_0.pcd": b"pcd", "state/x.npz": b"s"}
    with MapDir(uri) as md:
        md.update([make_bag(tmp_path / "a.bag", 1)], tile_build(files))
        version = md.current()
        assert version is not None
        names = version.export(tmp_path / "out", lambda rel: not rel.startswith("state/"))
        assert names == ["lanelet2_map.osm", "manifest.json", "pointcloud_map/0_0.pcd"]
        assert (tmp_path / "out" / "pointcloud_map" / "0_0.pcd").read_bytes() == b"pcd"
        assert not (tmp_path / "out" / "state").exists()
        if version.path is not None:  # a copy: editing it leaves the map alone
            assert (tmp_path / "out" / "lanelet2_map.osm").stat().st_ino != (
                version.path / "lanelet2_map.osm"
            ).stat().st_ino
        with pytest.raises(HdmapError, match="out: exists and is not an empty directory"):
            version.export(tmp_path / "out", lambda rel: True)
        (tmp_path / "empty").mkdir()
        assert len(version.export(tmp_path / "empty", lambda rel: True)) == 4

        # the disk fills up halfway: nothing is left, neither the target nor the partial copy
        real_open = builtins.open

        def full(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if str(file).endswith(".pcd") and "w" in mode:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", full)
        with pytest.raises(OSError, match="No space left"):
            version.export(tmp_path / "half", lambda rel: True)
        monkeypatch.undo()
        assert not (tmp_path / "half").exists()
        assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


# --------------------------------------------------------------------------- SIGKILL


def wait_for(marker: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError("child did not get there in time")
        time.sleep(0.01)


HALFWAY_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from adcloud.hdmap.mapdir import MapDir
    md = MapDir(sys.argv[1])
    plan = md.plan(sys.argv[3:])
    st = md.begin(plan.parent)
    st.copy_from_parent()
    (st.path / "tiles").mkdir(exist_ok=True)
    for i in range(10_000):
        (st.path / "tiles" / f"{i}.bin").write_bytes(b"new" * 1000)
        if i == 20:
            Path(sys.argv[2]).write_text("halfway")
        time.sleep(0.005)
    st.commit(plan.manifest())
    """
)


def test_sigkill_halfway_leaves_previous_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "map"
    md = MapDir(root)
    a, b = make_bag(tmp_path / "a.bag", 1), make_bag(tmp_path / "b.bag", 2)
    md.update([a], record_build([]))
    v1 = md.current()
    assert v1 is not None
    v1_files = {rel: v1.read_bytes(rel) for rel in v1.files()}

    marker = tmp_path / "halfway"
    proc = subprocess.Popen(
        [sys.executable, "-c", HALFWAY_BUILD, str(root), str(marker), str(a), str(b)], cwd=REPO
    )
    try:
        wait_for(marker, proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # the previous version is current, complete and readable
    reader = MapDir(root)
    cur = reader.current()
    assert cur is not None and cur.id == "000001"
    assert {rel: cur.read_bytes(rel) for rel in cur.files()} == v1_files
    assert reader.versions() == ["000001"]
    partial = list((root / "versions").glob(".staging-*"))
    assert len(partial) == 1 and len(list((partial[0] / "tiles").iterdir())) > 20
    holder = reader.lock_holder()
    assert holder is not None and holder.pid == proc.pid  # the dead build's lock is there

    # the next build takes the stale lock over, cleans the partial version and succeeds
    caplog.set_level(logging.WARNING, logger="adcloud.hdmap.mapdir")
    res = reader.update([a, b], record_build([]))
    assert res.changed and res.version is not None
    assert f"taking over the build lock left by pid {proc.pid}" in caplog.text
    assert "removing .staging-000002" in caplog.text
    assert res.version.id == "000002"  # the dead build's id was never visible: reused
    assert [d.name for d in res.version.manifest.drives] == ["a", "b"]
    assert not list((root / "versions").glob(".staging-*"))
    assert reader.lock_holder() is None


KILLED_OFF_DISK_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from adcloud.hdmap.build import _parent_state
    from adcloud.hdmap.mapdir import MapDir, MapDirSettings
    md = MapDir(sys.argv[1], MapDirSettings(staging_dir=sys.argv[2]))
    st = md.begin(md.current())
    with _parent_state(st) as (parent, _, _):
        (st.path / "half").write_bytes(b"x" * 1000)
        Path(sys.argv[3] + ".tmp").write_text(f"{st.path}\\n{parent}")
        Path(sys.argv[3] + ".tmp").rename(sys.argv[3])
        time.sleep(60)
    """
)


def test_sigkill_of_a_build_off_the_local_disk_leaves_nothing_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build of a map on a store stages the version in a local directory and downloads
    the parent into another; killed outright, it leaves both (and its lock). The next build
    on the host takes the lock over and removes both directories -- even when the dead
    build's process id names a live process by then (a restarted container's new build)."""
    uri = off_the_local_disk("store", tmp_path, monkeypatch)
    stage, tmp = tmp_path / "stage", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    settings = MapDirSettings(staging_dir=str(stage))
    bags = [make_bag(tmp_path / f"d{i}.bag", i) for i in range(2)]
    with MapDir(uri, settings) as md:
        md.update(bags[:1], record_build([]))
    marker = tmp_path / "staged"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_OFF_DISK_BUILD, uri, str(stage), str(marker)], cwd=REPO
    )
    try:
        wait_for(marker, proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    staged, parent = map(Path, marker.read_text().splitlines())
    assert staged.parent == stage and (staged / "half").is_file()
    # the parent's copy too goes where the settings made room, not to a small /tmp
    assert parent.parent == stage and (parent / "manifest.json").is_file()

    with MapDir(uri, settings) as md:
        holder = md.lock_holder()
        assert holder is not None and holder.pid == proc.pid
        # the dead build's pid now names a live process: this one
        reused = dataclasses.replace(holder, pid=os.getpid())
        md._files.write_atomic(md._path(LOCK_NAME), reused.to_json())
        caplog.set_level(logging.WARNING, logger="adcloud.hdmap.mapdir")

        def build(plan: BuildPlan, staging: Staging) -> None:  # as build_map's steps go
            with _parent_state(staging):
                record_build([])(plan, staging)

        res = md.update(bags, build)
        assert res.changed and res.version is not None and res.version.id == "000002"
        assert f"taking over the build lock left by pid {os.getpid()}" in caplog.text
        assert md.lock_holder() is None
    assert not staged.exists() and not parent.exists()
    assert list(stage.iterdir()) == [] and list(tmp.iterdir()) == []


LOOPING_BUILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from adcloud.hdmap.mapdir import MapDir, MapDirSettings, Manifest
    md = MapDir(sys.argv[1], MapDirSettings(keep_versions=3))
    Path(sys.argv[2]).write_text("started")
    while True:
        st = md.begin(md.current())
        for i in range(20):
            (st.path / f"part-{i:02d}").write_text(st.version_id * 50)
        st.commit(Manifest(settings={"files": 20}))
    """
)


def check_complete(md: MapDir) -> str | None:
    """The current version's id after checking that every file is there and belongs to it."""
    cur = md.current()
    if cur is None:
        return None
    files = cur.files()
    assert files == ["manifest.json"] + [f"part-{i:02d}" for i in range(20)]
    for rel in files[1:]:
        assert cur.read_bytes(rel).decode() == cur.id * 50
    assert cur.manifest.version == cur.id
    return cur.id


def test_sigkill_at_random_moments_never_exposes_a_partial_version(tmp_path: Path) -> None:
    root = tmp_path / "map"
    rng = random.Random(20240101)
    seen: list[str | None] = []
    for round_ in range(6):
        marker = tmp_path / f"started-{round_}"
        proc = subprocess.Popen(
            [sys.executable, "-c", LOOPING_BUILD, str(root), str(marker)], cwd=REPO
        )
        try:
            wait_for(marker, proc)
            if round_ == 0:  # at least one commit, however busy the machine
                wait_for(root / CURRENT_NAME, proc)
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
        seen.append(check_complete(MapDir(root)))
    ids = [int(s) for s in seen if s is not None]
    assert len(ids) == len(seen)
    assert ids == sorted(ids)  # the map only moves forward
    assert len(MapDir(root).versions()) <= 4  # gc ran (3 kept, + at most one orphan)


def test_export_refuses_a_target_inside_the_map(tmp_path: Path) -> None:
    from adcloud.hdmap.build import export_map  # noqa: PLC0415

    md = MapDir(tmp_path / "map")
    md.update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    inside = tmp_path / "map" / "versions" / "exported"
    with pytest.raises(HdmapError, match="lies inside the map directory"):
        export_map(str(tmp_path / "map"), inside)
    assert not inside.exists() and md.versions() == ["000001"]
    version, names = export_map(str(tmp_path / "map"), tmp_path / "out")
    assert version.id == "000001" and names and (tmp_path / "out" / names[0]).is_file()


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_export_for_autoware_refuses_a_version_that_lacks_a_file_autoware_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, request: pytest.FixtureRequest
) -> None:
    """A version whose lanelet2_map.osm (or a listed point-cloud tile) was lost was exported
    for Autoware without it, and the CLI said "Autoware loads it"."""
    from adcloud.hdmap.build import export_map  # noqa: PLC0415

    uri = (
        str(tmp_path / "map")
        if backend == "local"
        else off_the_local_disk(backend, tmp_path, monkeypatch, request)
    )
    whole = {
        "lanelet2_map.osm": b"<osm/>",
        "map_projector_info.yaml": b"projector_type: LocalCartesian\n",
        "pointcloud_map_metadata.yaml": b"x_resolution: 20.0\ny_resolution: 20.0\n"
        b"0_0.pcd: [0.0, 0.0]\n20_0.pcd: [20.0, 0.0]\n",
        "pointcloud_map/0_0.pcd": b"pcd",
        "pointcloud_map/20_0.pcd": b"pcd",
    }
    no_osm = {rel: data for rel, data in whole.items() if rel != "lanelet2_map.osm"}
    no_tile = {rel: data for rel, data in whole.items() if rel != "pointcloud_map/20_0.pcd"}
    with MapDir(uri) as md:
        md.update([make_bag(tmp_path / "a.bag", 1)], tile_build(whole))
        md.update([make_bag(tmp_path / "b.bag", 2)], tile_build(no_osm))
        md.update([make_bag(tmp_path / "c.bag", 3)], tile_build(no_tile))
    with pytest.raises(MapFormatError, match=r"000002: lanelet2_map\.osm missing; Autoware"):
        export_map(uri, tmp_path / "osm", version="2", autoware=True)
    with pytest.raises(MapFormatError, match=r"000003: pointcloud_map/20_0\.pcd missing"):
        export_map(uri, tmp_path / "tile", autoware=True)
    assert not (tmp_path / "osm").exists() and not (tmp_path / "tile").exists()
    _, names = export_map(uri, tmp_path / "car", version="1", autoware=True)
    assert sorted(names) == sorted(whole)
    _, names = export_map(uri, tmp_path / "all")  # not for Autoware: what the version has
    assert "lanelet2_map.osm" in names


def test_export_opens_its_directory_as_the_umask_says_and_follows_a_link(
    tmp_path: Path,
) -> None:
    """The export's directory was left 0700 (a temporary directory renamed into place), so
    a driving stack running as another user could not read it; and an empty directory named
    through a symlink (``/data/map -> /mnt/ssd/map``) failed with "Not a directory"."""
    from adcloud.hdmap.build import export_map  # noqa: PLC0415

    MapDir(tmp_path / "map").update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    old = os.umask(0o022)
    try:
        _, names = export_map(str(tmp_path / "map"), tmp_path / "new")
        assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o755
        real = tmp_path / "ssd"
        real.mkdir()
        real.chmod(0o750)
        (tmp_path / "link").symlink_to(real)
        export_map(str(tmp_path / "map"), tmp_path / "link")
    finally:
        os.umask(old)
    assert (tmp_path / "link").is_symlink() and all((real / rel).is_file() for rel in names)
    assert stat.S_IMODE(real.stat().st_mode) == 0o750  # the directory it replaced
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_export_onto_a_file_says_it_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from adcloud.cli import main  # noqa: PLC0415

    MapDir(tmp_path / "map").update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    afile = tmp_path / "afile"
    afile.write_text("notes")
    assert main(["hdmap", "export", "--map", str(tmp_path / "map"), "--out", str(afile)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"{afile}: is a file, not a directory; give a new (or empty) directory" in said
    assert afile.read_text() == "notes"


def test_export_and_report_urls_are_not_taken_for_relative_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out s3://b/x`` once went to ``./s3:/b/x`` and ``file:///abs`` to ``./file:/abs``
    of the working directory, reported as done; a file:// URL is its path, another URL is
    refused before any work."""
    from adcloud.cli import main  # noqa: PLC0415
    from adcloud.hdmap.build import export_map  # noqa: PLC0415
    from adcloud.hdmap.report import write_report  # noqa: PLC0415
    from adcloud.hdmap.trajectory import Trajectory  # noqa: PLC0415

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    map_dir = str(tmp_path / "map")
    MapDir(map_dir).update([make_bag(tmp_path / "a.bag", 1)], record_build([]))
    out = tmp_path / "out"
    _, names = export_map(map_dir, f"file://{out}")
    assert (out / names[0]).is_file()
    with pytest.raises(HdmapError, match="written to the local disk"):
        export_map(map_dir, "s3://bucket/x")
    assert main(["hdmap", "export", "--map", map_dir, "--out", f"file://{tmp_path}/cli"]) == 0
    assert (tmp_path / "cli" / names[0]).is_file()
    with pytest.raises(SystemExit):
        main(["hdmap", "export", "--map", map_dir, "--out", "s3://bucket/y"])
    said = capsys.readouterr().err
    assert "s3://bucket/y: an export can only be written to the local disk" in said
    traj = Trajectory(np.array([0, 10**9], dtype=np.int64), np.stack([np.eye(4)] * 2))
    page = write_report(f"file://{tmp_path}/report", trajectories=traj)
    assert page == tmp_path / "report" / "summary.html" and page.is_file()
    with pytest.raises(HdmapError, match="written to the local disk"):
        write_report("s3://bucket/report", trajectories=traj)
    with pytest.raises(SystemExit):
        main(["hdmap", "eval", "--map", map_dir, "--truth", "t", "--report", "gs://b/r"])
    assert list(work.iterdir()) == []  # nothing below ./file: or ./s3:
    # a map given as FILE:// (fsspec knows only the lower-case scheme)
    assert MapDir(f"FILE://{map_dir}").current() == MapDir(map_dir).current()


def test_a_report_is_not_written_into_a_committed_version(tmp_path: Path) -> None:
    """``adcloud hdmap eval --report <map>/versions/000003/report`` once rewrote the files of
    version 3 in place -- and so those of version 1, which a rollback had linked them to."""
    from adcloud.hdmap.report import write_report  # noqa: PLC0415
    from adcloud.hdmap.trajectory import Trajectory  # noqa: PLC0415

    def build(plan: BuildPlan, staging: Staging) -> None:
        (staging.path / "report").mkdir()
        (staging.path / "report" / "summary.html").write_text(f"built {staging.version_id}")

    md = MapDir(tmp_path / "map")
    md.update([make_bag(tmp_path / "a.bag", 1)], build)
    md.update([make_bag(tmp_path / "b.bag", 2)], build)
    restored = md.roll_back()
    assert restored.path is not None and restored.id == "000003"
    page = restored.path / "report" / "summary.html"
    assert page.samefile(tmp_path / "map" / "versions" / "000001" / "report" / "summary.html")
    traj = Trajectory(np.array([0, 10**9], dtype=np.int64), np.stack([np.eye(4)] * 2))
    with pytest.raises(HdmapError, match="inside the committed map version"):
        write_report(restored.path / "report", trajectories=traj)
    with pytest.raises(HdmapError, match="inside the committed map version"):
        write_report(restored.path / "report" / "eval", trajectories=traj)
    assert page.read_text() == "built 000001"
    assert not (restored.path / "report" / "eval").exists()
    assert write_report(tmp_path / "map" / "eval", trajectories=traj).is_file()  # beside: fine


def test_a_build_needs_bags(tmp_path: Path) -> None:
    from adcloud.hdmap.build import bag_uris, plan_build  # noqa: PLC0415

    with pytest.raises(HdmapError, match="no bags given"):
        plan_build([], str(tmp_path / "map"))
    bag = make_bag(tmp_path / "a.bag", 1)
    assert bag_uris(Path(bag)) == bag_uris(str(bag)) == bag_uris([Path(bag)])
