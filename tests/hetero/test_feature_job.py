"""The image feature job and the ``adcloud hetero`` commands, on local Spark."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import SparkSession
from rich.console import Console

from adcloud.errors import AdcloudError
from adcloud.hetero import HeteroError, extract_features, hog_features, read_features
from adcloud.hetero.command import add_parser
from adcloud.hetero.devices import HeteroSettings

from .conftest import T0, smooth_images, write_image_bag

pytestmark = pytest.mark.opencl


@pytest.fixture(scope="module")
def image_bags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Three small camera bags: rgb8, padded mono8 and bgr8, with their images."""
    folder = tmp_path_factory.mktemp("image-bags")
    rgb = smooth_images(40, 48, 64, seed=1)
    mono = smooth_images(25, 30, 41, seed=2, color=False)
    bgr = smooth_images(10, 48, 64, seed=3)
    return {
        "rgb": write_image_bag(folder / "rgb.bag", rgb, chunk_threshold=64 * 1024),
        "mono": write_image_bag(folder / "mono.bag", mono, encoding="mono8", pad=3),
        "bgr": write_image_bag(folder / "bgr.bag", bgr[..., ::-1], encoding="bgr8"),
        "images": {"rgb": rgb, "mono": mono, "bgr": bgr},
    }


def test_features_of_every_image_are_saved_per_partition(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    out = tmp_path / "features"
    result = extract_features(
        spark, [str(image_bags["rgb"]), str(image_bags["mono"])], str(out), partitions_per_bag=3
    )
    assert result.images == 65
    assert result.partitions >= 4
    assert sum(result.devices.values()) == 65
    assert result.images_per_second > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "adcloud-hog" and manifest["version"] == 1
    assert "hetero" in json.loads((out / "settings.json").read_text())
    saved = read_features(str(out))
    assert set(saved) == {"48x64", "30x41"}
    stamps, features = saved["48x64"]
    assert np.all(np.diff(stamps) > 0)
    np.testing.assert_allclose(
        features, hog_features(image_bags["images"]["rgb"], device="numpy"), atol=3e-5
    )
    _, mono_features = saved["30x41"]
    np.testing.assert_allclose(
        mono_features, hog_features(image_bags["images"]["mono"], device="numpy"), atol=3e-5
    )
    for path in out.glob("part-*.npz"):
        with np.load(path, allow_pickle=False) as data:
            assert int(data["version"]) == 1
            assert list(data["params"]) == [8, 9]


def test_bgr_images_give_the_features_of_their_rgb_pixels(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    result = extract_features(spark, str(image_bags["bgr"]), str(tmp_path / "bgr"))
    assert result.images == 10
    ((_, features),) = read_features(str(tmp_path / "bgr")).values()
    np.testing.assert_allclose(
        features, hog_features(image_bags["images"]["bgr"], device="numpy"), atol=3e-5
    )


def test_existing_output_and_wrong_topic(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    out = tmp_path / "again"
    extract_features(spark, str(image_bags["bgr"]), str(out))
    with pytest.raises(HeteroError, match="exists and is not empty"):
        extract_features(spark, str(image_bags["bgr"]), str(out))
    assert extract_features(spark, str(image_bags["bgr"]), str(out), overwrite=True).images == 10
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert not (out / "_temporary").exists()
    # a job that fails, overwriting or not, leaves the output as it was
    with pytest.raises(HeteroError, match="not sensor_msgs/Image"):
        extract_features(spark, str(image_bags["rgb"]), str(out), topic="/status", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(HeteroError, match="not sensor_msgs/Image"):
        extract_features(spark, str(image_bags["rgb"]), str(tmp_path / "status"), topic="/status")
    assert not (tmp_path / "status").exists()
    # a topic no bag has (a typo) fails before anything is written: an overwrite committed
    # an empty result over the earlier one
    with pytest.raises(HeteroError, match=r"no bag has the topic /camra/image_raw; they have"):
        extract_features(
            spark, str(image_bags["bgr"]), str(out), topic="/camra/image_raw", overwrite=True
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # and overwrite never replaces a directory holding anything else (a mistyped --out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(HeteroError, match=r"notes\.txt\); refusing to replace it"):
        extract_features(spark, str(image_bags["bgr"]), str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"cell": 0}, "cell must be >= 1, got 0"),
        ({"bins": 0}, "bins must be >= 1, got 0"),
        ({"bins": 33}, "bins must be <= 32, got 33"),  # the kernels' limit
        ({"batch": 0}, "batch must be >= 1, got 0"),
        ({"partitions_per_bag": 0}, "partitions_per_bag must be >= 1, got 0"),
        ({"partition_mb": -1.0}, "partition_mb must be >= 0"),  # was taken as 0
        ({"partition_mb": float("nan")}, "partition_mb must be >= 0"),  # was a ValueError
        ({"settings": HeteroSettings(device="7:7")}, "device 7:7"),
    ],
)
def test_bad_parameters_fail_before_any_task(
    spark: SparkSession, image_bags: dict, tmp_path: Path, change: dict, says: str
) -> None:
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    with pytest.raises(HeteroError, match=re.escape(says)):
        extract_features(spark, str(image_bags["bgr"]), str(tmp_path / "out"), **change)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs  # no Spark job
    assert not (tmp_path / "out").exists()


def test_a_topic_that_is_no_image_is_refused_before_any_task(
    spark: SparkSession, image_bags: dict, shared_data: Path, tmp_path: Path
) -> None:
    # from the bags' indexes, on the driver: in the tasks it failed every attempt of every
    # task with a traceback that named neither the bag nor the image topics it has
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    bags = [str(image_bags["bgr"]), str(image_bags["rgb"])]
    with pytest.raises(HeteroError) as info:
        extract_features(spark, bags, str(tmp_path / "status"), topic="/status")
    assert str(info.value).startswith(
        f"{image_bags['bgr']}: /status carries std_msgs/msg/String, not sensor_msgs/Image; "
        "its image topics are /camera/image_raw"
    )
    lidar = shared_data / "01_embag_luminar_ros1" / "embag_test.bag"
    with pytest.raises(HeteroError) as info:
        extract_features(spark, str(lidar), str(tmp_path / "lidar"), topic="/luminar_pointcloud")
    assert str(info.value).startswith(
        f"{lidar}: /luminar_pointcloud carries sensor_msgs/msg/PointCloud2, not "
        "sensor_msgs/Image; it has no sensor_msgs/Image topic"
    )
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs  # no Spark job
    assert not (tmp_path / "status").exists() and not (tmp_path / "lidar").exists()


def test_a_missing_bag_leaves_no_output_directory(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.bag"
    with pytest.raises(AdcloudError, match=r"nope\.bag"):
        extract_features(spark, [str(image_bags["bgr"]), str(missing)], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # not even an empty _temporary/<job>/


def test_damaged_outputs_are_errors_naming_the_file(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    out = tmp_path / "damaged"
    result = extract_features(spark, str(image_bags["bgr"]), str(out))
    part = Path(result.files[0])
    part.write_bytes(part.read_bytes()[:100])  # cut short, as by a full disk
    with pytest.raises(HeteroError, match=rf"{part.name} is not a readable adcloud-hog part"):
        read_features(str(out))
    (out / "manifest.json").write_text('{"format": "adcloud-h')
    with pytest.raises(HeteroError, match=r"manifest\.json is not valid JSON"):
        read_features(str(out))
    with pytest.raises(HeteroError, match=r"has no manifest\.json"):
        read_features(str(tmp_path / "elsewhere"))


def test_cell_larger_than_the_images_fails_naming_both(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    # 48x64 images hold a single 40-pixel cell: their descriptors would be empty
    with pytest.raises(
        Exception, match=r"the 48x64 images on /camera/image_raw are smaller "
    ) as info:
        extract_features(spark, str(image_bags["bgr"]), str(tmp_path / "out"), cell=40)
    assert "2x2 cells of 40 pixels" in str(info.value)
    assert "choose a smaller cell (--cell), at most 24 pixels" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_output_whose_path_holds_glob_characters(
    spark: SparkSession, image_bags: dict, tmp_path: Path
) -> None:
    out = tmp_path / "feat [v2]*?"
    extract_features(spark, str(image_bags["bgr"]), str(out), partitions_per_bag=2)
    ((stamps, features),) = read_features(str(out)).values()
    assert len(stamps) == len(features) == 10
    # the manifest says which files make the output: one missing is an error, not less data
    next(out.glob("part-*.npz")).unlink()
    with pytest.raises(HeteroError, match=r"is incomplete: its manifest lists part-\d+"):
        read_features(str(out))


def run(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="adcloud")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    console = Console(record=True, width=200)
    code = args.func(args, console)
    return code, console.export_text()


def test_cli_devices() -> None:
    code, text = run(["hetero", "devices"])
    assert code == 0
    assert "OpenCL devices" in text and "0:0" in text and "policy" in text
    code, text = run(["hetero", "devices", "--json"])
    doc = json.loads(text)
    assert doc["opencl"] == "ok" and doc["devices"][0]["address"] == "0:0"
    code, text = run(["hetero", "devices", "--discover", "gpu", "--split", "2"])
    assert json.loads(text)["name"] == "gpu"


def test_cli_features_and_kernels(spark: SparkSession, image_bags: dict, tmp_path: Path) -> None:
    code, text = run(
        [
            "hetero",
            "features",
            str(image_bags["rgb"]),
            "--out",
            str(tmp_path / "cli"),
            "--master",
            "local[2]",
        ]
    )
    assert code == 0, text
    assert "HOG features of 40 images" in text and "images/s" in text
    assert str(tmp_path / "cli") in text
    code, text = run(["hetero", "kernels", "--out", str(tmp_path / "cl")])
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "cl").glob("*.cl")) == [
        "features.cl",
        "icp.cl",
        "raster.cl",
        "transform.cl",
        "voxel.cl",
    ]


@pytest.mark.parametrize(
    "argv", [["hetero"], ["hetero", "devices"], ["hetero", "features"], ["hetero", "kernels"]]
)
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run([*argv, "--help"])
    assert info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_an_image_message_that_does_not_decode_names_its_topic_and_time(
    spark: SparkSession, tmp_path: Path
) -> None:
    # mono pixels recorded as rgb8: the step holds a third of a row.  The error named the
    # step but not which message of which topic had it
    bag = write_image_bag(
        tmp_path / "bad.bag", smooth_images(3, 32, 32, color=False), encoding="rgb8"
    )
    with pytest.raises(Exception, match=rf"/camera/image_raw message at {T0} ns: image step 32"):
        extract_features(spark, str(bag), str(tmp_path / "out"))


def test_mono_and_colour_images_of_one_size_on_one_topic(
    spark: SparkSession, tmp_path: Path
) -> None:
    # a camera switched from rgb8 to mono8 at the same size: the task stacked (H, W, 3) and
    # (H, W) pixels into one batch and failed with NumPy's "must have the same shape"
    colour = smooth_images(3, 32, 40, seed=4)
    mono = smooth_images(2, 32, 40, seed=5, color=False)
    images = [colour[0], mono[0], colour[1], mono[1], colour[2]]
    bag = write_image_bag(
        tmp_path / "mixed.bag", images, encoding=["rgb8", "mono8", "rgb8", "mono8", "rgb8"]
    )
    result = extract_features(spark, str(bag), str(tmp_path / "out"), partitions_per_bag=1)
    assert result.images == 5
    stamps, features = read_features(str(tmp_path / "out"))["32x40"]
    assert stamps.tolist() == [T0 + i * 100_000_000 for i in range(5)]
    want = np.stack([hog_features(image, device="numpy") for image in images])
    np.testing.assert_allclose(features, want, atol=3e-5)


@pytest.mark.parametrize(
    "partitions", [None, [{"partition": 0}], [["part-00000-8x8.npz"]], [{"files": 3}]]
)
def test_a_manifest_without_its_part_list_is_an_error_naming_it(
    tmp_path: Path, partitions: object
) -> None:
    manifest: dict[str, object] = {"format": "adcloud-hog", "version": 1}
    if partitions is not None:
        manifest["partitions"] = partitions
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HeteroError, match=r"manifest\.json does not list its part files"):
        read_features(str(tmp_path))
