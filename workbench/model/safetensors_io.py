"""A minimal safetensors reader/writer for numpy that understands bf16 (numpy has no bf16: it stays uint16 bits).

The `safetensors` package's numpy front end refuses bf16, and going through torch would make torch a hard
dependency of loading; the format is a JSON header and raw little-endian tensors, so we read it directly.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}


class WeightsError(ValueError):
    """Missing, malformed or mis-shaped weights, with the file and tensor named."""


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise WeightsError(f"{path}: header length {n} is not plausible; not a safetensors file?")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise WeightsError(f"{path}: header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsFile:
    """Lazy access to the tensors of one file through a memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header, self.offset = read_header(self.path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def keys(self):
        return self.header.keys()

    def dtype(self, name) -> str:
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits)."""
        h = self.header[name]
        if h["dtype"] not in _DTYPES:
            raise WeightsError(f"{self.path}: tensor {name} has unsupported dtype {h['dtype']}")
        a, b = h["data_offsets"]
        dt = np.dtype(_DTYPES[h["dtype"]])
        n = int(np.prod(h["shape"])) if h["shape"] else 1
        if b - a != n * dt.itemsize or self.offset + b > self._map.size:
            raise WeightsError(f"{self.path}: tensor {name} is truncated or its offsets are inconsistent")
        return self._map[self.offset + a:self.offset + b].view(dt).reshape(h["shape"])

    def get_f32(self, name: str) -> np.ndarray:
        t = self.get(name)
        return bf16_to_f32(t) if self.dtype(name) == "BF16" else t.astype(np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 → bf16 bits (NaN kept NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def write(path: str | Path, tensors: dict[str, np.ndarray], bf16: set[str] = frozenset()):
    """Write tensors; names in `bf16` are uint16 bit arrays stored as BF16."""
    header, blobs, off = {}, [], 0
    rev = {v: k for k, v in _DTYPES.items() if k != "BF16"}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dt = "BF16" if name in bf16 else rev[arr.dtype.type]
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        blobs.append(arr.tobytes())
        off += arr.nbytes
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj)
        for b in blobs:
            f.write(b)
