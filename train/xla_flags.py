"""XLA flags the trainer and its profiler read from `$XLA_FLAGS` (no jax import)."""

from __future__ import annotations

import os

NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def command_buffers_on(xla_flags: str | None = None) -> bool:
    """Whether XLA runs GPU programs as command buffers (CUDA graphs; the default), read
    from `xla_flags` (default: $XLA_FLAGS). Then a trace's kernels carry no name stack
    (no phases, no `where`): profile with `XLA_FLAGS=--xla_gpu_enable_command_buffer=`,
    set before jax starts."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return NO_COMMAND_BUFFERS not in flags.split()
