"""A minimal safetensors reader/writer for numpy that understands bf16 (numpy has no bf16: it stays uint16 bits).

The `safetensors` package's numpy front end refuses bf16, and going through torch would make torch a hard
dependency of loading; the format is a JSON header and raw little-endian tensors, so we read it directly.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from .config import DuplicateKey, file_kind, unique_keys

# dtypes numpy can hold (bf16 as its uint16 bits)
_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
           "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
# bytes per element of every dtype the format defines, readable or not: offsets can be checked for all of them
_ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in _DTYPES.items()}, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
MAX_HEADER = 100_000_000      # the safetensors library's own limit on the JSON header


def read_header(path: Path) -> tuple[dict, int]:
    """The header of a safetensors file (tensor name → dtype, shape, data_offsets), checked against the file:
    every tensor's bytes are where the header says, inside the file, of the size its dtype and shape need, and no
    two tensors share a byte. A header that lies would otherwise hand back other tensors' bytes, or the header's
    own, as weights. Returns the header and the offset of the data."""
    path = Path(path)
    try:
        kind = file_kind(path)
        if kind is not None:                  # never opened: a FIFO would block, a device read without end
            raise WeightsError(f"{path}: not a regular file ({kind}); a safetensors file is expected")
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise WeightsError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n == 0 or n > MAX_HEADER or 8 + n > size:
                raise WeightsError(f"{path}: header length {n} is not plausible for a file of {size} bytes; "
                                   "not a safetensors file?")
            text = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: header is not valid JSON ({e})") from None
    except DuplicateKey as e:
        raise WeightsError(f"{path}: tensor {e.args[0]} appears twice in the header") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise WeightsError(f"{path}: __metadata__ is not a JSON object")
    _check_entries(path, header, size - 8 - n)
    return header, 8 + n


def _check_entries(path: Path, header: dict, data_bytes: int):
    spans = []
    for name, h in header.items():
        def bad(why):
            return WeightsError(f"{path}: tensor {name} {why}")
        if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= h.keys():
            raise bad("lacks dtype, shape or data_offsets in the header")
        dt, shape, off = h["dtype"], h["shape"], h["data_offsets"]
        if not isinstance(dt, str):
            raise bad(f"has dtype {json.dumps(dt)}, not a string")
        if dt not in _ITEMSIZE:
            raise bad(f"has unknown dtype {dt!r}")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise bad(f"has shape {json.dumps(shape)}, not a list of non-negative integers")
        if not (isinstance(off, list) and len(off) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in off)):
            raise bad(f"has data_offsets {json.dumps(off)}, not two integers")
        a, b = off
        if a < 0 or b < a:
            raise bad(f"has data_offsets [{a}, {b}]: they must be non-negative and in order")
        if b > data_bytes:
            raise bad(f"is truncated: its data_offsets end at byte {b} but the file holds {data_bytes} bytes of data")
        need = math.prod(shape) * _ITEMSIZE[dt]
        if b - a != need:
            raise bad(f"has data_offsets [{a}, {b}] ({b - a} bytes) but {dt} {shape} takes {need} bytes")
        if b > a:
            spans.append((a, b, name))
    spans.sort()
    for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise WeightsError(f"{path}: tensors {n0} and {n1} overlap (data_offsets [{a0}, {b0}] and [{a1}, {b1}])")


class SafetensorsFile:
    """Lazy access to the tensors of one file through a memory map; the header is checked on opening."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header, self.offset = read_header(self.path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def keys(self):
        return self.header.keys()

    def dtype(self, name) -> str:
        return self.header[name]["dtype"]

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits)."""
        h = self.header[name]
        if h["dtype"] not in _DTYPES:
            raise WeightsError(f"{self.path}: tensor {name} has dtype {h['dtype']}, which cannot be read here")
        a, b = h["data_offsets"]
        return self._map[self.offset + a:self.offset + b].view(_DTYPES[h["dtype"]]).reshape(h["shape"])


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
