"""The nightly-build examples in deploy/nightly/ parse and call `adcloud hdmap build`.

Airflow is not installed here: the DAG is compiled, then executed against stand-in ``airflow``
modules that record what the file builds (the DAG's arguments and the task's command)."""

from __future__ import annotations

import configparser
import datetime as dt
import json
import os
import py_compile
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from adcloud.cli import build_parser
from adcloud.spark import SparkSettings, check_master

NIGHTLY = Path(__file__).resolve().parents[2] / "deploy" / "nightly"
SERVICE = NIGHTLY / "adcloud-hdmap-nightly.service"
TIMER = NIGHTLY / "adcloud-hdmap-nightly.timer"
DAG_FILE = NIGHTLY / "adcloud_hdmap_dag.py"

# (low, high) of the five crontab time fields: minute, hour, day of month, month, day of week
CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_ITEM = re.compile(r"^(\*|\d+(?:-\d+)?)(?:/(\d+))?$")


def cron_field_ok(text: str, low: int, high: int) -> bool:
    """Whether one crontab time field (lists, ranges, steps, *) is valid for [low, high]."""
    for item in text.split(","):
        m = _ITEM.match(item)
        if m is None:
            return False
        base, step = m.group(1), m.group(2)
        if step is not None and int(step) == 0:
            return False
        if base != "*":
            lo, _, hi = base.partition("-")
            values = [int(lo)] + ([int(hi)] if hi else [])
            if any(not low <= v <= high for v in values) or (hi and int(hi) < int(lo)):
                return False
    return True


def cron_ok(expr: str) -> bool:
    fields = expr.split()
    return len(fields) == 5 and all(
        cron_field_ok(f, lo, hi) for f, (lo, hi) in zip(fields, CRON_RANGES, strict=True)
    )


def test_cron_validator_rejects_bad_fields() -> None:
    assert cron_ok("15 2 * * *") and cron_ok("*/10 0-6 1,15 * 1-5")
    assert not cron_ok("60 2 * * *")
    assert not cron_ok("15 2 * *")
    assert not cron_ok("15 2 * * mon-fri x")
    assert not cron_ok("*/0 2 * * *")
    assert not cron_ok("5-1 2 * * *")


def assert_build_command(argv: list[str]) -> None:
    """``argv`` runs ``adcloud hdmap build`` with a --bags and a --map URI."""
    assert Path(argv[0]).name == "adcloud", argv
    assert argv[1:3] == ["hdmap", "build"], argv
    for flag in ("--bags", "--map"):
        assert flag in argv, argv
        value = argv[argv.index(flag) + 1]
        assert value and not value.startswith("-"), argv
    # and adcloud's own parser takes every option the example gives
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "_cmd_build" and args.skip_bad_bags and args.trust_mtime, argv


def crontab_jobs() -> list[str]:
    lines = NIGHTLY.joinpath("crontab.example").read_text().splitlines()
    jobs = []
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if re.match(r"^[A-Z_]+=", stripped):  # environment settings (SHELL=, MAILTO=, ...)
            continue
        jobs.append(stripped)
    return jobs


def test_crontab_line() -> None:
    jobs = crontab_jobs()
    assert len(jobs) == 1
    fields = jobs[0].split(None, 5)
    assert len(fields) == 6
    assert cron_ok(" ".join(fields[:5])), fields[:5]
    command = fields[5]
    assert "%" not in command  # cron turns % into newlines
    argv = shlex.split(command)
    end = next((i for i, a in enumerate(argv) if a in (">>", ">", "2>&1", "|")), len(argv))
    assert_build_command(argv[:end])


def read_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(path.read_text(), source=str(path))
    return parser


def test_systemd_service() -> None:
    unit = read_unit(SERVICE)
    assert unit.sections() == ["Unit", "Service"]
    assert unit["Unit"]["Description"]
    service = unit["Service"]
    assert service["Type"] == "oneshot"
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).is_absolute()  # systemd wants an absolute executable
    assert_build_command(argv)
    assert re.fullmatch(r"\d+(h|min|s)", service["TimeoutStartSec"])
    assert "%" not in service["ExecStart"]  # no unit specifiers hidden in the URIs
    # an unattended build retries failed tasks: a plain local[*] fails at the first one
    env = dict(item.split("=", 1) for item in shlex.split(service["Environment"]))
    master = SparkSettings.load(environ=env).master
    check_master(master, reach=False)
    assert not master.startswith("local") or re.fullmatch(r"local\[[^,\]]+,[1-9]\d*\]", master)


def test_systemd_timer() -> None:
    unit = read_unit(TIMER)
    assert unit.sections() == ["Unit", "Timer", "Install"]
    timer = unit["Timer"]
    assert timer["Unit"] == SERVICE.name
    assert TIMER.stem == SERVICE.stem  # systemd pairs them by name too
    assert re.fullmatch(r"\*-\*-\* \d{2}:\d{2}(:\d{2})? UTC", timer["OnCalendar"])
    assert timer["Persistent"] == "true"
    assert unit["Install"]["WantedBy"] == "timers.target"


class _Recorder:
    dags: ClassVar[list[dict[str, Any]]] = []
    tasks: ClassVar[list[dict[str, Any]]] = []


class _StubDag:
    def __init__(self, **kwargs: Any) -> None:
        _Recorder.dags.append(kwargs)

    def __enter__(self) -> _StubDag:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _StubBash:
    def __init__(self, **kwargs: Any) -> None:
        _Recorder.tasks.append(kwargs)


def stub_airflow(monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    """Stand-in modules for Airflow 3 (airflow.sdk + standard provider) or Airflow 2."""
    for name in list(sys.modules):
        if name == "airflow" or name.startswith("airflow."):
            monkeypatch.delitem(sys.modules, name)
    airflow = types.ModuleType("airflow")
    modules = {"airflow": airflow}
    if version == 3:
        sdk = types.ModuleType("airflow.sdk")
        sdk.DAG = _StubDag  # type: ignore[attr-defined]
        bash = types.ModuleType("airflow.providers.standard.operators.bash")
        bash.BashOperator = _StubBash  # type: ignore[attr-defined]
        modules |= {
            "airflow.sdk": sdk,
            "airflow.providers": types.ModuleType("airflow.providers"),
            "airflow.providers.standard": types.ModuleType("airflow.providers.standard"),
            "airflow.providers.standard.operators": types.ModuleType(
                "airflow.providers.standard.operators"
            ),
            "airflow.providers.standard.operators.bash": bash,
        }
    else:
        airflow.DAG = _StubDag  # type: ignore[attr-defined]
        bash = types.ModuleType("airflow.operators.bash")
        bash.BashOperator = _StubBash  # type: ignore[attr-defined]
        modules |= {
            "airflow.operators": types.ModuleType("airflow.operators"),
            "airflow.operators.bash": bash,
        }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_airflow_dag_compiles(tmp_path: Path) -> None:
    py_compile.compile(str(DAG_FILE), cfile=str(tmp_path / "dag.pyc"), doraise=True)


@pytest.mark.parametrize("version", [2, 3])
def test_airflow_dag_builds_the_nightly_task(monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    stub_airflow(monkeypatch, version)
    monkeypatch.setattr(_Recorder, "dags", [])
    monkeypatch.setattr(_Recorder, "tasks", [])
    monkeypatch.delenv("ADCLOUD_BIN", raising=False)
    code = compile(DAG_FILE.read_text(), str(DAG_FILE), "exec")
    exec(code, {"__name__": "adcloud_hdmap_dag"})
    assert len(_Recorder.dags) == 1 and len(_Recorder.tasks) == 1
    dag = _Recorder.dags[0]
    assert dag["dag_id"] == "adcloud_hdmap_nightly"
    assert cron_ok(dag["schedule"])
    assert dag["catchup"] is False and dag["max_active_runs"] == 1
    assert dag["start_date"].tzinfo is not None
    task = _Recorder.tasks[0]
    env = render_variables(task["env"], {})
    assert task["append_env"] is True
    # the Variables' values (here their defaults) take the place of the quoted references
    command = task["bash_command"]
    for name, value in env.items():
        command = command.replace(f'"${name}"', shlex.quote(value))
    argv = shlex.split(command)
    assert argv[0] == "/opt/adcloud/.venv/bin/adcloud"
    assert_build_command(argv)
    assert argv[argv.index("--bags") + 1] == "s3://fleet-drives/incoming/"


_VARIABLE = re.compile(r"\{\{ var\.value\.get\('(\w+)', '([^']*)'\) \}\}")


def render(template: str, variables: dict[str, str]) -> str:
    """A templated field (``bash_command``, ``env``) as Airflow renders it with these Variables."""
    text = _VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(2)), template)
    assert "{{" not in text, template
    return text


def render_variables(env: dict[str, str], variables: dict[str, str]) -> dict[str, str]:
    """The task's ``env`` rendered with these Variables."""
    return {name: render(value, variables) for name, value in env.items()}


_ARGV_STUB = """#!/usr/bin/env python3
import json, sys
print(json.dumps(sys.argv[1:]))
"""


def test_airflow_dag_passes_variables_as_single_words(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Variables go through bash untouched: a map path with a space stays one argument and a
    ';' runs nothing (they were pasted into the command line unquoted)."""
    stub = tmp_path / "adcloud"
    stub.write_text(_ARGV_STUB)
    stub.chmod(0o755)
    stub_airflow(monkeypatch, 3)
    monkeypatch.setattr(_Recorder, "dags", [])
    monkeypatch.setattr(_Recorder, "tasks", [])
    monkeypatch.setenv("ADCLOUD_BIN", str(stub))
    exec(compile(DAG_FILE.read_text(), str(DAG_FILE), "exec"), {"__name__": "adcloud_hdmap_dag"})
    (task,) = _Recorder.tasks
    marker = tmp_path / "ran"
    variables = {
        "adcloud_hdmap_bags": str(tmp_path / "fleet drives" / "2026-11-2*"),
        "adcloud_hdmap_map": f"/maps/city; touch {marker}",
    }
    env = {**os.environ, **render_variables(task["env"], variables)}
    proc = subprocess.run(
        ["bash", "-c", render(task["bash_command"], variables)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    argv = json.loads(proc.stdout)
    assert argv[argv.index("--bags") + 1] == variables["adcloud_hdmap_bags"]
    assert argv[argv.index("--map") + 1] == variables["adcloud_hdmap_map"]
    assert not marker.exists()
    assert_build_command(["adcloud", *argv])


def _dag_arguments(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    stub_airflow(monkeypatch, 3)
    monkeypatch.setattr(_Recorder, "dags", [])
    monkeypatch.setattr(_Recorder, "tasks", [])
    exec(compile(DAG_FILE.read_text(), str(DAG_FILE), "exec"), {"__name__": "adcloud_hdmap_dag"})
    (dag,) = _Recorder.dags
    return dag


def test_the_three_schedules_start_the_build_at_the_same_utc_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README offers the three as the same nightly build: the DAG ran at 02:15 UTC, the
    timer at 02:15 of the host's zone (OnCalendar without a zone is local time), so a
    host off UTC built its map hours apart from the others, maybe in the working day."""
    dag = _dag_arguments(monkeypatch)
    minute, hour, *_ = dag["schedule"].split()
    assert dag["start_date"].utcoffset() == dt.timedelta(0)  # Airflow reads cron in its zone
    fields = crontab_jobs()[0].split(None, 5)
    assert fields[:2] == [minute, hour]
    lines = [line.strip() for line in NIGHTLY.joinpath("crontab.example").read_text().splitlines()]
    job = lines.index(crontab_jobs()[0])
    assert "CRON_TZ=UTC" in lines[:job]  # cronie reads the lines after it in UTC
    calendar = read_unit(TIMER)["Timer"]["OnCalendar"]
    assert calendar == f"*-*-* {int(hour):02d}:{int(minute):02d}:00 UTC"
