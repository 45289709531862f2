"""A palette PNG from an array of colour indices, with the standard library alone (the Gantt chart's picture)."""
from __future__ import annotations

import struct
import zlib

import numpy as np


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _rgba(colour: str) -> tuple[int, int, int, int]:
    """'#rrggbb' (opaque) or 'transparent'."""
    if colour == "transparent":
        return 0, 0, 0, 0
    if len(colour) != 7 or colour[0] != "#":
        raise ValueError(f"a colour is '#rrggbb' or 'transparent', not {colour!r}")
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16), 255


def palette_png(index: np.ndarray, palette: list[str], level: int = 6) -> bytes:
    """index: [height, width] uint8 into `palette` ('#rrggbb' or 'transparent', at most 256). Every row is stored
    unfiltered (filter type 0): the picture's rows repeat whole, which deflate finds at one row's distance."""
    index = np.ascontiguousarray(index, dtype=np.uint8)
    if index.ndim != 2 or not 0 < len(palette) <= 256:
        raise ValueError(f"a [height, width] index into 1 to 256 colours, not {index.shape} into {len(palette)}")
    if index.size and int(index.max()) >= len(palette):
        raise ValueError(f"index {int(index.max())} past the palette's {len(palette)} colours")
    h, w = index.shape
    rgba = [_rgba(c) for c in palette]
    rows = np.zeros((h, w + 1), np.uint8)
    rows[:, 1:] = index
    alpha = bytes(a for *_, a in rgba)
    return (b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0))
            + _chunk(b"PLTE", bytes(v for r, g, b, _ in rgba for v in (r, g, b)))
            + (_chunk(b"tRNS", alpha.rstrip(b"\xff")) if alpha.rstrip(b"\xff") else b"")
            + _chunk(b"IDAT", zlib.compress(rows.tobytes(), level))
            + _chunk(b"IEND", b""))
