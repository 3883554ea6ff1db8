"""Where a Spark application's task slots stood idle during a benchmark block, read from
Spark's event log.

A 2-vs-1-executor ratio below 2 has three causes that call for different fixes: time when no
task runs at all (the driver working alone between jobs), slots idle inside a job (too few
or unequal tasks: stragglers), and tasks that run slower side by side (cores shared with the
JVMs and the driver). The table this prints separates them job by job:

    conf = event_log_conf(work / "events")           # into the session's configuration
    ... run the block, note time.time() before and after ...
    print(slot_report(work / "events", started, ended, slots=2))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def event_log_conf(directory: Path) -> dict[str, str]:
    """Spark settings that write one plain (uncompressed, unrolled) event log per
    application into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": str(directory),
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
    }


def _jobs_and_tasks(path: Path) -> tuple[dict[int, dict[str, Any]], list[tuple[int, int, int]]]:
    jobs: dict[int, dict[str, Any]] = {}
    tasks: list[tuple[int, int, int]] = []  # (launch ms, finish ms, stage id)
    with path.open() as f:
        for line in f:
            event = json.loads(line)
            kind = event["Event"]
            if kind == "SparkListenerJobStart":
                props = event.get("Properties") or {}
                jobs[event["Job ID"]] = {
                    "start": event["Submission Time"],
                    "stages": event["Stage IDs"],
                    "site": props.get("callSite.short", "?"),
                }
            elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
                jobs[event["Job ID"]]["end"] = event["Completion Time"]
            elif kind == "SparkListenerTaskEnd":
                info = event["Task Info"]
                tasks.append((info["Launch Time"], info["Finish Time"], event["Stage ID"]))
    return jobs, tasks


def slot_report(directory: Path, start_s: float, end_s: float, slots: int) -> str:
    """Job by job between ``start_s`` and ``end_s`` (``time.time()``): wall time, task
    seconds, idle slot seconds, and the driver-only time between jobs."""
    start, end = start_s * 1000, end_s * 1000
    lines = []
    busy_total = idle_total = alone = 0.0
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name.startswith("app")):
        jobs, tasks = _jobs_and_tasks(path)
        job_of = {stage: job for job, info in jobs.items() for stage in info["stages"]}
        inside = sorted(
            (job, info)
            for job, info in jobs.items()
            if start <= info["start"] <= end and "end" in info
        )
        if not inside:
            continue
        previous = start
        for job, info in inside:
            wall = info["end"] - info["start"]
            busy = sum(
                min(b, info["end"]) - max(a, info["start"])
                for a, b, stage in tasks
                if job_of.get(stage) == job
            )
            count = sum(1 for _, _, stage in tasks if job_of.get(stage) == job)
            gap = max(0.0, info["start"] - previous)
            alone += gap
            busy_total += busy
            idle_total += max(0.0, slots * wall - busy)
            lines.append(
                f"  +{gap / 1000:5.2f} s alone | job {job:3d} {wall / 1000:6.2f} s, {count:4d} "
                f"tasks, {busy / 1000:6.2f} task-s, {max(0.0, slots * wall - busy) / 1000:5.2f} "
                f"slot-s idle  {info['site']}"
            )
            previous = info["end"]
        alone += max(0.0, end - previous)
    lines.append(
        f"  {slots} slot(s): {busy_total / 1000:.1f} task-s; the driver alone "
        f"{alone / 1000:.1f} s; idle slot-s inside jobs {idle_total / 1000:.1f}"
    )
    return "\n".join(lines)
