"""Minimal safetensors reader/writer on numpy, with bfloat16 through ml_dtypes.

``safetensors.numpy`` cannot represent bfloat16 (numpy has no such dtype), and
Llama checkpoints are usually bfloat16, so the format (8-byte little-endian header
length, JSON header, raw little-endian tensor bytes) is handled here directly.
Reads are memory-mapped: a tensor's bytes are touched only when it is used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from models.files import atomic_write

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
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
                (header_len,) = struct.unpack("<Q", head)
                if 8 + header_len > size:
                    raise ValueError(f"the header claims {header_len} bytes, the file has {size}")
                header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        except OSError as e:
            raise ValueError(f"{self.path}: cannot read ({e.strerror})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: not a valid safetensors file ({e})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict] = header
        self._offset = 8 + header_len
        self._check_entries(size - self._offset)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _check_entries(self, data_bytes: int) -> None:
        """Every tensor's byte range lies in the file and matches its dtype and shape:
        a truncated download fails here, naming the file, not at a later reshape."""
        for name, entry in self._entries.items():
            try:
                start, end = (int(x) for x in entry["data_offsets"])
                shape = [int(d) for d in entry["shape"]]
                dtype = entry["dtype"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{self.path}: tensor {name!r} has a malformed entry") from None
            if end > data_bytes:
                raise ValueError(
                    f"{self.path} is truncated: tensor {name!r} ends at byte {end} of the "
                    f"data, which holds {data_bytes} (download it again)"
                )
            if dtype in _DTYPES and end - start != int(np.prod(shape)) * _DTYPES[dtype].itemsize:
                raise ValueError(
                    f"{self.path}: tensor {name!r} spans {end - start} bytes, but {dtype} "
                    f"{shape} needs {int(np.prod(shape)) * _DTYPES[dtype].itemsize}"
                )

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


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A tensor that :func:`save_file` makes (``make()``, of this ``shape`` and
    ``dtype``) only when it writes it, one at a time: a file of converted weights then
    holds one converted tensor in memory, not all of them."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def save_file(
    tensors: Mapping[str, np.ndarray | Deferred],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` (arrays, or :class:`Deferred` ones, made as they are written)
    to one safetensors file (keys sorted, 8-byte aligned header), one tensor at a time.

    The bytes go to ``path + ".tmp"``, renamed over ``path`` once complete: a write that
    fails (a full disk, a tensor that cannot be made) leaves an earlier file at ``path``
    as it was, and readers that memory-map it keep reading the old bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        dtype = np.dtype(tensor.dtype).newbyteorder("=")
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        nbytes = math.prod(tensor.shape) * dtype.itemsize
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = os.fspath(path)
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            tensor = tensors[name]
            array = np.ascontiguousarray(tensor.make() if isinstance(tensor, Deferred) else tensor)
            if array.shape != tuple(tensor.shape) or array.dtype != tensor.dtype:
                raise ValueError(
                    f"tensor {name!r} was made {array.dtype}{list(array.shape)}, not the "
                    f"{np.dtype(tensor.dtype)}{list(tensor.shape)} its header says"
                )
            if array.dtype.byteorder == ">":
                array = array.byteswap().view(array.dtype.newbyteorder("<"))
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
