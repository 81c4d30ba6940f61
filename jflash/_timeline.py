"""The Mosaic kernels' timeline: Mosaic GPU's on-device profiler over jflash's named
scopes, per warpgroup, with the SM clock (`kernel_timeline`; `benchmarks/timeline.py`
runs it and reads the traces)."""

from __future__ import annotations

import contextlib
import warnings

from jflash import _mosaic_common
from jflash._mosaic_bwd import DKV_STEP_SCOPES
from jflash._mosaic_fwd import ITEM_SCOPES, STEP_SCOPES
from jflash._validation import is_int

# The kernels a timeline can cover, by the name `kernel_timeline` takes.
TIMELINE_KERNELS = {"fwd": "jflash_mosaic_fwd", "dkv": "jflash_mosaic_dkv"}

# Per kernel: its scopes per key step and per work item, the scope that begins each step,
# the one that begins each work item (None: one work item per CTA) and the one whose end
# starts the gap between items (the last matmul issue; None: no gap).
KERNEL_SCOPES = {
    "fwd": dict(
        step=STEP_SCOPES,
        item=ITEM_SCOPES,
        step_begins="s_wait",
        item_begins="q_wait",
        gap_from="issue",
    ),
    "dkv": dict(
        step=DKV_STEP_SCOPES, item={}, step_begins="in_wait", item_begins=None, gap_from=None
    ),
}


# Ranges each warpgroup keeps by default (16 bytes of shared memory per warpgroup each):
# what fits beside the kernel's own shared memory at D = 64 and 128, with and without
# segment ids (the dK/dV kernel's D = 64 one with segment ids fits 253;
# tests/test_lowering.py checks the defaults).
DEFAULT_SPACE = {"fwd": 480, "dkv": 240}


@contextlib.contextmanager
def kernel_timeline(directory: str, *, kernels=("fwd",), space: int | None = None):
    """Mosaic kernels traced inside this block (compiled, on Hopper) record their named
    scopes per warpgroup with the SM clock and write a Perfetto trace per call into
    `directory` (times in clock cycles, shown as nanoseconds).

    `kernels`: one or more of "fwd" (the forward) and "dkv" (the backward's dK/dV
    kernel). `space`: ranges each warpgroup keeps (16 bytes of shared memory each, later
    ones dropped); None: 480 for "fwd" and 240 for "dkv", which fit beside them (more
    than fits fails the kernel's lowering with Mosaic's shared-memory error). A call
    whose trace file exists already writes none. Kernels traced outside the block carry
    no profiler: the scopes change no instruction. A block inside which none of
    `kernels` was built for the GPU (on CPU, another implementation, a call jitted
    before the block) warns as it ends: it will write nothing.
    """
    kernels = (kernels,) if isinstance(kernels, str) else tuple(kernels)
    unknown = [k for k in kernels if k not in TIMELINE_KERNELS]
    if unknown or not kernels:
        raise ValueError(f"kernels={kernels!r}: name one or more of {', '.join(TIMELINE_KERNELS)}")
    if space is not None:
        if not is_int(space) or space < 1:
            raise ValueError(f"{space=} must be a positive int (ranges per warpgroup) or None")
        space = int(space)
    spaces = {TIMELINE_KERNELS[k]: DEFAULT_SPACE[k] if space is None else space for k in kernels}
    with _mosaic_common.profiling(str(directory), spaces) as compiled:
        yield
    if not compiled:
        warnings.warn(
            f"jflash.kernel_timeline({str(directory)!r}): no kernel of kernels={kernels!r} was "
            "built for the GPU inside the block, so no trace will be written; it records the "
            "Mosaic kernels (implementation='pallas_mosaic', compiled on Hopper) of calls "
            "traced inside it, and a function jitted before the block keeps its kernels",
            stacklevel=3,
        )
