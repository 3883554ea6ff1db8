"""scripts/install.sh: the Java check and the apt step, run hermetically.

Each test runs a copy of the script in a temporary "checkout" whose ``.venv/bin/python`` is
a stub, with stub ``dpkg``/``apt-get``/``sudo`` first on PATH, so nothing on the machine is
installed or changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
APT_PACKAGES = [
    "ros-core",
    "python3-rospy",
    "python3-rosbag",
    "python3-rostest",
    "topic-tools",
    "rosbash",
    "libusb-1.0-0",
    "gcc",
]


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the script and pyproject.toml with a stub venv Python that does nothing."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "scripts" / "install.sh", root / "scripts" / "install.sh")
    shutil.copy2(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / ".venv" / "bin").mkdir(parents=True)
    write_script(root / ".venv" / "bin" / "python", "#!/bin/sh\nexit 0\n")
    return root


def stub_bin(tmp_path: Path, missing: list[str]) -> Path:
    """dpkg reporting ``missing`` as not installed; apt-get and sudo that only log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    cases = "|".join(missing) or "__none__"
    write_script(
        bin_dir / "dpkg",
        f'#!/bin/sh\ncase "$2" in {cases}) exit 1;; esac\n'
        'echo "Package: $2"; echo "Status: install ok installed"\n',
    )
    write_script(bin_dir / "dpkg-query", "#!/bin/sh\necho 1.0\n")
    write_script(bin_dir / "apt-get", f'#!/bin/sh\necho "apt-get $*" >> {log}\n')
    write_script(bin_dir / "sudo", f'#!/bin/sh\necho "sudo" >> {log}\nexec "$@"\n')
    return bin_dir


def run_install(checkout: Path, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "PYTHON")}
    return subprocess.run(
        ["/bin/bash", str(checkout / "scripts" / "install.sh")],
        env={**base, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_missing_apt_packages_are_installed_with_apt_get(checkout: Path, tmp_path: Path) -> None:
    bin_dir = stub_bin(tmp_path, missing=["rosbash", "libusb-1.0-0"])
    proc = run_install(checkout, f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines() if c != "sudo"]
    assert calls == [
        "apt-get update -qq",
        "apt-get install -y -qq --no-install-recommends rosbash libusb-1.0-0",
    ]
    assert "installing Debian packages: rosbash libusb-1.0-0" in proc.stdout
    assert (checkout / ".venv" / ".adcloud-install-stamp").is_file()


def test_nothing_missing_means_no_apt_get(checkout: Path, tmp_path: Path) -> None:
    bin_dir = stub_bin(tmp_path, missing=[])
    proc = run_install(checkout, f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "calls.log").exists()
    again = run_install(checkout, f"{bin_dir}:{os.environ['PATH']}")
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout


def test_every_documented_package_is_checked(checkout: Path, tmp_path: Path) -> None:
    bin_dir = stub_bin(tmp_path, missing=APT_PACKAGES)
    proc = run_install(checkout, f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    install = (tmp_path / "calls.log").read_text().splitlines()[-1]
    assert install.split()[-len(APT_PACKAGES) :] == APT_PACKAGES


def test_old_java_fails_with_the_install_command(checkout: Path, tmp_path: Path) -> None:
    bin_dir = stub_bin(tmp_path, missing=[])
    write_script(bin_dir / "java", "#!/bin/sh\necho 'java version \"1.8.0_392\"' >&2\n")
    proc = run_install(checkout, f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode != 0
    assert "'1.8.0_392'" in proc.stderr
    assert "apt-get install -y --no-install-recommends openjdk-17-jre-headless" in proc.stderr
    assert not (tmp_path / "calls.log").exists()


def test_no_java_fails_with_the_install_command(checkout: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin-without-java"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname") or "/usr/bin/dirname")
    proc = run_install(checkout, str(bin_dir))
    assert proc.returncode != 0
    assert "no 'java' is on PATH" in proc.stderr
    assert "openjdk-17-jre-headless" in proc.stderr


def test_bad_java_home_fails_clearly(checkout: Path, tmp_path: Path) -> None:
    proc = run_install(checkout, os.environ["PATH"], JAVA_HOME=str(tmp_path / "no-jdk"))
    assert proc.returncode != 0
    assert "has no bin/java" in proc.stderr


@pytest.mark.parametrize(
    ("uv_runs", "env", "installer"),
    [
        (True, {}, "uv pip"),  # the default: uv installs the project and its dependencies
        (False, {}, "python -m pip"),  # no uv to be had (no wheel for the machine): pip does it
        (
            True,
            {"ADCLOUD_INSTALL_WITH_PIP": "1"},
            "python -m pip",
        ),  # asked for pip: uv is not fetched
    ],
)
def test_the_packages_are_installed_by_uv_or_pip_torch_held_at_the_cpu_build(
    checkout: Path, tmp_path: Path, uv_runs: bool, env: dict[str, str], installer: str
) -> None:
    bin_dir = stub_bin(tmp_path, missing=[])
    log = tmp_path / "venv.log"
    venv_bin = checkout / ".venv" / "bin"
    write_script(venv_bin / "python", f'#!/bin/sh\necho "python $*" >> {log}\nexit 0\n')
    if uv_runs:
        write_script(venv_bin / "uv", f'#!/bin/sh\necho "uv $*" >> {log}\nexit 0\n')
    proc = run_install(checkout, f"{bin_dir}:{os.environ['PATH']}", **env)
    assert proc.returncode == 0, proc.stderr
    calls = [c for c in log.read_text().splitlines() if " install " in c]
    assert calls[0] == "python -m pip install -q --no-compile torch==2.13.0"  # torch first
    project = [c for c in calls if c.endswith("-e .[dev]")]
    assert len(project) == 1 and project[0].startswith(installer), calls
    assert " -c " in project[0]  # torch held at the CPU build it has
    fetched_uv = any("uv==" in c for c in calls)
    assert fetched_uv == ("ADCLOUD_INSTALL_WITH_PIP" not in env), calls
