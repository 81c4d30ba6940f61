"""Tests of train/tensorboard.py: CRC32C, event encoding, read-back, corruption."""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest

from train.tensorboard import (
    FILE_VERSION,
    SummaryWriter,
    crc32c,
    event_files,
    masked_crc32c,
    read_records,
    read_scalars,
    truncate_events,
)

# Test vectors: RFC 3720 (iSCSI) appendix B.4 and the common check value.
CRC32C_VECTORS = [
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize(("data", "expected"), CRC32C_VECTORS)
def test_crc32c_vectors(data, expected):
    assert crc32c(data) == expected


def test_masked_crc32c():
    crc = 0xE3069283
    expected = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert masked_crc32c(b"123456789") == expected


def test_write_then_read_back(tmp_path):
    values = {"loss": [], "lr": []}
    with SummaryWriter(tmp_path) as writer:
        for step in range(5):
            loss, lr = 10.0 / (step + 1), np.float32(1e-3 * step)
            writer.scalars({"loss": loss, "lr": lr}, step)
            values["loss"].append((step, loss))
            values["lr"].append((step, float(lr)))
        writer.scalar("train/mfu", np.array(0.4375), 7)  # 0-d array; exact in float32
        writer.scalar("big_step", 1.5, 2**40)
    got = read_scalars(writer.path)
    assert set(got) == {"loss", "lr", "train/mfu", "big_step"}
    for tag in ("loss", "lr"):
        steps, vals = zip(*got[tag], strict=True)
        assert list(steps) == [s for s, _ in values[tag]]
        np.testing.assert_array_equal(
            np.array(vals, np.float32), np.array([v for _, v in values[tag]], np.float32)
        )
    assert got["train/mfu"] == [(7, 0.4375)]
    assert got["big_step"] == [(2**40, 1.5)]


def test_file_layout(tmp_path):
    with SummaryWriter(tmp_path) as writer:
        writer.scalar("x", 2.0, 3)
    assert writer.path.name.startswith("events.out.tfevents.")
    records = list(read_records(writer.path))
    assert len(records) == 2
    assert FILE_VERSION.encode() in records[0]
    # Event: wall_time (field 1, fixed64), step (field 2, varint 3), summary (field 5).
    assert records[1][0] == 0x09 and records[1][9:11] == b"\x10\x03" and records[1][11] == 0x2A
    data = writer.path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length == len(records[0])
    assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])


def test_buffered_until_flush(tmp_path):
    writer = SummaryWriter(tmp_path, flush_secs=3600)
    writer.scalar("loss", 1.0, 1)
    writer.flush()
    assert read_scalars(tmp_path) == {"loss": [(1, 1.0)]}
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="is closed"):
        writer.scalar("loss", 2.0, 2)


def test_multiple_files_in_a_directory(tmp_path):
    for step in range(3):
        with SummaryWriter(tmp_path) as writer:
            writer.scalar("loss", float(step), step)
    (tmp_path / "notes.txt").write_text("not an event file")
    assert len(event_files(tmp_path)) == 3
    assert read_scalars(tmp_path) == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0)]}


def test_bad_tags_rejected(tmp_path):
    with SummaryWriter(tmp_path) as writer, pytest.raises(ValueError, match="non-empty strings"):
        writer.scalars({"": 1.0}, 0)


@pytest.mark.parametrize(
    ("corrupt", "pattern"),
    [
        (lambda d: d[:-2], "truncated record"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "data CRC mismatch"),
        (lambda d: d[:-8] + bytes([d[-8] ^ 0x40]) + d[-7:], "data CRC mismatch"),
        (lambda d: d + b"\x05" + bytes(7) + b"\x00\x00\x00\x00", "length CRC mismatch"),
        (lambda d: d + b"\x01\x02", "truncated record header"),
    ],
)
def test_corrupt_file_detected(tmp_path, corrupt, pattern):
    with SummaryWriter(tmp_path) as writer:
        writer.scalar("loss", 1.0, 1)
    writer.path.write_bytes(corrupt(writer.path.read_bytes()))
    with pytest.raises(ValueError, match=f"{writer.path.name}: {pattern}"):
        read_scalars(tmp_path)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="the tensorboard package is not installed; the format is checked by the tests above",
)
def test_tensorboard_reads_our_files(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    with SummaryWriter(tmp_path) as writer:
        for step in range(4):
            writer.scalars({"loss": 4.0 - step, "lr": 0.5}, step)
    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["scalars"]) == ["loss", "lr"]
    events = accumulator.Scalars("loss")
    assert [(e.step, e.value) for e in events] == [(s, 4.0 - s) for s in range(4)]


def test_truncate_events_drops_steps_after_the_resumed_checkpoint(tmp_path):
    """A killed run wrote steps 1..10 and half a record; resuming from checkpoint 8
    keeps 1..8 (TensorBoard would otherwise show 9 and 10 twice)."""
    with SummaryWriter(tmp_path) as w:
        for step in range(1, 11):
            w.scalars({"train/loss": float(step), "train/lr": 0.1}, step)
    (path,) = event_files(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\x10\x00\x00")  # torn by the kill
    truncate_events(tmp_path, 8)
    scalars = read_scalars(tmp_path)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9))
    assert [s for s, _ in scalars["train/lr"]] == list(range(1, 9))
    assert next(read_records(path)).endswith(FILE_VERSION.encode())  # the header stays
    before = path.read_bytes()
    truncate_events(tmp_path, 8)
    assert path.read_bytes() == before
    truncate_events(tmp_path / "missing", 8)  # no TensorBoard directory: nothing to do
