"""``adcloud sim run`` and ``adcloud sim cameras``: replay jobs from the command line (and
under ``spark-submit``).

:func:`add_parser` registers ``sim`` with its ``run`` and ``cameras`` sub-commands.
:func:`run` builds a :class:`~adcloud.sim.replay.ReplayJob`, runs it on the Spark session
(``--master``, ``ADCLOUD_SPARK_MASTER`` or ``local[*,4]``), prints a pass/fail table and
writes the report; :func:`run_cameras` sweeps camera counts into a detector
(:func:`~adcloud.sim.perception.camera_sweep`).  Exit status of ``run``: 0 when every
scenario passed, 1 when any failed (errors of the job itself are turned into messages by
``adcloud.cli``).  Only this module prints.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from adcloud._argtypes import number, whole_number, written_url
from adcloud.sim.adapters import ADAPTERS, MAX_WAIT_S, NodeSpec, ReplayTiming
from adcloud.sim.errors import SimError
from adcloud.sim.evaluators import EVALUATORS, parse_evaluator
from adcloud.sim.perception import (
    CameraLoad,
    camera_replay_job,
    camera_sweep,
    check_sweep_target,
)
from adcloud.sim.replay import ReplayJob, ReplayResults, run_replay
from adcloud.sim.report import check_report_target, write_report
from adcloud.sim.scenario import CutMode, ScenarioCut

__all__ = ["add_parser", "run", "run_cameras"]

_EPILOG = """\
examples:
  adcloud sim run drive.bag --node "python -m adcloud.sim.examples.obstacle_node" \\
      --inputs /lidar/points --outputs /obstacles \\
      --eval rate:topic=/obstacles,min_hz=8 --eval latency:max_ms=100 \\
      --eval detections:topic=/obstacles --report out/sim
  adcloud sim run 'drives/*.bag' --adapter ros1 \\
      --node "/usr/lib/topic_tools/relay /lidar/points /relayed" \\
      --inputs /lidar/points --outputs /relayed --cut window --window 5 --warmup 1
  adcloud submit --master spark://127.0.0.1:7077 -- sim run d.bag --node ... --inputs ...

Evaluators, written name:key=value,key=value (see adcloud.sim.evaluators):
  {evaluators}, or your own as package.module:attr.
--rate 0 replays as fast as possible, --rate 1 in real time.
"""


#: Seconds >= 0; > 0; a quiet period a thread can wait (inf overflows there); a time limit.
_seconds = number("number of seconds", exclusive=False)
_positive_seconds = number("number of seconds")
_wait_seconds = number("number of seconds", exclusive=False, maximum=MAX_WAIT_S)
_limit_seconds = number("number of seconds", maximum=MAX_WAIT_S)


def _topics(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _node_arguments(p: argparse.ArgumentParser, bags: str, node_help: str) -> None:
    """The bags, ``--node`` and ``--adapter`` arguments every ``sim`` command takes."""
    p.add_argument("bags", nargs=bags, help="bag URLs, globs or directories")
    p.add_argument("--node", required=True, help=node_help)
    p.add_argument(
        "--adapter",
        default="pipe",
        help=f"node adapter: {', '.join(sorted(ADAPTERS))} or package.module:attr (default: pipe)",
    )


def add_parser(subparsers: Any) -> None:
    """Register ``sim`` (with ``run``) on an ``argparse`` sub-parsers object."""
    sim = subparsers.add_parser(
        "sim",
        help="replay simulation: feed recorded drives to a node under test",
        description="Replay recorded drives into a node under test on Spark executors and "
        "report pass/fail per scenario.",
    )
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    p = sim_sub.add_parser(
        "run",
        help="run a replay job",
        description="Cut bags into scenarios, replay each into the node (one Spark task per "
        "scenario), evaluate its outputs and write results.jsonl, junit.xml and report.html.",
        epilog=_EPILOG.format(evaluators=", ".join(sorted(EVALUATORS))),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _node_arguments(p, "*", "the node's command line")
    p.add_argument("--inputs", required=True, type=_topics, help="input topics, comma-separated")
    p.add_argument(
        "--outputs",
        default=(),
        type=_topics,
        help="output topics, comma-separated (default: every topic a pipe node writes; the "
        "ros1 adapter needs them named)",
    )
    p.add_argument(
        "--eval", action="append", default=[], metavar="SPEC", help="evaluator (repeatable)"
    )
    p.add_argument(
        "--cut",
        choices=[m.value for m in CutMode],
        default=None,  # bag; None tells a --cut given beside --scenarios from the default
        help="how bags become scenarios: bag = one per bag (default), window = consecutive "
        "--window windows, file = the --scenarios file",
    )
    p.add_argument(
        "--window",
        type=_positive_seconds,
        default=None,  # 10; None tells a --window given without --cut window
        help="window length, s (--cut window; default 10); a last window shorter than half "
        "of it is merged into the one before",
    )
    p.add_argument(
        "--warmup",
        type=_seconds,
        default=None,  # 0
        help="warm-up before each window, s (>= 0; --cut window; default 0)",
    )
    p.add_argument("--scenarios", metavar="FILE", help="scenario file (implies --cut file)")
    p.add_argument(
        "--rate", type=float, default=0.0, help="0: as fast as possible; r: r x real time"
    )
    p.add_argument("--no-sync", action="store_true", help="do not wait for outputs per input")
    p.add_argument(
        "--quiet-period",
        type=_wait_seconds,
        default=0.25,
        metavar="SECONDS",
        help="synchronous mode: after each input, wait for the node's answer until the node "
        "has been idle this long (s; a node still computing is waited for, up to --timeout); "
        "a ROS node, in either mode: after the last input, until it has been idle this long",
    )
    p.add_argument(
        "--triggers",
        default=(),
        type=_topics,
        help="synchronous mode: input topics after which to wait for the node's answer, "
        "comma-separated (default: empty = all inputs)",
    )
    p.add_argument(
        "--answers",
        default=(),
        type=_topics,
        help="synchronous mode: output topics whose messages answer an input and end its "
        "wait, comma-separated (default: empty = every output); name them when the node "
        "also publishes on a timer of its own",
    )
    p.add_argument(
        "--timeout", type=_limit_seconds, default=300.0, help="per-scenario time limit, s"
    )
    p.add_argument(
        "--startup-timeout",
        type=_limit_seconds,
        default=20.0,
        help="node start-up, s (default 20): synchronous mode waits this long after the first "
        "input for the node's first answer while the node is idle (a node still computing is "
        "waited for, up to --timeout; a pipe node slower to start is not failed for it); the "
        "ros1 adapter fails a node that has not subscribed to the inputs by then",
    )
    p.add_argument(
        "--max-output-mb",
        type=number("number of MiB"),
        default=1024.0,
        help="most output one scenario's node may write, MiB of messages on the output "
        "topics (default 1024): more fails the scenario, not the executor's memory",
    )
    p.add_argument(
        "--report",
        metavar="URI",
        type=written_url("the report"),
        help="report directory (any store URI but memory://)",
    )
    p.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    p.set_defaults(func=run)
    _add_cameras_parser(sim_sub)


_CAMERAS_EPILOG = """\
examples:
  adcloud synth --seconds 20 --no-lidar --cameras 4 --out rig.bag
  adcloud sim cameras rig.bag --node "python -m adcloud.sim.examples.camera_node --work-ms 60" \\
      --cameras /camera/image_raw,/camera1/image_raw,/camera2/image_raw,/camera3/image_raw \\
      --report out/sweep

For each count n (--counts, default 1 up to the number of --cameras) the first n camera
topics are replayed at their frame rate (times --rate) into the node, free-running: a
detector that cannot keep up drops frames.  A count passes when its frame loss is at most
--max-loss (and p95 latency within --max-latency-ms when given); the detector sustains the
largest count that passes with every smaller count passing too.  The report directory gets
sweep.json, sweep.png and each count's replay report in cameras-<n>/, replacing an earlier
sweep's report as a whole once all of it is written (a directory holding other files is
refused before the sweep).
Exit status: 0, or 1 when --require N is given and fewer than N cameras are sustained.
"""


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--counts takes comma-separated whole numbers, not {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--counts takes camera counts of 1 or more, not {text!r}")
    return counts


def _add_cameras_parser(sim_sub: Any) -> None:
    p = sim_sub.add_parser(
        "cameras",
        help="how many camera streams a detector sustains (frame loss, fps, latency per count)",
        description="Replay 1, 2, ... camera streams at their frame rate into a detector node, "
        "one count after the other, and report frame loss, throughput and latency per count and "
        "the most cameras the detector sustains.",
        epilog=_CAMERAS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _node_arguments(p, "+", "the detector's command line")
    p.add_argument(
        "--cameras",
        required=True,
        type=_topics,
        help="camera image topics, comma-separated, in the order they are added",
    )
    p.add_argument("--output", default="/detections", help="the detector's output topic")
    p.add_argument(
        "--counts", type=_counts, help="camera counts to try, comma-separated (default: all)"
    )
    p.add_argument(
        "--rate",
        type=number("replay speed"),
        default=1.0,
        help="replay speed, > 0 (default 1: the frame rate)",
    )
    p.add_argument(
        "--max-loss", type=float, default=0.05, help="frame loss a count may have (default 0.05)"
    )
    p.add_argument("--max-latency-ms", type=float, help="p95 latency bound per count, ms")
    p.add_argument(
        "--stop-after-failure", action="store_true", help="skip larger counts once one fails"
    )
    p.add_argument(
        "--require",
        type=whole_number(0, "cameras"),
        help="exit 1 unless at least this many are sustained",
    )
    p.add_argument(
        "--timeout", type=_limit_seconds, default=300.0, help="per-scenario time limit, s"
    )
    p.add_argument(
        "--report",
        metavar="URI",
        type=written_url("the report"),
        help="report directory (any store URI but memory://)",
    )
    p.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    p.set_defaults(func=run_cameras)


def _session(master: str | None) -> Any:
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415 - keep --help fast

    settings = SparkSettings.load(master=master) if master else SparkSettings.load()
    return get_session(settings, **{"spark.ui.showConsoleProgress": "false"})


def job_from_args(args: argparse.Namespace) -> ReplayJob:
    """The :class:`ReplayJob` that ``args`` describe (validated).

    A scenario file names its bags and cuts them itself: bags or a ``--cut`` other than
    ``file`` beside ``--scenarios`` are refused rather than ignored."""
    if args.scenarios and args.bags:
        raise SimError(
            f"--scenarios {args.scenarios} names the bags it replays; give no bags with it "
            f"(not {' '.join(args.bags)})"
        )
    if args.scenarios and args.cut not in (None, CutMode.FILE.value):
        raise SimError(
            f"--scenarios {args.scenarios} cuts the bags as it lists; --cut {args.cut} "
            "does not go with it"
        )
    mode = CutMode.FILE if args.scenarios else CutMode(args.cut or CutMode.BAG.value)
    given = [
        option
        for option, value in (("--window", args.window), ("--warmup", args.warmup))
        if value is not None
    ]
    if given and mode is not CutMode.WINDOW:
        # windows are all they shape: a bag or a scenario file would replay unchanged
        raise SimError(
            f"{' and '.join(given)} cut bags into windows: give --cut window with "
            f"{'them' if len(given) > 1 else 'it'} (the cut is {mode.value})"
        )
    window = 10.0 if args.window is None else args.window
    warmup = 0.0 if args.warmup is None else args.warmup
    return ReplayJob(
        bags=tuple(args.bags),
        node=NodeSpec(args.node, adapter=args.adapter),
        input_topics=args.inputs,
        output_topics=args.outputs,
        evaluators=tuple(parse_evaluator(e) for e in args.eval),
        cut=ScenarioCut(mode, window, warmup, args.scenarios),
        timing=ReplayTiming(
            rate=args.rate,
            sync=not args.no_sync,
            quiet_s=args.quiet_period,
            timeout_s=args.timeout,
            startup_timeout_s=args.startup_timeout,
            trigger_topics=args.triggers,
            answer_topics=args.answers,
            max_output_mb=args.max_output_mb,
        ),
    ).validate()


def _table(results: ReplayResults) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for name in ("scenario", "result", "outputs", "p50 ms", "p95 ms", "wall s", "reason"):
        table.add_column(name, justify="right" if "ms" in name or name == "wall s" else "left")
    for r in results.results:
        table.add_row(
            r.scenario,
            Text("pass", "green") if r.passed else Text("FAIL", "red"),
            str(sum(r.output_counts.values())),
            f"{r.latency_p50_ms:.1f}",
            f"{r.latency_p95_ms:.1f}",
            f"{r.wall_s:.2f}",
            r.reason if len(r.reason) <= 80 else r.reason[:79] + "…",
        )
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``adcloud sim run``; 0 if every scenario passed, else 1."""
    job = job_from_args(args)
    if args.report:
        check_report_target(args.report)  # before the job, not after it
    spark = _session(args.master)
    results = run_replay(spark, job)
    console.print(_table(results))
    passed = sum(r.passed for r in results.results)
    console.print(f"{passed} of {len(results.results)} scenarios passed in {results.wall_s:.1f} s")
    if args.report:
        url = write_report(results, args.report)
        console.print(f"report: {url}/report.html")
        if not results.passed:
            console.print(
                f"full reasons, exit codes and stderr of the failed scenarios: {url}/results.jsonl"
            )
    else:  # no report to read them in: the failed scenarios' whole reasons, here
        for r in results.results:
            if not r.passed and len(r.reason) > 80:
                console.print(f"{r.scenario}: {r.reason}", highlight=False, soft_wrap=True)
    return 0 if results.passed else 1


def _load_row(load: CameraLoad) -> tuple[str | Text, ...]:
    def ms(value: float) -> str:
        return "" if math.isnan(value) else f"{value:.1f}"  # NaN: no answer at all

    return (
        str(load.cameras),
        Text("pass", "green") if load.passed else Text("FAIL", "red"),
        str(load.frames),
        f"{100 * load.loss_rate:.1f}",
        f"{load.throughput_fps:.1f}",
        ms(load.latency_p50_ms),
        ms(load.latency_p95_ms),
        load.reason[:60],
    )


def run_cameras(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``adcloud sim cameras``; 1 only when ``--require`` is not met."""
    options: dict[str, Any] = {
        "rate": args.rate,
        "max_loss": args.max_loss,
        "max_latency_ms": args.max_latency_ms,
        "timeout_s": args.timeout,
    }
    node = NodeSpec(args.node, adapter=args.adapter)
    # the limits, the node, the topics and the counts are checked before Spark starts (the
    # sweep's jobs all share them; the sweep checks the counts only once Spark runs)
    camera_replay_job(args.bags, node, args.cameras[:1], args.output, **options)
    if len(set(args.cameras)) != len(args.cameras):
        raise SimError(f"--cameras names a topic twice: {','.join(args.cameras)}")
    beyond = [n for n in args.counts or () if n > len(args.cameras)]
    if beyond:
        raise SimError(
            f"--counts {','.join(map(str, beyond))}: more cameras than the "
            f"{len(args.cameras)} topic(s) --cameras names"
        )
    if args.report:
        check_sweep_target(args.report)  # the whole report, before the sweep, not after it
    spark = _session(args.master)
    table = Table(show_edge=False, pad_edge=False)
    for name in ("cameras", "result", "frames", "loss %", "frames/s", "p50 ms", "p95 ms"):
        table.add_column(name, justify="left" if name == "result" else "right")
    table.add_column("reason")
    kept: list[ReplayResults] = []

    def shown(load: CameraLoad, results: ReplayResults) -> None:
        kept.append(results)
        console.print(f"{load.cameras} camera(s): " + ("pass" if load.passed else "FAIL"))

    sweep = camera_sweep(
        spark,
        args.bags,
        node,
        args.cameras,
        args.output,
        counts=args.counts,
        stop_after_failure=args.stop_after_failure,
        on_load=shown,
        **options,
    )
    for load in sweep.loads:
        table.add_row(*_load_row(load))
    console.print(table)
    console.print(
        f"the detector sustains {sweep.sustained} of {len(args.cameras)} camera(s) at "
        f"{args.rate:g}x their frame rate (frame loss <= {args.max_loss:.0%})"
    )
    if args.report:
        url = sweep.write(args.report, kept)
        console.print(f"report: {url}/sweep.png, {url}/sweep.json")
    return 1 if args.require is not None and sweep.sustained < args.require else 0


def run_demo(spark: Any, bag: str, out_dir: str, console: Console) -> ReplayResults:
    """The replay part of ``adcloud demo``: the example obstacle detector over a drive.

    Cuts ``bag`` into 2 s windows (0.5 s warm-up), replays each window as fast as
    possible in synchronous mode into ``python -m adcloud.sim.examples.obstacle_node``
    (one Spark task per window), checks its detections against the LiDAR labels, its
    rate and latency, and writes the report under ``out_dir/sim``.
    """
    import sys  # noqa: PLC0415

    job = ReplayJob(
        bags=(bag,),
        node=NodeSpec(f"{sys.executable} -m adcloud.sim.examples.obstacle_node"),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
        evaluators=(
            parse_evaluator("rate:topic=/obstacles,min_hz=8"),
            parse_evaluator("latency:max_ms=2000,stat=p95"),
            parse_evaluator("detections:topic=/obstacles,min_precision=0.9,min_recall=0.9"),
        ),
        cut=ScenarioCut(CutMode.WINDOW, window_s=2.0, warmup_s=0.5),
        timing=ReplayTiming(rate=0.0, sync=True),
    ).validate()
    console.rule("adcloud sim: replaying the drive into an obstacle detector")
    results = run_replay(spark, job)
    console.print(_table(results))
    report = write_report(results, f"{out_dir}/sim")
    verdict = "all passed" if results.passed else f"{len(results.failed)} failed"
    console.print(
        f"{len(results.results)} scenarios, {verdict}; report: [bold]{escape(str(report))}[/bold]",
        markup=True,
    )
    return results
