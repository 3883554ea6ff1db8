"""adcloud.train on a CUDA GPU against the same training on the CPU, in one run.

The product's training function (:func:`adcloud.train.loop.train`, ``sync="single"``) trains
``lidar_seg`` and ``camera_seg`` (small and full presets) on the synthetic drives of the
training tests (20 s, seed 6, for training; 10 s, seed 5, held out; 16 beams x 512 columns,
the 160x120 camera) once with ``train.device="cuda"`` and once with ``"cpu"`` (all the
machine's cores), same seed, same batches, same steps.  Printed per task, preset and device:
training samples/s, the GPU/CPU ratio, the final loss, how far the two loss curves differ, the
held-out mIoU, and the exported model's inference latency (p50/p99,
:func:`adcloud.train.export.export_model` on that device).

A GPU machine may have no ROS tooling and no Spark, so the samples are made on a machine with
the project installed and carried over as one ``.npz``::

    .venv/bin/python benchmarks/bench_train_gpu.py prepare --out work/gpu/samples.npz
    python3 benchmarks/bench_train_gpu.py run --samples work/gpu/samples.npz --json out.json

``prepare`` synthesizes the drives and makes the samples with the task's own ETL (messages
read by :mod:`adcloud.binpipe`, decoded with its ``MessageDecoder``), as the Spark job does.
``run`` needs only torch, NumPy and the project's pure-Python modules.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # ``run`` works from a bare checkout (no install)

from adcloud.train.task import ImageSample, PointCloudSample, Sample  # noqa: E402

SPLITS = ("train", "heldout")
TASKS = ("lidar_seg", "camera_seg")


def prepare(out: Path) -> None:
    """Synthesize both drives and write their ``lidar_seg`` and ``camera_seg`` samples to
    ``out``."""
    from adcloud.binpipe import (  # noqa: PLC0415
        ConnectionInfo,
        MessageDecoder,
        plan_partitions,
        read_partition,
    )
    from adcloud.synth import DriveConfig, generate_drive  # noqa: PLC0415
    from adcloud.train.task import get_task  # noqa: PLC0415

    drives = {
        "train": DriveConfig(seconds=20, seed=6, lidar_beams=16, lidar_columns=512, camera=True),
        "heldout": DriveConfig(seconds=10, seed=5, lidar_beams=16, lidar_columns=512, camera=True),
    }
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
        for split, drive in drives.items():
            bag = generate_drive(drive, Path(tmp) / f"{split}.bag").bag
            for name in TASKS:
                task = get_task(name)
                samples: list[Sample] = []
                for part in plan_partitions(str(bag), topics=task.topics):
                    decoder = MessageDecoder(
                        ConnectionInfo(
                            c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization
                        )
                        for c in part.connections
                    )
                    for msg in read_partition(part):
                        samples.extend(task.samples(msg.topic, msg.timestamp, decoder.decode(msg)))
                key = f"{name}_{split}"
                arrays[f"{key}_stamps"] = np.array([s.stamp_ns for s in samples], dtype=np.int64)
                arrays[f"{key}_labels"] = np.concatenate([s.labels.ravel() for s in samples])
                if name == "lidar_seg":
                    clouds = [s.points for s in samples if isinstance(s, PointCloudSample)]
                    arrays[f"{key}_sizes"] = np.array([len(c) for c in clouds], dtype=np.int64)
                    arrays[f"{key}_points"] = np.concatenate(clouds)
                else:
                    arrays[f"{key}_images"] = np.stack(
                        [s.image for s in samples if isinstance(s, ImageSample)]
                    )
                print(f"{name} {split}: {len(samples)} samples", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


def load(path: Path, name: str) -> dict[str, list[Sample]]:
    """Task ``name``'s samples that ``prepare`` wrote, by split."""
    out: dict[str, list[Sample]] = {}
    with np.load(path) as data:
        for split in SPLITS:
            key = f"{name}_{split}"
            stamps = data[f"{key}_stamps"].tolist()
            if name == "lidar_seg":
                ends = np.cumsum(data[f"{key}_sizes"])[:-1]
                points = np.split(data[f"{key}_points"], ends)
                labels = np.split(data[f"{key}_labels"], ends)
                out[split] = [
                    PointCloudSample(int(t), p, lab)
                    for t, p, lab in zip(stamps, points, labels, strict=True)
                ]
            else:
                images = data[f"{key}_images"]
                masks = data[f"{key}_labels"].reshape(images.shape[:3])
                out[split] = [
                    ImageSample(int(t), img, lab)
                    for t, img, lab in zip(stamps, images, masks, strict=True)
                ]
    return out


def train_once(
    name: str,
    preset: str,
    device: str,
    samples: dict[str, list[Sample]],
    steps: int,
    threads: int,
) -> dict[str, Any]:
    """One single-process run of task ``name``'s ``preset`` on ``device``: throughput, losses,
    held-out scores and the exported model's latency there."""
    import torch  # noqa: PLC0415

    from adcloud.train.config import TrainConfig  # noqa: PLC0415
    from adcloud.train.export import export_model  # noqa: PLC0415
    from adcloud.train.loop import train  # noqa: PLC0415
    from adcloud.train.task import get_task  # noqa: PLC0415

    task = get_task(name, {"preset": preset})
    config = TrainConfig(
        task=name,
        task_options={"preset": preset},
        sync="single",
        workers=1,
        steps=steps,
        batch_size=2,
        optimizer="adamw",
        lr=1e-2,
        weight_decay=1e-4,
        schedule="cosine",
        warmup_steps=20,
        final_lr_ratio=0.05,
        seed=0,
        checkpoint_every=0,
        threads=threads,
        device=device,
        progress=False,
    ).validate()
    result = train(task, samples["train"], config, eval_samples=samples["heldout"])
    model = task.build_model()
    model.load_state_dict(result.state_dict())
    model.to(device)
    inputs = tuple(t.to(device) for t in task.example_inputs(samples["heldout"]))
    with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
        exported = export_model(
            model, inputs, Path(tmp) / "model", {"task": task.name}, warmup=10, runs=100
        )
    latency = exported.metadata["latency_ms"]
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return {
        "task": name,
        "preset": preset,
        "device": device,
        "device_name": name,
        "threads": torch.get_num_threads(),
        "steps": result.steps,
        "seconds": result.seconds,
        "samples_per_second": result.samples_per_second,
        "losses": list(result.losses),
        "miou": result.metrics["miou"],
        "accuracy": result.metrics["accuracy"],
        "latency_ms": latency,
        "parameters": exported.metadata["model"]["parameters"],
    }


def allreduce_config(preset: str, steps: int, workers: int, root: Path, device: str) -> Any:
    """The ``allreduce`` round's training settings: ``workers`` trainers of 2 samples each,
    checkpoints every 50 steps to a ``local://`` store under ``root``."""
    from adcloud.train.config import TrainConfig  # noqa: PLC0415

    return TrainConfig(
        task="lidar_seg",
        task_options={"preset": preset},
        sync="allreduce",
        workers=workers,
        steps=steps,
        batch_size=2,
        optimizer="adamw",
        lr=1e-2,
        weight_decay=1e-4,
        schedule="cosine",
        warmup_steps=20,
        final_lr_ratio=0.05,
        seed=0,
        checkpoint_every=50,
        store="local:///bench-train-gpu",
        store_options=(f"root={root / 'store'}",),
        threads=1,
        device=device,
        progress=False,
        out=str(root / "out" / "{run}"),
    ).validate()


def worker(args: argparse.Namespace) -> int:
    """One ``torchrun`` trainer of the ``allreduce`` round (started by :func:`allreduce`)."""
    import logging  # noqa: PLC0415
    import os  # noqa: PLC0415

    from adcloud.train.job import run_torchrun  # noqa: PLC0415
    from adcloud.train.task import get_task  # noqa: PLC0415

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("adcloud.train.sync").setLevel(logging.INFO)
    world = int(os.environ["WORLD_SIZE"])
    config = allreduce_config(args.preset, args.steps, world, args.root, args.device)
    config = config.replace(run=f"torchrun-{world}")
    task = get_task("lidar_seg", {"preset": args.preset})
    run_torchrun(config, task=task, samples=load(args.samples, "lidar_seg")["train"])
    return 0


def torchrun_once(args: argparse.Namespace, world: int, device: str, root: Path) -> dict[str, Any]:
    """One ``torchrun`` job of ``world`` trainers on ``device``: rank 0's result, the wall
    time and which process group each rank joined (or ``error``: the job's last lines)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), __file__, "worker", "--samples", str(args.samples),
        "--preset", args.preset, "--steps", str(args.steps), "--root", str(root / device),
        "--device", device,
    ]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(
        command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    logs = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}\n" + "\n".join(logs[-40:])}
    out = root / device / "out" / f"torchrun-{world}" / "result.json"
    return {
        "result": json.loads(out.read_text()),
        "wall": time.perf_counter() - began,
        "groups": sorted(line.split(": ", 1)[-1] for line in logs if "joined the" in line),
    }


def curve_gap(a: Sequence[float], b: Sequence[float]) -> str:
    """How far two loss curves are apart, step by step."""
    gaps = sorted(abs(x - y) for x, y in zip(a, b, strict=True))
    return f"median {gaps[len(gaps) // 2]:.4f}, largest {gaps[-1]:.4f}"


def allreduce(args: argparse.Namespace) -> int:
    """``sync=allreduce`` under torchrun on one GPU: 1 trainer (NCCL) against the same
    training in one process, and 2 trainers sharing the GPU (gloo on CUDA tensors) against
    the same 2 trainers on the CPU -- the same batches, so the curves must agree up to the
    order of float additions."""
    import torch  # noqa: PLC0415

    from adcloud.train.loop import train  # noqa: PLC0415
    from adcloud.train.task import get_task  # noqa: PLC0415

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", flush=True)
        return 1
    samples = load(args.samples, "lidar_seg")["train"]
    task = get_task("lidar_seg", {"preset": args.preset})
    runs = list(dict.fromkeys([(1, args.device), (2, args.device), (2, "cpu")]))
    with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
        root = Path(tmp)
        config = allreduce_config(args.preset, args.steps, 1, root / "single", args.device)
        single = train(task, samples, config.replace(sync="single", checkpoint_every=0))
        print(
            f"single process on {args.device}: {single.samples_per_second:.1f} samples/s, "
            f"final loss {single.losses[-1]:.4f}",
            flush=True,
        )
        done: dict[tuple[int, str], dict[str, Any]] = {}
        for world, device in runs:
            job = done[world, device] = torchrun_once(args, world, device, root)
            if "error" in job:
                print(f"torchrun, {world} trainer(s) on {device}: FAILED {job['error']}")
                continue
            result = job["result"]
            print(
                f"torchrun, {world} trainer(s) on {device}: {result['samples_per_second']:.1f} "
                f"samples/s (whole job {job['wall']:.1f} s), final loss "
                f"{result['losses'][-1]:.4f}; " + "; ".join(job["groups"]),
                flush=True,
            )
    failed = sum("error" in job for job in done.values())
    one, two, cpu = (done.get(key, {}).get("result") for key in runs)
    if one:
        gap = curve_gap(one["losses"], single.losses)
        print(f"1 trainer vs one process, same device: loss curves {gap}")
    if two and cpu:
        gap = curve_gap(two["losses"], cpu["losses"])
        print(f"2 trainers, {args.device} vs cpu, same batches: loss curves {gap}")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    print(
        f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
        + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")
        + f"; {args.steps} steps of 2 samples",
        flush=True,
    )
    devices = [d for d in args.devices.split(",") if d]
    if "cuda" in devices and not torch.cuda.is_available():
        print("no CUDA device: the GPU figures are not taken", flush=True)
        devices.remove("cuda")
    rows: list[dict[str, Any]] = []
    for runs in args.runs.split(","):
        name, _, preset = runs.partition(":")
        samples = load(args.samples, name)
        print(
            f"{name}: {len(samples['train'])} training samples, {len(samples['heldout'])} held out",
            flush=True,
        )
        by_device: dict[str, dict[str, Any]] = {}
        for device in devices:
            began = time.perf_counter()
            row = train_once(name, preset or "small", device, samples, args.steps, args.threads)
            row["wall_seconds"] = time.perf_counter() - began
            by_device[device] = row
            rows.append(row)
            lat = row["latency_ms"]
            print(
                f"{runs:<16} {device:<5} {row['device_name'][:32]:<32} "
                f"{row['samples_per_second']:8.1f} samples/s  training {row['seconds']:6.1f} s  "
                f"final loss {row['losses'][-1]:.4f}  held-out mIoU {row['miou']:.3f}  "
                f"latency p50/p99 {lat['p50']:.2f}/{lat['p99']:.2f} ms",
                flush=True,
            )
        if {"cuda", "cpu"} <= by_device.keys():
            gpu, cpu = by_device["cuda"], by_device["cpu"]
            gaps = sorted(abs(a - b) for a, b in zip(gpu["losses"], cpu["losses"], strict=True))
            speed = gpu["samples_per_second"] / cpu["samples_per_second"]
            print(
                f"{runs}: GPU/CPU training throughput {speed:.1f}x, inference p50 "
                f"{cpu['latency_ms']['p50'] / gpu['latency_ms']['p50']:.1f}x; loss curves "
                f"differ by {gaps[len(gaps) // 2]:.4f} (median) / {gaps[-1]:.4f} (largest) per "
                f"step; held-out mIoU {gpu['miou']:.3f} (GPU) vs {cpu['miou']:.3f} (CPU)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("prepare", help="synthesize the drives and write their samples")
    make.add_argument("--out", type=Path, required=True, help="the .npz to write")
    bench = commands.add_parser("run", help="train on each device and compare")
    bench.add_argument("--samples", type=Path, required=True, help="the .npz of `prepare`")
    bench.add_argument("--steps", type=int, default=300, help="training steps (300)")
    bench.add_argument(
        "--runs",
        default="lidar_seg:small,lidar_seg:full,camera_seg:small,camera_seg:full",
        help="TASK:PRESET pairs to train (default: both presets of both tasks)",
    )
    bench.add_argument("--devices", default="cuda,cpu", help="devices to compare (cuda,cpu)")
    bench.add_argument(
        "--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)"
    )
    bench.add_argument("--json", type=Path, help="also write every run's figures here")
    ring = commands.add_parser(
        "allreduce", help="allreduce under torchrun on the GPU against one process"
    )
    ring.add_argument("--samples", type=Path, required=True, help="the .npz of `prepare`")
    ring.add_argument("--steps", type=int, default=100, help="training steps (100)")
    ring.add_argument("--preset", default="small", help="lidar_seg preset (small)")
    ring.add_argument("--device", default="cuda", help="cuda (cpu: to try it without a GPU)")
    one = commands.add_parser("worker", help="one torchrun trainer of `allreduce` (internal)")
    one.add_argument("--samples", type=Path, required=True)
    one.add_argument("--steps", type=int, required=True)
    one.add_argument("--preset", required=True)
    one.add_argument("--root", type=Path, required=True)
    one.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.command == "allreduce":
        return allreduce(args)
    if args.command == "worker":
        return worker(args)
    if args.command == "prepare":
        prepare(args.out)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
