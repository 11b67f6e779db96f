"""Torch tensors through `MsgpackSerde`.

Marked ``torch``: the default run (the README's install has no torch) leaves these out, and CI's
second step installs torch and runs them. Run by hand without torch, they skip.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from aioshmcache._serde import MsgpackSerde
from aioshmcache.errors import SerdeError

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

SERDE = MsgpackSerde()
ALIGN = 64

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (0,), (7,), (3, 4), (2, 0, 3), (2, 3, 4)]


def aligned(n: int) -> memoryview:
    raw = np.zeros(n + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + n].data


def encode(obj: object) -> memoryview:
    plan = SERDE.plan(obj)
    buf = aligned(plan.nbytes)
    SERDE.write(plan, buf)
    return buf


def sample(dtype: Any, shape: tuple[int, ...]) -> Any:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen).to(dtype)


def assert_same_tensor(expected: Any, got: Any) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == expected.dtype
    assert tuple(got.shape) == tuple(expected.shape)
    assert got.device.type == "cpu"
    assert torch.equal(got, expected.detach())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("copy", [True, False], ids=["copy", "view"])
def test_round_trip(dtype: Any, shape: tuple[int, ...], copy: bool) -> None:
    t = sample(dtype, shape)
    buf = encode({"t": t, "n": np.arange(3)})
    got = SERDE.read(buf, copy=copy)
    assert isinstance(got, dict)
    assert_same_tensor(t, got["t"])
    assert type(got["n"]) is np.ndarray  # numpy arrays stay numpy
    base = np.frombuffer(buf, np.uint8).ctypes.data
    if t.numel():
        address = got["t"].data_ptr()
        shares = base <= address < base + len(buf)
        assert shares is not copy  # view: zero-copy into the buffer; copy: its own memory
        if not copy:
            assert (address - base) % ALIGN == 0
    if copy:
        np.frombuffer(buf, np.uint8)[:] = 0xFF
        assert_same_tensor(t, got["t"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_view_on_readonly_buffer_copies_without_warning(dtype: Any) -> None:
    t = sample(dtype, (4, 5))
    data = bytes(encode([t]))
    got = SERDE.read(memoryview(data), copy=False)  # filterwarnings=error: must not warn
    assert isinstance(got, list)
    assert_same_tensor(t, got[0])


def test_non_contiguous_and_special_tensors() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    cases = {
        "transposed": base.transpose(0, 2),
        "strided": base[:, ::2, 1::2],
        "bf16_strided": base.to(torch.bfloat16)[::2].transpose(1, 2),
        "requires_grad": torch.ones(3, requires_grad=True),
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
        "neg": torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag,
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "scalar": torch.tensor(3.5),
        "uint16": torch.arange(5).to(torch.uint16),
    }
    for copy in (True, False):
        got = SERDE.read(encode(cases), copy=copy)
        assert isinstance(got, dict)
        for name, t in cases.items():
            expected = t.detach().resolve_conj().resolve_neg()
            if name == "uint16":
                assert got[name].dtype == torch.uint16
                assert got[name].tolist() == expected.tolist()
            else:
                assert_same_tensor(expected, got[name])
            assert got[name].is_contiguous()
            assert type(got[name]) is torch.Tensor


def test_bfloat16_bit_patterns_exact() -> None:
    bits = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80], dtype=torch.int32)
    t = bits.to(torch.int16).view(torch.bfloat16)
    got = SERDE.read(encode(t))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), t.view(torch.int16))  # NaN payloads included


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(3, device="meta"),
        lambda: torch.zeros(3).to_sparse(),
        lambda: torch.zeros(3, dtype=torch.float8_e4m3fn),
        lambda: torch.zeros(3, dtype=torch.float8_e5m2),
    ],
    ids=["meta", "sparse", "float8_e4m3fn", "float8_e5m2"],
)
def test_unsupported_tensors(make: Any) -> None:
    with pytest.raises(SerdeError):
        SERDE.plan({"t": make()})


def test_reader_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = encode({"t": torch.ones(3)})
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(SerdeError, match="torch is not importable"):
        SERDE.read(payload)
    # Values without tensors do not need torch.
    assert SERDE.read(encode({"a": np.zeros(2)})) is not None


def test_copy_read_leaves_no_buffer_export() -> None:
    view = encode({"t": torch.ones(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)})
    got = SERDE.read(view, copy=True)
    view.release()  # BufferError if a tensor still exported it
    assert isinstance(got, dict) and got["t"].sum().item() == 12
