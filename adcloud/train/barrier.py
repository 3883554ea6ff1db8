"""The driver's side of the trainers' barrier stage: task slots before it starts, a watch on
it while it runs.

A barrier stage starts all its tasks at once or none of them.  Spark checks that a cluster
has enough slots only against its *total* and retries that check for minutes
(``spark.scheduler.barrier.maxConcurrentTasksCheck.*``: 40 x 15 s) before it fails with a
raw ``BarrierJobSlotsNumberCheckFailed``; and once the stage runs, a retried attempt after a
lost executor waits for good if the slots are not all there again (a lost worker) or other
jobs hold them -- the trainers' own waits end after ``sync_timeout_s``, Spark's does not.

- :func:`task_slots` -- how many tasks the application runs at once (what Spark's check
  counts: executors alive x their cores / ``spark.task.cpus``; ``local[N]``: ``N``);
- :func:`check_slots` -- fail at once, saying what to change, when ``workers`` exceed them;
- :class:`BarrierWatch` -- tags the stage's job with a job tag of its own and cancels it
  when none of its tasks has run for ``limit_s``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from types import TracebackType
from typing import Any

from adcloud.train.errors import TrainError


def _local_cores(master: str) -> int | None:
    # adcloud.spark imports pyspark, which the torchrun trainers (adcloud.train.job run under
    # torchrun, on a GPU node perhaps) neither need nor always have: import it on use
    from adcloud.spark import local_cores as cores  # noqa: PLC0415

    return cores(master)


__all__ = ["BarrierWatch", "cancelled_by", "check_slots", "task_slots"]

log = logging.getLogger(__name__)

#: The job properties a caller (a notebook) may have set that the watch sets for the
#: stage; restored after it.  Not the job group: a notebook (Zeppelin, Livy, Databricks)
#: cancels a cell's jobs by the group it set, and the training is one of them.
_JOB_PROPERTIES = ("spark.job.description", "spark.job.interruptOnCancel")


def _task_cpus(sc: Any) -> int:
    return max(1, int(sc.getConf().get("spark.task.cpus", "1") or 1))


def task_slots(sc: Any) -> int | None:
    """How many tasks the application on ``sc`` can run at once now; None when unknown.

    Spark's own count (``SparkContext.maxNumConcurrentTasks``: the executors alive, each
    with its cores divided by ``spark.task.cpus``) where the JVM offers it, else ``N`` of a
    ``local[N]`` master, or the executors times ``spark.executor.cores``.  Not
    ``defaultParallelism``: on a cluster that is at least 2 whatever the cores, and a
    setting (``spark.default.parallelism``) besides.
    """
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception as err:  # py4j's errors: another Spark version, a remote session
        log.debug("Spark's task slot count is not available (%s); estimating it", err)
    cpus = _task_cpus(sc)
    cores_here = _local_cores(str(sc.master))
    if cores_here is not None:
        return cores_here // cpus
    cores = sc.getConf().get("spark.executor.cores")
    if cores is None:
        return None
    executors = len(sc.statusTracker().getExecutorInfos()) - 1  # the driver is listed too
    return max(0, executors) * (int(cores) // cpus)


def _slots_in_use(sc: Any) -> int:
    return sum(info.numRunningTasks for info in sc.statusTracker().getExecutorInfos())


#: Seconds the slot count of a cluster must stay the same, once it has any, before
#: :func:`check_slots` takes it for all the application gets.
_SETTLE_S = 5.0


def check_slots(sc: Any, workers: int, *, wait_s: float = 10.0) -> None:
    """Raise :class:`TrainError` when ``sc``'s application cannot run ``workers`` tasks at
    once, saying what to change.  On a cluster, executors that are still registering (a
    session just started) are waited for: up to ``wait_s`` seconds, and no longer once the
    count has stayed the same for :data:`_SETTLE_S` (a cluster with too few cores does not
    get more by waiting); a ``local[N]`` master has its slots from the start (a
    ``local-cluster[...]`` one has executors, which register as a cluster's do)."""
    master = str(sc.master)
    local = _local_cores(master) is not None and not master.startswith("local-cluster")
    now = started = time.monotonic()
    deadline = now + (0.0 if local else wait_s)
    last, since = None, now
    while True:
        slots = task_slots(sc)
        if slots is None or slots >= workers:
            return
        now = time.monotonic()
        if slots != last:
            last, since = slots, now
        if now >= deadline or (slots > 0 and now - since >= _SETTLE_S):
            break
        time.sleep(0.5)
    need = (
        f"train.workers={workers} trainers run as one Spark barrier stage and need {workers} "
        f"task slots at once, but the application on {sc.master} has {slots} (executors "
        f"alive x cores each / spark.task.cpus={_task_cpus(sc)})"
    )
    if slots == 0:  # no number of trainers fits: lowering train.workers is no way out
        raise TrainError(
            f"{need} after {math.ceil(now - started)} s: no executor has registered, or "
            "none has spark.task.cpus cores; check that the cluster has workers with free "
            "cores for the application (spark.cores.max, spark.executor.cores, more workers)"
        )
    raise TrainError(
        f"{need}: lower train.workers to {slots}, or give it more executors or cores "
        "(spark.cores.max, spark.executor.cores, more workers)"
    )


def _margin(timeout_s: float) -> float:
    """Seconds of quiet beyond ``sync_timeout_s`` before the watch acts: between a failed
    attempt and its retry Spark kills the old trainers (``spark.python.task.killTimeout``)
    and resubmits the stage, a few quiet seconds that are no stall."""
    return min(60.0, max(5.0, timeout_s / 2))


class BarrierWatch:
    """Tags the Spark jobs started inside its ``with`` block (in this thread) with a job tag
    of their own (:attr:`tag`), and cancels them when none of their tasks has run for
    ``limit_s`` (``sync_timeout_s`` plus a margin): a barrier stage that waits for slots it
    will not get.  The caller's job group stays theirs: cancelling it cancels the training.

    Running trainers are never judged: a slow step, a long validation or checkpoint is not a
    stall, and a trainer that waits on a dead peer fails by itself after ``sync_timeout_s``.
    Progress is what Spark's status tracker shows of the tagged jobs' stages -- tasks
    running, a task or a stage attempt that finished or failed.  After the block,
    :attr:`reason` says why the jobs were cancelled (None when they were not); the caller's
    job description and ``interruptOnCancel`` are restored.
    """

    def __init__(
        self,
        sc: Any,
        name: str,
        timeout_s: float,
        *,
        workers: int,
        advice: str,
        poll_s: float = 0.5,
    ) -> None:
        self.sc = sc
        self.tag = f"adcloud-train-{name}-{uuid.uuid4().hex[:8]}"
        self.name = name
        self.timeout_s = timeout_s
        self.limit_s = timeout_s + _margin(timeout_s)
        self.workers = workers
        self.advice = advice
        self.poll_s = poll_s
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> BarrierWatch:
        self._saved = {key: self.sc.getLocalProperty(key) for key in _JOB_PROPERTIES}
        self.sc.addJobTag(self.tag)
        self.sc.setLocalProperty(
            "spark.job.description", f"adcloud train: run {self.name} (barrier stage)"
        )
        self.sc.setInterruptOnCancel(True)
        self._thread = threading.Thread(target=self._watch, name=f"watch {self.tag}", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sc.removeJobTag(self.tag)
        for key, value in self._saved.items():
            self.sc.setLocalProperty(key, value)

    def stage_attempt(self) -> int:
        """The attempt number (0: the first) of the barrier stage of the last job tagged
        :attr:`tag`: the one before its result stage (both are made when the job is
        submitted, the barrier stage first; the stages the shards were made by are older); 0
        when Spark no longer holds its record."""
        tracker = self.sc.statusTracker()
        for job_id in sorted(self._job_ids(), reverse=True):
            job = tracker.getJobInfo(job_id)
            ids = sorted(job.stageIds) if job is not None else []
            info = tracker.getStageInfo(ids[-2]) if len(ids) >= 2 else None
            if info is not None:
                return int(info.currentAttemptId)
        return 0

    def _job_ids(self) -> list[int]:
        """The ids of the jobs tagged :attr:`tag` (Spark's status tracker: PySpark's has
        no lookup by tag)."""
        return [int(i) for i in self.sc._jsc.sc().statusTracker().getJobIdsForTag(self.tag)]

    def _state(self) -> tuple[int, tuple[tuple[int, ...], ...]]:
        """``(tasks running, per stage: id, attempt, running, done, failed)`` of the
        tagged jobs."""
        tracker = self.sc.statusTracker()
        stages = []
        for job_id in sorted(self._job_ids()):
            job = tracker.getJobInfo(job_id)
            if job is None:
                continue
            for stage_id in sorted(job.stageIds):
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    stages.append(
                        (
                            stage_id,
                            info.currentAttemptId,
                            info.numActiveTasks,
                            info.numCompletedTasks,
                            info.numFailedTasks,
                        )
                    )
        return sum(stage[2] for stage in stages), tuple(stages)

    def _watch(self) -> None:
        since = time.monotonic()
        last: tuple[tuple[int, ...], ...] | None = None
        while not self._stop.wait(self.poll_s):
            try:
                running, stages = self._state()
                now = time.monotonic()
                if running or stages != last:
                    since, last = now, stages
                    continue
                if now - since < self.limit_s:
                    continue
                self.reason = self._stalled(now - since)
                log.warning("%s; cancelling the Spark jobs tagged %s", self.reason, self.tag)
                self.sc.cancelJobsWithTag(self.tag)
            except Exception as err:  # the context stopped under us: nothing left to watch
                log.debug("watch of %s ends: %s", self.tag, err)
            if self.reason is not None:
                return

    def _stalled(self, quiet_s: float) -> str:
        slots = task_slots(self.sc)
        try:
            busy = f", {_slots_in_use(self.sc)} of them busy with other tasks"
        except Exception:
            busy = ""
        have = "an unknown number of task slots" if slots is None else f"{slots} task slot(s)"
        return (
            f"run {self.name}: no task of its barrier stage has run for {math.floor(quiet_s)} s "
            f"(train.sync_timeout_s={self.timeout_s:g} plus {_margin(self.timeout_s):g} s): "
            f"its {self.workers} trainers need {self.workers} task slots at once and the "
            f"application has {have} now{busy} (an executor or worker was lost, or other "
            f"jobs hold them); the job was cancelled. {self.advice}"
        )


def cancelled_by(watch: BarrierWatch, err: BaseException) -> TrainError | None:
    """The :class:`TrainError` to raise for ``err``, the failure of a job run under
    ``watch``: its stall when the watch cancelled it, Spark's slot check when that failed
    (executors lost between :func:`check_slots` and the stage); None for another error."""
    if watch.reason is not None:
        return TrainError(watch.reason)
    if "BarrierJobSlotsNumberCheckFailed" in str(err):
        slots = task_slots(watch.sc)
        return TrainError(
            f"run {watch.name}: Spark could not start the {watch.workers} trainers of the "
            f"barrier stage together: the application has {slots} task slot(s) now; lower "
            "train.workers or give it more executors or cores"
        )
    return None
