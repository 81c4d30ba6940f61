"""The Mosaic GPU kernels compiled for a Hopper GPU on a machine without one: each
kernel's PTX, and ptxas's registers, spills and wgmma serialisations, read before a GPU
is at hand (a kernel change that spills is known to run slower).

    # once: the CUDA plugin's two wheels into a folder of their own (not the venv, whose
    # jax would then look for a GPU at every start), and ptxas on the PATH
    pip install --no-deps --target .deviceless jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
    python benchmarks/deviceless.py --shapes causal:16384:128,causal:4096:64 --dump dump
    python benchmarks/sass.py dump/*dkv*.ptx       # where the spills sit (nvdisasm)

XLA compiles for a GPU it is told about (a target configuration: the GPU's SM count,
shared memory and compute capability) instead of one it finds, the deviceless compile of
its ahead-of-time path; Mosaic GPU then lowers each kernel to PTX and assembles it with
the ptxas on the PATH, as on the GPU. Each shape is one causal or full forward+backward
call (`--pass fwd`: the forward alone) of batch 1 with `--heads` / `--kv-heads` heads,
bf16, through `implementation="pallas_mosaic"`; `documents` is causal with segment ids
(packed documents: the forward's id-compare and span kernels, the dK/dV kernel's
segment form), whose values a compile does not see; `ring` is one rank of a causal
zigzag ring of two GPUs holding `seq` tokens (`ring_attention_rank` at a traced rank:
the diagonal block's kernels and the two half blocks', f32 results), `ring-documents`
the same over packed documents. After each compile the optimised HLO is read for a
Mosaic launch given the buffer it writes in place as another operand too (XLA merges
equal values, such as two zero constants): a defect the run stops on. The kernels'
parameters and launch order are those of the named GPU (`--gpu`; both have 132 SMs);
the ptxas is this machine's, whose version may differ from the GPU machine's jax
wheels'."""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PLUGIN_WHEELS = "jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2"

# XLA's GPU target configurations (text protos): what the compile reads of the GPU.
_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{name}"
"""
GPUS = {
    "h100": _TARGET.format(
        name="NVIDIA H100 80GB HBM3", memory=84942979072, bandwidth=3352320000000
    ),
    "h200": _TARGET.format(name="NVIDIA H200", memory=150754820096, bandwidth=4800000000000),
}


MASKS = ("causal", "full", "documents", "ring", "ring-documents")


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """`mask:seq:head_dim,...` (mask one of `MASKS`) as tuples."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in MASKS:
            raise ValueError(f"--shapes item {item!r} is not {'|'.join(MASKS)}:SEQ:HEAD_DIM")
        try:
            seq, head_dim = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"--shapes item {item!r}: SEQ and HEAD_DIM must be integers") from None
        shapes.append((parts[0], seq, head_dim))
    return shapes


def load_plugin(plugin_dir: str) -> None:
    """Puts the CUDA plugin's folder first on the path, or stops with the command that
    installs it."""
    if not os.path.isdir(os.path.join(plugin_dir, "jax_plugins", "xla_cuda13")):
        raise SystemExit(
            f"--plugin-dir {plugin_dir!r} holds no CUDA plugin: pip install --no-deps "
            f"--target {plugin_dir} {PLUGIN_WHEELS}"
        )
    sys.path.insert(0, os.path.abspath(plugin_dir))


def compile_shape(devices, mask: str, seq: int, head_dim: int, args) -> None:
    """One call's kernels compiled for the target GPU (their PTX lands in the dump)."""
    import jax
    import jax.numpy as jnp

    import jflash

    mesh = jax.sharding.Mesh(devices, ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, seq, args.heads, head_dim), jnp.bfloat16, sharding=replicated)
    kv = jax.ShapeDtypeStruct((1, seq, args.kv_heads, head_dim), jnp.bfloat16, sharding=replicated)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=replicated)

    def attention(q, k, v, ids):
        return jflash.flash_attention(
            q,
            k,
            v,
            causal=mask != "full",
            segment_ids=ids if mask == "documents" else None,
            implementation="pallas_mosaic",
            deterministic=args.deterministic,
        )

    def loss(q, k, v, ids):
        return attention(q, k, v, ids).astype(jnp.float32).sum()

    def ring_rank(q, k, v, rank, ids):
        return jflash.ring_attention_rank(
            q, [(k, v)] * 2, q, rank, causal=True, layout="zigzag",
            implementation="pallas_mosaic", deterministic=args.deterministic,
            segment_ids=None if ids is None else (ids, [ids] * 2),
        )  # fmt: skip

    if mask.startswith("ring"):
        rank = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        ring_ids = ids if mask == "ring-documents" else None
        traced = jax.jit(ring_rank).trace(q, kv, kv, rank, ring_ids)
    else:
        fn = attention if args.pass_ == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
        traced = jax.jit(fn).trace(q, kv, kv, ids)
    compiled = traced.lower(lowering_platforms=("cuda",)).compile()
    shared = shared_aliased_operands(compiled.as_text())
    if shared:
        raise SystemExit(
            f"{mask}:{seq}:{head_dim}: a Mosaic launch is given the buffer it writes in "
            f"place as another operand too (XLA merged equal values): {'; '.join(shared)}"
        )


_CALL = re.compile(r"(%\S+) = .*? custom-call\((.*?)\), custom_call_target=\"mosaic_gpu")
_ALIASED = re.compile(r"\{[\d,]*\}: \((\d+), \{")


def shared_aliased_operands(hlo: str) -> list[str]:
    """The Mosaic custom calls of optimised HLO text one of whose in-place operands (an
    output aliased to it: an accumulator, or the zeroed work-item counter Pallas adds) is
    also passed as another operand: the kernel would read what it writes there."""
    found = []
    for line in hlo.splitlines():
        call = _CALL.search(line)
        if not call or "output_to_operand_aliasing={" not in line:
            continue
        operands = [re.sub(r"/\*.*?\*/", "", x).strip() for x in call.group(2).split(",")]
        aliasing = line.split("output_to_operand_aliasing={", 1)[1]
        for j in sorted({int(x) for x in _ALIASED.findall(aliasing)}):
            if operands.count(operands[j]) > 1:
                found.append(f"{call.group(1)} operand {j} ({operands[j]})")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="causal:16384:128,causal:16384:64,causal:4096:64")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--plugin-dir", default=".deviceless")
    parser.add_argument("--ptxas", default=None)
    parser.add_argument("--dump", default=None, help="folder kept with each kernel's PTX")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        parser.error(str(e))
    # Before jax is imported: its plugins are found on the path as it starts, and Mosaic
    # GPU reads where to dump as it loads.
    load_plugin(args.plugin_dir)
    dump = args.dump or tempfile.mkdtemp(prefix="deviceless-")
    os.environ["MOSAIC_GPU_DUMP_TO"] = os.path.abspath(dump)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax.experimental import topologies

    from benchmarks.common import as_hopper, check_out, table, write_json
    from benchmarks.sass import assemble, find_tool

    if args.out:
        check_out(parser, "--out", args.out)
    ptxas = find_tool("ptxas", args.ptxas)  # Mosaic GPU's compile runs it too
    os.environ["PATH"] = os.path.dirname(ptxas) + os.pathsep + os.environ["PATH"]
    os.makedirs(dump, exist_ok=True)

    import jflash

    topology = topologies.get_topology_desc(
        "deviceless", "cuda", target_config=GPUS[args.gpu], topology="1x1x1"
    )
    rows = []
    # The library picks its kernels from the process's own devices (CPU here): it is
    # told that they are the Hopper GPU the compile targets.
    with as_hopper(jflash, narrow_memory=args.gpu == "h100"), tempfile.TemporaryDirectory() as tmp:
        for mask, seq, head_dim in shapes:
            before = set(glob.glob(os.path.join(dump, "*.ptx")))
            try:
                compile_shape(topology.devices, mask, seq, head_dim, args)
            except ValueError as e:  # jflash's refusals of a shape, heads or head dim
                raise SystemExit(f"{mask}:{seq}:{head_dim}: {e}") from None
            for ptx in sorted(set(glob.glob(os.path.join(dump, "*.ptx"))) - before):
                _, report = assemble(ptx, ptxas, tmp)
                rows.append(
                    dict(
                        shape=f"{mask}:{seq}:{head_dim}",
                        kernel=os.path.basename(ptx)[: -len(".ptx")],
                        registers=report["registers"],
                        spill_stores=report["spill_stores"],
                        spill_loads=report["spill_loads"],
                        serialised=", ".join(report["serialised"]) or "none",
                    )
                )
    columns = ["shape", "kernel", "registers", "spill_stores", "spill_loads", "serialised"]
    print(table(rows, columns))
    print(f"PTX in {dump} (benchmarks/sass.py reads where the spills sit)")
    if args.out:
        write_json(args.out, {"gpu": args.gpu, "ptxas": ptxas, "pass": args.pass_, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
