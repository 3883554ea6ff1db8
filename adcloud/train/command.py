"""``adcloud train run|inspect``: training jobs and exported models from the command line.

``run`` trains on the Spark session (``--master``, ``ADCLOUD_SPARK_MASTER`` or ``local[*,4]``;
under ``spark-submit`` the submitted session) with a :class:`~adcloud.train.config.TrainConfig`
from ``--config`` (section ``train``), ``ADCLOUD_TRAIN_*`` and ``--set key=value``; ``inspect``
shows an exported model's metadata. Only this module prints.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["add_parser"]

_EPILOG_RUN = """\
examples:
  adcloud train run --config train.yaml
  adcloud train run --set task=lidar_seg --set bags=drive.bag --set heldout_bags=test.bag \\
      --set sync=allreduce --set workers=2 --set steps=300 --set out=runs/seg
  adcloud submit --master spark://127.0.0.1:7077 -- train run --config train.yaml

train.yaml:
  train:
    task: lidar_seg            # or camera_seg
    bags: [drives/]            # files, directories, globs, any fsspec URL
    heldout_bags: [test.bag]
    sync: ps                   # single | ps (parameter server on the store) | allreduce
    workers: 2                 # one trainer per executor (a Spark barrier stage)
    store: local:///adcloud    # checkpoints and parameter versions
    out: runs/seg              # model/ (torch.export + metadata), loss.png, result.json
                               # (default adcloud-runs/{run}, {run}: the run's name)

Running the same config on the same bags again resumes from its last checkpoint; bags
that changed (their size or file metadata) start a new run.  Set train.run to name a run.
"""


def _session(args: argparse.Namespace) -> Any:
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415

    settings = SparkSettings.load(master=args.master) if args.master else SparkSettings.load()
    return get_session(settings, **{"spark.ui.showConsoleProgress": "false"})


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from adcloud.train.config import TrainConfig  # noqa: PLC0415
    from adcloud.train.job import load_task, run_training  # noqa: PLC0415

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            console.print(f"--set {item!r} is not KEY=VALUE")
            return 2
        overrides[key.strip()] = value
    config = TrainConfig.load(file=args.config, **overrides).validate()
    task = load_task(config)  # a wrong task name or option fails before Spark starts
    spark = _session(args)
    with console.status(f"training {config.task} ({config.sync}) on {spark.sparkContext.master}"):
        result = run_training(spark, config, task=task)
    table = Table(title=f"run {result.run}")
    table.add_column("field")
    table.add_column("value", justify="right")
    rows = [
        ("task", result.task),
        ("mode", f"{result.mode}, {result.world} trainer(s)"),
        (
            "steps",
            f"{result.steps} (resumed at {result.start_step})"
            if result.start_step
            else str(result.steps),
        ),
        (
            "loss first -> last",
            f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else "-",
        ),
        ("samples/s", f"{result.samples_per_second:,.1f}"),
        *((name, f"{value:.4f}") for name, value in sorted(result.metrics.items())),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(
        f"outputs: {result.output}  (model/, loss.png, result.json, settings.json; "
        f"adcloud train inspect {result.output}/model)",
        highlight=False,
    )
    return 0


def _cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    from adcloud.train.export import inspect_model, inspection_table  # noqa: PLC0415

    info = inspect_model(args.path)
    if args.json:
        console.print_json(json.dumps(info, default=str))
    else:
        console.print(inspection_table(info))
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``train`` (``run``, ``inspect``) on ``subparsers``."""
    train = subparsers.add_parser(
        "train",
        help="distributed training inside Spark; exported models",
        description="Train models on drives inside one Spark job (ETL cached in executor "
        "memory, one trainer per executor, parameter server or all-reduce), export them with "
        "torch.export and inspect the result.",
    )
    sub = train.add_subparsers(dest="train_command", metavar="COMMAND", required=True)
    run = sub.add_parser(
        "run",
        help="train a model (resumes an interrupted run)",
        description="Decode the bags, build samples, train and export the model to out/.",
        epilog=_EPILOG_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", help="YAML/JSON settings file (section train)")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting"
    )
    run.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    run.set_defaults(func=_cmd_run)

    inspect = sub.add_parser(
        "inspect",
        help="show an exported model's metadata",
        description="Show what an exported model is: task, config, data manifest (bags and "
        "hashes), code version, metrics, parameters, MACs and measured latency.",
    )
    inspect.add_argument("path", help="the model directory (out/model) or its model.pt2")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=_cmd_inspect)


def run_demo(spark: Any, bag: str, out_dir: str, console: Console) -> str:
    """The training part of ``adcloud demo``: a short LiDAR-segmentation run on ``bag`` with
    two trainers all-reducing inside a Spark barrier stage, exported under ``out_dir/train``."""
    import tempfile  # noqa: PLC0415

    from adcloud.train.config import TrainConfig  # noqa: PLC0415
    from adcloud.train.job import run_training  # noqa: PLC0415

    console.rule("adcloud train: ETL and data-parallel training in one Spark job")
    out = f"{out_dir}/train"
    # the run's checkpoints are only for resuming this run: they go with it
    with tempfile.TemporaryDirectory(prefix="adcloud-demo-train-") as store:
        config = TrainConfig(
            task="lidar_seg",
            bags=(bag,),
            sync="allreduce",
            workers=2,
            steps=20,
            batch_size=4,
            lr=3e-3,
            checkpoint_every=10,
            store=f"file://{store}",
            out=out,
            progress=False,
        ).validate()
        with console.status("training lidar_seg with 2 trainers (allreduce) ..."):
            result = run_training(spark, config)
    console.print(
        f"{result.steps} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
        f"{result.samples_per_second:.1f} samples/s; exported model: [bold]{out}/model[/bold] "
        "(adcloud train inspect shows it)",
        highlight=False,
    )
    return out
