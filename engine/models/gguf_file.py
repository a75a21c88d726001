"""A GGUF file's header, read with struct over a memory map: a few milliseconds where the gguf package's
reader takes seconds (it reads every tensor's description and the tokenizer's arrays into numpy).

The layout (llama.cpp's docs/gguf.md): b"GGUF", a version, the tensors' count, the metadata's count; each
metadata entry a key, a value type and a value; each tensor's name, shape, type and offset; then, aligned,
the tensors' data.
"""
from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

# GGUF's value types: the fixed-size ones (struct formats), 8 a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DEFAULT_ALIGNMENT = 32


def gguf_metadata(path: Path, wanted) -> dict:
    """The numbers under the wanted keys of a GGUF file's header, read as far as they are found. {} for a
    file it cannot read."""
    found: dict = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
            for key, value, _ in _entries(header):
                if key in wanted:
                    found[key] = value
                    if len(found) == len(wanted):
                        break
    except (OSError, ValueError, struct.error, RecursionError):  # not there, empty (mmap), cut short, not
        return {}  # GGUF, or arrays nested past Python's stack
    return found


def gguf_cut_short(path: Path) -> str | None:
    """Where a GGUF file ends before its header or its tensors' data do (a copy or a download that did not
    finish), in words; None where it is whole or cannot be read this far (the loader's error says why)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
            tensors, at, alignment = _tensors(header)
            data_end = 0
            for shape, kind, offset in tensors:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                data_end = max(data_end, offset + math.prod(shape) // block * block_bytes)
    except struct.error:
        return f"the file ends at byte {size:,}, inside its header (a copy or download that did not finish?)"
    except (OSError, ValueError, KeyError, RecursionError):
        return None
    needed = -(-at // alignment) * alignment + data_end
    if needed > size:
        return (f"the file is {size:,} bytes but its tensors run to byte {needed:,} (a copy or download that did "
                "not finish?)")
    return None


def gguf_parameters(path: Path) -> int | None:
    """How many numbers a GGUF file's tensors hold; None for a file it cannot read."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
            return sum(math.prod(shape) for shape, _, _ in _tensors(header)[0])
    except (OSError, ValueError, struct.error, RecursionError):
        return None


def _tensors(header) -> tuple[list[tuple[tuple[int, ...], int, int]], int, int]:
    """Each tensor's shape, type and data offset; the offset after their descriptions; the data's alignment."""
    count = struct.unpack_from("<Q", header, 8)[0] if header[:4] == b"GGUF" else 0
    alignment, at = _DEFAULT_ALIGNMENT, 24
    for key, value, at in _entries(header):
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    tensors = []
    for _ in range(count):
        at += 8 + struct.unpack_from("<Q", header, at)[0]  # the name
        (dims,) = struct.unpack_from("<I", header, at)
        shape = struct.unpack_from(f"<{dims}Q", header, at + 4)
        kind, offset = struct.unpack_from("<IQ", header, at + 4 + 8 * dims)
        at += 16 + 8 * dims
        tensors.append((shape, kind, offset))
    return tensors, at, alignment


def _entries(header) -> Iterator[tuple[str, object, int]]:
    """Each metadata entry: its key, its value (None for strings and arrays), and the offset after it."""
    if header[:4] != b"GGUF" or struct.unpack_from("<I", header, 4)[0] < 2:  # version 1: 32-bit counts
        raise ValueError("not a GGUF file of version 2 or later")
    at, (_, count) = 24, struct.unpack_from("<QQ", header, 8)
    for _ in range(count):
        (size,) = struct.unpack_from("<Q", header, at)
        key = bytes(header[at + 8:at + 8 + size]).decode("utf-8", "replace")
        (kind,) = struct.unpack_from("<I", header, at + 8 + size)
        value, at = _value(header, kind, at + 12 + size)
        yield key, value, at


def _value(header, kind: int, at: int) -> tuple[object, int]:
    """A value at an offset, and the offset after it (strings and arrays are skipped: None)."""
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], header, at)[0], at + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return None, at + 8 + struct.unpack_from("<Q", header, at)[0]
    if kind == 9:
        item, count = struct.unpack_from("<IQ", header, at)
        at += 12
        if item in _SCALARS:
            return None, at + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):  # strings (a tokenizer's vocabulary) or arrays
            _, at = _value(header, item, at)
        return None, at
    raise ValueError(f"unknown GGUF value type {kind}")
