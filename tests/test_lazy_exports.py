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


def _loaded_after(code: str, heavy: tuple[str, ...]) -> list[str]:
    """The modules of ``heavy`` that a fresh interpreter has imported after ``code``."""
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {heavy!r} if m in sys.modules))\n"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.split()


def test_pipe_node_start_does_not_load_the_platform() -> None:
    # A pipe node runs once per scenario: it must not pay for the bag readers, fsspec,
    # Spark or plotting that the package namespaces also export.
    heavy = (
        "pyspark",
        "fsspec",
        "matplotlib",
        "adcloud.binpipe.bags",
        "adcloud.sim.replay",
        "adcloud.store",
    )
    assert _loaded_after("import adcloud.sim.examples.obstacle_node", heavy) == []


def test_cli_help_does_not_load_the_services() -> None:
    # `adcloud --help` builds every subcommand's parser: it must not import torch, GTSAM or
    # matplotlib (seconds on 2 cores) through the service packages' namespaces.
    code = "from adcloud.cli import build_parser\nbuild_parser().format_help()"
    heavy = ("torch", "gtsam", "matplotlib", "pyspark", "scipy", "open3d")
    assert _loaded_after(code, heavy) == []
    # the probe does see an import: the trainer's export module needs torch
    assert "torch" in _loaded_after(f"{code}\nimport adcloud.train.export", heavy)
