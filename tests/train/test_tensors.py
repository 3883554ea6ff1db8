"""The pickle-free tensor file format: round trips, layout, and every way a file can be bad."""

from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np
import pytest
import torch

from adcloud.train.errors import TrainError
from adcloud.train.tensors import (
    DTYPES,
    MAGIC,
    TensorFormatError,
    decode_tensors,
    decode_tree,
    encode_tensors,
    encode_tree,
)


def _header(data: bytes) -> dict:
    _, _, length, _, _ = struct.unpack_from("<8sIIII", data, 0)
    return json.loads(data[24 : 24 + length])


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exactly(name: str) -> None:
    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(1)
    if dtype is torch.bool:
        tensor = torch.rand(3, 5, generator=gen) > 0.5
    elif dtype.is_complex:
        tensor = torch.randn(3, 5, generator=gen, dtype=dtype)
    elif dtype.is_floating_point:
        tensor = (torch.randn(3, 5, generator=gen) * 100).to(dtype)
    else:
        tensor = torch.randint(0, 100, (3, 5), generator=gen).to(dtype)
    stored = decode_tensors(encode_tensors({"t": tensor}))
    back = stored.tensors["t"]
    assert back.dtype == dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_layout_matches_the_documented_header() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = np.array([1, 2, 3], dtype=np.int64)
    data = encode_tensors({"a": a, "b": b}, {"version": 7})
    assert data[:8] == MAGIC
    header = _header(data)
    assert header["format"] == "adcloud-tensors"
    assert header["version"] == 1
    assert header["metadata"] == {"version": 7}
    offset = header["data_offset"]
    assert offset % 64 == 0
    assert len(data) == offset + header["data_size"]
    entry_a, entry_b = header["tensors"]
    assert entry_a == {
        "name": "a",
        "dtype": "float32",
        "shape": [2, 3],
        "offset": 0,
        "nbytes": 24,
        "crc32": zlib.crc32(a.numpy().tobytes()),
    }
    assert entry_b["offset"] % 64 == 0
    # the raw bytes are little-endian and exactly where the header says
    raw = data[offset + entry_b["offset"] : offset + entry_b["offset"] + entry_b["nbytes"]]
    assert np.frombuffer(raw, "<i8").tolist() == [1, 2, 3]


def test_scalars_empty_and_non_contiguous_tensors() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "transposed": base.t(),
        "sliced": base[:, ::2],
    }
    back = decode_tensors(encode_tensors(tensors)).tensors
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
    assert back["scalar"].shape == ()


def test_decoded_tensors_are_writable_copies() -> None:
    data = encode_tensors({"w": torch.ones(4)})
    tensor = decode_tensors(data).tensors["w"]
    tensor.add_(1)
    assert torch.equal(decode_tensors(data).tensors["w"], torch.ones(4))


def test_tensors_of_one_file_do_not_share_elements() -> None:
    # every tensor views one copy of the data region: writes stay inside their own tensor
    back = decode_tensors(encode_tensors({"a": torch.zeros(3), "b": torch.zeros(2, 2)})).tensors
    back["a"].fill_(7)
    assert torch.equal(back["b"], torch.zeros(2, 2))


def test_a_file_from_another_writer_with_tensors_off_the_64_byte_grid_reads() -> None:
    # An independent writer (struct + json here) that packs tensors back to back, with the
    # header padded by whitespace: the reader copies such tensors out instead of viewing them.
    a = np.arange(3, dtype="<f8")
    b = np.array([True, False, True])
    c = np.arange(4, dtype="<i4").reshape(2, 2)
    blobs = [a.tobytes(), b.astype(np.uint8).tobytes(), c.tobytes()]
    entries, cursor = [], 0
    kinds = zip("abc", ("float64", "bool", "int32"), (a, b, c), blobs, strict=True)
    for name, dtype, arr, raw in kinds:
        entries.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(arr.shape),
                "offset": cursor,
                "nbytes": len(raw),
                "crc32": zlib.crc32(raw),
            }
        )
        cursor += len(raw)  # 24, then 27: b and c are off the grid
    header = {"format": "adcloud-tensors", "version": 1, "data_offset": 1024}
    header |= {"data_size": cursor, "metadata": {}, "tensors": entries}
    text = json.dumps(header, indent=1).encode()
    prefix = struct.pack("<8sIIII", MAGIC, 1, len(text), zlib.crc32(text), 0)
    data = prefix + text + bytes(1024 - len(prefix) - len(text)) + b"".join(blobs)
    back = decode_tensors(data).tensors
    assert back["a"].tolist() == [0.0, 1.0, 2.0]
    assert back["b"].tolist() == [True, False, True]
    assert back["c"].tolist() == [[0, 1], [2, 3]]
    shared = back["a"].untyped_storage().data_ptr()
    assert back["c"].untyped_storage().data_ptr() != shared  # a private copy
    assert back["c"].data_ptr() % 4 == 0  # aligned for its int32 elements


def test_truncation_is_reported_with_the_offset() -> None:
    data = encode_tensors({"w": torch.ones(100)})
    for cut in (0, 10, 30, len(data) - 1):
        with pytest.raises(TensorFormatError, match="truncated") as info:
            decode_tensors(data[:cut], source="/run/x")
        assert info.value.offset == cut
        assert info.value.source == "/run/x"
        assert "/run/x" in str(info.value)


def test_corrupt_tensor_bytes_name_the_tensor_and_offset() -> None:
    data = bytearray(encode_tensors({"a": torch.zeros(10), "b": torch.ones(10)}))
    header = _header(bytes(data))
    where = header["data_offset"] + header["tensors"][1]["offset"] + 3
    data[where] ^= 0xFF
    with pytest.raises(TensorFormatError, match="'b' is corrupt") as info:
        decode_tensors(bytes(data), source="key")
    assert info.value.offset == header["data_offset"] + header["tensors"][1]["offset"]


def test_corrupt_header_bad_magic_version_and_trailing_bytes() -> None:
    data = encode_tensors({"a": torch.zeros(3)})
    flipped = bytearray(data)
    flipped[30] ^= 0x01
    with pytest.raises(TensorFormatError, match="header checksum") as info:
        decode_tensors(bytes(flipped))
    assert info.value.offset == 24
    with pytest.raises(TensorFormatError, match="bad magic"):
        decode_tensors(b"PK\x03\x04" + data[4:])
    newer = bytearray(data)
    struct.pack_into("<I", newer, 8, 2)
    with pytest.raises(TensorFormatError, match="version 2"):
        decode_tensors(bytes(newer))
    with pytest.raises(TensorFormatError, match="unexpected bytes"):
        decode_tensors(data + b"\x00")


def test_unsupported_inputs_are_refused_with_the_name() -> None:
    with pytest.raises(TrainError, match="'q'"):
        encode_tensors({"q": torch.zeros(2).to_sparse()})
    with pytest.raises(TrainError, match="'s'"):
        encode_tensors({"s": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(TrainError, match="JSON"):
        encode_tensors({}, {"loss": float("nan")})


def test_tree_round_trips_an_optimizer_state_exactly() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
    state = opt.state_dict()
    tree = {"optimizer": state, "model": dict(model.state_dict()), "inf": -math.inf, "none": None}
    back, meta = decode_tree(encode_tree(tree, {"step": 3}))
    assert meta == {"step": 3}
    assert back["inf"] == -math.inf and back["none"] is None
    assert set(back["optimizer"]["state"]) == {0, 1, 2, 3}  # int keys survive
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)  # a tuple again
    for key, slots in state["state"].items():
        for slot, value in slots.items():
            assert torch.equal(back["optimizer"]["state"][key][slot], value)
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    fresh.load_state_dict(back["optimizer"])
    assert fresh.param_groups[0]["lr"] == 0.01


def test_tree_keeps_numpy_arrays_as_arrays() -> None:
    keys = np.arange(624, dtype=np.uint32)
    back, _ = decode_tree(encode_tree({"numpy": keys, "list": [1, (2, "x")]}))
    assert isinstance(back["numpy"], np.ndarray)
    assert back["numpy"].dtype == np.uint32
    assert np.array_equal(back["numpy"], keys)
    assert back["list"] == [1, (2, "x")]


def test_tree_refuses_what_it_cannot_store() -> None:
    with pytest.raises(TrainError, match="object"):
        encode_tree({"x": object()})
    with pytest.raises(TrainError, match="mapping key"):
        encode_tree({(1, 2): 3})
    with pytest.raises(TrainError, match="reserved"):
        encode_tree({}, {"tree": 1})
    with pytest.raises(TensorFormatError, match="no state skeleton"):
        decode_tree(encode_tensors({"a": torch.zeros(1)}))


def test_tree_paths_that_spell_the_same_keep_their_own_values() -> None:
    # key "a/b" and key "b" under "a" have one path, as have int key 1 and text key "1":
    # one file entry for both gave both the last one's values
    tree = {
        "a/b": torch.tensor([1.0]),
        "a": {"b": torch.tensor([2.0])},
        1: np.array([3.0]),
        "1": np.array([4.0]),
    }
    back, _ = decode_tree(encode_tree(tree))
    assert back["a/b"].tolist() == [1.0]
    assert back["a"]["b"].tolist() == [2.0]
    assert back[1].tolist() == [3.0]
    assert back["1"].tolist() == [4.0]


def test_an_array_of_text_is_refused_naming_it() -> None:
    with pytest.raises(TrainError, match=r"'/names'.*dtype <U4 cannot be stored"):
        encode_tree({"names": np.array(["road", "curb"])})


def test_a_conjugate_view_is_stored_with_its_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    back = decode_tensors(encode_tensors({"z": z.conj()})).tensors["z"]
    assert back.tolist() == [1 - 2j, 3 + 4j]
