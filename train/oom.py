"""Recognising an out-of-memory error, for the trainer and its tools (no jax import:
`train.tools.profile`'s parent process must not start a backend)."""

from __future__ import annotations

# Matched case-insensitively: XLA's "RESOURCE_EXHAUSTED: Out of memory while trying to
# allocate ...", the CUDA driver's CUDA_ERROR_OUT_OF_MEMORY, NCCL's "out of memory".
MEMORY_ERRORS = ("resource_exhausted", "out of memory", "out_of_memory")
# The BFC allocator's warning when a retry succeeded is not a failure.
NOT_A_FAILURE = "this is not a failure"


def is_oom(error: BaseException | str) -> bool:
    """Whether an exception (or a line of a child's output) says memory ran out."""
    text = str(error).lower()
    return NOT_A_FAILURE not in text and any(m in text for m in MEMORY_ERRORS)


def failed_allocation_bytes(error: BaseException | str) -> int | None:
    """The size of the one allocation XLA could not make ("... trying to allocate N
    bytes"), or None where the message names none."""
    import re

    match = re.search(r"allocate (\d+) bytes", str(error))
    return int(match.group(1)) if match else None


def allocator_hint(requested: int | None, limit: int | None, in_use: int | None) -> str:
    """Advice when the failed allocation fits the device's limit beside what is in use:
    the default (BFC) allocator could not find the block in one piece; CUDA's pool
    allocator can (the 1B at 256k needs one 82 GiB temporary block)."""
    if None in (requested, limit, in_use) or requested + in_use > limit:
        return ""
    gib = 2**30
    return (
        f"; the allocation it failed ({requested / gib:.1f} GiB) fits the device's limit "
        f"({limit / gib:.1f} GiB, {in_use / gib:.1f} in use), so the allocator could not "
        "find it in one piece: XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async runs such steps"
    )
