#!/usr/bin/env bash
# Install everything adcloud needs on a Debian 12 machine, into the checkout's .venv.
#
#   bash scripts/install.sh        (or: make install)
#
# Idempotent: what is already installed is left alone, and a run with nothing to do takes a
# second or two. Steps:
#   1. Java 17+ must be present (Spark 4 runs on it); it is not installed here.
#   2. Debian packages for ROS 1 and Open3D, installed with apt-get only when missing
#      (through sudo when not root).
#   3. .venv (python3 -m venv), torch==2.13.0 first with pip (the CPU wheel on this disk; any
#      other spec pulls several GB of CUDA wheels), then `uv pip install -e '.[dev]'` with
#      torch held at that version (uv resolves and installs the ~170 packages in ~1 min where
#      pip took ~3 min; where uv cannot be installed, pip does it). A stamp in .venv records
#      the hash of pyproject.toml so unchanged dependencies are not re-resolved.
#   4. Byte-compiled sources and a JVM class archive for Spark (faster start-up of every
#      Python worker and every Spark JVM), built side by side.
# Environment: PYTHON (interpreter for the venv, default python3), ADCLOUD_SKIP_APT=1 (skip
# step 2, e.g. on a machine without Debian packages; ROS features then say what is missing),
# ADCLOUD_INSTALL_WITH_PIP=1 (step 3 with pip alone, e.g. where only pip's settings reach a
# package mirror).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_SPEC="torch==2.13.0"
UV_SPEC="uv==0.13.9"
APT_PACKAGES=(ros-core python3-rospy python3-rosbag python3-rostest topic-tools rosbash libusb-1.0-0 gcc)
STAMP="$VENV/.adcloud-install-stamp"

say() { printf '==> %s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

# Run a command with its output kept in a log; show the log only when the command fails.
quietly() {
    local log
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "command failed: $*"
    fi
    rm -f "$log"
}

# -- 1. Java -------------------------------------------------------------------------------------
JAVA_HINT="install it with: sudo apt-get install -y --no-install-recommends openjdk-17-jre-headless"
if [[ -n "${JAVA_HOME:-}" ]]; then
    JAVA="$JAVA_HOME/bin/java"
    [[ -x "$JAVA" ]] || die "JAVA_HOME=$JAVA_HOME has no bin/java; fix JAVA_HOME or unset it and $JAVA_HINT"
else
    JAVA=$(command -v java || true)
    [[ -n "$JAVA" ]] || die "Java 17 or newer is required by Spark and no 'java' is on PATH; $JAVA_HINT"
fi
JAVA_VERSION=$("$JAVA" -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')
JAVA_MAJOR=${JAVA_VERSION%%.*}
if [[ "$JAVA_MAJOR" == 1 ]]; then  # 1.8.0_x -> 8
    JAVA_MAJOR=$(cut -d. -f2 <<<"$JAVA_VERSION")
fi
[[ "$JAVA_MAJOR" =~ ^[0-9]+$ && "$JAVA_MAJOR" -ge 17 ]] ||
    die "Spark 4 needs Java 17 or newer but $JAVA is '${JAVA_VERSION:-unknown}'; $JAVA_HINT"

# -- 2. Debian packages ---------------------------------------------------------------------------
installed() { dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed'; }

if [[ "${ADCLOUD_SKIP_APT:-0}" != 1 ]]; then
    command -v dpkg >/dev/null ||
        die "this is not a Debian system: install ${APT_PACKAGES[*]} by other means and rerun with ADCLOUD_SKIP_APT=1"
    wanted=("${APT_PACKAGES[@]}")
    # Debian's own python3 needs python3-venv for `python3 -m venv`.
    if [[ ! -x "$VENV/bin/python" ]] && ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
        wanted+=(python3-venv)
    fi
    missing=()
    for package in "${wanted[@]}"; do
        installed "$package" || missing+=("$package")
    done
    if ((${#missing[@]})); then
        as_root=()
        if [[ $(id -u) -ne 0 ]]; then
            command -v sudo >/dev/null || die "need root or sudo to install: ${missing[*]}"
            as_root=(sudo)
        fi
        say "installing Debian packages: ${missing[*]}"
        quietly "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        quietly "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
fi

# -- 3. Python environment ------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
    command -v "$PYTHON" >/dev/null || die "no '$PYTHON' found: install Python 3.11 (or set PYTHON)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        die "adcloud needs Python 3.11+, '$PYTHON' is $("$PYTHON" --version 2>&1)"
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    quietly "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -c '' 2>/dev/null ||
    die "$VENV is broken (was its Python removed?); delete it (rm -rf $VENV) and run again"

stamp_value="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_SPEC $("$VENV/bin/python" -V 2>&1)"
packages_present() {
    # adcloud must resolve to this checkout (editable install), the rest must be importable.
    "$VENV/bin/python" - "$ROOT" <<'EOF'
import importlib.util
import pathlib
import sys

root = pathlib.Path(sys.argv[1]).resolve()
spec = importlib.util.find_spec("adcloud")
ok = spec is not None and spec.origin is not None and root in pathlib.Path(spec.origin).resolve().parents
ok = ok and all(importlib.util.find_spec(name) for name in ("pyspark", "torch", "pytest", "ruff", "mypy"))
sys.exit(0 if ok else 1)
EOF
}

cleanup() {
    if [[ -n "${archive_pid:-}" ]]; then
        kill "$archive_pid" 2>/dev/null || true
    fi
    rm -f "${constraints:-}" "${archive_log:-}"
}
trap cleanup EXIT

compile_site=0
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$stamp_value" ]] && packages_present; then
    say "Python packages are up to date ($VENV)"
else
    # --no-compile: pip byte-compiles file by file on one core; compileall below uses both
    say "installing $TORCH_SPEC (CPU) into $VENV"
    quietly "$VENV/bin/python" -m pip install -q --no-compile "$TORCH_SPEC"
    say "installing adcloud with its dependencies and dev tools (editable; first run takes a minute or more)"
    constraints=$(mktemp)
    echo "$TORCH_SPEC" >"$constraints"  # nothing may swap the CPU torch for a CUDA build
    # uv does not read pip's configuration: behind a package mirror, set UV_DEFAULT_INDEX
    # (uv's name for pip's index-url) or ADCLOUD_INSTALL_WITH_PIP=1
    if [[ "${ADCLOUD_INSTALL_WITH_PIP:-0}" != 1 ]] &&
        "$VENV/bin/python" -m pip install -q --no-compile "$UV_SPEC" >/dev/null 2>&1 &&
        [[ -x "$VENV/bin/uv" ]]; then
        quietly "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$constraints" -e '.[dev]'
    else
        say "pip installs the packages (a few minutes)"
        quietly "$VENV/bin/python" -m pip install -q --no-compile -c "$constraints" -e '.[dev]'
    fi
    packages_present || die "the packages were installed but adcloud, pyspark or torch does not import from $VENV"
    compile_site=1
fi

# -- 4. Speed-ups -------------------------------------------------------------------------------
# A class-data-sharing archive of the classes Spark's JVMs load (adcloud/_jvm_archive.py): a
# session starts ~3 s sooner and its first jobs run ~2 s sooner. Built once per Java and
# pyspark (about a minute); kept in .venv/share/adcloud/jvm. Only a speed-up: a JVM that
# cannot build one (not HotSpot 13+) gets a warning, and Spark runs without it. It is built
# in the background while the sources are byte-compiled: the JVM keeps about one core busy,
# and one after the other the two took 127 s of a fresh install here, side by side 113 s.
archive_pid=""
archive_log=$(mktemp)
if ! "$VENV/bin/python" -m adcloud._jvm_archive --check; then
    say "building the JVM class archive for Spark (once per Java and pyspark, about a minute)"
    "$VENV/bin/python" -m adcloud._jvm_archive >/dev/null 2>"$archive_log" &
    archive_pid=$!
fi

if ((compile_site)); then
    # Byte-compile what was installed: where PYTHONDONTWRITEBYTECODE is set (as on some CI
    # machines) Python writes no .pyc itself, and every process would compile torch afresh.
    # The packages' own test suites (a sixth of the sources) are never imported: left out.
    # A few files that are not Python 3 (samples inside packages) fail, as they do for pip.
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$VENV/bin/python" -m compileall -q -j 0 -x '/tests/' "$site" >/dev/null 2>&1 || true
    echo "$stamp_value" >"$STAMP"
fi

# Byte-compile the checkout: Spark's Python workers and every CLI process import adcloud, and
# where PYTHONDONTWRITEBYTECODE is set (as on CI machines) nothing else writes these caches, so
# each process would compile the sources again. Files already up to date are skipped.
quietly "$VENV/bin/python" -m compileall -q -j 0 "$ROOT/adcloud"

if [[ -n "$archive_pid" ]]; then
    if ! wait "$archive_pid"; then
        cat "$archive_log" >&2
        say "no JVM class archive (above: why); Spark works without it, ~6 s slower to start a session"
    fi
    archive_pid=""
fi

# -- summary ----------------------------------------------------------------------------------------
ros="not installed (ADCLOUD_SKIP_APT=1)"
if installed python3-rospy 2>/dev/null; then
    ros="ROS 1 rospy $(dpkg-query -W -f='${Version}' python3-rospy), rosbag $(dpkg-query -W -f='${Version}' python3-rosbag)"
fi
"$VENV/bin/python" - "$JAVA_VERSION" "$ros" <<'EOF'
import platform
import sys
from importlib.metadata import version

java, ros = sys.argv[1:3]
print("adcloud is installed:")
print(f"  python  {platform.python_version()} ({sys.prefix})")
print(f"  java    {java}")
from adcloud._jvm_archive import main as archive_check

archive = "built" if archive_check(["--check"]) == 0 else "not built"
print(f"  spark   {version('pyspark')} (pyspark; JVM class archive {archive})")
print(f"  torch   {version('torch')}")
print(f"  ros     {ros}")
EOF
