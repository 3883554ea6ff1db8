"""Whole drives: determinism, every format read back by rosbags, ROS 1 tools and BinPipe."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from mcap.reader import make_reader
from pyspark.sql import SparkSession
from rosbags.highlevel import AnyReader

from adcloud.binpipe import BagFormat, plan_partitions, read_partition, summarize
from adcloud.binpipe.rdd import BinPipeRDD
from adcloud.synth import DriveConfig, DriveResult, SynthError, generate_drive
from adcloud.synth.labels import Label

TINY = DriveConfig(
    seconds=1.2,
    seed=5,
    lidar_beams=16,
    lidar_columns=512,
    camera_width=64,
    camera_height=48,
    truth_raster=False,
)
ROSBAG = Path("/usr/bin/rosbag")


def _digest(path: Path) -> dict[str, str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {
        str(f.relative_to(path)) if path.is_dir() else "": hashlib.sha256(
            f.read_bytes()
        ).hexdigest()
        for f in files
    }


def _count(bag: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    with AnyReader([bag]) as reader:
        for conn, _, raw in reader.messages():
            reader.deserialize(raw, conn.msgtype)
            counts[conn.topic] = counts.get(conn.topic, 0) + 1
    return counts


@pytest.fixture(scope="module")
def drives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DriveResult]:
    """The TINY drive in each format and compression, named ``format-compression``."""
    root = tmp_path_factory.mktemp("formats")
    out = {}
    for fmt, comp in (
        ("ros1", "none"),
        ("ros1", "lz4"),
        ("ros1", "bz2"),
        ("ros2", "none"),
        ("mcap", "zstd"),
    ):
        name = f"{fmt}-{comp}"
        config = DriveConfig(
            **{**TINY.__dict__, "format": fmt, "compression": comp, "chunk_bytes": 256 << 10}
        )
        out[name] = generate_drive(config, root / (name + (".bag" if fmt == "ros1" else "")))
    return out


@pytest.mark.parametrize("fmt", ["ros1", "ros2", "mcap"])
def test_same_seed_gives_byte_identical_output(fmt: str, tmp_path: Path) -> None:
    config = DriveConfig(**{**TINY.__dict__, "format": fmt, "camera": fmt == "ros1"})
    name = "drive.bag" if fmt == "ros1" else "drive"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = generate_drive(config, tmp_path / "a" / name)
    b = generate_drive(config, tmp_path / "b" / name)
    assert _digest(a.bag) == _digest(b.bag)
    assert _digest(a.truth) == _digest(b.truth)


def test_different_seeds_give_different_drives(tmp_path: Path) -> None:
    a = generate_drive(TINY, tmp_path / "a.bag")
    b = generate_drive(DriveConfig(**{**TINY.__dict__, "seed": 6}), tmp_path / "b.bag")
    assert a.bag.read_bytes() != b.bag.read_bytes()
    assert (a.truth / "map.geojson").read_text() != (b.truth / "map.geojson").read_text()


def test_every_format_reads_back_with_rosbags(drives: dict[str, DriveResult]) -> None:
    for name, result in drives.items():
        assert _count(result.bag) == result.messages, name
        assert result.message_count > 200


def test_ros1_output_passes_rosbag_info(drives: dict[str, DriveResult]) -> None:
    assert ROSBAG.exists(), (
        "Debian's ROS 1 tools are missing: run scripts/install.sh (python3-rosbag)"
    )
    for name in ("ros1-none", "ros1-lz4", "ros1-bz2"):
        result = drives[name]
        proc = subprocess.run(
            [str(ROSBAG), "info", str(result.bag)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
        assert re.search(rf"^messages:\s+{result.message_count}$", text, re.M), text
        assert re.search(r"/lidar/points\s+\d+ msgs\s+: sensor_msgs/PointCloud2", text), text
        assert re.search(r"sensor_msgs/PointCloud2\s+\[1158d486dd51d683ce2f1be655c3c181\]", text)
        assert re.search(r"tf2_msgs/TFMessage\s+\[94810edda583a504dfda3829e70d7eec\]", text)
        assert re.search(rf"^compression:\s+{name.split('-')[1]} ", text, re.M), text


_ROS1_READ = """
import collections, sys
import rosbag
counts = collections.Counter()
with rosbag.Bag(sys.argv[1]) as bag:
    for topic, msg, t in bag.read_messages():
        assert msg.header.stamp == t if hasattr(msg, "header") else True
        counts[topic] += 1
print(sum(counts.values()))
"""


def test_ros1_python_reads_every_message(drives: dict[str, DriveResult]) -> None:
    """Debian's ROS 1 ``rosbag`` module decompresses and deserializes every message."""
    for name in ("ros1-none", "ros1-lz4", "ros1-bz2"):
        result = drives[name]
        proc = subprocess.run(
            ["/usr/bin/python3", "-c", _ROS1_READ, str(result.bag)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert int(proc.stdout.split()[-1]) == result.message_count


def test_ros1_bags_are_chunked_and_read_back_by_partition(drives: dict[str, DriveResult]) -> None:
    for name in ("ros1-none", "ros1-lz4", "ros2-none", "mcap-zstd"):
        result = drives[name]
        summary = summarize(str(result.bag))
        assert summary.message_count == result.message_count
        parts = plan_partitions(str(result.bag))
        got = sum(1 for part in parts for _ in read_partition(part))
        assert got == result.message_count, name
        if summary.format == BagFormat.ROS1:
            assert summary.chunk_count > 3  # 256 KiB chunks: streamed, not one blob


@pytest.mark.parametrize("name", ["ros1-none", "ros2-none", "mcap-zstd"])
def test_binpipe_rdd_counts_every_message(
    name: str, drives: dict[str, DriveResult], spark: SparkSession
) -> None:
    result = drives[name]
    assert BinPipeRDD.from_bags(spark, [str(result.bag)]).count() == sum(
        _count(result.bag).values()
    )


def test_a_camera_rig_records_every_camera_from_its_own_mount(tmp_path: Path) -> None:
    config = DriveConfig(**{**TINY.__dict__, "lidar": False, "cameras": 4})
    rig = generate_drive(config, tmp_path / "rig.bag")
    single = generate_drive(DriveConfig(**{**TINY.__dict__, "lidar": False}), tmp_path / "one.bag")
    prefixes = ["/camera", "/camera1", "/camera2", "/camera3"]
    frames = rig.messages["/camera/image_raw"]
    assert frames == single.messages["/camera/image_raw"] > 0
    for prefix in prefixes:
        for name in ("image_raw", "labels", "camera_info"):
            assert rig.messages[f"{prefix}/{name}"] == frames
    images: dict[str, list[tuple[int, object]]] = {p: [] for p in prefixes}
    with AnyReader([rig.bag]) as reader:
        for conn, ts, raw in reader.messages():
            if conn.topic == "/tf_static":
                tf = reader.deserialize(raw, conn.msgtype)
                children = {t.child_frame_id: t.header.frame_id for t in tf.transforms}
            elif conn.topic.endswith("/labels"):
                msg = reader.deserialize(raw, conn.msgtype)
                images[conn.topic.removesuffix("/labels")].append((ts, msg))
    for k in (1, 2, 3):
        assert children[f"camera{k}_link"] == "base_link"
        assert children[f"camera{k}_optical"] == f"camera{k}_link"
    for prefix, shots in images.items():
        assert [ts for ts, _ in shots] == [ts for ts, _ in images["/camera"]]
        frame = "camera_optical" if prefix == "/camera" else f"camera{prefix[-1]}_optical"
        assert {m.header.frame_id for _, m in shots} == {frame}  # type: ignore[attr-defined]
    # every camera sees the road it drives on, each from its own direction
    first = [bytes(m.data) for _, m in images["/camera"]]  # type: ignore[attr-defined]
    road = int(Label.ROAD)
    assert any(road in f for f in first)
    for prefix in prefixes[1:]:
        labels = [bytes(m.data) for _, m in images[prefix]]  # type: ignore[attr-defined]
        assert labels != first
        assert any(road in f for f in labels), prefix
    with AnyReader([single.bag]) as reader:
        conns = [c for c in reader.connections if c.topic == "/camera/labels"]
        alone = [bytes(reader.deserialize(r, c.msgtype).data) for c, _, r in reader.messages(conns)]
    assert alone == first  # the forward camera does not change with the rig around it
    world = json.loads((rig.truth / "world.json").read_text())
    assert [c["prefix"] for c in world["camera"]["rig"]] == prefixes
    assert [c["yaw_deg"] for c in world["camera"]["rig"]] == [0.0, 90.0, 180.0, 270.0]
    assert {"camera3_link", "camera3_optical"} <= set(world["frames"])


def test_existing_output_is_refused_unless_overwrite(tmp_path: Path) -> None:
    generate_drive(TINY, tmp_path / "d.bag")
    with pytest.raises(SynthError, match="exists already"):
        generate_drive(TINY, tmp_path / "d.bag")
    again = generate_drive(TINY, tmp_path / "d.bag", overwrite=True)
    assert again.bag.exists()
    with pytest.raises(SynthError, match="does not exist"):
        generate_drive(TINY, tmp_path / "missing" / "d.bag")
    (tmp_path / "a-file").write_text("")
    # a file where the directory belongs is named as such, not as a missing directory
    with pytest.raises(SynthError, match=r"a-file is not a directory"):
        generate_drive(TINY, tmp_path / "a-file" / "d.bag")
    with pytest.raises(SynthError, match="lidar_beams"):
        generate_drive(DriveConfig(lidar_beams=4), tmp_path / "e.bag")


def test_a_run_that_finds_its_output_taken_meanwhile_leaves_the_other_runs_drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs to one path: the one that loses the race fails alone.

    The existence check comes before the world is built (about a second); another run
    that creates the bag in that time must keep it (the loser removed it and the truth,
    failing both runs).
    """
    import adcloud.synth.drive as drive_module  # noqa: PLC0415

    out = tmp_path / "d.bag"
    real_make_route = drive_module.make_route
    other: list[DriveResult] = []

    def other_run_first(*args: object, **kwargs: object) -> object:
        # another run, started at the same time, gets there first
        monkeypatch.setattr(drive_module, "make_route", real_make_route)
        other.append(generate_drive(TINY, out))
        return real_make_route(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(drive_module, "make_route", other_run_first)
    with pytest.raises(SynthError, match="exists already"):
        generate_drive(TINY, out)
    assert other and _count(out) == other[0].messages
    assert (out.parent / "d.bag.truth" / "world.json").is_file()
    # only the truth directory taken: the loser removes its own bag, not the other's truth
    out2 = tmp_path / "e.bag"
    taken = tmp_path / "e.bag.truth"

    def truth_taken(*args: object, **kwargs: object) -> object:
        taken.mkdir()
        (taken / "poses.txt").write_text("# another run's\n")
        return real_make_route(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(drive_module, "make_route", truth_taken)
    with pytest.raises(SynthError, match="exists already"):
        generate_drive(TINY, out2)
    assert not out2.exists()
    assert (taken / "poses.txt").read_text() == "# another run's\n"


def test_an_interrupted_drive_leaves_nothing_behind(tmp_path: Path) -> None:
    def stop(t: float) -> None:
        if t > 0.5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_drive(TINY, tmp_path / "cut.bag", progress=stop)
    assert list(tmp_path.iterdir()) == []
    # overwriting: the drive it was replacing comes back whole
    first = generate_drive(TINY, tmp_path / "kept.bag")
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(KeyboardInterrupt):
        generate_drive(TINY, first.bag, overwrite=True, progress=stop)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_an_error_while_the_truth_is_finished_puts_the_old_drive_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adcloud.synth.truth import TruthWriter  # noqa: PLC0415

    first = generate_drive(TINY, tmp_path / "kept.bag")
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def disk_full(self: object, meta: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TruthWriter, "finish", disk_full)
    with pytest.raises(OSError, match="No space left"):
        generate_drive(TINY, first.bag, overwrite=True)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # the old drive whole, nothing of the new one
    with pytest.raises(OSError, match="No space left"):
        generate_drive(TINY, tmp_path / "new.bag")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.bag", "kept.bag.truth"]


def test_overwrite_replaces_a_drive_only(tmp_path: Path) -> None:
    """``--out precious --overwrite`` must not take a folder of other files with it."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    with pytest.raises(SynthError, match=r"precious is not a bag .* refusing to replace it"):
        generate_drive(TINY, precious, overwrite=True)
    text = tmp_path / "notes.bag"
    text.write_text("not a bag")
    with pytest.raises(SynthError, match=r"notes\.bag is not a bag"):
        generate_drive(TINY, text, overwrite=True)
    drive = generate_drive(TINY, tmp_path / "d.bag")
    (drive.truth / "my-labels.json").write_text("{}")
    with pytest.raises(SynthError, match=r"d\.bag\.truth holds what a drive's truth does not"):
        generate_drive(TINY, drive.bag, overwrite=True)
    assert (precious / "notes.txt").read_text() == "important"
    assert text.read_text() == "not a bag" and (drive.truth / "my-labels.json").exists()


def test_overwrite_keeps_a_folder_that_holds_a_metadata_yaml_among_other_files(
    tmp_path: Path,
) -> None:
    """A ``metadata.yaml`` made any folder a rosbag2 bag: ``--out experiment --overwrite``
    removed the results and notes beside it.  A real rosbag2 drive is still replaced."""
    config = DriveConfig(**{**TINY.__dict__, "format": "mcap", "lidar": False, "camera": False})
    folder = tmp_path / "experiment"
    (folder / "notes").mkdir(parents=True)
    (folder / "metadata.yaml").write_text("author: me\n")
    (folder / "results.csv").write_text("1,2\n")
    with pytest.raises(SynthError, match=r"experiment is not a bag .* refusing to replace it"):
        generate_drive(config, folder, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["metadata.yaml", "notes", "results.csv"]
    assert not (tmp_path / "experiment.truth").exists()
    drive = generate_drive(config, tmp_path / "d")
    again = generate_drive(config, drive.bag, overwrite=True)
    assert sorted(p.name for p in again.bag.iterdir()) == ["d.mcap", "metadata.yaml"]


def test_overwrite_replaces_a_link_to_a_drive_and_keeps_its_target(tmp_path: Path) -> None:
    """``--out latest --overwrite`` where ``latest`` links to a rosbag2 drive: the links
    are replaced by the new drive, the drive they pointed to stays (removing the old link
    ran rmtree on it, which failed after the new drive was in place)."""
    config = DriveConfig(**{**TINY.__dict__, "format": "mcap"})
    target = generate_drive(config, tmp_path / "real")
    before = _digest(target.bag)
    (tmp_path / "latest").symlink_to("real")
    (tmp_path / "latest.truth").symlink_to("real.truth")
    new = generate_drive(config, tmp_path / "latest", overwrite=True)
    assert not new.bag.is_symlink() and not new.truth.is_symlink()
    assert (new.truth / "world.json").is_file()
    assert _digest(target.bag) == before and (target.truth / "world.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "latest.truth",
        "real",
        "real.truth",
    ]


def test_overwrite_removes_what_a_killed_overwrite_set_aside(tmp_path: Path) -> None:
    """A run killed (``kill -9``) while overwriting left the old drive hidden as
    ``.d.bag.replaced-PID``; nothing ever removed it.  The next overwrite does, unless
    the run that set it aside still runs."""
    drive = generate_drive(TINY, tmp_path / "d.bag")
    dead = subprocess.Popen(["true"])  # a pid that ran and is gone
    dead.wait()
    shutil.copy(drive.bag, tmp_path / f".d.bag.replaced-{dead.pid}")
    shutil.copytree(drive.truth, tmp_path / f".d.bag.truth.replaced-{dead.pid}")
    alive = subprocess.Popen(["sleep", "600"])  # stands for a run overwriting right now
    try:
        running = tmp_path / f".d.bag.replaced-{alive.pid}"
        running.write_bytes(drive.bag.read_bytes())
        generate_drive(TINY, drive.bag, overwrite=True)
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "d.bag", "d.bag.truth"]


_KILLED = """
import sys
from adcloud.synth import DriveConfig, generate_drive
config = DriveConfig(seconds=600, format=sys.argv[2], lidar_beams=16, truth_raster=False)

def progress(t):
    if t >= 1.0:  # a second of the drive is written: time to be killed
        print("writing", flush=True)

generate_drive(config, sys.argv[1], overwrite=len(sys.argv) > 3, progress=progress)
"""


@pytest.mark.parametrize("fmt", ["ros1", "mcap"])
def test_a_killed_run_leaves_no_half_drive_under_its_name(fmt: str, tmp_path: Path) -> None:
    """``kill -9`` (OOM killer, power cut) mid-drive: the half-written bag stays hidden in
    the run's staging directory, never under the name readers open (it stood there, and
    ``adcloud synth`` refused the next run with "exists already").  An overwritten drive
    is still there, whole; the next run removes what the killed one left."""
    out = tmp_path / ("cut.bag" if fmt == "ros1" else "cut")
    config = DriveConfig(**{**TINY.__dict__, "format": fmt})
    old = generate_drive(config, out)
    before = _digest(old.bag)
    for overwrite in (True, False):
        if not overwrite:
            _remove_drive(old)
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED, str(out), fmt, *(["overwrite"] if overwrite else [])],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        finally:
            proc.kill()
            proc.wait()
        if overwrite:
            assert _digest(out) == before and (old.truth / "world.json").is_file()
        else:
            assert not out.exists() and not old.truth.exists()
    drive = generate_drive(config, out)
    assert _count(drive.bag) == drive.messages
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, f"{out.name}.truth"]


def _remove_drive(drive: DriveResult) -> None:
    if drive.bag.is_dir():
        shutil.rmtree(drive.bag)
    else:
        drive.bag.unlink()
    shutil.rmtree(drive.truth)


@pytest.mark.parametrize("fmt", ["ros2", "mcap"])
def test_overwrite_replaces_a_rosbag2_drive_whose_writer_was_killed(
    fmt: str, tmp_path: Path
) -> None:
    """A writer killed mid-drive by an adcloud that wrote in place left a rosbag2 directory
    without metadata.yaml (written last) and a truth directory without world.json;
    ``--overwrite`` replaces that drive instead of calling the directory "not a bag"."""
    config = DriveConfig(**{**TINY.__dict__, "format": fmt})
    (tmp_path / "whole").mkdir()
    whole = generate_drive(config, tmp_path / "whole" / "cut")
    out = tmp_path / "cut"
    out.mkdir()
    storage = "cut.db3" if fmt == "ros2" else "cut.mcap"
    shutil.copy(whole.bag / storage, out / storage)
    (tmp_path / "cut.truth").mkdir()
    shutil.copy(whole.truth / "poses.txt", tmp_path / "cut.truth" / "poses.txt")
    shutil.rmtree(tmp_path / "whole")
    drive = generate_drive(config, out, overwrite=True)
    assert _count(drive.bag) == drive.messages
    assert (drive.truth / "world.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "cut.truth"]


def test_a_full_disk_is_one_error_naming_the_bag_and_leaves_nothing(tmp_path: Path) -> None:
    """``ENOSPC`` while the bag is written: closing the half bag and the truth files failed
    the same way, so the clean-up stopped half-way (the half bag and truth stayed) and the
    command line printed a traceback (rosbags' error names no file)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("this sandbox does not permit mounting a tmpfs")
    try:
        config = DriveConfig(**{**TINY.__dict__, "seconds": 3.0})
        with pytest.raises(OSError, match="No space left") as caught:
            generate_drive(config, disk / "d.bag")
        assert caught.value.filename == str(disk / "d.bag")
        assert list(disk.iterdir()) == []
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "adcloud.cli",
                "synth",
                "--out",
                str(disk / "d.bag"),
                "-q",
                "--seconds",
                "3",
                "--beams",
                "16",
                "--no-raster",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert f"error: {disk / 'd.bag'}: No space left on device" in done.stderr
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True)


def _sqlite_full() -> sqlite3.Error:
    """The error sqlite3 raises on a full disk (a database at its page limit)."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x BLOB)")
    db.execute("PRAGMA max_page_count = 2")
    try:
        for _ in range(10):
            db.execute("INSERT INTO t VALUES (?)", (b"x" * 4000,))
    except sqlite3.Error as err:
        return err
    finally:
        db.close()
    raise AssertionError("sqlite3 wrote past its page limit")


def test_a_full_disk_under_a_ros2_bag_is_named_like_the_other_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlite3's "database or disk is full" names no file and is no OSError: the command
    line printed a traceback where ros1 and mcap say "<bag>: No space left on device"."""
    from adcloud.synth import writer  # noqa: PLC0415

    full = _sqlite_full()
    written = [0]
    real = writer._Ros2.write

    def write(self: Any, topic: str, t_ns: int, data: bytes) -> None:
        written[0] += 1
        if written[0] > 50:
            raise full
        real(self, topic, t_ns, data)

    monkeypatch.setattr(writer._Ros2, "write", write)
    config = DriveConfig(**{**TINY.__dict__, "format": "ros2", "lidar": False, "camera": False})
    with pytest.raises(OSError, match="No space left") as caught:
        generate_drive(config, tmp_path / "d")
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename == str(tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


def test_output_names_and_times_a_bag_cannot_hold_are_refused(tmp_path: Path) -> None:
    for out in (".", ""):
        with pytest.raises(SynthError, match="out must name a bag file or bag directory"):
            generate_drive(TINY, out)
    late = DriveConfig(seconds=1, start_time_ns=2_200_000_000 * 10**9)
    with pytest.raises(SynthError, match="must end before 2038-01-19"):
        generate_drive(late, tmp_path / "late.bag")
    assert list(tmp_path.iterdir()) == []


_MEMORY = """
import resource, sys
from adcloud.synth import DriveConfig, generate_drive
config = DriveConfig(seconds=float(sys.argv[2]), lidar_beams=16, camera=False, truth_raster=False)
generate_drive(config, sys.argv[1])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_memory_does_not_grow_with_the_drive(tmp_path: Path) -> None:
    """Streaming: a 4x longer drive peaks at about the same memory (KiB of RSS)."""
    peaks = []
    for seconds in (2, 8):
        proc = subprocess.run(
            [sys.executable, "-c", _MEMORY, str(tmp_path / f"m{seconds}.bag"), str(seconds)],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        peaks.append(int(proc.stdout.split()[-1]))
    assert peaks[1] - peaks[0] < 25 * 1024, peaks


def _humble_qos(text: object, where: str) -> list[dict[str, object]]:
    """``text`` parsed as Humble's rosbag2 parses offered QoS profiles: a YAML string of a
    list of profiles whose policies are numbers."""
    assert isinstance(text, str), f"{where}: QoS profiles are {type(text).__name__}, not a string"
    profiles = yaml.safe_load(text)
    assert isinstance(profiles, list) and profiles, where
    for profile in profiles:
        for policy in ("history", "reliability", "durability", "liveliness"):
            assert isinstance(profile[policy], int), f"{where}: {policy}={profile[policy]!r}"
    return profiles


@pytest.mark.parametrize("name", ["ros2-none", "mcap-zstd"])
def test_rosbag2_drives_store_qos_as_humble_reads_it(
    drives: dict[str, DriveResult], name: str
) -> None:
    """The rosbag2 drives were written in format 9, which stores QoS profiles as a YAML
    list with named policies ("keep_last"); Humble's rosbag2 reads them as a string of
    numbered policies, so ``ros2 bag info`` on Humble -- whose message definitions the
    drive uses -- failed on metadata.yaml.  metadata.yaml and the storage file hold the
    string form, and /tf_static stays latched (keep last 1, transient local)."""
    bag = drives[name].bag
    info = yaml.safe_load((bag / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    stored: dict[str, object] = {}
    for entry in info["topics_with_message_count"]:
        meta = entry["topic_metadata"]
        stored[meta["name"]] = meta["offered_qos_profiles"]
    if name.startswith("mcap"):
        with (bag / f"{bag.name}.mcap").open("rb") as f:
            summary = make_reader(f).get_summary()
        assert summary is not None
        in_file = {c.topic: c.metadata["offered_qos_profiles"] for c in summary.channels.values()}
    else:
        with sqlite3.connect(bag / f"{bag.name}.db3") as db:
            in_file = dict(db.execute("SELECT name, offered_qos_profiles FROM topics").fetchall())
    assert set(in_file) == set(stored) and "/tf_static" in stored
    for topic, text in [*stored.items(), *in_file.items()]:
        profiles = _humble_qos(text, f"{name} {topic}")
        latched = topic == "/tf_static"
        # rmw enums: history KEEP_LAST 1 / UNKNOWN 3 (as ros2 bag record stores a
        # publisher's), durability TRANSIENT_LOCAL 1 / VOLATILE 2
        assert (profiles[0]["history"], profiles[0]["depth"]) == ((1, 1) if latched else (3, 0))
        assert profiles[0]["durability"] == (1 if latched else 2)
