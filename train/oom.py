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
