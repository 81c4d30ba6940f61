"""Minimal safetensors reader/writer on numpy, with bfloat16 through ml_dtypes.

``safetensors.numpy`` cannot represent bfloat16 (numpy has no such dtype), and
Llama checkpoints are usually bfloat16, so the format (8-byte little-endian header
length, JSON header, raw little-endian tensor bytes) is handled here directly.
Reads are memory-mapped: a tensor's bytes are touched only when it is used.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES: dict[np.dtype, str] = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile(Mapping[str, np.ndarray]):
    """Read-only, memory-mapped mapping ``name -> np.ndarray`` of one file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict] = header
        self._offset = 8 + header_len
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        raw = self._mmap[self._offset + start : self._offset + end]
        dtype = _DTYPES[entry["dtype"]].newbyteorder("<")
        return raw.view(dtype).reshape(entry["shape"])

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` without reading it."""
        return tuple(self._entries[name]["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` to one safetensors file (keys sorted, 8-byte aligned header)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        dtype = array.dtype.newbyteorder("=")
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {array.dtype}")
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays[name] = array
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(arrays):
            array = arrays[name]
            if array.dtype.byteorder == ">":
                array = array.byteswap().view(array.dtype.newbyteorder("<"))
            f.write(array.view(np.uint8).tobytes())
