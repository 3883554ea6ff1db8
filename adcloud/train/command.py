"""``adcloud train run|eval|inspect``: training jobs and exported models from the command line.

``run`` trains on the Spark session (``--master``, ``ADCLOUD_SPARK_MASTER`` or ``local[*,4]``;
under ``spark-submit`` the submitted session) with a :class:`~adcloud.train.config.TrainConfig`
from ``--config`` (section ``train``), ``ADCLOUD_TRAIN_*`` and ``--set key=value``; ``eval``
scores an exported model on bags on the same kind of session
(:func:`adcloud.train.evaluate.evaluate_model`); ``inspect`` shows an exported model's
metadata. Only this module prints.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adcloud._argtypes import whole_number, written_url

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
    eval_every: 50             # score them every 50 steps too: the validation curve
    sync: ps                   # single | ps (parameter server on the store) | allreduce
    workers: 2                 # one trainer per executor (a Spark barrier stage)
    store: local:///adcloud    # checkpoints and parameter versions
    out: runs/seg              # model/ (torch.export + metadata), loss.png, result.json
                               # (default adcloud-runs/{run}, {run}: the run's name)

Running the same config on the same bags again resumes from its last checkpoint; bags
that changed (their size or file metadata) start a new run.  Set train.run to name a run:
resumed on bags that changed, were added or removed, or with other task options, a named
run is refused, naming them (--set resume_changed_data=true resumes it on them anyway).
"""


def _spark_settings(args: argparse.Namespace) -> Any:
    """Spark's settings: the ``spark`` section of ``--config`` (beside ``train``), then
    ``ADCLOUD_SPARK_*``, then ``--master``."""
    from adcloud.spark import SparkSettings  # noqa: PLC0415

    overrides = {"master": args.master} if args.master else {}
    settings = SparkSettings.load(file=getattr(args, "config", None), **overrides)
    return settings.importing("torch")  # every trainer and scorer imports it


def _session(args: argparse.Namespace) -> Any:
    from adcloud.spark import get_session  # noqa: PLC0415

    return get_session(_spark_settings(args), **{"spark.ui.showConsoleProgress": "false"})


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from adcloud.train.config import TrainConfig  # noqa: PLC0415
    from adcloud.train.job import load_task, preflight, run_training  # noqa: PLC0415

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key.strip()] = value
    config = TrainConfig.load(file=args.config, **overrides).validate()
    task = load_task(config)  # a wrong task name or option fails before Spark starts
    run = preflight(config, task)  # and so do a missing bag and checkpoints it cannot resume
    spark = _session(args)
    with console.status(f"training {config.task} ({config.sync}) on {spark.sparkContext.master}"):
        result = run_training(spark, config, task=task, preflighted=run)
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
        (
            "samples/s",
            "- (no step left to train)"
            if result.start_step >= result.steps
            else f"{result.samples_per_second:,.1f}",
        ),
        *_curve_row(result.validation),
        *((name, f"{value:.4f}") for name, value in sorted(result.metrics.items())),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    extra = ", eval.json, confusion.png" if config.heldout_bags else ""
    console.print(
        f"outputs: {result.output}  (model/, loss.png, result.json, settings.json{extra}; "
        f"adcloud train inspect {result.output}/model)",
        highlight=False,
    )
    return 0


def _setting(text: str) -> str:
    """``--set``: ``KEY=VALUE``, checked as it is parsed."""
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(f"--set {text!r} is not KEY=VALUE")
    return text


def _curve_row(curve: Any) -> list[tuple[str, str]]:
    """The validation curve as one table row: the first score at each step (the last 6)."""
    if not curve:
        return []
    name = next(iter(curve[-1][1]), "")
    points = [f"{step}: {scores.get(name, float('nan')):.3f}" for step, scores in curve[-6:]]
    return [(f"held-out {name} by step", "  ".join(points))]


def _cmd_eval(args: argparse.Namespace, console: Console) -> int:
    from adcloud.train.errors import TrainError  # noqa: PLC0415
    from adcloud.train.evaluate import (  # noqa: PLC0415
        EVAL_FILE,
        PLOT_FILE,
        check_eval_target,
        evaluate_model,
        model_inputs,
        model_task,
    )
    from adcloud.train.export import inspect_model  # noqa: PLC0415
    from adcloud.train.job import bag_uris  # noqa: PLC0415

    # no bag, a missing bag, a missing or corrupt model (its program, or the input sizes its
    # metadata records), one of an unknown task, or an --out that is a file fails before
    # Spark starts
    if args.out:
        check_eval_target(args.out)
    given = [b for b in args.bags if b.strip()]
    if not given:  # --bags "" (an unset shell variable): no bag, not the working directory
        raise TrainError("--bags names no bag: give at least one bag, directory or glob")
    bag_uris(given)  # raises naming a bag or glob not there
    info = inspect_model(args.model)
    model_task(info, str(info["path"]))
    model_inputs(info, str(info["path"]))
    spark = _session(args)
    with console.status(f"scoring {info['path']} on {spark.sparkContext.master}"):
        evaluation = evaluate_model(
            spark,
            args.model,
            args.bags,
            partitions_per_bag=args.partitions_per_bag,
            out=args.out,
        )
    if args.json:
        console.print_json(evaluation.to_json())
        return 0
    console.print(evaluation.table())
    if args.out:
        plot = f" and {PLOT_FILE}" if evaluation.plottable else " (no confusion matrix to draw)"
        console.print(f"wrote {args.out}/{EVAL_FILE}{plot}", highlight=False)
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
    """Register ``train`` (``run``, ``eval``, ``inspect``) on ``subparsers``."""
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
    run.add_argument(
        "--config", help="YAML/JSON settings file (section train; Spark's in section spark)"
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        type=_setting,
        metavar="KEY=VALUE",
        help="override a setting (repeatable), e.g. --set steps=300",
    )
    run.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    run.set_defaults(func=_cmd_run)

    evaluate = sub.add_parser(
        "eval",
        help="score an exported model on bags (per bag and overall)",
        description="Score an exported model (a run's model/ directory) on drives in one "
        "Spark job: the executors decode the bags, run the model on their samples and "
        "return counts (a confusion matrix); the scores are per bag and over all bags. The "
        "task and its options come from the model's metadata.",
        epilog="examples:\n"
        "  adcloud train eval --model runs/seg/model --bags test.bag\n"
        "  adcloud train eval --model runs/seg/model --bags 'drives/2026-11-*.bag' "
        "--out runs/seg/eval-nov\n"
        "  adcloud submit --master spark://127.0.0.1:7077 -- train eval --model "
        "/shared/seg/model --bags s3://drives/test/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument(
        "--model", required=True, help="the model directory (out/model; a path or an fsspec URL)"
    )
    evaluate.add_argument(
        "--bags",
        nargs="+",
        required=True,
        help="bags to score on: files, directories, globs or fsspec URLs",
    )
    evaluate.add_argument(
        "--out",
        type=written_url("the scores"),
        help="directory or URL for eval.json and confusion.png (default: none written)",
    )
    evaluate.add_argument(
        "--partitions-per-bag",
        type=whole_number(1),  # checked before Spark starts
        help="split each bag into this many Spark partitions (default: ~128 MiB each)",
    )
    evaluate.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    evaluate.add_argument("--json", action="store_true", help="machine-readable output")
    evaluate.set_defaults(func=_cmd_eval)

    inspect = sub.add_parser(
        "inspect",
        help="show an exported model's metadata",
        description="Show what an exported model is: task, config, data manifest (bags and "
        "hashes), code version, metrics, parameters, MACs and measured latency.",
    )
    inspect.add_argument(
        "path", help="the model directory (out/model) or its model.pt2; a path or an fsspec URL"
    )
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=_cmd_inspect)


def run_demo(
    spark: Any, bag: str, out_dir: str, console: Console, heldout: str | None = None
) -> str:
    """The training part of ``adcloud demo``: a short LiDAR-segmentation run on ``bag`` with
    two trainers all-reducing inside a Spark barrier stage, exported under ``out_dir/train``
    and, with ``heldout``, scored on that other drive by the executors."""
    from adcloud._scratch import scratch_dir  # noqa: PLC0415
    from adcloud.train.config import TrainConfig  # noqa: PLC0415
    from adcloud.train.job import run_training  # noqa: PLC0415

    console.rule("adcloud train: ETL and data-parallel training in one Spark job")
    out = f"{out_dir}/train"
    # the run's checkpoints are only for resuming this run: they go with it (and with a
    # killed demo, with the next one)
    with scratch_dir("adcloud-demo-train-") as store:
        config = TrainConfig(
            task="lidar_seg",
            bags=(bag,),
            heldout_bags=(heldout,) if heldout else (),
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
        f"{result.samples_per_second:.1f} samples/s; exported model: "
        f"[bold]{escape(str(out))}/model[/bold] "
        "(adcloud train inspect shows it)",
        highlight=False,
        markup=True,
    )
    if heldout and result.metrics:
        console.print(
            f"scored on the executors on {heldout}: mIoU {result.metrics['miou']:.3f}, "
            f"accuracy {result.metrics['accuracy']:.3f} after {result.steps} steps "
            f"({out}/eval.json, confusion.png)",
            highlight=False,
        )
    return out
