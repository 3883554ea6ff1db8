"""The ``adcloud`` command line.

Every job command (``ingest``, ``demo``) builds its SparkSession through
:func:`adcloud.spark.get_session`, so the same command runs on ``local[*,4]``, on a
standalone cluster (``--master spark://...``) or under ``spark-submit`` on any
cluster manager: ``adcloud submit -- ingest ...`` builds that ``spark-submit`` line,
whose application file is this module.

Only this module prints and chooses exit codes; the library raises
:class:`~adcloud.errors.AdcloudError` subclasses, turned here into one-line messages
(exit 2 for bad input or missing components, 1 for anything unexpected; see
:data:`_EPILOG_EXIT`).
"""

from __future__ import annotations

import argparse
import contextlib
import decimal
import fcntl
import functools
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adcloud._argtypes import local_path, number, whole_number
from adcloud.errors import AdcloudError, ConfigError, MissingComponentError

__all__ = ["main"]

log = logging.getLogger("adcloud")

_EPILOG_INGEST = """examples:
  adcloud ingest drive.bag --out out/drive.binpipe
  adcloud ingest 's3://bucket/drives/*.bag' --topics /imu/data,/fix --out s3://bucket/ingest/
  adcloud submit --master spark://127.0.0.1:7077 -- ingest drive.bag --out out/x
"""


_EPILOG_EXIT = """exit status:
  0    done (a check that ran and passed included)
  1    a verdict the command explains (a replay scenario failed, a map missed a target,
       a dry run found a bag that cannot be built), or an unexpected error (a traceback)
  2    bad input or a missing component: one "error:" line on stderr saying what to do
  130  stopped by Ctrl-C; 143 stopped by SIGTERM
  141  the reader of stdout went away (adcloud store cat URL | head)

Every command has --help; adcloud -v COMMAND shows tracebacks and more logging.
"""


def _ns(text: str | None) -> int | None:
    """Parse a time bound: integer nanoseconds, or seconds with a decimal point (and an
    optional exponent: 1.5e9); within what a bag's int64 nanosecond stamps can hold."""
    if text is None:
        return None
    bad = argparse.ArgumentTypeError(
        f"not a time: {text!r} (nanoseconds as digits, e.g. 1700000000000000000, or seconds "
        "with a decimal point, e.g. 1700000000.5 or 1.7e9)"
    )
    seconds = re.fullmatch(r"-?([0-9]*)\.([0-9]*)(?:[eE][-+]?[0-9]{1,4})?", text)
    if re.fullmatch(r"-?[0-9]+", text):
        ns = int(text)
    elif seconds and (seconds[1] or seconds[2]):
        # exact (not float: 1700000000.123456789 s keeps its last nanoseconds)
        ns = round(decimal.Decimal(text).scaleb(9))
    else:
        raise bad
    if not -(2**63) <= ns < 2**63:
        raise argparse.ArgumentTypeError(
            f"{text!r} is beyond the time a bag can hold (int64 nanoseconds: about the years "
            "1678 to 2262)"
        )
    return ns


def _mib(text: str) -> float:
    """``--partition-mb``: a size in MiB, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: give a size in MiB, 0 or more")
    return value


def _topics(text: str) -> list[str]:
    """``--topics`` as a list (argparse type).  A value that names no topic
    (``--topics ,``) is an error: it would select nothing."""
    topics = [t.strip() for t in text.split(",") if t.strip()]
    if not topics:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no topic; give comma-separated topics, or leave --topics out "
            "for all of them"
        )
    return topics


def _fmt_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 10**9 // 10**6:03d}"


def _cmd_bag_info(args: argparse.Namespace, console: Console) -> int:
    from adcloud.binpipe import expand_uris, summarize  # noqa: PLC0415 - keep --help fast
    from adcloud.errors import AdcloudError  # noqa: PLC0415

    uris = expand_uris(args.bags)
    summaries = []
    problems: dict[str, str] = {}  # one unreadable bag does not hide the others
    for uri in uris:
        try:
            summaries.append(summarize(uri))
        except AdcloudError as err:
            if len(uris) == 1:
                raise
            problems[uri] = str(err)
    code = 2 if problems else 0
    if args.json:
        data = [s.to_dict() for s in summaries]
        data += [{"uri": uri, "error": text} for uri, text in problems.items()]
        console.print_json(json.dumps(data))
        return code
    errors = Console(stderr=True, markup=False)
    for text in problems.values():
        errors.print(
            f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True, markup=True
        )
    for s in summaries:
        duration = (s.end - s.start) / 1e9 if s.message_count else 0.0
        console.print(f"[bold]{escape(s.uri)}[/bold]", markup=True)
        console.print(
            f"  format {s.format}  size {s.size:,} B  chunks {s.chunk_count}  "
            f"compression {s.compression}  indexed {'yes' if s.indexed else 'NO'}"
        )
        if s.message_count:
            console.print(
                f"  start {_fmt_time(s.start)}  end {_fmt_time(s.end)}  "
                f"duration {duration:.3f} s  messages {s.message_count:,}"
            )
        table = Table(show_edge=False, pad_edge=False)
        table.add_column("topic")
        table.add_column("type")
        table.add_column("count", justify="right")
        table.add_column("Hz", justify="right")
        for t in s.topics:
            # the topic's own rate (as the JSON has it), not its count over the whole bag
            hz = "-" if t.frequency is None else f"{t.frequency:.1f}"
            table.add_row(t.topic, t.msgtype, f"{t.count:,}", hz)
        console.print(table)
    if problems:
        console.print(f"{len(problems)} of {len(uris)} bags could not be read (above)")
    return code


def _cmd_bag_reindex(args: argparse.Namespace, console: Console) -> int:
    from adcloud.binpipe import BagError, summarize  # noqa: PLC0415
    from adcloud.binpipe.reindex import ReindexReport, reindex_bag  # noqa: PLC0415

    if "://" in args.out:
        raise BagError(f"{args.out}: OUT is a local .bag path, not a URL; give the path")
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        raise BagError(
            f"{args.out} is a directory; OUT is the path of the .bag file to write, "
            f"e.g. {out / Path(args.bag.rstrip('/')).name}"
        )
    if out.exists() and not args.overwrite:
        raise BagError(f"{out} exists; pass --overwrite to replace it, or choose another path")
    report = ReindexReport()
    reindex_bag(args.bag, out, report=report)
    console.print(
        f"wrote {out}: {report.messages:,} messages in {report.chunks} chunks on "
        f"{report.connections} connections"
    )
    for what in report.dropped:
        console.print(f"dropped: {what}")
    summary = summarize(str(out))  # the copy reads back through its new index
    if summary.message_count != report.messages:
        raise BagError(
            f"{out}: the copy's index lists {summary.message_count} messages, not "
            f"{report.messages}; please report this with the source bag"
        )
    return 0


def _session(args: argparse.Namespace, *, worker_imports: tuple[str, ...] = ()) -> Any:
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415

    master = getattr(args, "master", None)
    settings = SparkSettings.load(master=master) if master else SparkSettings.load()
    settings = settings.importing(*worker_imports)
    # The CLI draws its own progress bars; Spark's console bar would interleave with them.
    return get_session(settings, **{"spark.ui.showConsoleProgress": "false"})


def _cmd_ingest(args: argparse.Namespace, console: Console) -> int:
    from tqdm import tqdm  # noqa: PLC0415

    from adcloud.binpipe import BinPipeRDD, expand_uris, plan_partitions  # noqa: PLC0415
    from adcloud.binpipe.rdd import check_save_target  # noqa: PLC0415

    uris = expand_uris(args.bags)
    check_save_target(args.out, overwrite=args.overwrite)  # before Spark starts
    topics = args.topics
    spark = _session(args)
    parts = []
    for uri in tqdm(uris, desc="indexing bags", unit="bag", disable=args.quiet):
        parts.extend(
            plan_partitions(
                uri,
                topics=topics,
                start=args.start,
                end=args.end,
                partitions_per_bag=args.partitions_per_bag,
                time_source=args.time_source,
                partition_bytes=int(args.partition_mb * 2**20) or None,
                reindex_dir=args.reindex_dir,
                min_partitions=spark.sparkContext.defaultParallelism,
            )
        )
    _check_selection(uris, parts, topics, args, console)
    request = {"topics": topics, "start": args.start, "end": args.end}
    rdd = BinPipeRDD.from_partitions(
        spark, parts, bags=uris, request={**request, "time_source": args.time_source}
    )
    started = time.monotonic()
    with _SparkProgress(spark, total=len(parts), quiet=args.quiet):
        manifest = rdd.save(args.out, overwrite=args.overwrite)
    elapsed = time.monotonic() - started
    size = sum(p["bytes"] for p in manifest["partitions"])
    used = len({p.reindexed_from or p.uri for p in parts})  # the others had nothing selected
    bags = f"{used} bag(s)" if used == len(uris) else f"{used} of {len(uris)} bags"
    console.print(
        f"ingested {manifest['records']:,} messages from {bags} into "
        f"{len(manifest['partitions'])} partitions ({size / 1e6:.1f} MB) at {args.out} "
        f"in {elapsed:.1f} s"
    )
    return 0


def _check_selection(
    uris: list[str], parts: list[Any], topics: list[str] | None, args: Any, console: Console
) -> None:
    """Say which requested topics no bag has (an error when none of them is there, as when
    no message lies in the time range): an empty save is almost always a typo."""
    from adcloud.binpipe import BinpipeError, summarize  # noqa: PLC0415

    found = {c.topic for part in parts for c in part.connections}
    if parts and all(t in found for t in topics or ()):
        return
    summaries = [summarize(uri) for uri in uris]  # the bags' whole index, for the message
    have = sorted({t.topic for s in summaries for t in s.topics})
    missing = [t for t in topics or () if t not in have]
    if missing:
        text = (
            f"--topics {', '.join(missing)}: no such topic in the bag(s); they have "
            f"{', '.join(have) or 'none'}"
        )
        if len(missing) == len(topics or ()):
            raise BinpipeError(f"{text}. Nothing was written")
        console.print(f"warning: {text}", highlight=False)
    if parts or (args.start is None and args.end is None):
        return
    spans = [(s.start, s.end) for s in summaries if s.message_count]
    span = (
        f"the bags' messages span {min(a for a, _ in spans) / 1e9:.3f} to "
        f"{max(b for _, b in spans) / 1e9:.3f} s ({_fmt_time(min(a for a, _ in spans))} to "
        f"{_fmt_time(max(b for _, b in spans))} UTC)"
        if spans
        else "the bags hold no message"
    )
    raise BinpipeError(
        f"no message of {', '.join(topics) if topics else 'any topic'} lies in the time range "
        f"given (--start {args.start}, --end {args.end}); {span}. Nothing was written"
    )


class _SparkProgress:
    """A tqdm bar fed by Spark's status tracker while a job runs in this thread."""

    def __init__(self, spark: Any, total: int, quiet: bool) -> None:
        self._spark = spark
        self._total = total
        self._quiet = quiet
        self._stop = False
        self._failed = False
        self._thread: Any = None

    def __enter__(self) -> _SparkProgress:
        if self._quiet or not self._total:
            return self
        import threading  # noqa: PLC0415

        from tqdm import tqdm  # noqa: PLC0415

        tracker = self._spark.sparkContext.statusTracker()
        bar = tqdm(total=self._total, desc="partitions", unit="part")

        def poll() -> None:
            done = 0
            while not self._stop:
                now = 0
                for stage_id in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(stage_id)
                    if info is not None:
                        now = max(now, info.numCompletedTasks)
                if now > done:
                    bar.update(now - done)
                    done = now
                time.sleep(0.2)
            if not self._failed:  # a failed job's bar stays where the job stopped
                bar.update(self._total - done)
            bar.close()

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._failed = exc[0] is not None
        self._stop = True
        if self._thread is not None:
            self._thread.join()


def _demo_bags() -> list[Path]:
    here = Path(__file__).resolve().parent.parent
    shared = here.parent / "shared" / "data"
    return sorted(shared.glob("*/*.bag"))


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from adcloud.binpipe import BinPipeRDD, summarize  # noqa: PLC0415
    from adcloud.synth.command import run_demo as synth_demo  # noqa: PLC0415

    out = Path(args.out).resolve()
    for bag in args.bag or ():
        summarize(bag)  # a missing or unreadable --bag fails now, not after the drive and Spark
    out.mkdir(parents=True, exist_ok=True)
    outputs: list[tuple[str, Path]] = []

    # 1. a synthetic drive with ground truth (adcloud.synth)
    drive = synth_demo(out, console, seconds=args.seconds, quiet=args.quiet)
    outputs += [("synthetic drive (ROS 1 bag)", drive.bag), ("its ground truth", drive.truth)]

    # 2. ROS bags as binary Spark partitions (adcloud.binpipe)
    bags = [Path(b) for b in args.bag] if args.bag else [drive.bag, *_demo_bags()]
    spark = _session(args, worker_imports=("torch",))  # for the training at the end
    console.rule("adcloud binpipe: ROS bags as binary Spark partitions")
    console.print(
        f"Spark {spark.version} master [bold]{escape(spark.sparkContext.master)}[/bold]",
        markup=True,
    )
    for bag in bags:
        s = summarize(str(bag))
        console.print(
            f"{bag.name}: {s.format}, {s.message_count:,} messages on {len(s.topics)} topics, "
            f"{s.chunk_count} chunks ({s.compression})"
        )
    rdd = BinPipeRDD.from_bags(spark, [str(b) for b in bags]).cache()
    console.print(
        f"partitions: {rdd.getNumPartitions()} (chunk ranges read in parallel), "
        f"records: {rdd.count():,}"
    )
    piped = rdd.pipe("cat")
    console.print(f"piped every partition through `cat` as binary: {piped.count():,} records back")
    df = rdd.to_dataframe(spark)
    counts = df.groupBy("topic", "msgtype").count().orderBy("topic").collect()
    table = Table(title="messages per topic (Spark SQL over the BinPipeRDD)")
    table.add_column("topic")
    table.add_column("type")
    table.add_column("count", justify="right")
    for row in counts:
        table.add_row(row["topic"], row["msgtype"], f"{row['count']:,}")
    console.print(table)
    ingest_dir = out / "ingest"
    manifest = rdd.save(str(ingest_dir), overwrite=True)
    console.print(
        f"saved {manifest['records']:,} records as {len(manifest['partitions'])} BinPipe "
        f"streams under [bold]{escape(str(ingest_dir))}[/bold]",
        markup=True,
    )
    outputs.append(("BinPipe partitions (manifest.json, part-*.binpipe)", ingest_dir))

    # 3. OpenCL kernels from Spark executors (adcloud.hetero)
    from adcloud.hetero import run_demo as hetero_demo  # noqa: PLC0415

    console.rule("adcloud hetero: OpenCL kernels dispatched from Spark executors")
    hetero = hetero_demo(spark, out, bag=drive.bag)
    for line in hetero.lines:
        console.print(line, soft_wrap=True)
    outputs += [(f"hetero {name}", path) for name, path in hetero.outputs.items()]

    # 4. replay simulation of a node under test (adcloud.sim)
    from adcloud.sim.command import run_demo as sim_demo  # noqa: PLC0415

    sim_demo(spark, str(drive.bag), str(out), console)
    outputs.append(("replay report (report.html, results.jsonl, junit.xml)", out / "sim"))

    # 5. an HD map of the drive (adcloud.hdmap)
    from adcloud.hdmap.command import run_demo as hdmap_demo  # noqa: PLC0415

    version = hdmap_demo(spark, None, str(out), console)
    outputs.append(("HD map (report/summary.html, lanelet2_map.osm, grid/)", version))

    # 6. distributed training on the drive (adcloud.train)
    from adcloud.train.command import run_demo as train_demo  # noqa: PLC0415

    other = out / "hdmap-drive" / "drive.bag"  # the map's drive, when the demo made one
    heldout = str(other) if other.is_file() else None
    trained = train_demo(spark, str(drive.bag), str(out), console, heldout)
    outputs.append(
        (
            "trained model (model/model.pt2, metadata.json, loss.png"
            + (", eval.json, confusion.png)" if heldout else ")"),
            Path(trained),
        )
    )

    console.rule("outputs")
    for what, where in outputs:
        console.print(f"{what}: [bold]{escape(str(where))}[/bold]", soft_wrap=True, markup=True)
    return 0


def _driver_defaults(confs: Sequence[str]) -> list[str]:
    """``KEY=VALUE`` settings for the driver JVM that spark-submit starts before the job can
    apply any: adcloud's driver memory (``ADCLOUD_SPARK_DRIVER_MEMORY``) and JVM options
    (a quiet log4j2 profile, G1 regions for Spark's cache), unless ``confs`` sets them."""
    from adcloud.spark import SparkSettings, spark_conf  # noqa: PLC0415

    given = dict(c.split("=", 1) for c in confs if "=" in c)
    settings = SparkSettings.load()
    merged = spark_conf(settings, given)
    keys = ("spark.driver.memory", "spark.driver.extraJavaOptions")
    return [f"{key}={merged[key]}" for key in keys if key not in given]


#: The YARN-only options of ``adcloud submit`` and their defaults.
_YARN_DEFAULTS: dict[str, object] = {
    "queue": "simulation",  # as deploy/yarn/spark-defaults.conf (the shipped queues)
    "deploy_mode": "cluster",
    "executors": 2,
    "executor_memory": "4g",
    "gpus_per_executor": 0,
    "fpgas_per_executor": 0,
    "tasks_per_device": 1,
    "fpga_ip_id": None,
    "fpga_binaries": None,
    "docker_image": None,
}


def _cmd_submit(args: argparse.Namespace, console: Console) -> int:
    from adcloud.spark import SparkSettings, check_master, spark_home  # noqa: PLC0415

    submit = spark_home() / "bin" / "spark-submit"
    job = list(args.job)
    if job[:1] == ["--"]:  # the separator itself; later ones belong to the job
        job = job[1:]
    if not job:  # an error, on stderr: stdout of a dry run is the line to run
        raise ConfigError(
            "nothing to submit: give the job after --, e.g. adcloud submit -- ingest x.bag"
        )
    _check_job(job)
    confs = list(args.conf or [])
    bad = [c for c in confs if "=" not in c or c.startswith("=")]
    if bad:
        raise ConfigError(f"--conf takes KEY=VALUE, got {bad[0]!r}")
    master = next((c for c in confs if c.split("=", 1)[0].strip() == "spark.master"), None)
    if master is not None:  # spark-submit's --master wins over it, without a word
        raise ConfigError(f"--conf {master}: give the master with --master, not as a setting")
    settings = SparkSettings.load()
    if args.master is None:  # as every other command: ADCLOUD_SPARK_MASTER, else local[*,4]
        args.master = settings.master
    # ADCLOUD_SPARK_CONF goes on the submit line, below the user's own --conf: a setting of
    # the driver JVM (a class path, packages) is read before the job starts, and in YARN's
    # cluster mode the driver runs in a container this environment does not reach.
    named = {c.split("=", 1)[0].strip() for c in confs}
    confs = [
        *(f"{key}={value}" for key, value in settings.conf_pairs().items() if key not in named),
        *confs,
    ]
    # the form, and yarn's Hadoop configuration, are checked for a dry run too
    check_master(args.master, reach=False)
    given = [
        f"--{name.replace('_', '-')}" for name in _YARN_DEFAULTS if getattr(args, name) is not None
    ]
    if args.master != "yarn" and given:
        raise ConfigError(
            f"{', '.join(given)}: for --master yarn only (containers); on "
            f"{args.master} give Spark settings with --conf, e.g. --conf "
            "spark.executor.resource.gpu.amount=1 --conf spark.executor.instances=4"
        )
    for name, default in _YARN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if not any(c.startswith("spark.log.level=") for c in confs):
        confs.append("spark.log.level=WARN")  # spark-submit's default INFO drowns the job's output
    if args.master == "yarn":
        from adcloud.hetero.yarn import yarn_submit_args  # noqa: PLC0415

        options = yarn_submit_args(
            args.queue,
            args.gpus_per_executor,
            args.fpgas_per_executor,
            executors=args.executors,
            executor_memory=args.executor_memory,
            driver_memory=settings.driver_memory,
            deploy_mode=args.deploy_mode,
            tasks_per_device=args.tasks_per_device,
            fpga_ip_id=args.fpga_ip_id,
            fpga_binaries=args.fpga_binaries,
            docker_image=args.docker_image,
            conf=dict(c.split("=", 1) for c in confs),
        )
        cmd = [str(submit), *options]
    else:
        cmd = [str(submit), "--master", args.master]
        for conf in [*confs, *_driver_defaults(confs)]:
            cmd += ["--conf", conf]
    # adcloud -v submit: the job's traceback is what -v is for (-v before the command)
    verbose = ["-" + "v" * min(args.verbose, 2)] if args.verbose and job[0][:1] != "-" else []
    cmd += [str(Path(__file__).resolve()), *verbose, *job]
    env = dict(os.environ)
    if args.master.startswith(("local", "spark://127.0.0.1:", "spark://localhost:")):
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # as local sessions: no host-name warning
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if args.dry_run:
        # the environment the run sets goes with the line, so that it runs as printed
        # (spark-submit would otherwise start the driver with whatever python3 is first)
        names = ("SPARK_LOCAL_IP", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
        prefix = [f"{name}={env[name]}" for name in names if name in env]
        console.print(shlex.join([*prefix, *cmd]), soft_wrap=True, markup=False, highlight=False)
        return 0
    if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
        raise MissingComponentError(
            "Java 17 is needed by spark-submit: apt-get install openjdk-17-jre-headless"
        )
    check_master(args.master)  # a minute of Spark's retries and a stack trace, otherwise
    return _run_submit(cmd, env)


def _check_job(job: Sequence[str]) -> None:
    """Refuse a job that names no adcloud command, or ``submit`` itself, before spark-submit
    starts a JVM to find that out (and before a dry run prints a line that cannot run).

    Only the command's name is checked: the rest of the job may name files that exist
    only where the driver runs (``--deploy-mode cluster``).
    """
    commands = next(
        action.choices
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    name = next((word for word in job if not word.startswith("-")), None)
    jobs = ", ".join(command for command in commands if command != "submit")
    if name == "submit":
        raise ConfigError(
            f"the job after -- is the adcloud command that spark-submit runs ({jobs}), not "
            "submit itself: adcloud submit -- ingest x.bag --out o"
        )
    if name is not None and name not in commands:
        raise ConfigError(f"the job after --: {name!r} is not an adcloud command ({jobs})")
    master = next((word for word in job if _is_master_option(word)), None)
    if master is not None:
        # under spark-submit the submit line's master is the job's: the job's own would be
        # ignored, and the job run on another master without a word
        raise ConfigError(
            f"the job after -- gives {master!r}, which spark-submit's driver does not use: "
            "give the master to adcloud submit, before --: adcloud submit --master URL -- "
            f"{name or 'COMMAND'} ..."
        )


def _is_master_option(word: str) -> bool:
    """Whether ``word`` is a command's ``--master`` option (``--master=URL`` and the
    abbreviations argparse takes, ``--mast``, included)."""
    option = word.split("=", 1)[0]
    return len(option) >= len("--mas") and "--master".startswith(option)


#: What ``adcloud submit`` passes on to the spark-submit it runs: Ctrl-C, a scheduler's or
#: CI runner's SIGTERM, the hang-up of a closed terminal.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _run_submit(cmd: list[str], env: dict[str, str]) -> int:
    """Run spark-submit ``cmd`` to its end; its exit status (128+N when signal N ended it).

    spark-submit execs the driver JVM, which starts the Python driver and, on a local
    master, the executors' Python workers: one process group, made a session of its own so
    that a signal sent to the group reaches all of it, and a terminal's Ctrl-C reaches it
    once, through this process.  Each signal of :data:`_FORWARDED` this process gets goes
    on to the group.  Killed without a chance to pass anything on (SIGKILL: a cancelled CI
    job or Airflow task, the OOM killer), this process leaves the group to a
    :class:`~adcloud._lifeline.Lifeline`, which stops it; the driver JVM and Python would
    otherwise run on with no parent, holding their executors.  Nothing of the group
    outlives spark-submit.
    """
    from adcloud._lifeline import Lifeline  # noqa: PLC0415

    # The lifeline guards the group, not the environment mark: processes the job starts in
    # sessions of their own (a pipe command, a node and its roscore) have lifelines of their
    # own, whose reapers carry the environment and must be left to do their work.  The gap
    # between spark-submit's start and guard_group() is closed by PR_SET_PDEATHSIG (kept
    # across the exec of the JVM); setpriv sets it without Python code between fork and
    # exec, which is not safe in a process with threads.
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
    proc: subprocess.Popen[bytes] | None = None
    caught: list[int] = []  # before spark-submit started

    def forward(signum: int, frame: object) -> None:
        if proc is None:
            caught.append(signum)
        elif proc.returncode is None:  # once reaped, its group id may be another's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    handling = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in _FORWARDED}
    lifeline = Lifeline()
    # The driver writes its stderr to spark-submit's, opened again (_unmerge_stderr): where
    # ours cannot be (a file not opened for appending, a socket), spark-submit gets a pipe
    # whose bytes go on to ours.
    relay = None if _reopenable(os.getpid(), 2) else _StderrRelay()
    try:
        if handling:
            for sig in _FORWARDED:
                signal.signal(sig, forward)
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stderr=None if relay is None else relay.fd
        )
        if relay is not None:
            relay.start()
        lifeline.guard_group(proc.pid)
        for signum in caught:
            forward(signum, None)
        # its end, but not reaped yet: until then its group's id is its own
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    finally:
        if proc is not None:
            # What spark-submit left in its group (a Python worker still closing) goes with
            # it, and all of the group if this process is failing.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        lifeline.release()
        if relay is not None:
            relay.close()
        if handling:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    code = proc.returncode
    return code if code >= 0 else 128 - code


class _StderrRelay:
    """A pipe for spark-submit's stderr and a thread that copies it to this process's."""

    def __init__(self) -> None:
        self._read, self.fd = os.pipe()
        self._thread = threading.Thread(target=self._copy, daemon=True)

    def start(self) -> None:
        """Copy from now on; this process's end of the pipe for writing is closed."""
        os.close(self.fd)
        self._thread.start()

    def _copy(self) -> None:
        with contextlib.suppress(OSError):
            while data := os.read(self._read, 1 << 16):
                while data:
                    data = data[os.write(2, data) :]

    def close(self) -> None:
        """Copy what is left; a process the job left running with the pipe (a helper in a
        session of its own) is not waited for."""
        if self._thread.ident is None:  # never started: spark-submit did not start either
            os.close(self.fd)
        else:
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            os.close(self._read)


_REMOTE_ERROR = re.compile(
    r"^adcloud\.[\w.]*(?:Error|Exception): (.+?)(?:\n\s*\n|\n\tat |\Z)", re.M | re.S
)


def _remote_adcloud_error(err: BaseException) -> str | None:
    """The message of an adcloud error raised in a Spark task, from Spark's wrapper."""
    found = _REMOTE_ERROR.findall(str(err))
    return found[-1].strip() if found else None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog="adcloud",
        description="adcloud: ROS-bag data on Spark -- ingest, inspect and process drives.",
        epilog=_EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the main job on the embedded default (local Spark) and show its outputs",
        description="""\
The whole platform on one machine (local Spark, the local tiered store, PoCL), in six steps:

  1. synth   generate a synthetic drive with ground truth (--seconds)
  2. binpipe ingest it and the sample recordings in ../shared/data (or --bag) into BinPipe
             partitions, pipe them through a native process, query them with Spark SQL
             and save them
  3. hetero  OpenCL kernels (ICP, rasterization, image features) from the executors on the
             first OpenCL device
  4. sim     replay the drive through a node under test and score it (HTML report)
  5. hdmap   build an HD map of a 30 s drive (poses, ICP, 5 cm grid, lanes, signs) and
             evaluate it against its truth
  6. train   train a LiDAR segmentation model on the drive, export it and score it on
             the map's drive (on the executors)

Every output is listed at the end, under --out.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--bag",
        action="append",
        help="bag to ingest (repeatable); default: the demo's synthetic drive and ../shared/data",
    )
    demo.add_argument(
        "--seconds",
        type=number("number of seconds"),
        default=5.0,
        help="length of the synthetic drive (default 5 s)",
    )
    demo.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    demo.add_argument(
        "--out",
        default="out/demo",
        type=local_path("the demo"),
        help="local output directory (default: out/demo)",
    )
    demo.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    demo.set_defaults(func=_cmd_demo)

    bag = sub.add_parser(
        "bag",
        help="inspect bags",
        description="Inspect bags (any fsspec URL, local:// or alluxio://).",
    )
    bag_sub = bag.add_subparsers(dest="bag_command", metavar="COMMAND", required=True)
    info = bag_sub.add_parser(
        "info",
        help="topics, types, counts, time span and chunking of bags",
        description="Print what a bag holds, reading only its index: topics, message types, "
        "counts, rates, time span, chunks and compression. Works on ROS 1 .bag, ROS 2 "
        "(sqlite3 directories) and MCAP, local or remote (s3://, hdfs://, memory://).",
    )
    info.add_argument("bags", nargs="+", help="bag files, directories or globs")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_bag_info)
    reindex = bag_sub.add_parser(
        "reindex",
        help="write an indexed, readable copy of a ROS 1 bag cut off or never closed",
        description="Write an indexed copy of a ROS 1 bag whose index is missing or damaged "
        "(a recording cut off, a copy still being written): every complete chunk is kept "
        "byte for byte, a truncated or undecodable one is dropped and reported. The source is "
        "only read (any fsspec URL); the copy is a local file, written whole or not at all. "
        "adcloud ingest --reindex-dir DIR does the same on the fly.",
    )
    reindex.add_argument("bag", help="the damaged ROS 1 bag (file or URL)")
    reindex.add_argument("out", help="the indexed copy to write (a local .bag path)")
    reindex.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    reindex.set_defaults(func=_cmd_bag_reindex)

    ingest = sub.add_parser(
        "ingest",
        help="split bags into BinPipe partitions and save them to a store",
        description="Split bags into BinPipe partitions (one per chunk, read in parallel by "
        "Spark tasks, each reading only its byte range) and save them as binary stream "
        "files, atomically per partition.",
        epilog=_EPILOG_INGEST,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ingest.add_argument(
        "bags",
        nargs="+",
        help="bag files, directories or globs (any fsspec URL, local:// or alluxio://)",
    )
    ingest.add_argument(
        "--out", required=True, help="output directory or URL (local:// and alluxio:// too)"
    )
    ingest.add_argument(
        "--topics", type=_topics, help="comma-separated topics to keep (default: all)"
    )
    ingest.add_argument(
        "--start", type=_ns, help="first record time to keep (ns as digits, or s with a dot)"
    )
    ingest.add_argument(
        "--end", type=_ns, help="record time to stop before (ns as digits, or s with a dot)"
    )
    ingest.add_argument(
        "--partitions-per-bag",
        type=whole_number(1),
        help="group chunks into at most N partitions per bag",
    )
    ingest.add_argument(
        "--partition-mb",
        type=_mib,
        default=128,
        help="target partition size in MiB when --partitions-per-bag is not given "
        "(default 128, as Spark's file splits; 0: one partition per chunk)",
    )
    ingest.add_argument(
        "--time-source",
        choices=["record", "header"],
        default="record",
        help="timestamp of each record: bag record time (default) or message header stamp",
    )
    ingest.add_argument(
        "--reindex-dir",
        help="where to write indexed copies of unindexed ROS 1 bags (a killed recorder's); "
        "without it such a bag is an error. The source is never modified.",
    )
    ingest.add_argument("--overwrite", action="store_true", help="replace an existing output")
    ingest.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    ingest.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    ingest.set_defaults(func=_cmd_ingest)

    from adcloud.synth.command import add_parser as add_synth_parser  # noqa: PLC0415

    add_synth_parser(sub)

    from adcloud.store.command import add_parser as add_store_parser  # noqa: PLC0415

    add_store_parser(sub)

    from adcloud.sim.command import add_parser as add_sim_parser  # noqa: PLC0415

    add_sim_parser(sub)

    from adcloud.hetero.command import add_parser as add_hetero_parser  # noqa: PLC0415

    add_hetero_parser(sub)

    from adcloud.hdmap.command import add_parser as add_hdmap_parser  # noqa: PLC0415

    add_hdmap_parser(sub)

    from adcloud.train.command import add_parser as add_train_parser  # noqa: PLC0415

    add_train_parser(sub)

    submit = sub.add_parser(
        "submit",
        help="run an adcloud job through spark-submit on any cluster manager",
        description="Build and run the spark-submit line for an adcloud job. Everything after "
        "-- is the job's own command line.\n\n"
        "It ends with spark-submit's exit status (the job's, when the driver runs here). "
        "Ctrl-C,\nSIGTERM and SIGHUP go on to spark-submit and what it starts on this "
        "machine (the driver,\nunless --deploy-mode cluster); killed (kill -9), it takes "
        "those with it.",
        epilog="example: adcloud submit --master spark://127.0.0.1:7077 -- ingest d.bag --out o",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    submit.add_argument(
        "--master", help="Spark master URL (default: ADCLOUD_SPARK_MASTER, else local[*,4])"
    )
    submit.add_argument("--conf", action="append", help="Spark setting KEY=VALUE (repeatable)")
    submit.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    yarn = submit.add_argument_group(
        "YARN (--master yarn)", "containers with GPUs/FPGAs; see deploy/yarn/README.md"
    )
    yarn.add_argument(
        "--queue",
        help="YARN queue: simulation (default), training, mapping (deploy/yarn's queues)",
    )
    yarn.add_argument(
        "--deploy-mode",
        choices=["cluster", "client"],
        help="where the driver runs: in a container (cluster, the default) or here (client)",
    )
    yarn.add_argument(
        "--executors",
        type=whole_number(1, "containers"),
        help=f"executor containers ({_YARN_DEFAULTS['executors']})",
    )
    yarn.add_argument(
        "--executor-memory",
        help=f"memory per executor, JVM notation ({_YARN_DEFAULTS['executor_memory']})",
    )
    yarn.add_argument(
        "--gpus-per-executor", type=whole_number(0), help="yarn.io/gpu per container (0)"
    )
    yarn.add_argument(
        "--fpgas-per-executor", type=whole_number(0), help="yarn.io/fpga per container (0)"
    )
    yarn.add_argument(
        "--tasks-per-device", type=whole_number(1), help="tasks sharing one device (1)"
    )
    yarn.add_argument("--fpga-ip-id", help="FPGA image id (required with FPGAs)")
    yarn.add_argument("--fpga-binaries", help="archive URL of prebuilt FPGA kernels")
    yarn.add_argument("--docker-image", help="run the containers in this image (GPU jobs)")
    submit.add_argument("job", nargs=argparse.REMAINDER, help="-- then the adcloud job command")
    submit.set_defaults(func=_cmd_submit)
    return parser


#: (logger, message) of what py4j logs, traceback and all, when a command is interrupted.
_PY4J_INTERRUPT_NOISE = (
    ("", "KeyboardInterrupt while sending command."),  # java_gateway: the root logger
    ("py4j.clientserver", "Exception occurred while shutting down connection"),
)


def _not_said(message: str, record: logging.LogRecord) -> bool:
    return record.getMessage() != message


class _Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, systemd, a scheduler) unwinds like Ctrl-C, so every command's
    clean-up of half-written output runs for it too."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def _reopenable(pid: int, fd: int) -> bool:
    """Whether process ``pid``'s file descriptor ``fd`` can be opened again through
    ``/proc`` and written beside it without the two overwriting each other's lines: a
    terminal, a pipe, a device, a file opened for appending -- not another file (each
    would write at an offset of its own), never a socket (it cannot be opened)."""
    try:
        mode = Path(f"/proc/{pid}/fd/{fd}").stat().st_mode
        if stat.S_ISSOCK(mode):
            return False
        if not stat.S_ISREG(mode):
            return True
        flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0]
        return bool(int(flags, 8) & os.O_APPEND)
    except (OSError, IndexError, ValueError):
        return False


def _unmerge_stderr() -> None:
    """Under spark-submit, write this driver's stderr where spark-submit's goes.

    spark-submit starts a Python driver with its stderr merged into its stdout (Spark's
    PythonRunner), so the ``error:`` line, warnings and progress bars of a submitted job
    went to its stdout: into ``x.json`` of ``adcloud submit -- bag info --json x.bag >
    x.json``, and not where ``2>`` sends errors.  The JVM that started this process holds
    spark-submit's own stderr; it is opened again and made this process's where
    :func:`_reopenable` (``adcloud submit`` sees to it: see :func:`_run_submit`).
    Otherwise the two stay merged, as Spark left them.
    """
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # set by spark-submit for a Python driver
        return
    jvm = os.getppid()
    try:
        ours = os.fstat(2)
        if not os.path.samestat(ours, os.fstat(1)):  # not merged: as someone chose
            return
        if os.path.samestat(Path(f"/proc/{jvm}/fd/2").stat(), ours) or not _reopenable(jvm, 2):
            return
        # O_NONBLOCK: a pipe nobody reads any more is refused (ENXIO), not waited on
        fd = os.open(f"/proc/{jvm}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    sys.stderr.flush()
    os.dup2(fd, 2)  # inheritable: what the driver starts writes its errors there too
    os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``adcloud`` console script."""
    _unmerge_stderr()
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # py4j logs an interrupted gateway call, and the connection it then fails to shut down,
    # with their tracebacks: Ctrl-C and SIGTERM are how a command is stopped, and it says so
    # itself (exit 130/143).  A logger's filter sees only what is logged to it by name.
    for name, message in _PY4J_INTERRUPT_NOISE:
        logging.getLogger(name).addFilter(functools.partial(_not_said, message))
    # Markup is off: paths, topics and error texts hold square brackets ("run[2].bag");
    # the few lines that style themselves say markup=True and escape what they quote.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    console = Console(markup=False)
    errors = Console(stderr=True, markup=False)  # stdout stays the command's output
    had_spark = _active_spark() is not None
    try:
        if args.command != "submit" and getattr(args, "master", None) is not None:
            _check_not_submitted(args.master)
        return int(args.func(args, console))
    except AdcloudError as err:
        if args.verbose:  # as the epilog says: -v shows the traceback, then the one line
            traceback.print_exc()
        errors.print(
            f"[red]error:[/red] {escape(str(err))}", highlight=False, soft_wrap=True, markup=True
        )
        return 2
    except BrokenPipeError:
        # the reader of our stdout went away (`adcloud store cat URL | head`): as cat does,
        # stop without a word; stdout is pointed at /dev/null so the exit flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as err:
        # A file the user named cannot be opened or written (missing, a directory, no
        # permission): say which, without a traceback (-v shows it).
        if err.filename is None or args.verbose:
            raise
        where = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
        errors.print(
            f"[red]error:[/red] {escape(str(where))}: {escape(err.strerror or str(err))}",
            highlight=False,
            soft_wrap=True,
            markup=True,
        )
        return 2
    except Exception as err:
        stop = _interrupt_behind(err)
        if stop is not None:
            # Ctrl-C or SIGTERM landed inside a Spark call and PySpark's clean-up then
            # failed on the broken gateway (py4j "Answer from Java side is empty"): the
            # command was stopped, and says so as any stopped command does
            return 143 if isinstance(stop, _Terminated) else 130
        # Errors raised on executors reach the driver wrapped by Spark, with the
        # Python traceback as text: show the adcloud error inside, not the wrapper.
        remote = _remote_adcloud_error(err)
        if remote is None:
            raise
        if args.verbose:  # the whole traceback, the task's Python traceback in it
            traceback.print_exc()
        errors.print(
            f"[red]error (in a Spark task):[/red] {escape(str(remote))}",
            highlight=False,
            soft_wrap=True,
            markup=True,
        )
        return 2
    except KeyboardInterrupt as err:
        return 143 if isinstance(err, _Terminated) else 130
    finally:
        # Stop a SparkContext this command started (not one a notebook or caller
        # already had), so its Python workers shut down cleanly before exit.
        started = _active_spark()
        if started is not None and not had_spark:
            _stop_spark(started)


def _check_not_submitted(master: str) -> None:
    """Refuse a command's ``--master`` when spark-submit started this driver: the master is
    the submit line's, so the one given here would be ignored without a word."""
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # set by spark-submit for a Python driver
        raise ConfigError(
            f"--master {master}: this job runs under spark-submit, on the master of its "
            "submit line; give the master there (adcloud submit --master URL -- COMMAND ..., "
            "or spark-submit --master URL), not to the job"
        )


def _stop_spark(context: Any) -> None:
    """Stop ``context``; a driver JVM already gone (SIGTERM to the whole process group ends
    it too) has nothing left to stop, and the command's own outcome stands."""
    from py4j.protocol import Py4JError  # noqa: PLC0415 - pyspark is loaded when Spark ran

    try:
        context.stop()
    except (Py4JError, OSError) as err:
        log.debug("the Spark driver was already gone: %s", err)


def _interrupt_behind(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that ``err`` was raised while handling, if any."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _active_spark() -> Any:
    if "pyspark" not in sys.modules:
        return None
    from pyspark import SparkContext  # noqa: PLC0415

    return SparkContext._active_spark_context


if __name__ == "__main__":
    sys.exit(main())
