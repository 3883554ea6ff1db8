"""How data-parallel trainers agree on the parameters after every step.

A :class:`Synchronizer` turns each trainer's local gradient into the same new parameters on
every trainer.  :func:`~adcloud.train.loop.train` calls :meth:`~Synchronizer.start` once
(everyone starts from rank 0's parameters), :meth:`~Synchronizer.step` after every
``backward()`` and :meth:`~Synchronizer.close` at the end.

- :class:`SingleProcess` -- one trainer: ``optimizer.step()``.
- :class:`ParameterStoreSync` -- the parameter server of the paper, on an
  :mod:`adcloud.store` store (``local://`` MEM tier, ``alluxio://``).  Step ``k``:

  1. every trainer ``r > 0`` pushes its gradient to ``/<run>/v<k>/grad-<r>``;
  2. rank 0 -- the server role -- waits for all of them, averages them in rank order with its
     own gradient (which never leaves its memory), applies **its** optimizer (the optimizer
     state lives on the server only; the other trainers' optimizers never step) and
     publishes the parameters and buffers as version ``k+1`` at ``/<run>/params/v<k+1>``,
     then the pointer ``/<run>/params/latest`` (JSON: version, key, size, CRC-32), last;
  3. every other trainer reads exactly ``/<run>/params/v<k+1>`` before its next step.

  Every file is an :mod:`adcloud.train.tensors` file whose metadata names the run, the
  *session* (one token per attempt of the job, so files left by a killed attempt are never
  mistaken for current ones), the version and the rank.  A file of another session is waited
  past; a file whose header names another version, or that fails its checksum, raises
  :class:`~adcloud.train.errors.StaleParametersError`; so does waiting longer than
  ``timeout_s``, or waiting for a trainer whose process on the same host has died (every
  trainer's host and pid come from the barrier stage's ``allGather``).  The server deletes
  consumed gradients and keeps the newest ``keep_versions`` parameter versions.
- :class:`AllReduceSync` -- ``torch.distributed`` all-reduce (gloo on CPU, NCCL on CUDA):
  every trainer averages the gradients with one all-reduce of a flat buffer and applies its
  own replica of the optimizer, which stays identical because its inputs are.  The process
  group comes from a Spark barrier task (:meth:`AllReduceSync.from_barrier`: rank 0 picks the
  address, ``BarrierTaskContext.allGather`` shares it) or from ``torchrun``'s environment
  (:meth:`AllReduceSync.from_env`).

In both distributed modes buffers (e.g. batch-norm statistics) follow rank 0 after every
step, as ``DistributedDataParallel`` does.  Each trainer's returned loss is the mean of the
trainers' losses: with equal per-trainer batches, the loss of the global batch.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from adcloud._crc import crc32
from adcloud.store import Store, StoreError, StoreNotFoundError, WriteType
from adcloud.train.errors import StaleParametersError, TrainError
from adcloud.train.tensors import TensorFormatError, decode_tensors, encode_tensors

if TYPE_CHECKING:
    from pyspark import BarrierTaskContext

__all__ = [
    "AllReduceSync",
    "BarrierInfo",
    "ParameterStoreSync",
    "SingleProcess",
    "Synchronizer",
    "barrier_session",
    "free_port",
    "gradient_names",
]

log = logging.getLogger(__name__)

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.005
_LIVENESS_S = 0.5


@runtime_checkable
class Synchronizer(Protocol):
    """One trainer's side of the per-step agreement on parameters."""

    @property
    def mode(self) -> str:
        """``single``, ``ps`` or ``allreduce``."""
        ...

    @property
    def rank(self) -> int:
        """This trainer's rank in ``[0, world)``."""
        ...

    @property
    def world(self) -> int:
        """The number of trainers."""
        ...

    @property
    def owns_optimizer(self) -> bool:
        """Whether this trainer's optimizer state is the one to checkpoint."""
        ...

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Make every trainer hold rank 0's parameters before step ``step``."""
        ...

    def step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, loss: float
    ) -> float:
        """Apply one step from this trainer's gradients (already in ``.grad``).

        Returns the mean of all trainers' ``loss`` at this step.
        """
        ...

    def close(self) -> None:
        """Release what the synchronizer holds (process groups, finished versions)."""
        ...

    def stats(self) -> dict[str, float]:
        """Seconds spent synchronizing, bytes sent and received, so far."""
        ...


def gradient_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s trainable parameters, in a fixed order."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class SingleProcess:
    """One trainer: the optimizer steps on the local gradient."""

    mode = "single"
    rank = 0
    world = 1
    owns_optimizer = True

    def __init__(self) -> None:
        self._seconds = 0.0

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Nothing to agree on."""

    def step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, loss: float
    ) -> float:
        """``optimizer.step()``; returns ``loss``."""
        tick = time.perf_counter()
        optimizer.step()
        self._seconds += time.perf_counter() - tick
        return loss

    def close(self) -> None:
        """Nothing to release."""

    def stats(self) -> dict[str, float]:
        """Seconds in ``optimizer.step``."""
        return {"sync_seconds": self._seconds, "bytes_sent": 0.0, "bytes_received": 0.0}


# -- parameter server on the store --------------------------------------------------------


def _wait(
    poll: Callable[[], Any],
    deadline: float,
    fail: Callable[[list[int]], StaleParametersError],
    dead: Callable[[], list[int]],
) -> Any:
    """Call ``poll`` until it returns something other than None, backing off.

    Raises ``fail(dead_ranks)`` as soon as ``dead()`` names a trainer that died, and
    ``fail([])`` at the deadline.
    """
    pause = _POLL_MIN_S
    next_check = time.monotonic() + _LIVENESS_S
    while True:
        found = poll()
        if found is not None:
            return found
        now = time.monotonic()
        if now >= next_check:
            gone = dead()
            if gone:
                raise fail(gone)
            next_check = now + _LIVENESS_S
        if now > deadline:
            raise fail([])
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ParameterStoreSync:
    """The parameter server on a store (see the module docstring for the protocol).

    ``store`` must be shared by all trainers (``local://`` on one machine, ``alluxio://``
    across machines); ``run`` is the run's directory in it; ``session`` one token per
    attempt, the same on every trainer of that attempt (:func:`barrier_session`).
    ``peers`` maps ranks to ``(hostname, pid)``: a trainer waiting for a peer that ran on its
    own host and whose process is gone fails at once instead of at ``timeout_s``.
    """

    mode = "ps"

    def __init__(
        self,
        store: Store,
        run: str,
        rank: int,
        world: int,
        *,
        session: str,
        timeout_s: float = 120.0,
        keep_versions: int = 2,
        peers: Mapping[int, tuple[str, int]] | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise TrainError(f"rank {rank} is not in [0, {world})")
        if keep_versions < 2:
            raise TrainError("keep_versions must be >= 2: a trainer may still read the older one")
        if not session:
            raise TrainError("a parameter-server session token must not be empty")
        self.store = store
        self.run = run.strip("/")
        self._rank = rank
        self._world = world
        self.session = session
        self.timeout_s = timeout_s
        self.keep_versions = keep_versions
        self._seconds = 0.0
        self._sent = 0
        self._received = 0
        self._published: list[int] = []
        self._peers = dict(peers or {})
        self._host = socket.gethostname()
        hosts = sorted({host for host, _ in self._peers.values()} | {self._host})
        if len(hosts) > 1 and store.uri.startswith("local://"):
            # each host has its own local store: the trainers would wait for each other's
            # parameters until sync_timeout_s, then blame a stuck parameter server
            raise TrainError(
                f"sync=ps: the trainers run on {len(hosts)} hosts ({', '.join(hosts[:4])}), "
                f"but {store.uri} is a local:// store, which each machine has for itself. "
                "Give train.store a store every host reaches: alluxio://HOST:39999/... (an "
                "Alluxio proxy, or `adcloud store serve` on one machine), or use "
                "sync=allreduce"
            )

    def _dead(self, ranks: Iterable[int]) -> list[int]:
        """Which of ``ranks`` run on this host in a process that no longer exists."""
        return [
            r
            for r in ranks
            if r in self._peers
            and self._peers[r][0] == self._host
            and not _pid_alive(self._peers[r][1])
        ]

    @property
    def rank(self) -> int:
        """This trainer's rank."""
        return self._rank

    @property
    def world(self) -> int:
        """The number of trainers."""
        return self._world

    @property
    def owns_optimizer(self) -> bool:
        """Only the server (rank 0) steps its optimizer."""
        return self._rank == 0

    # -- keys --------------------------------------------------------------------------

    def grad_key(self, version: int, rank: int) -> str:
        """Where trainer ``rank`` pushes its gradient for step ``version``."""
        return f"/{self.run}/v{version}/grad-{rank}"

    def params_key(self, version: int) -> str:
        """Where parameter version ``version`` is published."""
        return f"/{self.run}/params/v{version}"

    @property
    def latest_key(self) -> str:
        """The pointer to the newest published version (written after the version itself)."""
        return f"/{self.run}/params/latest"

    def latest(self) -> dict[str, Any] | None:
        """The newest published version's pointer record, or None when there is none."""
        try:
            record: Any = json.loads(self.store.get(self.latest_key))
        except (StoreNotFoundError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    # -- the protocol ------------------------------------------------------------------

    def _meta(self, kind: str, version: int, **extra: Any) -> dict[str, Any]:
        return {
            "kind": kind,
            "run": self.run,
            "session": self.session,
            "version": version,
            "rank": self._rank,
            **extra,
        }

    def _read(self, key: str, kind: str, version: int) -> tuple[dict[str, torch.Tensor], Any]:
        """The tensors and metadata at ``key`` if it is this session's ``version``, else None.

        None means "not there yet" (missing, or left by another attempt); a file of this
        session with another version or a corrupt file raises.
        """
        try:
            data = self.store.get(key)
        except StoreNotFoundError:
            return {}, None
        except StoreError as err:
            raise StaleParametersError(
                f"run {self.run}: rank {self._rank} cannot read {kind} version {version} at "
                f"{self.store.uri}{key}: {err}"
            ) from err
        try:
            stored = decode_tensors(data, source=f"{self.store.uri}{key}")
        except TensorFormatError as err:
            raise StaleParametersError(
                f"run {self.run}: rank {self._rank}: {kind} version {version} is unusable "
                f"(byte {err.offset}): {err}; it is never used for training -- restart the run "
                "(it resumes from its last checkpoint)"
            ) from err
        meta = stored.metadata
        if meta.get("session") != self.session or meta.get("run") != self.run:
            return {}, None
        if meta.get("kind") != kind or meta.get("version") != version:
            raise StaleParametersError(
                f"run {self.run}: rank {self._rank} expected {kind} version {version} at "
                f"{self.store.uri}{key} but its header says {meta.get('kind')} version "
                f"{meta.get('version')}; stale parameters are never used"
            )
        self._received += len(data)
        return stored.tensors, meta

    def _publish(self, model: nn.Module, version: int, loss: float | None) -> None:
        state = dict(model.state_dict().items())
        data = encode_tensors(state, self._meta("params", version, loss=loss))
        key = self.params_key(version)
        self.store.put(key, data, write_type=WriteType.MUST_CACHE)
        pointer = {
            "run": self.run,
            "session": self.session,
            "version": version,
            "key": key,
            "size": len(data),
            "crc32": crc32(data),
        }
        self.store.put(self.latest_key, json.dumps(pointer).encode(), write_type="MUST_CACHE")
        self._sent += len(data)
        self._published.append(version)
        while len(self._published) > self.keep_versions:
            self._delete(self.params_key(self._published.pop(0)))

    def _delete(self, key: str) -> None:
        with contextlib.suppress(StoreNotFoundError):
            self.store.delete(key, recursive=True)

    def _load(self, model: nn.Module, version: int) -> float:
        key = self.params_key(version)
        deadline = time.monotonic() + self.timeout_s

        def poll() -> tuple[dict[str, torch.Tensor], Any] | None:
            tensors, meta = self._read(key, "params", version)
            return None if meta is None else (tensors, meta)

        def fail(dead: list[int]) -> StaleParametersError:
            if dead:
                return StaleParametersError(
                    f"run {self.run}: rank {self._rank} was waiting for parameter version "
                    f"{version} at {self.store.uri}{key}, but the parameter server (rank 0, "
                    f"pid {self._peers[0][1]}) died; the run resumes from its last checkpoint "
                    "when it is restarted"
                )
            latest = self.latest()
            seen = (
                f"the latest published is version {latest.get('version')} of session "
                f"{latest.get('session')}"
                if latest
                else "no version is published"
            )
            return StaleParametersError(
                f"run {self.run}: rank {self._rank} waited {self.timeout_s:.0f} s for "
                f"parameter version {version} (session {self.session}) at "
                f"{self.store.uri}{key}; {seen}. The parameter server (rank 0) died or is "
                "stuck: read its log, or raise train.sync_timeout_s"
            )

        tensors, meta = _wait(poll, deadline, fail, lambda: self._dead([0]))
        state = model.state_dict()
        missing = sorted(set(state) - set(tensors))
        if missing:
            raise StaleParametersError(
                f"run {self.run}: parameter version {version} at {self.store.uri}{key} lacks "
                f"{', '.join(missing[:5])}: it was published for another model"
            )
        wrong = [
            f"{name} {tuple(tensors[name].shape)} for {tuple(target.shape)}"
            for name, target in state.items()
            if tuple(tensors[name].shape) != tuple(target.shape)
        ]
        if wrong:
            raise StaleParametersError(
                f"run {self.run}: parameter version {version} at {self.store.uri}{key} has "
                f"other shapes ({', '.join(wrong[:3])}): it was published for another model"
            )
        with torch.no_grad():
            for name, target in state.items():
                target.copy_(tensors[name])
        loss = meta.get("loss")
        return float("nan") if loss is None else float(loss)

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Rank 0 publishes its parameters as version ``step``; the others load them."""
        tick = time.perf_counter()
        if self._rank == 0:
            self._publish(model, step, None)
        else:
            self._load(model, step)
        self._seconds += time.perf_counter() - tick

    def step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, loss: float
    ) -> float:
        """Push this trainer's gradient for version ``step``; return after loading ``step+1``."""
        tick = time.perf_counter()
        params = _trainable(model)
        try:
            if self._rank == 0:
                return self._serve(model, optimizer, params, step, loss)
            grads = {name: p.grad for name, p in params if p.grad is not None}
            none = [name for name, p in params if p.grad is None]
            data = encode_tensors(grads, self._meta("grad", step, loss=loss, none=none))
            self.store.put(self.grad_key(step, self._rank), data, write_type="MUST_CACHE")
            self._sent += len(data)
            return self._load(model, step + 1)
        finally:
            self._seconds += time.perf_counter() - tick

    def _serve(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Sequence[tuple[str, nn.Parameter]],
        step: int,
        loss: float,
    ) -> float:
        deadline = time.monotonic() + self.timeout_s
        pending = set(range(1, self._world))
        received: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}

        def poll() -> bool | None:
            for rank in sorted(pending):
                tensors, meta = self._read(self.grad_key(step, rank), "grad", step)
                if meta is not None:
                    received[rank] = (tensors, meta)
                    pending.discard(rank)
            return True if not pending else None

        def fail(dead: list[int]) -> StaleParametersError:
            keys = ", ".join(self.grad_key(step, r) for r in sorted(pending))
            if dead:
                return StaleParametersError(
                    f"run {self.run}: the parameter server (rank 0) was waiting for the "
                    f"gradients of version {step} ({keys}), but trainer rank(s) {dead} died; "
                    "the run resumes from its last checkpoint when it is restarted"
                )
            return StaleParametersError(
                f"run {self.run}: the parameter server (rank 0) waited {self.timeout_s:.0f} s "
                f"for the gradients of version {step} from rank(s) {sorted(pending)} "
                f"(session {self.session}) at {self.store.uri}: {keys}. Those trainers died "
                "or are stuck: read their logs, or raise train.sync_timeout_s"
            )

        _wait(poll, deadline, fail, lambda: self._dead(sorted(pending)))
        losses = [loss]
        # Sum in rank order, so the result does not depend on arrival order.
        for rank in range(1, self._world):
            tensors, meta = received[rank]
            losses.append(float(meta.get("loss", float("nan"))))
            for name, param in params:
                grad = tensors.get(name)
                if grad is None:
                    continue
                grad = grad.to(param.device)
                if param.grad is None:
                    param.grad = grad.clone()
                else:
                    param.grad.add_(grad)
        with torch.no_grad():
            for _, param in params:
                if param.grad is not None:
                    param.grad.div_(self._world)
        optimizer.step()
        mean_loss = float(sum(losses) / len(losses))
        self._publish(model, step + 1, mean_loss)
        self._delete(f"/{self.run}/v{step}")
        return mean_loss

    def close(self) -> None:
        """Rank 0 removes gradients and versions left behind (also by earlier attempts);
        the versions it published last and the pointer stay."""
        if self._rank != 0:
            return
        keep = {self.params_key(v) for v in self._published}
        for directory in (f"/{self.run}", f"/{self.run}/params"):
            try:
                entries = self.store.list(directory)
            except StoreNotFoundError:
                continue
            for entry in entries:
                versioned = entry.name.startswith("v") and entry.name[1:].isdigit()
                if versioned and entry.path not in keep:
                    self._delete(entry.path)

    def stats(self) -> dict[str, float]:
        """Seconds in :meth:`start`/:meth:`step` (waiting included), bytes put and got."""
        return {
            "sync_seconds": self._seconds,
            "bytes_sent": float(self._sent),
            "bytes_received": float(self._received),
        }


# -- all-reduce ---------------------------------------------------------------------------


def free_port(host: str = "") -> int:
    """A TCP port that is free on this machine now (for a process-group master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class BarrierInfo:
    """What the tasks of one Spark barrier stage agreed on.

    ``session``: a fresh token drawn by rank 0 (one per attempt of the stage); ``master``:
    ``host:port`` of a free port on rank 0's host (empty unless asked for); ``peers``: every
    rank's ``(hostname, pid)``.
    """

    session: str
    master: str
    peers: dict[int, tuple[str, int]]


def barrier_session(context: BarrierTaskContext, *, with_master: bool) -> BarrierInfo:
    """Agree on a session token, every task's process (and a master) in a barrier stage.

    Rank 0 (``partitionId() == 0``) draws the token and, ``with_master``, a free port on its
    executor's host; one ``allGather`` hands them and every task's host and pid to all.
    """
    message: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    if context.partitionId() == 0:
        master = ""
        if with_master:
            host = context.getTaskInfos()[0].address.rsplit(":", 1)[0] or "127.0.0.1"
            if host in ("localhost", ""):
                host = "127.0.0.1"
            master = f"{host}:{free_port()}"
        message.update(session=uuid.uuid4().hex, master=master)
    replies = [json.loads(text) for text in context.allGather(json.dumps(message))]
    peers = {rank: (str(r["host"]), int(r["pid"])) for rank, r in enumerate(replies)}
    return BarrierInfo(str(replies[0]["session"]), str(replies[0]["master"]), peers)


#: Keys of the board in the process group's store: ``<key><rank>`` holds the JSON of
#: ``[collectives entered, the last one, "host, pid"]``.
_BOARD_KEY = "adcloud/entered/"
#: Seconds a rank whose collective failed waits to read the others' notes.
_BOARD_READ_S = 5.0


def _default_store(dist: Any) -> Any:
    """The default process group's key-value store (None where torch does not offer it)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def _groups(tensors: Sequence[torch.Tensor]) -> Iterator[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), so each group flattens into one
    buffer."""
    seen: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        seen.setdefault((tensor.dtype, tensor.device), []).append(index)
    yield from seen.values()


class AllReduceSync:
    """``torch.distributed`` all-reduce of the gradients; optimizer replicated on every rank.

    Build it with :meth:`from_barrier` (Spark), :meth:`from_env` (torchrun) or directly on an
    initialised default process group.  :meth:`close` destroys the group it created.

    A collective that gets no answer within ``timeout_s`` (the process group's timeout,
    ``train.sync_timeout_s``: a peer that hangs, or one far slower than the rest) raises
    :class:`~adcloud.train.errors.TrainError` naming the rank, host and pid that stopped
    answering and the collective it last entered, where gloo says only "Timed out
    waiting"; inside a Spark barrier stage that fails the stage, which Spark retries from
    the last checkpoint.  (NCCL's watchdog ends the process at the same timeout instead.)
    """

    mode = "allreduce"
    owns_optimizer = True

    def __init__(self, *, owns_group: bool = False, timeout_s: float | None = None) -> None:
        import torch.distributed as dist  # noqa: PLC0415 - only this mode needs it

        if not dist.is_available() or not dist.is_initialized():
            raise TrainError(
                "AllReduceSync needs an initialised torch.distributed process group: use "
                "AllReduceSync.from_barrier (Spark) or AllReduceSync.from_env (torchrun)"
            )
        self._dist = dist
        self._rank = dist.get_rank()
        self._world = dist.get_world_size()
        self._owns_group = owns_group
        self._seconds = 0.0
        self._bytes = 0
        self._timeout_s = timeout_s
        # the process group's own key-value store (served by rank 0's process from a thread
        # of its own, so it answers while rank 0's Python code hangs): every rank notes there
        # which collective it last entered, so that a rank whose collective times out can
        # name the rank that never came (gloo says only "Timed out waiting ... for recv")
        self._board: Any = _default_store(dist)
        self._entered = 0
        self._where = f"{socket.gethostname()}, pid {os.getpid()}"

    @property
    def rank(self) -> int:
        """This trainer's rank in the process group."""
        return self._rank

    @property
    def world(self) -> int:
        """The process group's size."""
        return self._world

    @classmethod
    def init(
        cls,
        *,
        init_method: str,
        rank: int,
        world: int,
        backend: str = "auto",
        device: torch.device | None = None,
        timeout_s: float = 120.0,
    ) -> AllReduceSync:
        """Initialise the default process group and return a synchronizer that owns it.

        ``backend``: ``auto`` (NCCL for a CUDA ``device``, else gloo), ``gloo`` or ``nccl``.
        """
        import torch.distributed as dist  # noqa: PLC0415

        chosen = _backend(backend, device or torch.device("cpu"))
        if chosen == "nccl" and device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(
                chosen,
                init_method=init_method,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, ValueError) as err:
            raise TrainError(
                f"rank {rank} of {world}: cannot join the {chosen} process group at "
                f"{init_method}: {err}; check that the trainers can reach each other on that "
                "address (firewall, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
            ) from err
        log.info(
            "rank %d of %d: joined the %s process group at %s", rank, world, chosen, init_method
        )
        return cls(owns_group=True, timeout_s=timeout_s)

    @classmethod
    def from_barrier(
        cls,
        context: BarrierTaskContext,
        *,
        backend: str = "auto",
        device: torch.device | None = None,
        timeout_s: float = 120.0,
    ) -> AllReduceSync:
        """The process group of a Spark barrier stage: rank = partition id, world = tasks."""
        info = barrier_session(context, with_master=True)
        return cls.init(
            init_method=f"tcp://{info.master}",
            rank=context.partitionId(),
            world=len(context.getTaskInfos()),
            backend=backend,
            device=device,
            timeout_s=timeout_s,
        )

    @classmethod
    def from_env(
        cls,
        *,
        backend: str = "auto",
        device: torch.device | None = None,
        timeout_s: float = 120.0,
    ) -> AllReduceSync:
        """The process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_*``)."""
        try:
            rank = int(os.environ["RANK"])
            world = int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError) as err:
            raise TrainError(
                "RANK and WORLD_SIZE are not set: run under torchrun "
                "(torchrun --nproc-per-node N ...)"
            ) from err
        return cls.init(
            init_method="env://",
            rank=rank,
            world=world,
            backend=backend,
            device=device,
            timeout_s=timeout_s,
        )

    def _collective(self, what: str, run: Callable[[], Any]) -> Any:
        """``run()``, a collective called ``what`` in messages, noted on the board first; a
        collective that fails (no answer within the timeout, a peer's connection closed)
        raises :class:`TrainError` saying which rank stopped answering (:meth:`_stalled`)."""
        self._enter(what)
        try:
            return run()
        except RuntimeError as err:  # gloo's timeouts and closed connections (DistBackendError)
            raise self._stalled(what, err) from err

    def _enter(self, what: str) -> None:
        """Note on the board that this rank enters its next collective, ``what``."""
        self._entered += 1
        if self._board is None:
            return
        mark = json.dumps([self._entered, what, self._where])
        try:
            self._board.set(f"{_BOARD_KEY}{self._rank}", mark)
        except RuntimeError as err:  # the store is rank 0's: rank 0 does not answer either
            raise self._stalled(what, err) from err

    def _marks(self) -> dict[int, list[Any] | None]:
        """Every other rank's last note on the board (None: none, or the board is silent)."""
        out: dict[int, list[Any] | None] = {}
        with contextlib.suppress(RuntimeError):
            self._board.set_timeout(datetime.timedelta(seconds=_BOARD_READ_S))
        for rank in range(self._world):
            if rank == self._rank:
                continue
            try:
                found = json.loads(self._board.get(f"{_BOARD_KEY}{rank}"))
            except (RuntimeError, ValueError):
                found = None
            out[rank] = found if isinstance(found, list) and len(found) == 3 else None
        return out

    def _stalled(self, what: str, err: BaseException) -> TrainError:
        """The error of collective ``what``, failed with ``err``: which ranks never reached
        it (their last note on the board), and what to check."""
        text = str(err).strip()
        said = text.splitlines()[0] if text else type(err).__name__
        waited = "its timeout" if self._timeout_s is None else f"{self._timeout_s:g} s"
        head = (
            f"rank {self._rank} of {self._world} ({self._where}) got no answer in {what} "
            f"within train.sync_timeout_s={waited} ({said})"
        )
        check = (
            "It hangs (a stuck read, a deadlock, a lost GPU), died, or is far slower than the "
            "others: look at its executor's log and stack (py-spy dump --pid PID on its "
            "host); raise train.sync_timeout_s if its steps really take that long"
        )
        marks = self._marks() if self._board is not None else {}
        if not marks:
            return TrainError(f"{head}: another trainer stopped answering. {check}")
        behind = {r: m for r, m in marks.items() if m is None or int(m[0]) < self._entered}
        if not behind:
            return TrainError(
                f"{head}, though every rank reached it: the connection between the trainers "
                "broke; check the network between their hosts (firewall, GLOO_SOCKET_IFNAME "
                "/ NCCL_SOCKET_IFNAME)"
            )
        told = []
        for rank, mark in sorted(behind.items()):
            if mark is not None:
                told.append(f"rank {rank} ({mark[2]}), whose last collective was {mark[1]}")
            elif rank == 0:  # its process serves the board
                told.append("rank 0, whose process (it serves the trainers' store) is silent")
            else:
                told.append(f"rank {rank}, which never entered a collective")
        return TrainError(f"{head}: stopped answering: {'; '.join(told)}. {check}")

    def all_sum(self, values: NDArray[Any], what: str) -> NDArray[Any]:
        """The sum over all ranks of ``values`` (the same shape and dtype on every rank: the
        held-out counts of each trainer's share, say); ``what`` names it in messages."""
        array = np.ascontiguousarray(values)
        tensor = torch.from_numpy(array.copy())
        if self._dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
            tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        self._collective(what, lambda: self._dist.all_reduce(tensor))
        return np.asarray(tensor.cpu().numpy(), dtype=array.dtype)

    def _broadcast_state(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        for group in _groups(tensors):
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in group])
            self._collective(what, functools.partial(self._dist.broadcast, flat, src=0))
            self._bytes += flat.numel() * flat.element_size()
            offset = 0
            with torch.no_grad():
                for i in group:
                    n = tensors[i].numel()
                    tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                    offset += n

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Broadcast rank 0's parameters and buffers."""
        tick = time.perf_counter()
        self._broadcast_state(
            list(model.state_dict().values()),
            f"the broadcast of rank 0's parameters (before step {step + 1})",
        )
        self._seconds += time.perf_counter() - tick

    def step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, loss: float
    ) -> float:
        """All-reduce the gradients (and the loss), average, step the local optimizer."""
        tick = time.perf_counter()
        params = [p for _, p in _trainable(model)]
        if not params:
            raise TrainError("the model has no trainable parameters")
        device = params[0].device
        # One flat buffer per step: gradients, one "has a gradient" flag per parameter (a
        # parameter no rank touched keeps .grad None, as in one process) and the loss.  It is
        # float32 when the parameters are (flags and a loss are exact enough there), float64
        # for any other mix so nothing is reduced in a narrower type than its own.
        dtype = torch.float32 if all(p.dtype == torch.float32 for p in params) else torch.float64
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in params
        ]
        flags = [float(p.grad is not None) for p in params]
        extra = torch.tensor([*flags, loss], dtype=dtype, device=device)
        flat = torch.cat([*(t.to(dtype) for t in parts), extra])
        self._collective(f"the all-reduce of step {step + 1}", lambda: self._dist.all_reduce(flat))
        self._bytes += flat.numel() * flat.element_size()
        offset = 0
        for param in params:
            n = param.numel()
            chunk = flat[offset : offset + n]
            offset += n
            param.grad = (chunk / self._world).to(param.dtype).view_as(param).clone()
        flags_sum = flat[offset : offset + len(params)]
        for param, touched in zip(params, flags_sum.tolist(), strict=True):
            if touched == 0:
                param.grad = None
        mean_loss = float(flat[-1].item()) / self._world
        optimizer.step()
        buffers = list(model.buffers())
        if buffers:
            self._broadcast_state(buffers, f"the broadcast of rank 0's buffers (step {step + 1})")
        self._seconds += time.perf_counter() - tick
        return mean_loss

    def close(self) -> None:
        """Destroy the process group if this synchronizer created it."""
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()

    def stats(self) -> dict[str, float]:
        """Seconds in collectives and the optimizer step, bytes reduced or broadcast."""
        return {
            "sync_seconds": self._seconds,
            "bytes_sent": float(self._bytes),
            "bytes_received": float(self._bytes),
        }
