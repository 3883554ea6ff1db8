"""Layered, typed settings (:mod:`adcloud.config`)."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import Any

import pytest

from adcloud.config import load_settings, settings_dict, write_settings
from adcloud.errors import AdcloudError, ConfigError


@dataclass(frozen=True)
class Example:
    """Covers every field type the loader coerces."""

    name: str = "drive"
    workers: int = 2
    ratio: float = 0.5
    verbose: bool = False
    root: Path = Path("/tmp/adcloud")
    topics: tuple[str, ...] = ("/imu",)
    sizes: tuple[int, ...] = (1, 2)
    limit: int | None = None


def test_defaults_without_file_or_environment() -> None:
    assert load_settings(Example, "example", environ={}) == Example()


def test_settings_are_frozen() -> None:
    settings = load_settings(Example, "example", environ={})
    with pytest.raises(FrozenInstanceError):
        settings.workers = 3  # type: ignore[misc]


def test_environment_overrides_with_type_coercion() -> None:
    settings = load_settings(
        Example,
        "example",
        environ={
            "ADCLOUD_EXAMPLE_NAME": "night-run",
            "ADCLOUD_EXAMPLE_WORKERS": "8",
            "ADCLOUD_EXAMPLE_RATIO": "0.25",
            "ADCLOUD_EXAMPLE_VERBOSE": "yes",
            "ADCLOUD_EXAMPLE_ROOT": "~/adcloud-data",
            "ADCLOUD_EXAMPLE_TOPICS": "/fix, /imu/data",
            "ADCLOUD_EXAMPLE_SIZES": "3,4,5",
            "ADCLOUD_EXAMPLE_LIMIT": "100",
            "ADCLOUD_OTHER_WORKERS": "99",  # another section's variable
        },
    )
    assert settings == Example(
        name="night-run",
        workers=8,
        ratio=0.25,
        verbose=True,
        root=Path("~/adcloud-data").expanduser(),
        topics=("/fix", "/imu/data"),
        sizes=(3, 4, 5),
        limit=100,
    )
    assert isinstance(settings.workers, int)
    assert isinstance(settings.root, Path)


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("off", False), ("TRUE", True)])
def test_boolean_spellings(text: str, expected: bool) -> None:
    environ = {"ADCLOUD_EXAMPLE_VERBOSE": text}
    assert load_settings(Example, "example", environ=environ).verbose is expected


def test_optional_field_reads_none() -> None:
    settings = load_settings(
        Example, "example", environ={"ADCLOUD_EXAMPLE_LIMIT": "none"}, limit=None
    )
    assert settings.limit is None


def test_file_then_environment_then_keyword_overrides(tmp_path: Path) -> None:
    file = tmp_path / "adcloud.yaml"
    file.write_text(
        "example:\n  name: from-file\n  workers: 4\n  topics: [/a, /b]\nother:\n  workers: 1\n"
    )
    from_file = load_settings(Example, "example", file=file, environ={})
    assert (from_file.name, from_file.workers, from_file.topics) == ("from-file", 4, ("/a", "/b"))
    layered = load_settings(
        Example,
        "example",
        file=file,
        environ={"ADCLOUD_EXAMPLE_WORKERS": "6", "ADCLOUD_EXAMPLE_NAME": "from-env"},
        name="from-keyword",
    )
    assert (layered.name, layered.workers, layered.topics) == ("from-keyword", 6, ("/a", "/b"))


def test_json_file_and_missing_section(tmp_path: Path) -> None:
    file = tmp_path / "adcloud.json"
    file.write_text(json.dumps({"example": {"ratio": 2}}))
    assert load_settings(Example, "example", file=file, environ={}).ratio == 2.0
    assert load_settings(Example, "absent", file=file, environ={}) == Example()


def test_an_unset_float_is_null_in_json_and_reads_back_unset(tmp_path: Path) -> None:
    from adcloud.hdmap.config import HdmapSettings  # noqa: PLC0415 - real settings with NaN

    written = settings_dict(HdmapSettings())
    text = json.dumps({"hdmap": written}, allow_nan=False)  # strict JSON: no NaN in it
    assert written["origin_lat"] is None and written["resolution"] == 0.05
    file = tmp_path / "settings.json"
    file.write_text(text)
    again = load_settings(HdmapSettings, "hdmap", file=file, environ={})
    assert again.origin is None and settings_dict(again) == written  # (NaN != NaN)


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    file = tmp_path / "adcloud.yaml"
    file.write_text("example:\n  wokers: 4\n")
    with pytest.raises(ConfigError, match=r"unknown example setting.*wokers") as info:
        load_settings(Example, "example", file=file, environ={})
    assert "workers" in str(info.value)  # the known names are listed
    assert isinstance(info.value, AdcloudError)


def test_unknown_keyword_override_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown example setting.*colour"):
        load_settings(Example, "example", environ={}, colour="red")


def test_blank_list_entries_name_nothing() -> None:
    """ "a.bag," was ("a.bag", ""), and "" was ("",): a blank path is the working directory,
    and every bag in it was read."""
    environ = {"ADCLOUD_EXAMPLE_TOPICS": "/imu, ,/gps,", "ADCLOUD_EXAMPLE_SIZES": ""}
    loaded = load_settings(Example, "example", environ=environ)
    assert loaded.topics == ("/imu", "/gps")
    assert loaded.sizes == ()


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("ADCLOUD_EXAMPLE_WORKERS", "many", "example.workers"),
        ("ADCLOUD_EXAMPLE_RATIO", "half", "example.ratio"),
        ("ADCLOUD_EXAMPLE_VERBOSE", "maybe", "example.verbose"),
        ("ADCLOUD_EXAMPLE_SIZES", "1,two", "example.sizes"),
        ("ADCLOUD_EXAMPLE_LIMIT", "lots", "example.limit"),
    ],
)
def test_bad_value_names_the_field(variable: str, value: str, field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)) as info:
        load_settings(Example, "example", environ={variable: value})
    assert repr(value.rsplit(",", maxsplit=1)[-1]) in str(info.value)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("workers: 2.9", "example.workers"),  # never truncated to 2
        ("workers: true", "example.workers"),  # YAML's true is no count
        ("ratio: false", "example.ratio"),
        ("sizes: [1, 2.5]", "example.sizes"),
    ],
)
def test_numbers_in_a_file_are_read_exactly(tmp_path: Path, line: str, field: str) -> None:
    file = tmp_path / "adcloud.yaml"
    file.write_text(f"example:\n  {line}\n")
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_settings(Example, "example", file=file, environ={})
    file.write_text("example:\n  workers: 3.0\n  ratio: 2\n")  # whole and int values are fine
    loaded = load_settings(Example, "example", file=file, environ={})
    assert (loaded.workers, loaded.ratio) == (3, 2.0)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read settings file"):
        load_settings(Example, "example", file=tmp_path / "missing.yaml", environ={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("example: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read settings file"):
        load_settings(Example, "example", file=broken, environ={})
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("example: [1, 2]\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_settings(Example, "example", file=not_a_mapping, environ={})


def test_not_a_dataclass_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        load_settings(dict, "example", environ={})


def test_written_settings_load_back(tmp_path: Path) -> None:
    settings = Example(name="x", topics=("/a",), root=tmp_path)
    out = tmp_path / "settings.json"
    write_settings(out, example=settings)
    data = json.loads(out.read_text())
    assert data == {"example": settings_dict(settings)}
    assert data["example"]["root"] == str(tmp_path)
    assert data["example"]["topics"] == ["/a"]
    assert load_settings(Example, "example", file=out, environ={}) == settings


def test_near_misses_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "adcloud.yaml"
    file.write_text("exmpale:\n  x: 4\nother_section:\n  x: 1\n")
    environ = {
        "ADCLOUD_EXAMPLE_WROKERS": "3",  # misspelt: ignored, but said
        "ADCLOUD_EXAMPLE_SUB_FIELD": "1",  # another section's, far from every field
        "ADCLOUD_EXAMPLE_RATIO": "0.25",
    }
    with caplog.at_level(logging.WARNING, logger="adcloud.config"):
        loaded = load_settings(Example, "example", file=file, environ=environ)
    assert loaded.workers == 2 and loaded.ratio == 0.25
    said = caplog.text
    assert "ADCLOUD_EXAMPLE_WROKERS is not a setting: did you mean ADCLOUD_EXAMPLE_WORKERS?" in said
    # a section near this one's name, holding other fields, is another's: hdmap_labels and
    # hdmap_lanelet are both real
    assert "SUB_FIELD" not in said and "section" not in said


def test_one_name_is_one_name_not_its_characters() -> None:
    from adcloud.config import names  # noqa: PLC0415
    from adcloud.sim.replay import NodeSpec, ReplayJob  # noqa: PLC0415
    from adcloud.train.config import TrainConfig  # noqa: PLC0415

    assert names("drive.bag") == ("drive.bag",) and names(Path("a/b.bag")) == ("a/b.bag",)
    assert names([Path("x.bag"), "y.bag"]) == ("x.bag", "y.bag")
    config = TrainConfig(bags="drive.bag", heldout_bags=Path("test.bag"))  # type: ignore[arg-type]
    assert (config.bags, config.heldout_bags) == (("drive.bag",), ("test.bag",))
    job = ReplayJob(
        bags="drive.bag",  # type: ignore[arg-type]
        node=NodeSpec("cat"),
        input_topics="/lidar/points",  # type: ignore[arg-type]
        output_topics=(),
    ).validate()
    assert job.bags == ("drive.bag",) and job.input_topics == ("/lidar/points",)


@pytest.mark.parametrize("field", ["name", "workers", "root", "topics", "verbose"])
def test_an_empty_entry_in_a_file_is_an_error_not_the_word_none(tmp_path: Path, field: str) -> None:
    """``run:`` with nothing after it is YAML's null: never the string "None" (a run of
    that name), never a traceback."""
    path = tmp_path / "s.yaml"
    path.write_text(f"example:\n  {field}:\n")
    with pytest.raises(ConfigError, match=rf"example\.{field}: no value .*leave the key out"):
        load_settings(Example, "example", file=path, environ={})


@pytest.mark.parametrize("value", ["5", "{a.bag: 1}", "true"])
def test_a_list_field_given_no_list_is_an_error(tmp_path: Path, value: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(f"example:\n  topics: {value}\n")
    with pytest.raises(ConfigError, match=r"example\.topics: expected a list"):
        load_settings(Example, "example", file=path, environ={})


@pytest.mark.parametrize("value", ["[a, b]", "{a: 1}"])
def test_a_one_value_field_given_a_list_is_an_error(tmp_path: Path, value: str) -> None:
    """``name: [a, b]`` became the string "['a', 'b']"."""
    path = tmp_path / "s.yaml"
    path.write_text(f"example:\n  name: {value}\n")
    with pytest.raises(ConfigError, match=r"example\.name: expected one value, got a"):
        load_settings(Example, "example", file=path, environ={})


def test_settings_meant_for_a_section_that_is_not_there_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("exmaple:\n  workers: 3\n")
    with pytest.raises(ConfigError, match=r"no 'example' section, but a 'exmaple' one"):
        load_settings(Example, "example", file=path, environ={})
    path.write_text("workers: 3\nname: x\nother:\n  workers: 1\n")
    with pytest.raises(ConfigError, match=r"name, workers at the top level .*'example:'"):
        load_settings(Example, "example", file=path, environ={})
    path.write_text("- workers: 3\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_settings(Example, "example", file=path, environ={})
    # other sections only (one file for several commands), and an empty section, are fine
    path.write_text("spark:\n  master: local[2]\nexample:\n")
    assert load_settings(Example, "example", file=path, environ={}) == Example()
    path.write_text("name:\n  a: 1\n")  # a section that happens to share a field's name
    assert load_settings(Example, "example", file=path, environ={}) == Example()


def test_a_settings_file_that_is_not_text_is_a_config_error(tmp_path: Path) -> None:
    """A bag or an image given as the settings file: one error naming it, not a
    UnicodeDecodeError traceback."""
    path = tmp_path / "drive.bag"
    path.write_bytes(b"#ROSBAG V2.0\n\x89\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"drive\.bag: cannot read settings file"):
        load_settings(Example, "example", file=path, environ={})


@pytest.mark.parametrize("text", ["example:\n  1: 2\n", "example:\n  on: 2\n  name: x\n"])
def test_a_key_that_is_no_name_is_a_config_error(tmp_path: Path, text: str) -> None:
    """YAML reads ``1:`` and ``on:`` as a number and a boolean: an error naming the key,
    not a TypeError from sorting the unknown keys."""
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"s\.yaml: example\.(1|True) is not a setting name"):
        load_settings(Example, "example", file=path, environ={})


@pytest.mark.parametrize("value", ["[]", "0", "''", "false"])
def test_a_section_that_is_no_mapping_is_an_error_even_when_empty(
    tmp_path: Path, value: str
) -> None:
    """``example: []`` is not ``example:``: its settings were meant to be somewhere."""
    path = tmp_path / "s.yaml"
    path.write_text(f"example: {value}\n")
    with pytest.raises(ConfigError, match="section 'example' must be a mapping"):
        load_settings(Example, "example", file=path, environ={})


@pytest.mark.parametrize(
    ("where", "value"), [("env", "nan"), ("env", "NaN"), ("file", ".nan"), ("file", "")]
)
def test_nan_or_an_empty_number_is_refused_unless_unset_is_the_default(
    tmp_path: Path, where: str, value: str
) -> None:
    """NaN (and null, settings_dict's spelling of it) stands for "unset" only in a field
    whose default is NaN; a threshold of NaN made every comparison false and switched its
    check off without a word (``ADCLOUD_HDMAP_LOOPS_MIN_TRAVEL_M=nan``)."""

    @dataclass(frozen=True)
    class Thresholds:
        ratio: float = 0.5
        origin: float = float("nan")

    path = tmp_path / "s.yaml"
    path.write_text(f"example:\n  ratio: {value}\n  origin: {value}\n")
    environ = {"ADCLOUD_EXAMPLE_RATIO": value, "ADCLOUD_EXAMPLE_ORIGIN": value}
    source: dict[str, Any] = {"file": path} if where == "file" else {"environ": environ}
    with pytest.raises(ConfigError, match=r"example\.ratio: .* is not a number"):
        load_settings(Thresholds, "example", **({"environ": {}} | source))
    path.write_text(f"example:\n  origin: {value}\n")
    environ.pop("ADCLOUD_EXAMPLE_RATIO")
    loaded = load_settings(Thresholds, "example", **({"environ": {}} | source))
    assert loaded.ratio == 0.5 and math.isnan(loaded.origin)
    # a caller's NaN default makes it unset there too
    assert math.isnan(
        load_settings(
            Thresholds,
            "example",
            environ={"ADCLOUD_EXAMPLE_RATIO": "nan"},
            defaults={"ratio": math.nan},
        ).ratio
    )


@dataclass(frozen=True)
class Checked:
    """Checks its own range, as the services' settings do."""

    workers: int = 2
    ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"example.workers: give 1 or more, not {self.workers}")


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("ADCLOUD_EXAMPLE_WORKERS", "many", "example.workers: cannot read 'many'"),
        ("ADCLOUD_EXAMPLE_WORKERS", "0", "example.workers: give 1 or more, not 0"),
        ("ADCLOUD_EXAMPLE_RATIO", "nan", "example.ratio: 'nan' is not a number"),
    ],
)
def test_a_bad_value_says_which_variable_or_file_gave_it(
    tmp_path: Path, variable: str, value: str, said: str
) -> None:
    """``ADCLOUD_HDMAP_RESOLUTION=abc`` in a service's EnvironmentFile: the error named the
    setting (``hdmap.resolution``) but not the variable, nor that the value came from the
    environment rather than a settings file."""
    with pytest.raises(ConfigError) as info:
        load_settings(Checked, "example", environ={variable: value})
    assert str(info.value).startswith(said) and str(info.value).endswith(f"(from {variable})")
    field = variable.removeprefix("ADCLOUD_EXAMPLE_").lower()
    path = tmp_path / "settings.yaml"
    path.write_text(f"example:\n  {field}: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(Checked, "example", file=path, environ={})
    assert str(info.value).endswith(f"(from {path})"), info.value
    # a value the caller gave is its own: no source to name
    with pytest.raises(ConfigError) as info:
        load_settings(Checked, "example", environ={variable: "3"}, **{field: value})
    assert "(from" not in str(info.value)
