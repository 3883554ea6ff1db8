"""Cutting bags into scenarios."""

from __future__ import annotations

import codecs
import itertools
import json
import math
import pickle
import shutil
from pathlib import Path

import pytest

from adcloud.sim import (
    CutMode,
    Scenario,
    ScenarioCut,
    SimError,
    plan_scenarios,
    read_scenario_file,
)
from adcloud.synth import DriveResult

_NS = 1_000_000_000


def test_whole_bag_is_one_scenario(drive: DriveResult) -> None:
    (s,) = plan_scenarios(str(drive.bag))
    assert s.name == "drive"
    assert s.feed_start == s.start
    assert 2.9 < s.seconds <= 3.0


def test_windows_cover_the_bag_with_warmup(drive: DriveResult) -> None:
    scenarios = plan_scenarios(str(drive.bag), ScenarioCut(CutMode.WINDOW, 1.0, 0.4))
    assert [s.name for s in scenarios] == ["drive#0000", "drive#0001", "drive#0002"]
    first = scenarios[0]
    assert first.feed_start == first.start  # nothing before the bag to warm up on
    for prev, cur in itertools.pairwise(scenarios):
        assert cur.start == prev.end
        assert cur.start - cur.feed_start == round(0.4 * _NS)
    assert scenarios[-1].end == plan_scenarios(str(drive.bag))[0].end


def test_scenario_file(drive: DriveResult, tmp_path: Path) -> None:
    listing = tmp_path / "scenarios.json"
    bag = Path(drive.bag)
    listing.write_text(
        json.dumps(
            {
                "scenarios": [
                    {"name": "early", "bag": str(bag), "start": 0.5, "end": 1.5, "warmup": 0.2},
                    {"bag": str(bag), "start": 2.0},
                ]
            }
        )
    )
    early, rest = plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(listing)))
    whole = plan_scenarios(str(bag))[0]
    assert early.name == "early"
    assert early.start == whole.start + round(0.5 * _NS)
    assert early.end == whole.start + round(1.5 * _NS)
    assert early.start - early.feed_start == round(0.2 * _NS)
    assert rest.end == whole.end


def test_relative_bags_of_a_relative_scenario_file_become_absolute(
    drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executors run in other working directories: a bag named relative to the scenario
    file (itself given relative to here, or with no folder at all) is resolved on the
    driver, not looked for as ``sc/../d.bag`` wherever a task runs."""
    shutil.copy(drive.bag, tmp_path / "d.bag")
    (tmp_path / "sc").mkdir()
    (tmp_path / "sc/rel.json").write_text(json.dumps([{"name": "up", "bag": "../d.bag"}]))
    (tmp_path / "here.json").write_text(json.dumps([{"name": "beside", "bag": "d.bag"}]))
    monkeypatch.chdir(tmp_path)
    (up,) = plan_scenarios([], ScenarioCut(CutMode.FILE, file="sc/rel.json"))
    (beside,) = plan_scenarios([], ScenarioCut(CutMode.FILE, file="here.json"))
    assert up.uri == beside.uri == str(tmp_path / "d.bag")
    url = (tmp_path / "sc/rel.json").as_uri()  # a URL's bag stays a URL, ".." folded
    (far,) = plan_scenarios([], ScenarioCut(CutMode.FILE, file=url))
    assert far.uri == (tmp_path / "d.bag").as_uri()
    assert (far.start, far.end) == (up.start, up.end)


def test_scenario_file_errors(drive: DriveResult, tmp_path: Path) -> None:
    with pytest.raises(SimError, match="does not exist"):
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(tmp_path / "nope.json")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"bag": str(drive.bag), "start": 2, "end": 1}]))
    with pytest.raises(SimError, match="start <= end"):
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(bad)))


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"strat": 2.0, "end": 4.0}, r"unknown key 'strat' \(did you mean 'start'\?\)"),
        ({"start": 1.0, "wramup": 0.5}, r"unknown key 'wramup' \(did you mean 'warmup'\?\)"),
        ({"start": "1"}, r"start must be a finite number of seconds, not '1'"),
        ({"end": True}, r"end must be a finite number of seconds, not True"),
        ({"start": float("nan")}, r"start must be a finite number of seconds, not nan"),
        ({"end": float("inf")}, r"end must be a finite number of seconds, not inf"),
        ({"start": 1000.0}, r"start 1000 s is past the end of .*drive\.bag, whose messages span"),
        ({"start": 0.5, "end": 0.5}, r"start and end are both 0\.5 s, a scenario of no time"),
    ],
)
def test_scenario_file_entries_are_checked_field_by_field(
    drive: DriveResult, tmp_path: Path, entry: dict[str, object], says: str
) -> None:
    """A misspelt key would judge another time range than meant; NaN, a string or a start
    past the bag's end are errors naming the scenario and the field, not tracebacks."""
    listing = tmp_path / "scenarios.json"
    listing.write_text(json.dumps({"scenarios": [{"name": "a", "bag": str(drive.bag), **entry}]}))
    with pytest.raises(SimError, match=says) as info:
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(listing)))
    assert "scenario 'a'" in str(info.value)


def test_bad_cut_settings() -> None:
    with pytest.raises(SimError, match="window_s"):
        ScenarioCut(CutMode.WINDOW, window_s=0).validate()
    with pytest.raises(SimError, match="scenario file"):
        ScenarioCut(CutMode.FILE).validate()


@pytest.mark.parametrize(
    ("window", "warmup", "field"),
    [(1e-12, 0.0, "window_s"), (1e300, 0.0, "window_s"), (2.0, 1e300, "warmup_s")],
)
def test_windows_of_no_whole_nanosecond_or_past_int64_are_refused(
    drive: DriveResult, window: float, warmup: float, field: str
) -> None:
    # 1e-12 s rounds to a 0 ns window (range() step 0); 1e300 s overflows in nanoseconds
    with pytest.raises(SimError, match=f"{field} must be"):
        plan_scenarios(str(drive.bag), ScenarioCut(CutMode.WINDOW, window, warmup))
    with pytest.raises(SimError, match="warmup_s must be"):
        ScenarioCut(warmup_s=math.nan).validate()


def test_windows_too_short_for_a_plan_are_refused_before_they_are_listed(
    drive: DriveResult,
) -> None:
    """1 ns windows over a 3 s drive were ~3 billion scenarios: a MemoryError after minutes."""
    with pytest.raises(SimError, match=r"1e-09 s windows cut .* into 2,99\d,\d{3},\d{3} scen"):
        plan_scenarios(str(drive.bag), ScenarioCut(CutMode.WINDOW, 1e-9))


def test_scenario_file_times_past_int64_are_refused(drive: DriveResult, tmp_path: Path) -> None:
    listing = tmp_path / "s.json"
    listing.write_text(json.dumps([{"bag": str(drive.bag), "start": 0, "end": 1e300}]))
    with pytest.raises(SimError, match=r"end must be at most 9223372036 s, not 1e\+300"):
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(listing)))


def test_a_scenario_ends_1_ns_after_the_last_message(tmp_path: Path) -> None:
    """The summary's end (last record time + 1 ns) got another 1 ns: a bag of one message
    at t spanned [t, t + 2), and 1 ns windows cut it into its message and an empty window
    that failed for having no messages."""
    from rosbags.rosbag1 import Writer  # noqa: PLC0415
    from rosbags.typesys import Stores, get_typestore  # noqa: PLC0415

    store = get_typestore(Stores.ROS1_NOETIC)
    string = store.types["std_msgs/msg/String"]
    bag = tmp_path / "one.bag"
    with Writer(bag) as writer:
        conn = writer.add_connection("/chatter", string.__msgtype__, typestore=store)
        writer.write(conn, 7 * _NS, store.serialize_ros1(string(data="hi"), string.__msgtype__))
    (whole,) = plan_scenarios(str(bag))
    assert (whole.start, whole.end) == (7 * _NS, 7 * _NS + 1)
    windows = plan_scenarios(str(bag), ScenarioCut(CutMode.WINDOW, 1e-9))
    assert [(s.start, s.end) for s in windows] == [(7 * _NS, 7 * _NS + 1)]
    listing = tmp_path / "s.json"
    listing.write_text(json.dumps([{"bag": str(bag), "start": 1e-9}]))
    with pytest.raises(SimError, match="start 1e-09 s is past the end"):
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(listing)))


def test_empty_bag_gives_an_empty_scenario(empty_bag: Path) -> None:
    (s,) = plan_scenarios(str(empty_bag))
    assert s.start == s.end == 0


def test_a_bag_without_index_is_refused_not_replayed_as_empty(
    drive: DriveResult, tmp_path: Path
) -> None:
    """A ROS 1 bag cut off before its index (index_pos 0) summarises with no messages --
    unknown, not none -- and was planned as an empty scenario, failed later as "no
    messages on the input topics"."""
    bag = tmp_path / "cut.bag"
    data = bytearray(drive.bag.read_bytes())
    at = data.index(b"index_pos=") + len(b"index_pos=")
    data[at : at + 8] = bytes(8)
    bag.write_bytes(bytes(data))
    with pytest.raises(SimError, match=r"cut\.bag: the bag has no index .*reindex"):
        plan_scenarios(str(bag))


def test_missing_bag(tmp_path: Path) -> None:
    with pytest.raises(SimError, match="does not exist"):
        plan_scenarios(str(tmp_path / "none.bag"))


def test_scenario_pickles_as_a_description(drive: DriveResult) -> None:
    (s,) = plan_scenarios(str(drive.bag))
    data = pickle.dumps(s)
    assert len(data) < 400
    assert pickle.loads(data) == s
    assert isinstance(pickle.loads(data), Scenario)


def test_a_short_tail_joins_the_last_window(drive: DriveResult) -> None:
    whole = plan_scenarios(str(drive.bag))[0]
    span = whole.end - whole.start
    window = (span - 1) // 2  # two windows and a tail of 1 or 2 ns
    cut = ScenarioCut(CutMode.WINDOW, window / _NS)
    scenarios = plan_scenarios(str(drive.bag), cut)
    assert [s.name for s in scenarios] == ["drive#0000", "drive#0001"]
    assert scenarios[0].end - scenarios[0].start == window
    assert scenarios[1].start == scenarios[0].end
    assert scenarios[1].end == whole.end
    # A tail of 0.6 window stays a window of its own.
    third = plan_scenarios(str(drive.bag), ScenarioCut(CutMode.WINDOW, span / 2.6 / _NS))
    assert len(third) == 3
    assert third[-1].end == whole.end


def test_same_bag_names_in_different_folders(drive: DriveResult, tmp_path: Path) -> None:
    bags = [tmp_path / "a" / "drive.bag", tmp_path / "b" / "drive.bag"]
    bags += [tmp_path / "x" / "run" / "drive.bag", tmp_path / "y" / "run" / "drive.bag"]
    bags.append(tmp_path / "a" / "other.bag")
    for bag in bags:
        bag.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(drive.bag, bag)
    by_uri = {Path(s.uri).resolve(): s.name for s in plan_scenarios([str(b) for b in bags])}
    assert [by_uri[b.resolve()] for b in bags] == [
        "a/drive",
        "b/drive",
        "x/run/drive",
        "y/run/drive",
        "other",
    ]
    windows = plan_scenarios([str(b) for b in bags], ScenarioCut(CutMode.WINDOW, 1.0))
    names = [s.name for s in windows]
    assert len(names) == 15
    assert len(set(names)) == len(names)
    assert "a/drive#0000" in names


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    listing = tmp_path / "scenarios.yaml"
    listing.write_text("scenarios:\n  - {name: a, bag: drive.bag, start: 0.5\n  - name: b\n")
    with pytest.raises(SimError, match=r"scenarios\.yaml: not valid YAML: line \d+"):
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(listing)))


def test_a_name_given_twice_is_named(drive: DriveResult, tmp_path: Path) -> None:
    """ "scenario names must be unique" did not say which: here the second entry's default
    name, the bag's stem and its index, is the one the first entry gives."""
    listing = tmp_path / "scenarios.json"
    entries = [{"name": "drive#0001", "bag": str(drive.bag)}, {"bag": str(drive.bag)}]
    listing.write_text(json.dumps({"scenarios": entries}))
    with pytest.raises(SimError, match="'drive#0001' is given more than once"):
        plan_scenarios([], ScenarioCut(CutMode.FILE, file=str(listing)))


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"bag": None}, r"scenario 0: bag must be a path or URL, not None$"),
        ({"bag": ["d.bag"]}, r"scenario 0: bag must be a path or URL, not \['d\.bag'\]$"),
        ({"bag": 5}, r"scenario 0: bag must be a path or URL, not 5$"),
        ({"bag": " "}, r"scenario 0: bag must be a path or URL, not ' '$"),
        ({"name": ["a"], "bag": "d.bag"}, r"scenario 0: name must be text, not \['a'\]$"),
        (
            {"name": "a", "bag": "nope.bag"},
            r"scenario 'a': bag 'nope\.bag' \(a relative bag lies in the scenario file's "
            r"directory\): cannot read the index of .*nope\.bag",
        ),
        ({"name": "a", "bag": "d.bag", "start": -1}, r"scenario 'a': start must be >= 0 s"),
        ({"name": "a", "bag": "d.bag", "warmup": -1}, r"scenario 'a': warmup must be >= 0 s"),
        (
            {"name": "a", "bag": "d.bag", "start": 2, "end": 1},
            r"scenario 'a': end 1 s is before start 2 s",
        ),
    ],
)
def test_a_bad_bag_or_name_is_named_with_the_file_and_scenario(
    drive: DriveResult, tmp_path: Path, entry: dict[str, object], says: str
) -> None:
    """A null or list ``bag`` was read as a file called ``None`` or ``['d.bag']``, and a
    bag that does not read was reported without the scenario file that names it."""
    (tmp_path / "d.bag").symlink_to(drive.bag)
    listing = tmp_path / "scenarios.json"
    listing.write_text(json.dumps({"scenarios": [entry]}))
    with pytest.raises(SimError, match=says) as info:
        read_scenario_file(str(listing))
    assert str(info.value).startswith(f"{listing}: scenario ")


def test_a_scenario_file_that_is_no_text_or_no_file_is_a_sim_error(tmp_path: Path) -> None:
    binary = tmp_path / "scenarios.json"
    binary.write_bytes(b'{"scenarios": [\xff]}')
    with pytest.raises(SimError, match=r"scenarios\.json: not UTF-8 text \(byte 15 is 0xff\)"):
        read_scenario_file(str(binary))
    folder = tmp_path / "folder.json"
    folder.mkdir()
    with pytest.raises(SimError, match=r"cannot read scenario file .*folder\.json"):
        read_scenario_file(str(folder))


def test_a_scenario_file_with_a_byte_order_mark_reads(drive: DriveResult, tmp_path: Path) -> None:
    listing = tmp_path / "scenarios.json"
    text = json.dumps({"scenarios": [{"name": "a", "bag": str(drive.bag), "end": 1.0}]})
    listing.write_bytes(codecs.BOM_UTF8 + text.encode())
    (only,) = read_scenario_file(str(listing))
    assert (only.name, only.seconds) == ("a", 1.0)
