"""Package namespaces load their submodules on first use, so pipe nodes and the CLI start
fast."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "package", ["adcloud.binpipe", "adcloud.sim", "adcloud.hdmap", "adcloud.train", "adcloud.synth"]
)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))


def test_unknown_name_is_an_attribute_error() -> None:
    module = importlib.import_module("adcloud.sim")
    with pytest.raises(AttributeError, match=r"adcloud\.sim.*no_such_thing"):
        _ = module.no_such_thing  # type: ignore[attr-defined]


def test_pipe_node_start_does_not_load_the_platform() -> None:
    # A pipe node runs once per scenario: it must not pay for the bag readers, fsspec,
    # Spark or plotting that the package namespaces also export.
    code = (
        "import sys, adcloud.sim.examples.obstacle_node\n"
        "heavy = ('pyspark', 'fsspec', 'matplotlib', 'adcloud.binpipe.bags', "
        "'adcloud.sim.replay', 'adcloud.store')\n"
        "print(' '.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_cli_help_does_not_load_the_services() -> None:
    # `adcloud --help` builds every subcommand's parser: it must not import torch, GTSAM or
    # matplotlib (seconds on 2 cores) through the service packages' namespaces.
    code = (
        "import sys\n"
        "from adcloud.cli import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = ('torch', 'gtsam', 'matplotlib', 'pyspark', 'scipy', 'open3d')\n"
        "print(' '.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
