"""What a profile needs from a compiled XLA module's text: op name stacks and sizes.

A trace event names the HLO instruction it ran (`hlo_op`). GPU kernels also carry
the jax name stack, but CPU thunks, and kernels XLA creates itself (copies, some
fusions), do not. The optimized HLO text (`compiled.as_text()`) has both for every
instruction: `%ppermute.20 = bf16[2,1,512,8,128]{...} collective-permute(...),
..., metadata={op_name="jit(train_step)/.../ppermute"}`. This module reads that
text once, so the trace parser can attribute such events and size the ring's
transfers (bytes of each collective-permute).
"""

from __future__ import annotations

import dataclasses
import math
import re

# `[ROOT] %name = <result type> opcode(`; the type may be a tuple with spaces.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s(?P<op>[a-z][\w\-]*)\("
)
_OP_NAME = re.compile(r'op_name="(?P<stack>[^"]*)"')
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8e\w+|c64|c128|token)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0}

COLLECTIVE_PERMUTES = ("collective-permute", "collective-permute-start", "collective-permute-done")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (`bf16` -> 2, `s32` -> 4, `f8e4m3fn` -> 1)."""
    if dtype in _BITS:
        return _BITS[dtype] / 8
    match = re.match(r"[subf](\d+)", dtype)
    if not match:
        raise ValueError(f"unknown HLO element type {dtype=}")
    return int(match.group(1)) / 8


def array_bytes(hlo_type: str) -> list[int]:
    """Bytes of every array in an HLO type string (a tuple gives several)."""
    out = []
    for m in _ARRAY.finditer(hlo_type):
        dims = [int(d) for d in m.group("dims").split(",") if d]
        out.append(int(math.prod(dims) * dtype_bytes(m.group("dtype"))))
    return out


@dataclasses.dataclass(frozen=True)
class HloOps:
    """Per-instruction facts of one or more compiled modules.

    Attributes:
      name_stacks: instruction name -> jax name stack (`op_name` metadata).
      opcodes: instruction name -> HLO opcode (`fusion`, `collective-permute`, ...).
      permute_bytes: collective-permute instruction name -> bytes one device sends
        each time it runs (the operand; for an async `-start`, half of its buffers;
        for a `-done`, its result, the same size in a ring).
      permute_bytes_by_stack: jax name stack -> bytes of each transfer issued there
        (one per `collective-permute` or `-start`), for `permute_size`.
    """

    name_stacks: dict[str, str]
    opcodes: dict[str, str]
    permute_bytes: dict[str, int]
    permute_bytes_by_stack: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    modules: tuple[str, ...] = ()  # the `HloModule` names the text holds
    entry: bool = False  # the text holds a whole ENTRY computation (one cut short may not)
    program_id: int | None = None  # the module's id, where known (an XLA dump's file name)

    def name_stack(self, hlo_op: str) -> str:
        return self.name_stacks.get(hlo_op, "")

    def permute_size(self, hlo_op: str, stack: str = "") -> int | None:
        """Bytes a device sends per run of the collective-permute that a trace event
        names. On GPUs the trace names the instruction as it was before XLA made it
        asynchronous (`ppermute.10.1`), which the compiled text has renamed
        (`collective-permute-start.2`); such an event is sized by its jax name stack,
        which both keep. Where one stack issues several transfers (the ring's backward
        step sends K/V and the f32 dK/dV), each event there counts their mean: exact
        for the step's total, as each of them runs once per ring step. None: unknown."""
        if hlo_op in self.permute_bytes:
            return self.permute_bytes[hlo_op]
        sizes = self.permute_bytes_by_stack.get(stack)
        return sum(sizes) // len(sizes) if sizes else None


def parse_hlo(text: str) -> HloOps:
    """Reads `compiled.as_text()` (one module or several concatenated)."""
    stacks, opcodes, permutes, by_stack, modules = {}, {}, {}, {}, []
    entry, in_entry = False, False
    for line in text.splitlines():
        if line.startswith("HloModule "):
            modules.append(line.split()[1].rstrip(","))
            continue
        if line.startswith("ENTRY "):
            in_entry = True
        elif in_entry and line.rstrip() == "}":  # the ENTRY computation ends whole
            entry, in_entry = True, False
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, op = m.group("name"), m.group("op")
        opcodes[name] = op
        meta = _OP_NAME.search(line)
        if meta:
            stacks[name] = meta.group("stack")
        if op in COLLECTIVE_PERMUTES:
            sizes = [b for b in array_bytes(m.group("type")) if b > 4]  # drop u32[] sync flags
            permutes[name] = sum(sizes) // 2 if op.endswith("-start") else sum(sizes)
            if meta and not op.endswith("-done"):
                by_stack.setdefault(meta.group("stack"), []).append(permutes[name])
    return HloOps(
        name_stacks=stacks,
        opcodes=opcodes,
        permute_bytes=permutes,
        permute_bytes_by_stack=by_stack,
        modules=tuple(dict.fromkeys(modules)),
        entry=entry,
    )


if __name__ == "__main__":
    import sys

    from train.tools import not_a_command

    sys.exit(not_a_command("train.tools.hlo"))
