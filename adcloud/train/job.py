"""The training job: bags to a trained model in one Spark job, data kept in executor memory.

:func:`run_training` is the recipe:

1. ETL (:func:`etl_samples`): :meth:`BinPipeRDD.from_bags <adcloud.binpipe.BinPipeRDD.from_bags>`
   partitions the bags; every task decodes its messages with
   :class:`~adcloud.binpipe.MessageDecoder` and turns them into samples with
   :meth:`Task.samples <adcloud.train.task.Task.samples>`, keyed by ``(partition, ordinal)``
   -- bag order, then record order -- and the result is cached in executor memory.
2. Sharding (:func:`shard_samples`): sample ``i`` (in key order) goes to trainer
   ``i % workers``; the shards are cached too (a retried stage reuses them).  No file lies
   between ETL and training.
3. Training (:func:`train_on_shards`): ``rdd.barrier().mapPartitions`` runs
   :func:`adcloud.train.loop.train` in each task -- rank = partition id -- with the
   configured :mod:`~adcloud.train.sync` mode (``ps``: parameter versions in the store;
   ``allreduce``: a gloo/NCCL process group whose address rank 0 shares through
   ``BarrierTaskContext.allGather``).  Checkpoints go to the store, so a retried stage
   resumes from the last one.  Rank 0 returns the final parameters as bytes.  The stage
   needs ``workers`` task slots at once: too few fail before the ETL, and a stage that
   waits longer than ``sync_timeout_s`` for them (a retry after a lost worker) is
   cancelled (:mod:`adcloud.train.barrier`).
4. ``single`` mode collects the samples and runs the same function in the driver.

Held-out bags are decoded the same way and scored on the executors, each task summing the
scores of its share (:mod:`adcloud.train.evaluate`; a task whose scores are not sums is
scored in the driver with :meth:`Task.evaluate <adcloud.train.task.Task.evaluate>`).  With
``out`` set, the job
writes ``parameters.tensors`` (:mod:`adcloud.train.tensors` format), ``result.json`` (loss
curve, throughput, metrics) and ``settings.json`` (the effective config) there, with the
exported ``model/``: staged beside and moved into place together (:func:`write_outputs`).

``etl="files"`` is the benchmark's baseline: the ETL stage writes its samples to files in a
``file://`` directory (pickle-free, :func:`~adcloud.train.tensors.encode_tree`) and the
training stage reads them back.  They are intermediates: the run removes its own files when
it ends, finished or failed, unless ``keep_etl_files`` (:func:`remove_etl_files`).

The same training function runs under ``torchrun`` (:func:`run_torchrun`, or
``torchrun --nproc-per-node N -m adcloud.train.job --config train.yaml``): every process
decodes the bags itself (:func:`local_samples`), keeps the samples ``i % world == rank`` and
joins the ``env://`` process group.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import posixpath
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from adcloud._commit import JobOutput
from adcloud._scratch import make_scratch, remove_scratch, scratch_dir, sweep_scratch
from adcloud.errors import AdcloudError
from adcloud.store import Store, open_store
from adcloud.train.barrier import BarrierWatch, cancelled_by, check_slots
from adcloud.train.checkpoint import Checkpointer, CheckpointInfo, latest_checkpoint, resume_with
from adcloud.train.config import TrainConfig
from adcloud.train.errors import CheckpointError, DataError, TrainError
from adcloud.train.evaluate import (
    EVAL_FILE,
    PLOT_FILE,
    Evaluation,
    input_mismatch,
    input_shapes,
    score_bag_samples,
    score_parameters,
    score_samples,
)
from adcloud.train.export import METADATA_FILE, PROGRAM_FILE, data_manifest, export_model
from adcloud.train.loop import (
    TrainResult,
    learning_rate,
    past_steps,
    resolve_device,
    resolve_steps,
    train,
)
from adcloud.train.sync import AllReduceSync, ParameterStoreSync, Synchronizer, barrier_session
from adcloud.train.task import CountingTask
from adcloud.train.tensors import decode_tree, encode_tensors, encode_tree

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import SparkSession

    from adcloud.train.task import Task

__all__ = [
    "bag_uris",
    "data_changes",
    "data_fingerprint",
    "decode_samples",
    "etl_samples",
    "etl_to_files",
    "load_task",
    "local_samples",
    "main",
    "remove_etl_files",
    "run_torchrun",
    "run_training",
    "shard_samples",
    "train_on_shards",
    "write_outputs",
]

log = logging.getLogger(__name__)

#: Prefix of the scratch directory that holds a files-mode ETL's samples without train.etl_dir.
_ETL_SCRATCH = "adcloud-etl-"

_SAMPLES_FORMAT = "adcloud-samples"
_SAMPLES_VERSION = 1


def load_task(config: TrainConfig) -> Task:
    """The task ``config.task`` configured with ``config.task_options``."""
    from adcloud.train.task import get_task  # noqa: PLC0415 - models load only when used

    return get_task(config.task, config.task_options)


def _absolute(url: str) -> str:
    """Local paths made absolute (executors run elsewhere); URLs unchanged."""
    return url if "://" in url else str(Path(url).expanduser().resolve())


def bag_uris(bags: Sequence[str]) -> list[str]:
    """``bags`` (files, directories, globs; any fsspec URL) as the sorted bag URLs the ETL
    reads."""
    from adcloud.binpipe import expand_uris  # noqa: PLC0415

    return expand_uris([_absolute(b) for b in bags]) if bags else []


def _check_resumable(
    config: TrainConfig,
    run: str,
    *,
    warn: bool = True,
    data: Mapping[str, Any] | None = None,
) -> None:
    """On the driver, before any Spark work: a run whose newest checkpoint was written by
    another number of trainers, or trained with another optimizer, cannot resume (each
    trainer would find out in its task), nor can one whose checkpoint is past its steps
    (``steps`` as given; with ``epochs``, once they resolve to steps); one resumed with
    other settings is warned about (unless not ``warn``).  With ``data``, the training
    bags' :func:`data_fingerprint`, a run whose training data changed since its checkpoint
    cannot resume unless ``config.resume_changed_data`` (:func:`_check_same_data`)."""
    store = open_store(config.store, **config.store_kwargs())
    try:
        info = latest_checkpoint(store, run)
    finally:
        store.close()
    if info is not None and info.world != config.world:
        raise CheckpointError(
            f"run {run}: checkpoint {store.uri}{info.key} was written by {info.world} "
            f"trainer(s), this run has {config.world}; {resume_with(info.world)} to resume "
            "it, or give the run a new name (train.run)"
        )
    if info is not None and config.epochs == 0 and info.step > config.steps:
        raise CheckpointError(past_steps(run, f"{store.uri}{info.key}", info.step, config.steps))
    saved_optimizer = (info.settings or {}).get("optimizer") if info is not None else None
    if info is not None and saved_optimizer not in (None, config.optimizer):
        raise CheckpointError(
            f"run {run}: checkpoint {store.uri}{info.key} was trained with optimizer "
            f"{saved_optimizer}, this run has {config.optimizer}: its optimizer state cannot "
            f"resume another optimizer; run with optimizer={saved_optimizer} to resume it, or "
            "give the run a new name (train.run)"
        )
    if info is not None and data is not None:
        _check_same_data(config, run, info, data, f"{store.uri}{info.key}", warn=warn)
    if warn and info is not None and info.settings is not None:
        now = json.loads(json.dumps(config.pinned_settings(), sort_keys=True, default=str))
        # what decides the samples is the data check's; the bags as written (a directory
        # or the glob of its files) only where the checkpoint has no data fingerprint
        covered = {*_DECIDE_SAMPLES, *(("bags",) if info.data is not None else ())}
        changed = [
            f"{name} {info.settings.get(name)!r} -> {now[name]!r}"
            for name in now
            if name not in covered and info.settings.get(name) != now[name]
        ]
        if changed:
            log.warning(
                "run %s resumes at step %d from a checkpoint trained with other settings (%s): "
                "the steps before it keep those; give the run a new name (train.run) to train "
                "afresh with these",
                run,
                info.step,
                "; ".join(changed),
            )


#: Settings that decide which samples the bags give (the data check, not the warning).
_DECIDE_SAMPLES = ("task", "task_options")


def _check_same_data(
    config: TrainConfig,
    run: str,
    info: CheckpointInfo,
    data: Mapping[str, Any],
    where: str,
    *,
    warn: bool,
) -> None:
    """Refuse to resume checkpoint ``info`` (at ``where``) on other data than it was
    trained on: the run would go on training one model on two datasets.  ``data`` is the
    training bags' :func:`data_fingerprint` now; a changed task or task options change the
    samples too.  With ``config.resume_changed_data`` it resumes, with a warning (unless
    not ``warn``).  A checkpoint without a fingerprint (written by an older adcloud)
    resumes, with a warning that its data cannot be checked."""
    changes = []
    if info.settings is not None:
        now = json.loads(json.dumps(config.pinned_settings(), sort_keys=True, default=str))
        changes = [
            f"{name} {info.settings[name]!r} -> {now[name]!r}"
            for name in _DECIDE_SAMPLES
            if name in info.settings and info.settings[name] != now[name]
        ]
    if info.data is None:
        if warn and not changes:
            log.warning(
                "run %s: checkpoint %s records no fingerprint of the bags it was trained on "
                "(an older adcloud, or a run given its samples, wrote it): it resumes without "
                "a check that they are these",
                run,
                where,
            )
    else:
        changes += data_changes(info.data, data)
    if not changes:
        return
    shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if config.resume_changed_data:
        if warn:
            log.warning(
                "run %s resumes at step %d on other training data than its checkpoint %s was "
                "trained on (train.resume_changed_data): %s",
                run,
                info.step,
                where,
                shown,
            )
        return
    raise CheckpointError(
        f"run {run}: the training data changed since its checkpoint {where} (step "
        f"{info.step}) was written: {shown}. Resumed, the run would train one model on both "
        "datasets. Give the run a new name (train.run; left empty, the run's name follows "
        "the bags) to train afresh on this data, or set train.resume_changed_data=true to "
        "resume on it anyway"
    )


def preflight(config: TrainConfig, task: Task | None = None) -> str:
    """The run's name (fixed before steps resolve; it covers what the bags are now), after
    the checks that need no Spark: every bag is there (:func:`check_bags`), every held-out
    bag has the messages ``task`` (default: ``config.task``) reads
    (:func:`check_heldout_topics`), the output directory is not a file, and the run's
    checkpoints, if any, were written by as many trainers as it has, with the same
    optimizer, at no more steps than it has, on the same data (bags, task and task
    options; or ``resume_changed_data``).  ``adcloud train run`` calls it before it starts
    Spark and hands the name to :func:`run_training`, which calls it otherwise."""
    check_bags(config)
    task = load_task(config) if task is None else task
    check_heldout_topics(config, task)
    check_heldout_inputs(config, task)
    uris = bag_uris(config.bags)
    run = config.run_id(data_identity(uris))
    _check_output(config.output_dir(run))
    _check_resumable(config, run, data=data_fingerprint(uris))
    return run


def check_heldout_topics(config: TrainConfig, task: Task) -> None:
    """Fail now, naming the bag and the topic, when a held-out bag has no message on one of
    ``task.topics``: it would give no samples, found only once the training is done.  Read
    from each bag's index (no message is read); a bag without an index is left to the
    scoring."""
    from adcloud.binpipe import summarize  # noqa: PLC0415

    for uri in bag_uris(config.heldout_bags):
        try:
            summary = summarize(uri)
        except AdcloudError as err:
            raise TrainError(f"train.heldout_bags: {err}") from err
        if not summary.indexed:
            continue
        counts: dict[str, int] = {}
        for topic in summary.topics:
            counts[topic.topic] = counts.get(topic.topic, 0) + topic.count
        missing = [t for t in task.topics if not counts.get(t)]
        if missing:
            has = ", ".join(sorted(t for t, n in counts.items() if n)) or "none"
            raise TrainError(
                f"train.heldout_bags: {uri} has no messages on {', '.join(missing)}, which "
                f"task {task.name} scores (its topics: {has}); leave the bag out of "
                "heldout_bags, or set the task's topic in train.task_options"
            )


#: Messages read from a bag for its first sample before :func:`check_heldout_inputs` gives
#: up on it (the scoring checks every sample anyway).
_PEEK_MESSAGES = 256


def _first_sample(task: Task, uri: str) -> Any:
    """The first sample ``task`` makes of the bag at ``uri``, decoded here (a fresh copy of
    the task, as an executor has); None when the first :data:`_PEEK_MESSAGES` messages of
    its topics give none."""
    from adcloud.binpipe import (  # noqa: PLC0415
        ConnectionInfo,
        MessageDecoder,
        plan_partitions,
        read_partition,
    )

    fresh = copy.deepcopy(task)
    read = 0
    try:
        parts = plan_partitions(uri, topics=task.topics, partitions_per_bag=1)
    except AdcloudError:  # no index, say: left to the scoring, which says it in its terms
        return None
    for part in parts:
        decoder = MessageDecoder(
            ConnectionInfo(c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization)
            for c in part.connections
        )
        for message in read_partition(part):
            decoded = decoder.decode(message)
            for sample in _task_samples(fresh, uri, message.topic, message.timestamp, decoded):
                return sample
            read += 1
            if read >= _PEEK_MESSAGES:
                return None
    return None


def _other_inputs(task: Task, bag: str, found: tuple[str, str, str], trained: str) -> TrainError:
    """The error of held-out ``bag`` whose samples' model input is of another size than the
    training samples' (``found``: :func:`~adcloud.train.evaluate.input_mismatch`)."""
    name, size, expected = found
    return TrainError(
        f"train.heldout_bags: {bag} gives the model's input {name} of size {size} per "
        f"sample (topic {task.topics[0]}), but the training bags give {expected} "
        f"({trained}): the model is trained for that size and its export takes no other "
        "(adcloud train eval refuses such a bag), so its scores there would be meaningless; "
        "leave the bag out of heldout_bags, or hold out bags recorded like the training bags"
    )


def check_heldout_inputs(config: TrainConfig, task: Task) -> None:
    """Fail now, naming the bag and both sizes, when a held-out bag's samples make model
    inputs of another size than the training bags' (a camera recorded at another
    resolution): the exported model takes only the size it was trained on, so scores on
    such a bag would describe no model a user gets.  Compares each held-out bag's first
    sample with the first training bag's, decoded here (a few messages of each bag); the
    scoring compares every sample (:func:`run_training`)."""
    heldout = bag_uris(config.heldout_bags)
    trained = bag_uris(config.bags)
    if not heldout or not trained:
        return
    first = _first_sample(task, trained[0])
    inputs = input_shapes(task, first) if first is not None else ()
    if not inputs:
        return
    for uri in heldout:
        sample = _first_sample(task, uri)
        found = None if sample is None else input_mismatch(task, inputs, sample)
        if found is not None:
            raise _other_inputs(task, uri, found, trained[0])


def _check_output(out: str) -> None:
    """Refuse an output place that is a file, or a directory holding an entry of a run's
    name that no run wrote (a project's ``model/`` package, another tool's
    ``settings.json``), which the run would replace: now, not once trained."""
    out = _absolute(out)
    fs, root = fsspec.core.url_to_fs(out)
    if fs.isfile(root):
        raise TrainError(
            f"train.out: {out} is a file, not a directory for the run's model and results: "
            "remove it or set train.out to another place"
        )
    if not fs.isdir(root):
        return
    for entry in fs.ls(root, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if name in _RUN_FILES and not _run_entry(fs, entry):
            raise TrainError(
                f"train.out: {out} holds {name}, which no run wrote there and the run would "
                "replace with its own: move it away, or set train.out to an empty or new "
                "directory (default adcloud-runs/{run})"
            )


def check_bags(config: TrainConfig) -> None:
    """Fail now, naming the setting, when ``config`` has no training bags or names a bag
    (training or held out) that is not there: before Spark starts, not once the training is
    done and the held-out bags are read."""
    if not config.bags:
        raise TrainError("no bags to train on: set train.bags (files, directories or globs)")
    found = {}
    for name, bags in (("bags", config.bags), ("heldout_bags", config.heldout_bags)):
        try:
            found[name] = bag_uris(bags)
        except AdcloudError as err:
            raise TrainError(f"train.{name}: {err}") from err
    both = sorted(set(found["bags"]) & set(found["heldout_bags"]))
    if both:  # scores of data it trained on say nothing of how the model generalises
        log.warning(
            "train.heldout_bags: %s also in train.bags: the held-out scores include data the "
            "model is trained on",
            ", ".join(both[:3]) + (f" and {len(both) - 3} more" if len(both) > 3 else ""),
        )


def data_identity(bags: Sequence[str]) -> str:
    """A digest of what the bags at ``bags`` (URLs, as :func:`bag_uris` gives them) are now.

    Each file counts with its URL, size and fsspec ``ukey`` (a digest of what the
    filesystem reports: for a local file its ``stat`` -- times, inode, mode; for an object
    its ETag or version), a rosbag2 directory with every file in it.  Metadata only, not a
    read of the data, so it costs milliseconds on any bag size; a copied, touched or
    ``chmod``-ed bag counts as new data.
    """
    if not bags:
        return ""
    digest = hashlib.sha256()
    for uri in bags:
        fs, path = fsspec.core.url_to_fs(uri)
        members = sorted(fs.find(path)) if fs.isdir(path) else [path]
        for member in members:
            try:
                key = f"{member}\0{fs.size(member)}\0{fs.ukey(member)}\n"
            except (OSError, ValueError) as err:
                raise TrainError(f"{uri}: cannot stat {member}: {err}") from err
            digest.update(key.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


def _modified(info: Mapping[str, Any]) -> str | None:
    """When a file was last written, from fsspec's ``info`` (UTC, ISO 8601; None: the
    filesystem does not say)."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "modified"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            zone = value.tzinfo or datetime.UTC
            value = value.replace(tzinfo=zone).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            stamp = datetime.datetime.fromtimestamp(float(value), datetime.UTC)
            return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        if isinstance(value, str) and value:
            return value
    return None


def data_fingerprint(bags: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What each bag at ``bags`` (URLs, as :func:`bag_uris` gives them) is now, by URL (a
    local bag by its path): ``{"bytes", "files", "modified", "stamp"}``, recorded in every
    checkpoint so that a resumed run can tell whether it trains on the data its checkpoint
    was trained on.

    ``bytes`` and ``files`` count a rosbag2 directory's files together, ``modified`` is the
    newest write time (:func:`_modified`), ``stamp`` a digest of every file's path, size and
    write time -- a local file's ``st_mtime_ns``; elsewhere fsspec's ``ukey`` (an object's
    ETag or version).  Metadata only, not a read of the data, so it costs milliseconds on any
    bag size: a bag regenerated or edited in place gets another stamp, one merely read,
    ``chmod``-ed or moved back keeps its own.
    """
    out: dict[str, dict[str, Any]] = {}
    for uri in bags:
        fs, path = fsspec.core.url_to_fs(uri)
        local = isinstance(fs, LocalFileSystem)
        digest = hashlib.sha256()
        size = 0
        newest: str | None = None
        try:
            members = sorted(fs.find(path)) if fs.isdir(path) else [path]
            for member in members:
                info = fs.info(member)
                size += int(info.get("size") or 0)
                # a local file's write time to the nanosecond (its ukey would take in the
                # inode and ctime too, which a chmod or a backup's restore change)
                mark = str(Path(member).stat().st_mtime_ns) if local else str(fs.ukey(member))
                written = _modified(info)
                if written is not None and (newest is None or written > newest):
                    newest = written
                rel = posixpath.relpath(member, path) if member != path else ""
                key = f"{rel}\0{info.get('size')}\0{mark}\n"
                digest.update(key.encode("utf-8", "surrogateescape"))
        except (OSError, ValueError) as err:
            raise TrainError(f"{uri}: cannot stat the bag: {err}") from err
        # a local bag by its path: file:///d/a.bag and /d/a.bag are the same bag
        out[path if local else uri] = {
            "bytes": size,
            "files": len(members),
            "modified": newest,
            "stamp": digest.hexdigest()[:16],
        }
    return out


def data_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """How the training data ``now`` differs from ``before`` (both :func:`data_fingerprint`):
    one line per bag changed, added or removed (empty: the same data)."""
    out = []
    for uri in sorted(set(before) | set(now)):
        old, new = before.get(uri), now.get(uri)
        if new is None:
            out.append(f"{uri} removed from the bags")
        elif old is None:
            out.append(f"{uri} added to the bags")
        elif old.get("stamp") != new.get("stamp"):
            told = []
            if old.get("bytes") != new.get("bytes"):
                told.append(f"{old.get('bytes')} -> {new.get('bytes')} bytes")
            if old.get("files") != new.get("files"):
                told.append(f"{old.get('files')} -> {new.get('files')} files")
            if old.get("modified") != new.get("modified"):
                told.append(f"written {old.get('modified')} -> {new.get('modified')}")
            out.append(f"{uri} changed ({', '.join(told) or 'its files were rewritten'})")
    return out


# -- ETL ------------------------------------------------------------------------------------


def _task_samples(task: Task, bag: str, topic: str, timestamp: int, decoded: Any) -> Any:
    """``task.samples`` of one message; a :class:`DataError` (it names the topic and the
    field) names the bag and the message's record time too: the error of a job over many
    bags must say which bag to look at."""
    try:
        return task.samples(topic, timestamp, decoded)
    except DataError as err:
        where = f"{bag}: " if bag else ""
        raise DataError(f"{where}{err} (the message recorded at {timestamp} ns)") from err


def decode_samples(
    task: Task, blocks: Iterable[bytes | bytearray], *, bag: str = ""
) -> Iterator[tuple[int, Any]]:
    """The samples ``task`` makes of one partition's BinPipe blocks, with their ordinal in
    the partition (the messages decoded with the definitions the partition carries); ``bag``,
    the bag the partition reads, is named in the :class:`DataError` of a bad message."""
    from adcloud.binpipe import Block, BlockKind, ConnectionInfo, MessageDecoder  # noqa: PLC0415

    decoder = MessageDecoder()
    ordinal = 0
    for raw in blocks:
        block = Block.parse(memoryview(raw))
        if block.kind == BlockKind.META:
            for record in block:
                decoder.add(ConnectionInfo.from_record(record, "a META block of the partition"))
            continue
        for message in block.messages():
            decoded = decoder.decode(message)
            for sample in _task_samples(task, bag, message.topic, message.timestamp, decoded):
                yield ordinal, sample
                ordinal += 1


def _etl_partition(
    index: int, blocks: Iterable[bytes | bytearray], *, task: Task, bags: Sequence[str] = ()
) -> Iterator[tuple[tuple[int, int], Any]]:
    # Each Spark task unpickles its own copy of ``task``, so buffered state (a message
    # waiting for its partner) never crosses partitions.
    bag = bags[index] if index < len(bags) else ""
    for ordinal, sample in decode_samples(task, blocks, bag=bag):
        yield (index, ordinal), sample


def etl_samples(
    spark: SparkSession, config: TrainConfig, task: Task, bags: Sequence[str]
) -> RDD[tuple[tuple[int, int], Any]]:
    """``((partition, ordinal), sample)`` of every message of ``task.topics`` in ``bags``.

    Not cached: the caller caches what it keeps.
    """
    from adcloud.binpipe import BinPipeRDD  # noqa: PLC0415 - pyspark is heavy

    if not bags:
        raise TrainError("no bags to train on: set train.bags (files, directories or globs)")
    rdd = BinPipeRDD.from_bags(
        spark,
        [_absolute(b) for b in bags],
        topics=list(task.topics),
        partitions_per_bag=config.partitions_per_bag,
    )
    return rdd.rdd.mapPartitionsWithIndex(
        functools.partial(_etl_partition, task=task, bags=rdd.partition_bags or ())
    )


def bag_samples(
    spark: SparkSession, task: Task, bags: Sequence[str], partitions_per_bag: int | None = None
) -> RDD[tuple[str, Any]]:
    """``(bag URI, sample)`` of every message of ``task.topics`` in ``bags``, partitioned as
    the bags are (the URIs as :func:`bag_uris` gives them).  Not cached."""
    from adcloud.binpipe import BinPipeRDD  # noqa: PLC0415 - pyspark is heavy

    rdd = BinPipeRDD.from_bags(
        spark, bag_uris(bags), topics=list(task.topics), partitions_per_bag=partitions_per_bag
    )
    return rdd.rdd.mapPartitionsWithIndex(
        functools.partial(_bag_partition, task=task, bags=rdd.partition_bags or ())
    )


def _bag_partition(
    index: int, blocks: Iterable[bytes | bytearray], *, task: Task, bags: Sequence[str]
) -> Iterator[tuple[str, Any]]:
    for _, sample in decode_samples(task, blocks, bag=bags[index]):
        yield bags[index], sample


def heldout_samples(spark: SparkSession, config: TrainConfig, task: Task) -> RDD[tuple[str, Any]]:
    """:func:`bag_samples` of ``config.heldout_bags``."""
    return bag_samples(spark, task, config.heldout_bags, config.partitions_per_bag)


def local_samples(
    task: Task,
    bags: Sequence[str],
    *,
    partitions_per_bag: int | None = None,
    min_partitions: int = 1,
) -> list[Any]:
    """The samples of ``bags`` decoded in this process, in the order :func:`etl_samples` keys
    them (bag order, then record order), for runs without Spark (torchrun, tests)."""
    from adcloud.binpipe import (  # noqa: PLC0415
        ConnectionInfo,
        MessageDecoder,
        plan_partitions,
        read_partition,
    )
    from adcloud.binpipe.rdd import DEFAULT_PARTITION_BYTES  # noqa: PLC0415

    out: list[Any] = []
    for uri in bag_uris(bags):
        parts = plan_partitions(
            uri,
            topics=task.topics,
            partitions_per_bag=partitions_per_bag,
            partition_bytes=DEFAULT_PARTITION_BYTES,
            min_partitions=min_partitions,
        )
        for part in parts:
            copy_of_task = copy.deepcopy(task)  # a fresh copy per partition, as on executors
            decoder = MessageDecoder(
                ConnectionInfo(
                    c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization
                )
                for c in part.connections
            )
            for message in read_partition(part):
                decoded = decoder.decode(message)
                out.extend(
                    _task_samples(copy_of_task, uri, message.topic, message.timestamp, decoded)
                )
    return out


# -- the files baseline ---------------------------------------------------------------------


def _sample_fields(sample: Any) -> Any:
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        return dict(zip(sample._fields, sample, strict=True))
    return sample


def _rebuild(fields: Any, kind: type | None) -> Any:
    if kind is None:
        return fields
    return kind(**fields)


def _write_part(
    index: int,
    items: Iterable[tuple[tuple[int, int], Any]],
    *,
    directory: str,
    job: str = "",
) -> Iterator[dict[str, Any]]:
    kinds: list[type] = []
    keys: list[list[int]] = []
    fields: list[Any] = []
    types: list[int] = []
    for key, sample in items:
        keys.append([int(key[0]), int(key[1])])
        plain = dataclasses.is_dataclass(sample) or hasattr(sample, "_fields")
        kind = type(sample) if plain else None
        if kind is not None and kind not in kinds:
            kinds.append(kind)
        types.append(kinds.index(kind) if kind is not None else -1)
        fields.append(_sample_fields(sample))
    data = encode_tree(
        {"keys": keys, "types": types, "samples": fields},
        {"format": _SAMPLES_FORMAT, "version": _SAMPLES_VERSION},
    )
    url = posixpath.join(directory, f"part-{job}{'-' if job else ''}{index:05d}.tensors")
    fs, path = fsspec.core.url_to_fs(url)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with fs.open(tmp, "wb") as handle:
        handle.write(data)
    fs.mv(tmp, path)
    # The sample classes go back to the driver in the task result, never into the file.
    yield {"url": url, "count": len(keys), "kinds": kinds, "bytes": len(data)}


def _read_part(part: tuple[str, list[type]]) -> Iterator[tuple[tuple[int, int], Any]]:
    url, kinds = part
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "rb") as handle:
        data = handle.read()
    tree, meta = decode_tree(data, source=url)
    if meta.get("format") != _SAMPLES_FORMAT or meta.get("version") != _SAMPLES_VERSION:
        raise TrainError(f"{url} is not an {_SAMPLES_FORMAT} v{_SAMPLES_VERSION} file")
    for key, kind, fields in zip(tree["keys"], tree["types"], tree["samples"], strict=True):
        yield (int(key[0]), int(key[1])), _rebuild(fields, kinds[kind] if kind >= 0 else None)


def etl_to_files(
    spark: SparkSession,
    keyed: RDD[tuple[tuple[int, int], Any]],
    directory: str,
    *,
    job: str = "",
) -> RDD[tuple[tuple[int, int], Any]]:
    """The baseline exchange: write ``keyed`` to files under ``directory``, read them back.

    One ``part-JOB-PPPPP.tensors`` file per partition (``adcloud-samples`` v1: an
    :func:`~adcloud.train.tensors.encode_tree` file of the keys, the sample fields and a
    type index); the returned RDD reads them (one partition per file).  ``JOB`` (``job``,
    or drawn anew) is new for every call: runs sharing ``train.etl_dir`` never read each
    other's samples (the returned RDD reads its files again whenever Spark recomputes it).
    :func:`remove_etl_files` removes them once the RDD is no longer read.
    """
    directory = _absolute(directory)
    if "://" not in directory:
        directory = "file://" + directory
    fs, root = fsspec.core.url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    reports = keyed.mapPartitionsWithIndex(
        functools.partial(_write_part, directory=directory, job=job or _etl_job())
    ).collect()
    parts = [(r["url"], r["kinds"]) for r in reports]
    log.info(
        "etl files: %d samples in %d files, %d bytes under %s",
        sum(r["count"] for r in reports),
        len(reports),
        sum(r["bytes"] for r in reports),
        directory,
    )
    return spark.sparkContext.parallelize(parts, max(1, len(parts))).flatMap(_read_part)


def _etl_job() -> str:
    """A new ``JOB`` for :func:`etl_to_files`' file names (hex: no glob character)."""
    return uuid.uuid4().hex[:12]


def remove_etl_files(directory: str, job: str, *, made: bool = False) -> None:
    """Remove what :func:`etl_to_files` wrote under ``directory`` for ``job``: its
    ``part-JOB-*`` files, the half-written ``.tmp`` files of failed task attempts among
    them; and, ``made`` (the caller created ``directory``), the directory once empty.
    Nothing else there is touched: another run's files, the user's own."""
    if not job or not job.isalnum():
        raise TrainError(f"etl files: {job!r} is not the JOB of an etl_to_files call")
    directory = _absolute(directory)
    fs, root = fsspec.core.url_to_fs(directory)
    files = fs.glob(posixpath.join(root, f"part-{job}-*"))
    if files:
        fs.rm(files)
    if made and fs.isdir(root) and not fs.ls(root, detail=False):
        fs.rmdir(root)
    log.info("etl files: removed %d file(s) of job %s under %s", len(files), job, directory)


# -- sharding and training ------------------------------------------------------------------


def shard_samples(
    keyed: RDD[tuple[tuple[int, int], Any]],
    workers: int,
    heldout: RDD[tuple[str, Any]] | None = None,
) -> tuple[RDD[tuple[int, Any]], list[int]]:
    """``workers`` shards of ``keyed`` (sample ``i`` in key order to shard ``i % workers``) as
    an RDD of ``(i, sample)`` with one partition per shard, and the shard sizes.  With
    ``heldout`` (``(bag, sample)`` pairs, :func:`heldout_samples`), its pairs are dealt the
    same way into the same partitions as ``(-1 - j, (bag, sample))`` (a trainer tells them by
    the negative index); the sizes count the training samples only.

    ``keyed`` must be in key order across its partitions, as :func:`etl_samples` and
    :func:`etl_to_files` make it (partition ``p`` holds the keys ``(p, 0), (p, 1), ...``), so
    the index needs no sort.  ``keyed`` is cached while the index and the shuffle read it,
    then released once the shards are cached (one the caller cached is left as it was), so
    the samples are held in executor memory once, not twice, while training runs (a lost
    shard is rebuilt from its lineage).
    """
    from pyspark import StorageLevel  # noqa: PLC0415

    # an RDD the caller cached stays cached (and at its own storage level, which Spark
    # would refuse to change)
    mine = not keyed.is_cached
    if mine:
        keyed.persist(StorageLevel.MEMORY_ONLY)
    indexed = keyed.values().zipWithIndex()
    total = indexed.count()
    sizes = [len(range(r, total, workers)) for r in range(workers)]
    dealt = indexed.map(lambda pair: (pair[1] % workers, (pair[1], pair[0])))
    if heldout is not None:
        heldout.persist(StorageLevel.MEMORY_ONLY)  # read by the index and by the shuffle
        held = heldout.zipWithIndex()
        dealt = dealt.union(held.map(lambda pair: (pair[1] % workers, (-1 - pair[1], pair[0]))))
    shards = dealt.partitionBy(workers, int).values()
    shards.persist(StorageLevel.MEMORY_ONLY)
    shards.count()
    if mine:
        keyed.unpersist()
    if heldout is not None:
        heldout.unpersist()
    return shards, sizes


def _local_slot(context: Any, rank: int) -> tuple[int, int]:
    """``(index, count)``: this trainer's place among the barrier stage's trainers on its
    host, and how many run there (from the tasks' executor addresses)."""
    hosts = [str(info.address).rsplit(":", 1)[0] for info in context.getTaskInfos()]
    return hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])


def _cuda_index(context: Any, rank: int) -> int:
    """The CUDA device a trainer takes: the GPU Spark assigned to its task when Spark
    schedules ``gpu`` resources with CUDA ordinals (as its ``getGpusResources.sh`` reports
    them), else its place among the trainers on its host -- not its global rank, which on
    a second host would name a GPU another trainer there already uses."""
    gpus = context.resources().get("gpu")
    if gpus is not None and gpus.addresses and str(gpus.addresses[0]).isdigit():
        return int(gpus.addresses[0])
    return _local_slot(context, rank)[0]


def _gpus_per_rank(local_ranks: int) -> bool:
    """Whether this host has a GPU for each of its ``local_ranks`` trainers.  NCCL needs one
    GPU per rank (two ranks on one GPU fail with "Duplicate GPU detected"); ranks that share
    a GPU all-reduce their CUDA tensors through gloo instead."""
    import torch  # noqa: PLC0415

    return torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks


def _checkpointer(
    config: TrainConfig, store: Store, run: str, data: Mapping[str, Any] | None
) -> Checkpointer:
    """The run's checkpointer on ``store``, as ``config`` sets it (every trainer and the
    driver alike)."""
    return Checkpointer(
        store,
        run,
        every=config.checkpoint_every,
        keep=config.keep_checkpoints,
        timeout_s=config.sync_timeout_s,
        settings=config.pinned_settings(),
        data=data,
    )


def _open_sync(
    config: TrainConfig,
    context: Any,
    rank: int,
    world: int,
    run: str,
    cuda_index: int,
    store: Store,
) -> Synchronizer:
    """The trainer's synchronizer; ``ps`` keeps its versions in ``store`` (the caller's, which
    it closes)."""
    if config.sync == "ps":
        info = barrier_session(context, with_master=False)
        return ParameterStoreSync(
            store,
            run,
            rank,
            world,
            session=info.session,
            timeout_s=config.sync_timeout_s,
            keep_versions=config.keep_versions,
            peers=info.peers,
        )
    device = resolve_device(config.device, cuda_index)
    # Spark's GPU assignment gives each trainer a GPU of its own
    assigned = context.resources().get("gpu") is not None
    can_nccl = device.type == "cuda" and (assigned or _gpus_per_rank(_local_slot(context, rank)[1]))
    # every rank must pick the same backend, whatever its host has
    votes = context.allGather("nccl" if can_nccl else "gloo")
    backend = "nccl" if all(v == "nccl" for v in votes) else "gloo"
    return AllReduceSync.from_barrier(
        context, backend=backend, device=device, timeout_s=config.sync_timeout_s
    )


def _check_checkpoint_store(config: TrainConfig, hosts: Iterable[str]) -> None:
    """Refuse checkpoints in a ``local://`` store when the trainers run on several hosts.

    Every trainer writes its part of a checkpoint and rank 0 publishes it once all parts
    are there: in a store each machine has for itself, rank 0 would wait ``sync_timeout_s``
    at every checkpoint for parts it cannot see, and a resumed run would find nothing.
    """
    names = sorted(set(hosts))
    if len(names) > 1 and config.checkpoint_every > 0 and config.store.startswith("local://"):
        raise TrainError(
            f"the trainers run on {len(names)} hosts ({', '.join(names[:4])}), but "
            f"checkpoints go to {config.store}, a local:// store each machine has for itself. "
            "Give train.store a store every host reaches (alluxio://HOST:39999/...: an "
            "Alluxio proxy, or `adcloud store serve` on one machine), or set "
            "checkpoint_every=0"
        )


def _validate_shard(
    model: Any,
    step: int,
    *,
    task: CountingTask,
    held: Sequence[Any],
    context: Any,
    sync: Synchronizer,
    timeout_s: float,
) -> dict[str, float]:
    """Executor side: the scores of all trainers' held-out shards, each trainer counting its
    own and every one adding up all counts (the trainers call it at the same steps).

    The sum is an all-reduce of the process group in ``allreduce`` mode (a trainer that
    hangs fails it after the group's timeout, named, see :class:`AllReduceSync`), else a
    ``BarrierTaskContext.allGather`` given at most ``timeout_s`` (:func:`_gather_within`):
    Spark's own wait is ``spark.barrier.sync.timeout``, a year by default."""
    counts = task.eval_counts(model, held)
    what = f"the held-out scores of step {step}"
    if isinstance(sync, AllReduceSync):
        return task.scores(sync.all_sum(np.asarray(counts), what))
    message = json.dumps(np.asarray(counts).tolist())
    gathered = _gather_within(context, message, timeout_s, what)
    total = sum((np.asarray(json.loads(m)) for m in gathered), start=np.zeros_like(counts))
    return task.scores(total)


def _gather_within(context: Any, message: str, timeout_s: float, what: str) -> list[str]:
    """``context.allGather(message)``, failing with :class:`TrainError` when the other tasks
    have not all come within ``timeout_s`` seconds, naming them and their executors.

    The gather runs in a thread of its own: a task whose wait is given up on fails, and
    Spark then ends the stage's tasks, that thread's wait among them."""
    replies: list[list[str]] = []
    failure: list[BaseException] = []

    def gather() -> None:
        try:
            replies.append(list(context.allGather(message)))
        except BaseException as err:  # handed to the task's thread
            failure.append(err)

    thread = threading.Thread(target=gather, name=f"allGather: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise failure[0]
    if replies:
        return replies[0]
    rank = context.partitionId()
    infos = context.getTaskInfos()
    others = ", ".join(f"rank {r} ({i.address})" for r, i in enumerate(infos) if r != rank)
    raise TrainError(
        f"rank {rank} of {len(infos)} ({socket.gethostname()}, pid {os.getpid()}) waited "
        f"train.sync_timeout_s={timeout_s:g} s in {what} for the other trainers, and not all "
        f"of them came: one of {others} stopped answering. It hangs (a stuck read, a "
        "deadlock, a lost GPU) or is far slower than the others: look at the executor logs "
        "of the trainers that did not fail with this error, and raise train.sync_timeout_s "
        "if their steps really take that long"
    )


def _barrier_train(
    items: Iterable[tuple[int, Any]],
    *,
    task: Task,
    config: TrainConfig,
    data: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Executor side: one trainer of the barrier stage."""
    from pyspark import BarrierTaskContext  # noqa: PLC0415

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    world = len(context.getTaskInfos())
    _check_checkpoint_store(config, context.allGather(socket.gethostname()))
    ordered = sorted(items, key=lambda pair: pair[0])
    shard = [sample for i, sample in ordered if i >= 0]
    held = [pair[1] for i, pair in reversed(ordered) if i < 0]  # -1, -2, ...: their order
    run = config.run_id()
    cuda_index = _cuda_index(context, rank)
    # Spark reuses its Python workers: what a trainer opens (the store's files, connections
    # and thread; the process group) is closed when it ends, failed or not, so a retried
    # attempt in the same worker joins a new group and nothing piles up run after run
    with contextlib.ExitStack() as stack:
        store = open_store(config.store, **config.store_kwargs())
        stack.callback(store.close)
        sync = _open_sync(config, context, rank, world, run, cuda_index, store)
        stack.callback(sync.close)
        validate = None
        # as run_training decides it (every trainer alike: a trainer's share of the held-out
        # samples may be empty); without held-out bags there is nothing to score, and the
        # counts of no sample would make a validation curve of NaN
        if config.eval_every and config.heldout_bags and isinstance(task, CountingTask):
            validate = functools.partial(
                _validate_shard,
                task=task,
                held=held,
                context=context,
                sync=sync,
                timeout_s=config.sync_timeout_s,
            )
        checkpointer = _checkpointer(config, store, run, data)
        result = train(
            task,
            shard,
            config,
            sync,
            checkpointer,
            rank,
            world,
            validate=validate,
            device_index=cuda_index,
        )
    report = result.to_dict()
    report["rank"] = rank
    report["parameters"] = result.parameters
    yield report


def _result_from(
    report: Mapping[str, Any], others: Sequence[Mapping[str, Any]], attempt: int
) -> TrainResult:
    sync = dict(report["sync"])
    sync["max_sync_seconds"] = max(float(r["sync"]["sync_seconds"]) for r in others)
    sync["attempt"] = float(attempt)
    return TrainResult(
        task=report["task"],
        run=report["run"],
        mode=report["mode"],
        world=int(report["world"]),
        steps=int(report["steps"]),
        start_step=int(report["start_step"]),
        losses=tuple(float(v) for v in report["losses"]),
        parameters=bytes(report["parameters"]),
        seconds=float(report["seconds"]),
        samples_per_second=float(report["samples_per_second"]),
        shard_size=int(report["shard_size"]),
        metrics={},
        sync=sync,
        validation=tuple(
            (int(v["step"]), {k: float(x) for k, x in v.items() if k != "step"})
            for v in report.get("validation", [])
        ),
    )


def train_on_shards(
    shards: RDD[tuple[int, Any]],
    config: TrainConfig,
    task: Task,
    *,
    data: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Run :func:`~adcloud.train.loop.train` in a barrier stage, one task per shard.

    ``config.steps`` must be resolved (``epochs=0``); ``data``, the training bags'
    :func:`data_fingerprint`, goes into every checkpoint.  The stage needs ``workers`` task slots
    at once: fewer in the application fail at once (:func:`~adcloud.train.barrier.check_slots`).
    Spark retries the whole stage when a trainer dies, and the retry resumes from the last
    checkpoint; a stage none of whose tasks runs for ``sync_timeout_s`` and a margin (a retry
    waiting for slots a lost worker had) is cancelled with a :class:`TrainError`
    (:class:`~adcloud.train.barrier.BarrierWatch`).
    """
    if config.sync not in ("ps", "allreduce"):
        raise TrainError(f"train_on_shards runs ps or allreduce, not {config.sync!r}")
    sc = shards.context
    check_slots(sc, config.workers, wait_s=config.sync_timeout_s)
    job = functools.partial(_barrier_train, task=task, config=config, data=data)
    run = config.run_id()
    resume = (
        f"Run it again (run {run}) once the cluster has the slots: it resumes from its last "
        "checkpoint"
        if config.checkpoint_every
        else f"Run it again (run {run}) once the cluster has the slots"
    )
    watch = BarrierWatch(sc, run, config.sync_timeout_s, workers=config.workers, advice=resume)
    try:
        with watch:
            # Spark retries a failed barrier stage only when it is a shuffle-map stage (a
            # failed barrier *result* stage aborts the job), so the reports go through a
            # one-partition shuffle: a trainer that dies makes Spark rerun every trainer,
            # which resume from the last checkpoint.
            reports = shards.barrier().mapPartitions(job).repartition(1).collect()
    except Exception as err:
        said = cancelled_by(watch, err)
        if said is None:
            raise
        raise said from err
    by_rank = {int(r["rank"]): r for r in reports}
    if 0 not in by_rank:
        raise TrainError(f"run {config.run_id()}: rank 0 returned no result")
    # the stage attempt that trained the result (0: the first); a trainer cannot tell it:
    # PySpark's task context has the task's attempt only, which a retried stage's new task
    # set counts from 0 again
    return _result_from(by_rank[0], reports, watch.stage_attempt())


def _plot_losses(result: TrainResult, config: TrainConfig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    curve = result.validation
    fig = Figure(figsize=(6, 5.5 if curve else 3.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(211 if curve else 111)
    steps = np.arange(1, len(result.losses) + 1)
    ax.plot(steps, result.losses, lw=1.2)
    if result.start_step:
        ax.axvline(result.start_step, color="grey", ls="--", lw=0.8, label="resumed")
        ax.legend()
    rates = [learning_rate(config, int(s) - 1, result.steps) for s in steps]
    if len(set(rates)) > 1:  # a schedule: its learning rate on a second axis
        lr_axis = ax.twinx()
        lr_axis.plot(steps, rates, color="tab:orange", lw=1.0, alpha=0.8)
        lr_axis.set_ylabel("learning rate", color="tab:orange")
        lr_axis.tick_params(axis="y", colors="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over trainers)")
    ax.set_title(f"{result.task}: {result.mode}, {result.world} trainer(s)")
    ax.grid(alpha=0.3)
    if curve:  # the validation curve: the task's first score (mIoU, ...) on the held-out bags
        name = next(iter(curve[-1][1]), "")
        below = fig.add_subplot(212, sharex=ax)
        below.plot(
            [step for step, _ in curve],
            [scores.get(name, float("nan")) for _, scores in curve],
            marker="o",
            lw=1.2,
            color="tab:green",
        )
        below.set_xlabel("step")
        below.set_ylabel(f"held-out {name}")
        below.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


#: What a run writes in its output directory; other entries there (an ``adcloud train eval
#: --out OUT/nov`` directory, say) stay as they are.
_RUN_FILES = (
    "parameters.tensors",
    "settings.json",
    "loss.png",
    EVAL_FILE,
    PLOT_FILE,
    "result.json",
    "model",
)


#: Keys of the JSON files a run writes (and ``adcloud train eval --out`` its ``eval.json``).
_RUN_JSON_KEYS = {
    "settings.json": {"train"},
    "result.json": {"losses"},
    EVAL_FILE: {"scores"},
}


def _run_entry(fs: Any, path: str) -> bool:
    """Whether ``path``, an entry of :data:`_RUN_FILES` in an output directory, is what a
    run wrote there (so that the next run may replace it): ``model/`` holding nothing but an
    export's files, a JSON file with the keys a run writes; the other names are a run's."""
    name = posixpath.basename(path.rstrip("/"))
    try:
        if name == "model":
            held = {posixpath.basename(e.rstrip("/")) for e in fs.ls(path, detail=False)}
            return bool(fs.isdir(path)) and held <= {PROGRAM_FILE, METADATA_FILE}
        keys = _RUN_JSON_KEYS.get(name)
        if keys is None:
            return True
        text = json.loads(fs.cat_file(path))
    except (OSError, ValueError):
        return False
    return isinstance(text, dict) and keys <= set(text)


class _RunOutput(JobOutput):
    """A run's output directory, replaced as a whole (:class:`adcloud._commit.JobOutput`):
    the files are staged under ``<out>/_temporary/<job>/`` and moved into place once all are
    written, so an export that fails or is interrupted leaves the earlier run's outputs as
    they were.  Only the entries of :data:`_RUN_FILES` are replaced, and only when a run
    wrote them (:func:`_run_entry`)."""

    def __init__(self, fs: Any, root: str, uri: str) -> None:
        super().__init__(
            fs,
            root,
            uri,
            overwrite=True,
            ours=lambda name: _run_entry(fs, posixpath.join(root, name)),
            error=TrainError,
            what="a run",
        )

    def _replaceable(self, entries: list[str]) -> list[str]:
        return [e for e in entries if posixpath.basename(e.rstrip("/")) in _RUN_FILES]


def _staged_files(fs: Any, staging: str) -> list[tuple[str, str]]:
    """``(staged path, name in the output)`` of a staged run, ``model/`` last and its
    ``metadata.json`` (what readers start from) after its program: while the earlier outputs
    are replaced, a ``model/`` that is there is the new one, beside the new files."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    present = {posixpath.basename(e.rstrip("/")) for e in fs.ls(staging, detail=False)}
    files = [(posixpath.join(staging, n), n) for n in _RUN_FILES if n in present and n != "model"]
    if "model" not in present:
        return files
    if "file" in protocols:  # one rename: the program and its metadata appear together
        return [*files, (posixpath.join(staging, "model"), "model")]
    members = sorted(
        fs.find(posixpath.join(staging, "model")),
        key=lambda path: posixpath.basename(path) == METADATA_FILE,
    )
    return [*files, *((m, "model/" + posixpath.relpath(m, staging + "/model")) for m in members)]


def write_outputs(
    result: TrainResult,
    config: TrainConfig,
    out: str,
    *,
    task: Task | None = None,
    examples: Sequence[Any] = (),
    evaluation: Evaluation | None = None,
) -> None:
    """Write ``parameters.tensors``, ``result.json``, ``settings.json`` and ``loss.png`` under
    ``out``; with ``task`` and ``examples`` (samples to trace with) also the deployable
    ``model/`` (``model.pt2`` + ``metadata.json``, see :mod:`adcloud.train.export`); with
    ``evaluation``, its ``eval.json`` and ``confusion.png``.

    All or nothing: the files are staged beside and replace the earlier run's files as a
    whole once every one is written (:class:`adcloud._commit.JobOutput`), so a failed or
    interrupted export leaves the earlier outputs intact; entries a run does not write (an
    ``adcloud train eval --out`` directory in ``out``) stay."""
    out = _absolute(out)
    fs, root = fsspec.core.url_to_fs(out)
    _check_output(out)
    output = _RunOutput(fs, root, out)
    output.start()
    try:
        with scratch_dir("adcloud-train-") as local:
            (local / "parameters.tensors").write_bytes(result.parameters)
            (local / "result.json").write_text(result.to_json())
            settings = json.dumps({"train": config.to_dict()}, indent=2, sort_keys=True)
            (local / "settings.json").write_text(settings + "\n")
            _plot_losses(result, config, local / "loss.png")
            if evaluation is not None:
                evaluation.write(str(local))
            if task is not None and examples:
                _export_run(result, config, task, examples, local / "model")
            fs.put(str(local) + "/", output.staging, recursive=True)
        files = _staged_files(fs, output.staging)
    except BaseException:
        output.abort()  # the earlier outputs stay as they were
        raise
    output.commit(files, first=("model", "result.json"))


def _export_run(
    result: TrainResult, config: TrainConfig, task: Task, examples: Sequence[Any], out: Path
) -> None:
    """The run's deployable model (``model.pt2`` + ``metadata.json``) in directory ``out``."""
    model = task.build_model()
    model.load_state_dict(result.state_dict())
    metadata = {
        "task": task.name,
        "config": config.to_dict(),
        "data": {
            "bags": data_manifest(bag_uris(config.bags)),
            "heldout": data_manifest(bag_uris(config.heldout_bags)),
        },
        # a score of no data (the mIoU of held-out bags without one labelled point) is NaN,
        # which JSON has not: null, as in eval.json
        "metrics": {k: v if math.isfinite(v) else None for k, v in result.metrics.items()},
        "training": {
            "run": result.run,
            "mode": result.mode,
            "trainers": result.world,
            "steps": result.steps,
            "final_loss": result.losses[-1] if result.losses else None,
            "samples_per_second": result.samples_per_second,
            "validation": result.to_dict()["validation"],
        },
    }
    export_model(
        model, task.example_inputs(examples), out, metadata, dynamic_shapes=task.dynamic_shapes()
    )


def _write_outputs(
    result: TrainResult,
    config: TrainConfig,
    task: Task,
    examples: Sequence[Any],
    evaluation: Evaluation | None = None,
) -> TrainResult:
    """Write the finished run's outputs to ``config.output_dir`` (with the held-out
    ``evaluation``'s ``eval.json`` and ``confusion.png``; without one, an earlier run's
    scores there go too, as they would pass for this run's); ``result`` with its
    ``output`` set."""
    out = _absolute(config.output_dir(result.run))
    result = dataclasses.replace(result, output=out)
    write_outputs(result, config, out, task=task, examples=examples[:2], evaluation=evaluation)
    log.info("run %s: model and results in %s", result.run, out)
    return result


def _validate_cached(
    spark: SparkSession, task: Task, held: RDD[Any], inputs: Sequence[Any]
) -> Callable[[Any, int], dict[str, float]]:
    """``validate`` for a run trained on the driver: the model's parameters scored on the
    held-out samples cached on the executors (those of other ``inputs`` refused)."""

    def validate(model: Any, step: int) -> dict[str, float]:
        parameters = encode_tensors(dict(model.state_dict()))
        return score_samples(spark, task, parameters, held, inputs=inputs, name="the run")

    return validate


def _score_kept(
    spark: SparkSession,
    config: TrainConfig,
    task: Task,
    result: TrainResult,
    kept: RDD[tuple[str, Any]],
    inputs: Sequence[Any],
) -> Evaluation:
    """The finished model scored per held-out bag on the ``(bag, sample)`` pairs the run
    kept on its executors to score every ``eval_every`` steps: the bags are not decoded
    again (what :func:`score_parameters` would do)."""
    return score_bag_samples(
        spark,
        task,
        result.parameters,
        kept,
        bag_uris(config.heldout_bags),
        name=f"run {result.run} (held out)",
        inputs=inputs,
    )


def _first_other_input(
    pairs: Iterable[tuple[str, Any]], *, task: Task, inputs: Sequence[Any]
) -> Iterator[tuple[str, tuple[str, str, str]]]:
    for bag, sample in pairs:
        found = input_mismatch(task, inputs, sample)
        if found is not None:
            yield bag, found
            return


def _refuse_other_inputs(
    config: TrainConfig, task: Task, inputs: Sequence[Any], held: RDD[tuple[str, Any]]
) -> None:
    """Before the first step: refuse held-out ``(bag, sample)`` pairs (cached on the
    executors) whose model inputs differ from the training samples' ``inputs``, naming the
    bag and both sizes (:func:`check_heldout_inputs` compared each bag's first sample)."""
    if not inputs:
        return
    check = functools.partial(_first_other_input, task=task, inputs=inputs)
    found = held.mapPartitions(check).take(1)
    if found:
        bag, sizes = found[0]
        raise _other_inputs(task, bag, sizes, ", ".join(config.bags[:1]) or "its samples")


def _evaluate(task: Task, result: TrainResult, samples: Sequence[Any]) -> dict[str, float]:
    import torch  # noqa: PLC0415

    model = task.build_model()
    model.load_state_dict(result.state_dict())
    model.eval()
    with torch.no_grad():
        return dict(task.evaluate(model, samples))


def _is_dir(url: str) -> bool:
    fs, root = fsspec.core.url_to_fs(_absolute(url))
    return bool(fs.isdir(root))


def _remove_etl_files_of(config: TrainConfig, job: str, *, made: bool) -> None:
    """:func:`remove_etl_files` of a finished or failed run: a file that cannot be removed
    is said, and the run's outcome stays what it was."""
    try:
        remove_etl_files(config.etl_dir, job, made=made)
    except (OSError, TrainError) as err:
        log.warning(
            "etl files: the run's sample files part-%s-* in %s could not all be removed "
            "(%s): remove them by hand",
            job,
            config.etl_dir,
            err,
        )


def _no_samples(config: TrainConfig, task: Task) -> TrainError:
    return TrainError(
        f"the bags {', '.join(config.bags) or '(given as samples)'} gave no samples for task "
        f"{task.name} (topics {', '.join(task.topics)}): check the task's topic names against "
        "the bags (adcloud bag info) and the task options"
    )


def run_training(
    spark: SparkSession,
    config: TrainConfig,
    *,
    task: Task | None = None,
    keyed: RDD[tuple[tuple[int, int], Any]] | None = None,
    preflighted: str = "",
) -> TrainResult:
    """Train ``config.task`` on ``config.bags`` in one Spark job (see the module docstring).

    ``task`` replaces ``load_task(config)``; ``keyed`` replaces the ETL of ``config.bags``
    with ready ``((partition, ordinal), sample)`` pairs; ``preflighted`` is the run name
    :func:`preflight` returned for this ``config`` when the caller ran it already (so its
    checks are not repeated, nor its warnings given twice).  Held-out bags are scored on the
    executors (in the driver for a task whose scores are not sums).  The model and results
    go to ``config.output_dir(run)`` (the result's ``output``).
    """
    config = config.validate()
    task = load_task(config) if task is None else task
    validating = bool(config.eval_every and config.heldout_bags)
    if config.eval_every and not config.heldout_bags:
        log.warning(
            "train.eval_every=%d scores the held-out bags while training, but "
            "train.heldout_bags is empty: there is no validation curve",
            config.eval_every,
        )
    if validating and not isinstance(task, CountingTask):
        raise TrainError(
            f"train.eval_every scores the held-out bags during training, which needs a task "
            f"whose scores are sums (eval_counts and scores; see CountingTask); {task.name} "
            "has none: set eval_every=0"
        )
    started = time.perf_counter()
    # what the checkpoints record the run was trained on (preflight checked it against theirs)
    data = data_fingerprint(bag_uris(config.bags)) if keyed is None else None
    if preflighted:
        run = preflighted
    elif keyed is None:
        run = preflight(config, task)
    else:
        check_heldout_topics(config, task)
        run = config.run_id()
        _check_output(config.output_dir(run))
        _check_resumable(config, run)
    if config.sync != "single":  # before the ETL, not once the samples are made
        check_slots(spark.sparkContext, config.workers, wait_s=config.sync_timeout_s)
    given = keyed  # the caller's RDD stays as the caller left it (cached or not)
    if keyed is None:
        keyed = etl_samples(spark, config, task, config.bags)
    # Without train.etl_dir the samples (gigabytes) go to a scratch directory of the driver
    # (which local-mode executors read too): a driver killed outright leaves it behind, and
    # the next run's removes it (adcloud._scratch).
    scratch = config.etl == "files" and not config.etl_dir
    made_dir = make_scratch(_ETL_SCRATCH) if scratch else None
    if made_dir is None:  # a killed files-mode run's samples go with any later run
        sweep_scratch(_ETL_SCRATCH)
    # in train.etl_dir the run's own sample files go when it ends (train.keep_etl_files)
    etl_job = _etl_job()
    etl_dir_made = config.etl == "files" and bool(config.etl_dir) and not _is_dir(config.etl_dir)
    evaluation: Evaluation | None = None  # scored on the held-out samples kept for eval_every
    try:
        if config.etl == "files":
            keyed = etl_to_files(spark, keyed, config.etl_dir or str(made_dir), job=etl_job)
        if config.sync == "single":
            samples = [s for _, s in sorted(keyed.collect(), key=lambda pair: pair[0])]
            if not samples:
                raise _no_samples(config, task)
            resolved = config.replace(
                steps=resolve_steps(config, [len(samples)]), epochs=0, run=run
            )
            if config.epochs:  # steps known only now: a checkpoint past them cannot resume
                _check_resumable(resolved, run, warn=False)
            held = None
            inputs = input_shapes(task, samples[0])
            # a store holds files, connections and a thread: a notebook trains run after run
            store = open_store(config.store, **config.store_kwargs())
            try:
                if validating:  # decoded once, kept on the executors, scored there
                    held = heldout_samples(spark, config, task).cache()
                checkpointer = _checkpointer(config, store, run, data)
                if held is not None:  # before the first step, not at the first score
                    _refuse_other_inputs(config, task, inputs, held)
                result = train(
                    task,
                    samples,
                    resolved,
                    None,
                    checkpointer,
                    0,
                    1,
                    validate=None
                    if held is None
                    else _validate_cached(spark, task, held.values(), inputs),
                )
                if held is not None:  # the finished model, on the same cached samples
                    evaluation = _score_kept(spark, config, task, result, held, inputs)
            finally:
                store.close()
                if held is not None:
                    held.unpersist()
            examples = samples[:2]
        else:
            heldout = heldout_samples(spark, config, task) if validating else None
            shards, sizes = shard_samples(keyed, config.workers, heldout)
            if sum(sizes) == 0:
                raise _no_samples(config, task)
            if min(sizes) == 0:
                raise TrainError(
                    f"{sum(sizes)} sample(s) cannot fill {config.workers} shards: lower "
                    "train.workers or add data"
                )
            resolved = config.replace(steps=resolve_steps(config, sizes), epochs=0, run=run)
            try:
                if config.epochs:  # before the trainers start (they would fail each attempt)
                    _check_resumable(resolved, run, warn=False)
                # samples to trace the exported model with, from the cached shards
                examples = [s for _, s in shards.filter(lambda pair: pair[0] >= 0).take(2)]
                inputs = input_shapes(task, examples[0])
                kept = shards.filter(lambda pair: pair[0] < 0).values()
                if heldout is not None:  # the held-out pairs dealt into the cached shards
                    _refuse_other_inputs(config, task, inputs, kept)
                result = train_on_shards(shards, resolved, task, data=data)
                if heldout is not None:
                    evaluation = _score_kept(spark, config, task, result, kept, inputs)
            finally:
                shards.unpersist()
                if keyed is not given:
                    keyed.unpersist()
    finally:
        if made_dir is not None:
            remove_scratch(made_dir)
        elif config.etl == "files" and not config.keep_etl_files:
            _remove_etl_files_of(config, etl_job, made=etl_dir_made)
    if evaluation is not None:
        metrics = evaluation.scores
        result = dataclasses.replace(result, metrics=metrics)
        final = (result.steps, dict(metrics))  # the curve ends with the finished model's scores
        result = dataclasses.replace(result, validation=(*result.validation, final))
    elif config.heldout_bags:
        if isinstance(task, CountingTask):
            evaluation = score_parameters(
                spark,
                task,
                result.parameters,
                config.heldout_bags,
                partitions_per_bag=config.partitions_per_bag,
                name=f"run {result.run} (held out)",
                inputs=inputs,
            )
            metrics = evaluation.scores
        else:  # a task whose scores are not sums: its held-out samples go to the driver
            gathered = etl_samples(spark, config, task, config.heldout_bags).collect()
            samples = [s for _, s in sorted(gathered, key=lambda pair: pair[0])]
            metrics = _evaluate(task, result, samples)
        result = dataclasses.replace(result, metrics=metrics)
    log.info(
        "run %s (%s, %d trainer(s)): %d steps, final loss %.5f, %.1f s",
        result.run,
        result.mode,
        result.world,
        result.steps,
        result.losses[-1] if result.losses else float("nan"),
        time.perf_counter() - started,
    )
    return _write_outputs(result, config, task, examples, evaluation)


# -- torchrun -------------------------------------------------------------------------------


def run_torchrun(
    config: TrainConfig, *, task: Task | None = None, samples: Sequence[Any] | None = None
) -> TrainResult:
    """Run this process's trainer of a ``torchrun`` job (``env://`` process group).

    Every process decodes ``config.bags`` itself (or takes ``samples``: all of them, in
    order) and keeps samples ``i % world == rank``: the shards of :func:`shard_samples`.
    Rank 0 writes the model and results to ``config.output_dir(run)``.  Held-out bags are
    not scored here (that takes Spark's executors: ``adcloud train eval`` scores the model).
    """
    task = load_task(config) if task is None else task
    if config.heldout_bags:
        log.warning(
            "torchrun: train.heldout_bags (and eval_every) are not scored under torchrun; "
            "score the exported model with: adcloud train eval --model OUT/model --bags %s",
            " ".join(config.heldout_bags),
        )
    uris = bag_uris(config.bags) if samples is None else []
    fingerprint = data_fingerprint(uris) if samples is None else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    config = config.replace(sync="allreduce", workers=world)
    run = config.run_id(data_identity(uris))
    # every rank reaches the same verdict, before it decodes the bags and before the
    # process group waits for the others
    _check_resumable(config, run, warn=rank == 0, data=fingerprint)
    if samples is None:
        samples = local_samples(task, config.bags, partitions_per_bag=config.partitions_per_bag)
    sizes = [len(range(r, len(samples), world)) for r in range(world)]
    # every rank says it alike, before the others wait for it in the process group
    if not samples:
        raise _no_samples(config, task)
    if min(sizes) == 0:
        raise TrainError(
            f"{len(samples)} sample(s) cannot fill the shards of {world} torchrun "
            "processes: give fewer processes (--nproc-per-node, --nnodes) or more data"
        )
    config = config.replace(steps=resolve_steps(config, sizes), epochs=0, run=run)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = resolve_device(config.device, local_rank)
    # every host of a torchrun job runs --nproc-per-node trainers, so each rank decides alike
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = "nccl" if device.type == "cuda" and _gpus_per_rank(local_world) else "gloo"
    shard = [samples[i] for i in range(rank, len(samples), world)]
    with contextlib.ExitStack() as stack:
        sync = AllReduceSync.from_env(
            backend=backend, device=device, timeout_s=config.sync_timeout_s
        )
        stack.callback(sync.close)
        store = open_store(config.store, **config.store_kwargs())
        stack.callback(store.close)
        checkpointer = _checkpointer(config, store, config.run_id(), fingerprint)
        result = train(
            task, shard, config, sync, checkpointer, rank, world, device_index=local_rank
        )
    if rank == 0:
        return _write_outputs(result, config, task, list(samples[:2]))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun -m adcloud.train.job --config FILE [--set key=value ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m adcloud.train.job",
        description="Run one trainer of a torchrun job: every process decodes the bags itself, "
        "keeps its shard and trains with all-reduce (gloo on CPU, NCCL on GPU); rank 0 "
        "writes the outputs (model, metrics, loss curve) to train.out (default "
        "adcloud-runs/{run}).",
        epilog="example: torchrun --nproc-per-node 2 -m adcloud.train.job --config train.yaml "
        "--set steps=100 (keys are the train section's: steps, workers, out, ...)",
    )
    parser.add_argument("--config", help="settings file with a train: section")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting"
    )
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r} is not KEY=VALUE")
        overrides[key.strip()] = value
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = TrainConfig.load(file=args.config, **overrides)
        result = run_torchrun(config)
    except AdcloudError as err:  # as the adcloud command says it: one line, exit 2
        print(f"error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        log.info(
            "final loss %.5f after %d steps; outputs in %s",
            result.losses[-1],
            result.steps,
            result.output,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
