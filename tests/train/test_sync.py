"""Synchronizers: the parameter server on a real local store (trainers as threads sharing its
MEM tier) and torch.distributed all-reduce over a real gloo process group."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from adcloud.store import Store, open_store
from adcloud.train.errors import StaleParametersError, TrainError
from adcloud.train.sync import (
    AllReduceSync,
    ParameterStoreSync,
    SingleProcess,
    Synchronizer,
    free_port,
)
from adcloud.train.tensors import decode_tensors, encode_tensors

STEPS = 6


def _store(root: Path) -> Store:
    return open_store("local:///sync-tests", root=str(root))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return x, y


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _run(
    sync: Synchronizer, x: torch.Tensor, y: torch.Tensor, model: torch.nn.Module
) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sync.start(model, opt, 0)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(sync.step(model, opt, step, float(loss.detach())))
    return losses


def test_single_process_steps_the_optimizer() -> None:
    x, y = _data()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    losses = _run(SingleProcess(), x, y, model)
    assert losses[-1] < losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_parameter_server_matches_one_trainer_on_the_global_batch(tmp_path: Path) -> None:
    x, y = _data()
    reference = _model()
    expected = _run(SingleProcess(), x, y, reference)

    models = [_model(), _model()]
    # rank 1 starts from different weights: start() must hand it rank 0's
    with torch.no_grad():
        for p in models[1].parameters():
            p.add_(1.0)
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    syncs = [
        ParameterStoreSync(_store(tmp_path), "run-a", r, 2, session="s1", timeout_s=30)
        for r in range(2)
    ]

    def trainer(rank: int) -> None:
        try:
            results[rank] = _run(syncs[rank], x[rank::2], y[rank::2], models[rank])
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # every trainer holds exactly the same parameters: the published version
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    # the averaged half-batch gradients are the global-batch gradient
    for a, b in zip(models[0].parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert results[0] == results[1]
    assert results[0] == pytest.approx(expected, rel=1e-5)

    store = _store(tmp_path)
    pointer = json.loads(store.get("/run-a/params/latest"))
    assert pointer["version"] == STEPS
    assert pointer["session"] == "s1"
    published = decode_tensors(store.get(pointer["key"]))
    assert published.metadata["version"] == STEPS
    assert torch.equal(published.tensors["0.weight"], models[1].state_dict()["0.weight"])
    syncs[0].close()
    names = sorted(e.name for e in store.list("/run-a"))
    assert names == ["params"]  # consumed gradients are deleted behind
    kept = sorted(e.name for e in store.list("/run-a/params"))
    assert kept == ["latest", f"v{STEPS - 1}", f"v{STEPS}"]  # keep_versions=2
    stats = syncs[1].stats()
    assert stats["bytes_sent"] > 0 and stats["bytes_received"] > 0


def _params_file(model: torch.nn.Module, **meta: object) -> bytes:
    base = {"kind": "params", "run": "run-b", "session": "s2", "version": 1, "rank": 0}
    base.update(meta)
    return encode_tensors(dict(model.state_dict()), base)


def test_a_version_left_by_another_attempt_is_never_used(tmp_path: Path) -> None:
    store = _store(tmp_path)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(7.0)
    store.put("/run-b/params/v1", _params_file(other, session="old-attempt"))
    worker = ParameterStoreSync(store, "run-b", 1, 2, session="s2", timeout_s=0.3)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StaleParametersError) as info:
        worker.start(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    text = str(info.value)
    assert "run run-b" in text and "rank 1" in text and "version 1" in text
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_version_whose_header_disagrees_is_stale(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("/run-b/params/v1", _params_file(_model(), version=5))
    worker = ParameterStoreSync(store, "run-b", 1, 2, session="s2", timeout_s=5)
    model = _model()
    with pytest.raises(StaleParametersError, match="header says params version 5"):
        worker.start(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)


def test_a_version_of_another_model_is_refused_by_tensor(tmp_path: Path) -> None:
    store = _store(tmp_path)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    store.put("/run-b/params/v1", _params_file(wider))
    worker = ParameterStoreSync(store, "run-b", 1, 2, session="s2", timeout_s=5)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        StaleParametersError, match=r"0.weight \(16, 4\) for \(8, 4\).*another model"
    ):
        worker.start(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)  # nothing half-copied


def test_a_corrupt_version_is_refused_with_its_offset(tmp_path: Path) -> None:
    store = _store(tmp_path)
    data = bytearray(_params_file(_model()))
    data[-2] ^= 0xFF
    store.put("/run-b/params/v1", bytes(data))
    worker = ParameterStoreSync(store, "run-b", 1, 2, session="s2", timeout_s=5)
    model = _model()
    with pytest.raises(StaleParametersError, match=r"byte \d+.*corrupt"):
        worker.start(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)


def test_the_server_names_the_trainers_it_waited_for(tmp_path: Path) -> None:
    store = _store(tmp_path)
    server = ParameterStoreSync(store, "run-c", 0, 3, session="s3", timeout_s=0.3)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    server.start(model, opt, 0)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(StaleParametersError, match=r"rank\(s\) \[1, 2\]") as info:
        server.step(model, opt, 0, 1.0)
    assert "/run-c/v0/grad-1" in str(info.value)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_peer_on_this_host_fails_the_wait_at_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    host = socket.gethostname()
    dead = _dead_pid()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worker = ParameterStoreSync(
        store, "run-d", 1, 2, session="s4", timeout_s=60, peers={0: (host, dead), 1: (host, 1)}
    )
    tick = time.monotonic()
    with pytest.raises(
        StaleParametersError, match=rf"parameter server \(rank 0, pid {dead}\) died"
    ):
        worker.start(model, opt, 0)
    server = ParameterStoreSync(
        store, "run-d", 0, 2, session="s4", timeout_s=60, peers={0: (host, 1), 1: (host, dead)}
    )
    server.start(model, opt, 0)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(StaleParametersError, match=r"trainer rank\(s\) \[1\] died"):
        server.step(model, opt, 0, 1.0)
    assert time.monotonic() - tick < 10  # not the 60 s timeout
    # a peer on another host is not judged by pid: only the timeout applies there (through
    # a store both hosts reach; here, for the test, an fsspec store this host shares)
    shared = open_store(f"file://{tmp_path / 'shared'}")
    remote = ParameterStoreSync(
        shared, "run-d", 1, 2, session="s5", timeout_s=0.8, peers={0: ("elsewhere", dead)}
    )
    with pytest.raises(StaleParametersError, match="waited 1 s"):
        remote.start(model, opt, 0)


def test_a_local_store_is_refused_for_trainers_on_several_hosts(tmp_path: Path) -> None:
    """Each machine has its own local:// store: ps across hosts fails at once, saying what
    to use, instead of timing out with the blame on the parameter server."""
    store = _store(tmp_path)
    here = socket.gethostname()
    with pytest.raises(TrainError, match=r"2 hosts .*local:// store.*alluxio://"):
        ParameterStoreSync(store, "r", 1, 2, session="s", peers={0: ("elsewhere", 7)})
    # all on this host: fine
    ParameterStoreSync(store, "r", 1, 2, session="s", peers={0: (here, 7), 1: (here, 8)})


def test_parameter_server_arguments_are_checked(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with pytest.raises(TrainError, match="rank 2"):
        ParameterStoreSync(store, "r", 2, 2, session="s")
    with pytest.raises(TrainError, match="keep_versions"):
        ParameterStoreSync(store, "r", 0, 2, session="s", keep_versions=1)
    with pytest.raises(TrainError, match="session"):
        ParameterStoreSync(store, "r", 0, 2, session="")


class _Partial(torch.nn.Module):
    """A model with a parameter the loss never touches (its grad stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(2, 1)
        self.unused = torch.nn.Linear(2, 1)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.used(x)


def test_allreduce_on_a_real_gloo_group() -> None:
    with pytest.raises(TrainError, match="process group"):
        AllReduceSync()
    sync = AllReduceSync.init(
        init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world=1, backend="gloo"
    )
    try:
        assert (sync.rank, sync.world, sync.mode) == (0, 1, "allreduce")
        model = _Partial()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync.start(model, opt, 0)
        model(torch.ones(3, 2)).sum().backward()
        expected = model.used.weight.detach() - 0.1 * model.used.weight.grad
        unused = model.unused.weight.detach().clone()
        assert sync.step(model, opt, 0, 2.5) == pytest.approx(2.5)
        assert torch.allclose(model.used.weight, expected)
        assert model.unused.weight.grad is None  # no rank touched it: not stepped
        assert torch.equal(model.unused.weight, unused)
        assert sync.stats()["bytes_sent"] > 0
    finally:
        sync.close()
    assert not dist.is_initialized()


def test_allreduce_from_env_needs_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TrainError, match="torchrun"):
        AllReduceSync.from_env()


_HANGING_RANK = """
import sys, time, torch
from adcloud.train.sync import AllReduceSync
print("ready", flush=True)  # torch imported: rank 0 may start the group's store
sync = AllReduceSync.init(
    init_method=sys.argv[1], rank=1, world=2, backend="gloo", timeout_s=float(sys.argv[2])
)
torch.manual_seed(3)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sync.start(model, opt, 0)
model(torch.ones(2, 4)).sum().backward()
sync.step(model, opt, 0, 1.0)
print(sync.all_sum(__import__("numpy").array([1, 2], "int64"), "the counts"), flush=True)
time.sleep(600)  # hangs before the all-reduce of step 1: the peer must not wait for ever
"""


def test_a_hung_peer_fails_the_collective_naming_its_rank_host_and_pid() -> None:
    """Rank 1, a real process, hangs between two steps: rank 0's all-reduce fails after the
    group's timeout with an error that says which rank, on which host and pid, stopped
    answering and the last collective it entered (gloo says only "Timed out waiting")."""
    address = f"tcp://127.0.0.1:{free_port()}"
    child = subprocess.Popen(
        [sys.executable, "-c", _HANGING_RANK, address, "15"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        sync = AllReduceSync.init(
            # 15 s, not 5: on a loaded machine the first broadcast alone took longer
            init_method=address,
            rank=0,
            world=2,
            backend="gloo",
            timeout_s=15.0,
        )
        try:
            torch.manual_seed(3)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sync.start(model, opt, 0)
            model(torch.ones(2, 4)).sum().backward()
            sync.step(model, opt, 0, 3.0)
            summed = sync.all_sum(torch.tensor([10, 20]).numpy(), "the counts")
            assert summed.tolist() == [11, 22] and summed.dtype.name == "int64"
            model(torch.ones(2, 4)).sum().backward()
            with pytest.raises(TrainError) as failed:
                sync.step(model, opt, 1, 3.0)
        finally:
            sync.close()
    finally:
        child.kill()
        child.wait()
    said = str(failed.value)
    assert said.startswith(f"rank 0 of 2 ({socket.gethostname()}, pid "), said
    assert "got no answer in the all-reduce of step 2 within train.sync_timeout_s=15 s" in said
    assert (
        f"stopped answering: rank 1 ({socket.gethostname()}, pid {child.pid}), whose last "
        "collective was the counts" in said
    )
    assert "raise train.sync_timeout_s" in said
