"""TensorBoard scalar summaries without TensorFlow or tensorboardX.

An event file (``events.out.tfevents.<time>.<host>...``) is a TFRecord file: a sequence
of records ``[uint64 length][uint32 masked_crc32c(length)][data][uint32
masked_crc32c(data)]`` (little-endian), each ``data`` a serialized ``tensorflow.Event``
protobuf. The first event carries ``file_version: "brain.Event:2"``; scalar events are
``Event{wall_time=1: double, step=2: int64, summary=5: Summary{value=1: repeated
Value{tag=1: string, simple_value=2: float}}}``. The few protobuf fields needed are
encoded here by hand (wire format: varint keys ``field << 3 | wire_type``).

Only process 0 should write; that is the caller's job.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

FILE_VERSION = "brain.Event:2"
_CRC_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1

# Protobuf wire types.
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


# A rewritten event file's name until it replaces the file (`truncate_events`): without
# "tfevents", which TensorBoard and `event_files` take for an event file.
REWRITE_NAME = "rewrite.part"


def _crc32c_table() -> tuple[int, ...]:
    """Byte table of CRC-32C (Castagnoli), reflected polynomial 0x82F63B78."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as used by TFRecord."""
    crc = _U32
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _U32


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits and add a constant (mod 2**32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & _U32


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= _U64  # negative int64 values take ten bytes, two's complement
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, _LENGTH) + _varint(len(payload)) + payload


def _encode_event(
    wall_time: float,
    step: int,
    *,
    file_version: str | None = None,
    scalars: Iterable[tuple[str, float]] = (),
) -> bytes:
    """Serialized ``Event``; ``scalars`` is an iterable of ``(tag, value)``."""
    out = _key(1, _FIXED64) + struct.pack("<d", wall_time) + _key(2, _VARINT) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    values = b"".join(
        _length_delimited(
            1,
            _length_delimited(1, tag.encode()) + _key(2, _FIXED32) + struct.pack("<f", value),
        )
        for tag, value in scalars
    )
    if values:
        out += _length_delimited(5, values)
    return out


def _encode_record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class SummaryWriter:
    """Writes scalar summaries to a new event file in ``logdir``.

    Writes go through a buffered file, flushed by :meth:`flush`, on :meth:`close` (also
    on leaving a ``with`` block), and after a write when ``flush_secs`` have passed since
    the last flush.

    Args:
        logdir: directory (created if missing); TensorBoard's ``--logdir`` or a run in it.
        flush_secs: longest time written scalars may stay unflushed while writing.
        filename_suffix: appended to the file name.
    """

    _counter = 0  # distinguishes files that one process opens in the same second

    def __init__(
        self, logdir: str | os.PathLike, *, flush_secs: float = 30.0, filename_suffix: str = ""
    ):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        SummaryWriter._counter += 1
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{SummaryWriter._counter:06d}{filename_suffix}"
        )
        self.path = self.logdir / name
        self.flush_secs = flush_secs
        self._file = open(self.path, "wb")
        self._last_flush = time.monotonic()
        self._write(_encode_event(time.time(), 0, file_version=FILE_VERSION))
        self.flush()

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Records ``value`` (anything ``float()`` accepts, e.g. a 0-d array) at ``step``."""
        self.scalars({tag: value}, step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Records several scalars at ``step`` in one event."""
        for tag in values:
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"scalar tags must be non-empty strings, got {tag!r}")
        if values:
            scalars = [(tag, float(value)) for tag, value in values.items()]
            self._write(_encode_event(time.time(), int(step), scalars=scalars))

    def flush(self) -> None:
        """Writes buffered events to disk."""
        self._check_open()
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flushes and closes the file; further writes raise. Closing twice is a no-op."""
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _write(self, event: bytes) -> None:
        self._check_open()
        self._file.write(_encode_record(event))
        if time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def _check_open(self) -> None:
        if self._file.closed:
            raise ValueError(f"SummaryWriter for {self.path} is closed")


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


def read_records(path: str | os.PathLike) -> Iterator[bytes]:
    """Yields the ``data`` of each TFRecord in ``path``, verifying both CRCs.

    Raises:
        ValueError: a CRC mismatch or a truncated record, naming the file and offset.
    """
    data = Path(path).read_bytes()
    offset = 0
    while offset < len(data):
        header = data[offset : offset + 12]
        if len(header) < 12:
            raise ValueError(f"{path}: truncated record header at byte {offset}")
        length_bytes, (length_crc,) = header[:8], struct.unpack("<I", header[8:])
        if masked_crc32c(length_bytes) != length_crc:
            raise ValueError(f"{path}: length CRC mismatch in the record at byte {offset}")
        (length,) = struct.unpack("<Q", length_bytes)
        end = offset + 12 + length
        if end + 4 > len(data):
            raise ValueError(f"{path}: truncated record at byte {offset} ({length=})")
        payload = data[offset + 12 : end]
        (data_crc,) = struct.unpack("<I", data[end : end + 4])
        if masked_crc32c(payload) != data_crc:
            raise ValueError(f"{path}: data CRC mismatch in the record at byte {offset}")
        yield payload
        offset = end + 4


def _fields(message: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of each field; fixed-size values as raw bytes."""
    pos = 0
    while pos < len(message):
        key, pos = _read_varint(message, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(message, pos)
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            value, pos = message[pos : pos + size], pos + size
        elif wire_type == _LENGTH:
            size, pos = _read_varint(message, pos)
            value, pos = message[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type} (field {field})")
        if pos > len(message):
            raise ValueError(f"protobuf field {field} runs past the end of the message")
        yield field, wire_type, value


def _read_varint(message: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(message):
            raise ValueError("truncated protobuf varint")
        byte = message[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _event_scalars(event: bytes) -> tuple[int, list[tuple[str, float]]]:
    """``(step, [(tag, simple_value), ...])`` of one serialized ``Event``."""
    step, scalars = 0, []
    for field, _, value in _fields(event):
        if field == 2:
            step = value - (1 << 64) if value >> 63 else value
        elif field == 5:
            for value_field, _, summary_value in _fields(value):
                if value_field == 1:
                    scalars.extend(_summary_value(summary_value))
    return step, scalars


def _summary_value(message: bytes) -> list[tuple[str, float]]:
    """``[(tag, simple_value)]`` of a ``Summary.Value``, or ``[]`` if it is not a scalar."""
    tag, simple_value = None, None
    for field, wire_type, value in _fields(message):
        if field == 1 and wire_type == _LENGTH:
            tag = value.decode()
        elif field == 2 and wire_type == _FIXED32:
            (simple_value,) = struct.unpack("<f", value)
    return [] if tag is None or simple_value is None else [(tag, simple_value)]


def event_files(path: str | os.PathLike) -> list[Path]:
    """``[path]`` for a file, else the event files directly in the directory, by name."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such event file or directory")
    return sorted(p for p in path.iterdir() if p.is_file() and "tfevents" in p.name)


def read_scalars(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Scalars of an event file, or of all event files directly in a directory.

    Returns:
        ``{tag: [(step, value), ...]}`` in file (name) order, then write order. Values
        are float32-rounded, as stored.

    Raises:
        ValueError: a corrupt record (CRC mismatch, truncation), naming the file.
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for file in event_files(path):
        for record in read_records(file):
            try:
                step, scalars = _event_scalars(record)
            except ValueError as e:
                raise ValueError(f"{file}: malformed event ({e})") from None
            for tag, value in scalars:
                out.setdefault(tag, []).append((step, value))
    return out


def truncate_events(logdir: str | os.PathLike, last_step: int) -> None:
    """Drops the scalar events after ``last_step`` from the event files directly in
    ``logdir`` (a resumed run writes those steps again; TensorBoard would show both).

    A record torn by a kill at the end of a file is dropped too. Files are rewritten
    through a temporary file (``REWRITE_NAME``, which no reader takes for an event file)
    and ``os.replace``, so a failure leaves the old file; one left by a kill is removed.
    """
    logdir = Path(logdir)
    if not logdir.is_dir():
        return
    tmp = logdir / REWRITE_NAME
    tmp.unlink(missing_ok=True)
    for file in event_files(logdir):
        data = file.read_bytes()
        keep, offset, changed = [], 0, False
        while offset < len(data):
            header = data[offset : offset + 12]
            length = struct.unpack("<Q", header[:8])[0] if len(header) == 12 else -1
            end = offset + 12 + length
            whole = length >= 0 and end + 4 <= len(data)
            if not whole or masked_crc32c(header[:8]) != struct.unpack("<I", header[8:])[0]:
                changed = True  # a torn or corrupt tail: nothing after it can be read
                break
            try:
                step, scalars = _event_scalars(data[offset + 12 : end])
            except ValueError:
                step, scalars = 0, [("", 0.0)]
            if scalars and step > last_step:
                changed = True
            else:
                keep.append(data[offset : end + 4])
            offset = end + 4
        if changed:
            tmp.write_bytes(b"".join(keep))
            os.replace(tmp, file)
