"""``adcloud store ...``: the CLI registered by :func:`adcloud.store.command.add_parser`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from adcloud.store import LocalStore, ServerLimits, StoreError, StoreFullError
from adcloud.store.command import add_parser
from tests.store.conftest import worker_env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adcloud")
    add_parser(p.add_subparsers(dest="command", required=True))
    return p


def run(*argv: str) -> tuple[int, str]:
    args = parser().parse_args(list(argv))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    code = args.func(args, console)
    return code, console.file.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize("sub", ["", "ls", "cat", "put", "cp", "stat", "free", "persist", "serve"])
def test_help_everywhere(sub: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["store", *([sub] if sub else []), "--help"])
    assert info.value.code == 0
    assert "usage: adcloud store" in capsys.readouterr().out


def test_put_to_a_name_with_a_hash_leaves_other_files_alone(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    run("store", "put", str(first), "local:///d/a", "--write-type", "MUST_CACHE")
    code, out = run("store", "put", str(second), "local:///d/a#2?x", "--write-type", "MUST_CACHE")
    assert code == 0 and "local:///d/a#2?x" in out
    with LocalStore("local://") as store:
        assert store.get("/d/a") == b"first"
        assert store.get("/d/a#2?x") == b"second"


def test_put_and_cp_wait_only_for_their_own_persists(tmp_path: Path, store_root: Path) -> None:
    # another file's persist keeps failing (its under-store directory is a symlink out of
    # the under-store): put and cp used to wait for the whole store's journal and fail
    # after --wait-timeout although their own files were persisted
    (store_root / "ufs").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (store_root / "ufs" / "bad").symlink_to(tmp_path / "elsewhere")
    with LocalStore("local://", background=False) as store:
        store.put("/bad/f", b"stuck", write_type="ASYNC_THROUGH")
    src = tmp_path / "in.bin"
    src.write_bytes(b"mine")
    code, out = run("store", "put", str(src), "local:///ok/f", "--wait-timeout", "5")
    assert code == 0 and "PERSISTED" in out
    code, out = run("store", "cp", "-q", "local:///ok/f", "local:///ok/g", "--wait-timeout", "5")
    assert code == 0
    with LocalStore("local://", background=False) as store:
        assert store.stat("/ok/g").persisted and store.pending_persists() == 1
    with pytest.raises(StoreError, match=r"still not persisted after 0\.5 s: /bad/g"):
        run("store", "put", str(src), "local:///bad/g", "--wait-timeout", "0.5")


def test_put_ls_stat_free_persist(tmp_path: Path, store_root: Path) -> None:
    src = tmp_path / "params.bin"
    src.write_bytes(b"p" * 5000)
    code, out = run(
        "store", "put", str(src), "local:///models/m1/params.bin", "--write-type", "MUST_CACHE"
    )
    assert code == 0 and "stored 4.9 KiB" in out and "MEM" in out
    code, out = run("store", "put", str(src), "local:///models/m1/copy.bin", "--pin")
    assert code == 0 and "PERSISTED" in out  # ASYNC_THROUGH by default, waited for

    code, out = run("store", "ls", "local:///models", "-r")
    assert code == 0
    assert "/models/m1/params.bin" in out and "NOT_PERSISTED" in out
    assert "listed files per tier" in out and "MEM" in out

    code, out = run("store", "ls", "local:///models/m1", "--json")
    entries = json.loads(out)
    assert {e["path"] for e in entries} == {"/models/m1/params.bin", "/models/m1/copy.bin"}

    code, out = run("store", "stat", "local:///models/m1/copy.bin")
    assert code == 0
    for needle in (
        "copy.bin",
        "5,000 B",
        "MEM",
        "pinned",
        "yes",
        "crc32:",
        "tiers of local://",
        "capacity",
    ):
        assert needle in out

    code, out = run("store", "persist", "local:///models/m1/params.bin")
    assert code == 0 and "is in the under-store" in out
    code, out = run("store", "free", "local:///models/m1/params.bin")
    assert code == 0
    assert LocalStore("local://").stat("/models/m1/params.bin").tier is None
    with pytest.raises(StoreError, match="pinned"):
        run("store", "free", "local:///models/m1/copy.bin")
    # a directory: the hint names the command line's -r, not the Python keyword alone
    with pytest.raises(StoreError, match=r"free it with recursive=True \(-r on the command"):
        run("store", "free", "local:///models/m1")


def test_cat(tmp_path: Path, store_root: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    store = LocalStore("local://")
    store.put("/c/bytes", bytes(range(256)))
    store.close()
    out_file = tmp_path / "out.bin"
    assert run("store", "cat", "local:///c/bytes", "-o", str(out_file))[0] == 0
    assert out_file.read_bytes() == bytes(range(256))
    assert run("store", "cat", "local:///c/bytes")[0] == 0
    assert capsysbinary.readouterr().out == bytes(range(256))


def test_cat_into_a_file_that_breaks_off_keeps_the_earlier_file(
    tmp_path: Path, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that breaks off (the server dies, Ctrl-C) leaves ``-o FILE`` as it was."""
    store = LocalStore("local://")
    store.put("/c/big", bytes(3 << 20))
    store.close()
    out_file = tmp_path / "out.bin"
    out_file.write_bytes(b"precious")
    real = shutil.copyfileobj

    def breaks_off(src: Any, dst: Any, length: int = 0) -> None:
        dst.write(src.read(1 << 20))
        raise OSError("reading /c/big from the proxy broke off")

    monkeypatch.setattr(shutil, "copyfileobj", breaks_off)
    with pytest.raises(OSError, match="broke off"):
        run("store", "cat", "local:///c/big", "-o", str(out_file))
    assert out_file.read_bytes() == b"precious"
    assert not list(tmp_path.glob(".out.bin*"))  # no half file left beside it
    monkeypatch.setattr(shutil, "copyfileobj", real)
    assert run("store", "cat", "local:///c/big", "-o", str(out_file))[0] == 0
    assert out_file.read_bytes() == bytes(3 << 20)


def test_cp_within_a_store_and_between_stores(tmp_path: Path, store_root: Path) -> None:
    store = LocalStore("local://", background=False)
    tree = {"/v1/grid/0_0.tif": b"t" * 3000, "/v1/grid/1_0.tif": b"u" * 10, "/v1/m.json": b"{}"}
    for path, data in tree.items():
        store.put(path, data, write_type="MUST_CACHE")
    with pytest.raises(StoreError, match=r"local:///v1 is a directory; copy it with -r"):
        run("store", "cp", "local:///v1", "local:///v2")
    code, out = run("store", "cp", "-r", "-q", "local:///v1", "local:///v2")
    assert code == 0 and "copied 3 file(s), 2.9 KiB, from local:///v1 to local:///v2" in out
    for path, data in tree.items():
        copy = "/v2" + path[len("/v1") :]
        assert store.get(copy) == data
        assert store.stat(copy).checksum == store.stat(path).checksum
    # within the local store the copies share the cached objects
    shared = [p for p in store_root.rglob("objects/*/*") if p.stat().st_nlink == 2]
    assert len(shared) == 2 * len(tree)

    code, out = run("store", "cp", "local:///v1/grid/0_0.tif", f"file://{tmp_path}/one.tif")
    assert code == 0 and (tmp_path / "one.tif").read_bytes() == tree["/v1/grid/0_0.tif"]
    code, out = run("store", "cp", "-r", "-q", "local:///v1", f"file://{tmp_path}/backup")
    assert code == 0
    got = {p.relative_to(tmp_path / "backup").as_posix() for p in (tmp_path / "backup").rglob("*")}
    assert got == {"grid", "grid/0_0.tif", "grid/1_0.tif", "m.json"}
    store.close()


def test_ls_of_an_fsspec_store(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"12")
    code, out = run("store", "ls", f"file://{tmp_path}/d")
    assert code == 0 and "under-store" in out and "/f" in out


def test_serve_as_a_process(
    store_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("cli-token\n")
    code = (
        "import sys\n"
        "from adcloud.store.command import add_parser\n"
        "import argparse\n"
        "from rich.console import Console\n"
        "p = argparse.ArgumentParser(); add_parser(p.add_subparsers(dest='c'))\n"
        "a = p.parse_args(sys.argv[1:])\n"
        "sys.exit(a.func(a, Console()))\n"
    )
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "store",
            "serve",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )
    try:
        from adcloud.store import AlluxioStore, StoreUnavailableError  # noqa: PLC0415

        client = AlluxioStore(f"alluxio://127.0.0.1:{port}/", token="cli-token", timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.put("/served", b"over http")
                break
            except StoreUnavailableError:
                assert time.monotonic() < deadline, (
                    proc.stderr.read() if proc.poll() is not None else ""
                )
                time.sleep(0.1)
        assert client.get("/served") == b"over http"
        monkeypatch.setenv("ADCLOUD_STORE_TOKEN", "cli-token")
        code_, out = run("store", "ls", f"alluxio://127.0.0.1:{port}/")
        assert code_ == 0 and "/served" in out and "MEM" in out
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean shutdown
        stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert f"alluxio://127.0.0.1:{port}/" in stdout and "token required" in stdout


@pytest.mark.parametrize(
    ("option", "content"), [("--token-file", ""), ("--token-file", " \n"), ("--token", "")]
)
def test_serve_refuses_an_empty_token(
    option: str, content: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adcloud.store import StoreServer  # noqa: PLC0415

    def ctrl_c(self: StoreServer) -> None:
        raise KeyboardInterrupt  # a server that did start stops at once instead of blocking

    monkeypatch.setattr(StoreServer, "serve_forever", ctrl_c)
    value, named = content, "--token"
    if option == "--token-file":
        token_file = tmp_path / "token"
        token_file.write_text(content)
        value = named = str(token_file)
    with pytest.raises(StoreError, match=rf"{re.escape(named)} is empty; .*leave out {option}"):
        run("store", "serve", "--port", "0", option, value)


def test_serve_takes_its_time_limits_from_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adcloud.store import StoreServer  # noqa: PLC0415

    seen: list[Any] = []

    def ctrl_c(self: StoreServer) -> None:
        seen.append(self.limits)
        raise KeyboardInterrupt

    monkeypatch.setattr(StoreServer, "serve_forever", ctrl_c)
    limits = ["--socket-timeout", "5", "--header-timeout", "2.5", "--min-rate", "8KiB/s"]
    assert run("store", "serve", "--port", "0", *limits)[0] == 0
    assert (seen[0].socket_timeout, seen[0].header_timeout) == (5.0, 2.5)
    assert seen[0].min_body_rate == 8192
    assert run("store", "serve", "--port", "0")[0] == 0  # the defaults are ServerLimits'
    default = ServerLimits()
    assert (seen[1].socket_timeout, seen[1].header_timeout, seen[1].min_body_rate) == (
        default.socket_timeout,
        default.header_timeout,
        default.min_body_rate,
    )
    for option, value in [
        ("--min-rate", "0"),
        ("--socket-timeout", "-1"),
        ("--header-timeout", "x"),
    ]:
        with pytest.raises(SystemExit):
            run("store", "serve", "--port", "0", option, value)


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--ttl", "-5"], "argument --ttl: '-5': give a number of seconds > 0"),
        (["--ttl", "0"], "argument --ttl: '0': give a number of seconds > 0"),
        (["--write-type", "BOGUS"], "argument --write-type: unknown write type 'BOGUS'"),
    ],
)
def test_put_refuses_bad_options_before_touching_the_file(
    tmp_path: Path,
    store_root: Path,
    option: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "a.bin"
    src.write_bytes(b"first")
    assert run("store", "put", str(src), "local:///kept.bin")[0] == 0
    src.write_bytes(b"second")
    with pytest.raises(SystemExit) as info:
        run("store", "put", *option, str(src), "local:///kept.bin")
    assert info.value.code == 2 and says in capsys.readouterr().err
    with LocalStore(root=store_root) as store:
        assert store.get("/kept.bin") == b"first"


def test_files_the_user_names_are_one_line_errors(
    tmp_path: Path, store_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from adcloud.cli import main  # noqa: PLC0415

    missing = tmp_path / "missing.bag"
    assert main(["store", "put", str(missing), "local:///x.bag"]) == 2
    out = capsys.readouterr().err
    assert f"error: {missing}: No such file or directory" in out.replace("\n", "")
    (tmp_path / "a.bin").write_bytes(b"a")
    assert main(["store", "put", str(tmp_path / "a.bin"), "local:///a.bin"]) == 0
    target = tmp_path / "no-such-dir" / "a.bin"
    assert main(["store", "cat", "local:///a.bin", "-o", str(target)]) == 2
    assert f"error: {target}: No such file or directory" in capsys.readouterr().err.replace(
        "\n", ""
    )
    assert main(["store", "cat", "local:///a.bin", "-o", str(tmp_path)]) == 2
    assert f"error: {tmp_path}: Is a directory" in capsys.readouterr().err.replace("\n", "")
    assert not list(tmp_path.rglob("*.part"))


def test_serve_says_why_it_cannot_listen(
    store_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket  # noqa: PLC0415

    from adcloud.cli import main  # noqa: PLC0415

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["store", "serve", "--port", str(port)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot listen on 127.0.0.1:{port}" in err and "another process holds that port" in err
    for option in (["--port", "70000"], ["--max-streams", "-3"], ["--max-file-bytes", "0"]):
        with pytest.raises(SystemExit) as info:
            parser().parse_args(["store", "serve", *option])
        assert info.value.code == 2, option


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--max-request-bytes", "0"], "argument --max-request-bytes: '0': give a size > 0"),
        (
            ["--token", "t0k3n-0123456789", "--token-file", "/dev/null"],
            "argument --token-file: not allowed with argument --token",
        ),
    ],
)
def test_serve_refuses_bad_options_as_usage_errors(
    option: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a server that fails to start naming an internal limit, nor one token source
    silently ignored for the other."""
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["store", "serve", "--port", "0", *option])
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_a_directory_target_takes_the_file_under_its_name(tmp_path: Path, store_root: Path) -> None:
    src = tmp_path / "scan.bin"
    src.write_bytes(b"s" * 300)
    code, out = run("store", "put", str(src), "local:///drives/")
    assert code == 0 and "local:///drives/scan.bin" in out
    assert run("store", "put", str(src), "local:///drives")[0] == 0  # an existing directory
    code, _ = run("store", "cp", "local:///drives/scan.bin", "local:///copies/")
    assert code == 0
    with LocalStore(root=store_root) as store:
        assert store.stat("/drives").is_dir and store.get("/drives/scan.bin") == b"s" * 300
        assert store.get("/copies/scan.bin") == b"s" * 300


@pytest.mark.parametrize("option", ["--socket-timeout"])
def test_serve_refuses_a_time_limit_a_socket_cannot_wait(
    option: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--socket-timeout 1e300`` started the server, which then dropped every connection
    it accepted (``settimeout`` overflows) without a word."""
    from adcloud.store import StoreServer  # noqa: PLC0415

    def ctrl_c(self: StoreServer) -> None:
        raise KeyboardInterrupt  # a server that started stops at once

    monkeypatch.setattr(StoreServer, "serve_forever", ctrl_c)
    with pytest.raises(SystemExit) as info:
        run("store", "serve", "--port", "0", option, "1e300")
    assert info.value.code == 2
    assert f"argument {option}: '1e300': give a number of seconds of at most 9223372036" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["put", "cp"])
def test_a_target_in_memory_is_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``store put f memory:///x`` said "stored ... at memory:///x" of a store that ended
    with the command."""
    src = tmp_path / "a.bin"
    src.write_bytes(b"a")
    source = str(src) if command == "put" else f"file://{src}"
    with pytest.raises(SystemExit) as info:
        run("store", command, source, "memory:///x.bin")
    assert info.value.code == 2
    assert "memory:///x.bin: memory:// lives inside one process" in capsys.readouterr().err


def test_ls_and_stat_never_place_a_lost_file_in_the_under_store(
    tmp_path: Path, store_root: Path
) -> None:
    """A LOST file (cached only, and its cached copy gone) has no tier; ls and stat showed
    it in the "under-store", where it never was."""
    with LocalStore("local://", background=False) as store:
        store.put("/l/mc", b"cache only", write_type="MUST_CACHE")
        for obj in (store_root / "mem" / "objects").rglob("*"):
            if obj.is_file():
                obj.unlink()
        with pytest.raises(StoreError, match="is lost"):
            store.get("/l/mc")
    code, out = run("store", "ls", "local:///l")
    assert code == 0
    assert re.search(r"/l/mc .* lost .* LOST", out) and "under-store" not in out
    code, out = run("store", "stat", "local:///l/mc")
    assert code == 0 and re.search(r"tier\s+\S*\s*lost", out) and "under-store" not in out


def test_put_of_a_file_larger_than_every_tier_is_refused_naming_it(
    tmp_path: Path, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``adcloud store put big.bin`` read and copied the whole file into the store before
    saying it fits in no tier; its size is known up front, so it is refused at once, the
    error naming the file, its size and the largest tier's capacity."""
    monkeypatch.setenv("ADCLOUD_STORE_MEM_CAPACITY", "4KB")
    monkeypatch.setenv("ADCLOUD_STORE_SSD_CAPACITY", "0")
    monkeypatch.setenv("ADCLOUD_STORE_HDD_CAPACITY", "0")
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 10_000)
    with pytest.raises(StoreFullError) as info:
        run("store", "put", str(big), "local:///big.bin", "--write-type", "MUST_CACHE")
    assert re.search(
        rf"{re.escape(str(big))}: cannot place /big\.bin \(9\.8 KiB\).*largest tier \(3\.9 KiB\)",
        str(info.value),
    )


def test_put_of_an_endless_stream_is_refused_once_it_outgrows_every_tier(
    tmp_path: Path, store_root: Path
) -> None:
    """``producer | adcloud store put - URL``: the store refused the stream only at its
    end, so a long-running producer ran on (and its bytes were staged) long after the
    file could not fit; now the put fails as soon as it passes the largest tier."""
    env = worker_env(
        ADCLOUD_STORE_MEM_CAPACITY="64KB",
        ADCLOUD_STORE_SSD_CAPACITY="0",
        ADCLOUD_STORE_HDD_CAPACITY="0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "adcloud.cli", "store", "put", "-", "local:///endless"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdin is not None and proc.stderr is not None
    try:
        with contextlib.suppress(BrokenPipeError):  # refused before all of it was read
            proc.stdin.write(b"x" * 200_000)  # the stream stays open: its length is unknown
            proc.stdin.flush()
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the put waited for the end of a stream that could never fit")
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert code != 0 and "stdin: cannot place /endless (over 62.5 KiB so far)" in err


def test_put_of_a_directory_says_how_to_copy_one(tmp_path: Path, store_root: Path) -> None:
    """A ROS 2 bag is a directory: put failed with a bare "Is a directory"."""
    bag = tmp_path / "r2 bag"
    bag.mkdir()
    (bag / "metadata.yaml").write_text("rosbag2_bagfile_information: {}\n")
    with pytest.raises(StoreError, match=r"is a directory; put stores one file") as refused:
        run("store", "put", str(bag), "local:///drives/r2")
    hint = shlex.split(str(refused.value).split("with: ", 1)[1])
    assert hint == ["adcloud", "store", "cp", "-r", f"file://{bag}", "local:///drives/r2"]
    code, _ = run(*hint[1:])
    assert code == 0
    with LocalStore("local://") as store:
        assert store.get("/drives/r2/metadata.yaml").startswith(b"rosbag2")
