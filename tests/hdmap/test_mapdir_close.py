"""A map on an adcloud store (``local://``) holds the store's threads, files and connections:
``plan_build`` and ``build_map`` close what they open, and the plans, versions and summaries
they return still read (the store opened again for them is closed once they are gone)."""

from __future__ import annotations

import gc
import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adcloud.hdmap import HdmapSettings, build_map
from adcloud.hdmap.build import STATE_KEYFRAMES, plan_build
from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.job import StageSettings
from adcloud.hdmap.kept import TILE_SETTINGS, tile_settings
from adcloud.hdmap.loops import Keyframe, KeyframeArchive
from adcloud.hdmap.mapdir import BuildPlan, MapDir, Staging
from adcloud.hdmap.semantic import SemanticMap, write_geojson
from adcloud.store import LocalStore

ORIGIN = (37.3875, -122.0575, 12.0)


class OpenStores:
    """The LocalStores opened since it was made, less those closed since."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open: list[LocalStore] = []
        opening, closing = LocalStore.__init__, LocalStore.close

        def init(store: LocalStore, *args: Any, **kwargs: Any) -> None:
            opening(store, *args, **kwargs)
            self.open.append(store)

        def close(store: LocalStore) -> None:
            closing(store)
            if store in self.open:
                self.open.remove(store)

        monkeypatch.setattr(LocalStore, "__init__", init)
        monkeypatch.setattr(LocalStore, "close", close)

    def threads(self) -> int:
        return sum(t.name == "adcloud-store-maintainer" for t in threading.enumerate())


@pytest.fixture
def store_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A local:// map with one version of what a labels-only build reads, from a stand-in
    bag."""
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(tmp_path / "store"))
    bag = tmp_path / "old.bag"
    bag.write_bytes(random.Random(1).randbytes(4096))
    stages = StageSettings.from_settings(HdmapSettings())

    def first_version(plan: BuildPlan, staging: Staging) -> None:
        out = staging.path
        (out / "state").mkdir()
        (out / "state" / "origin.json").write_text(json.dumps({"origin": ORIGIN}))
        (out / TILE_SETTINGS).write_text(json.dumps(tile_settings(stages.grid, stages.cloud)))
        write_geojson(out / "semantic.geojson", SemanticMap(origin=ORIGIN))
        pose = np.eye(4)
        frames = [Keyframe("old", 0, pose, 0.0, np.zeros((0, 3), np.float32))]
        KeyframeArchive.write(out / STATE_KEYFRAMES, frames)

    uri = "local:///maps/city"
    with MapDir(uri) as md:
        md.update([bag], first_version)
    return uri, bag


def test_plan_build_closes_the_store_and_its_plan_still_reads(
    store_map: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, bag = store_map
    stores = OpenStores(monkeypatch)
    threads = stores.threads()
    plan = plan_build(str(bag), uri)
    assert stores.open == [] and stores.threads() == threads
    assert plan.up_to_date and plan.parent is not None
    assert json.loads(plan.parent.read_bytes("state/origin.json")) == {"origin": list(ORIGIN)}
    assert len(stores.open) == 1  # opened again for the plan ...
    del plan
    gc.collect()
    assert stores.open == [] and stores.threads() == threads  # ... and closed with it


def test_build_map_closes_the_store_and_its_summary_still_reads(
    store_map: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan given to build_map is read through the map build_map opened (and closed):
    nothing reopens the store plan_build closed. A labels-only version, then a build with
    nothing new."""
    uri, bag = store_map
    labels = tmp_path / "labels.geojson"
    sign = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [1.0, 2.0, 2.0]},
        "properties": {"kind": "traffic_sign", "type": "stop", "facing_yaw_rad": 0.0},
    }
    lat, lon, alt = ORIGIN
    labels.write_text(
        json.dumps(
            {
                "type": "FeatureCollection",
                "adcloud:frame": "map",
                "adcloud:origin": {"latitude_deg": lat, "longitude_deg": lon, "height_m": alt},
                "features": [sign],
            }
        )
    )
    stores = OpenStores(monkeypatch)
    threads = stores.threads()
    plan = plan_build(str(bag), uri)
    summary = build_map(None, str(bag), uri, labels=str(labels), plan=plan)
    assert stores.open == [] and stores.threads() == threads
    assert summary.changed
    version = summary.result.version
    assert version is not None and version.id == "000002"
    assert version.manifest.labels == str(labels)
    assert "stop" in version.read_bytes("labels/imported.json").decode()
    del version, summary
    gc.collect()
    assert stores.open == []

    again = build_map(None, str(bag), uri, plan=plan_build(str(bag), uri))
    assert stores.open == [] and stores.threads() == threads
    assert not again.changed and again.result.version is not None
    assert again.result.version.id == "000002"
    assert again.result.plan.parent is not None
    assert again.result.plan.parent.read_bytes("manifest.json")


def test_a_plan_of_another_map_is_refused(store_map: tuple[str, Path], tmp_path: Path) -> None:
    """A plan builds on its map's version: given for another map whose CURRENT has the
    same id, the build would have published the first map's files in the second."""
    uri, bag = store_map
    plan = plan_build(str(bag), uri)
    other = tmp_path / "other"
    with MapDir(other) as md:
        md.update([bag], lambda plan, staging: None)
    with pytest.raises(HdmapError, match="a version of another map than"):
        build_map(None, str(bag), str(other), plan=plan)
