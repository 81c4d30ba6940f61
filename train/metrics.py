"""Throughput, MFU and memory numbers, and the JSONL log the trainer writes."""

from __future__ import annotations

import json
import os

import jax

from train.errors import TrainingError

# Dense bf16 peak per device (datasheet, FLOP/s), for MFU, by a part of the device kind
# (`NVIDIA H100 80GB HBM3`), the first that matches: the PCIe and NVL cards before the
# SXM parts whose name they share. Unknown devices: no MFU.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800 PCIe": 756e12,
    "H100": 989e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "GH200": 989e12,
    "GB200": 2500e12,
    "B200": 2250e12,
}


def peak_flops(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in kind:
            return flops
    return None


def memory(device=None) -> dict[str, float]:
    """Bytes in use and peak on one local device, in GiB (empty where not reported)."""
    stats = (device or jax.local_devices()[0]).memory_stats() or {}
    out = {}
    for key, name in (("bytes_in_use", "memory_gib"), ("peak_bytes_in_use", "peak_memory_gib")):
        if key in stats:
            out[name] = stats[key] / 2**30
    return out


def compiled_bytes(compiled) -> int | None:
    """Per-device bytes a compiled program needs: arguments + outputs + temporaries -
    aliased (XLA's memory analysis; None where the backend gives none)."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )


def throughput(tokens: float, seconds: float, flops_per_token: float, num_devices: int) -> dict:
    """tokens/s, achieved TFLOP/s per device and MFU (model FLOPs, recompute not counted)."""
    tps = tokens / seconds
    per_device = tps * flops_per_token / num_devices
    out = {"tokens_per_s": tps, "tflops_per_device": per_device / 1e12}
    peak = peak_flops()
    if peak:
        out["mfu"] = per_device / peak
    return out


class JsonlLog:
    """Append-only JSON-lines log (one object per logging step). A write finding that
    `path` no longer names the file it appends to (its `--output_dir` deleted, moved or
    replaced during the run) stops the run with a TrainingError instead of writing into
    a file no one can read."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        try:
            there = os.path.samestat(os.stat(self.path), os.fstat(self._file.fileno()))
        except FileNotFoundError:
            there = False
        if not there:
            raise TrainingError(
                f"{self.path} was removed or replaced while the run wrote it (its "
                "--output_dir deleted or moved?): stopping, since the run's records, "
                "settings and lock went with it"
            )
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
