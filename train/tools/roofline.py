"""Roofline inputs: ceilings measured on the device, and analytic FLOPs/bytes.

Ceilings (measured at startup on device 0, the same machine as the profile):
a bf16 matmul rate (8192^3 on a GPU) and the device-copy bandwidth (read + write
of a large array). On CPU small f32 versions are measured and labelled so.

Arithmetic intensity (FLOPs / bytes) of the two kernel classes is analytic, from
the model shape, with *compulsory* traffic (each operand read once, each result
written once), so it is an upper bound on the kernels' real intensity:

* matmuls: every projection and the LM head, `[T, D_in] x [D_in, D_out]`, forward
  and the two backward matmuls (3x both FLOPs and bytes), bf16 operands.
* attention (per layer, per device of a ring over `P` devices holding `T/P` query
  tokens): forward reads q, all K/V blocks, writes o and the f32 LSE; backward reads
  q, o, dO, LSE and K/V, writes dQ, dK, dV. FLOPs use the kernel convention of
  FlashAttention papers: causal forward `4 T_q T Hq D / 2`, forward + backward 3.5x that.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from models.config import LlamaConfig

BF16 = 2  # bytes


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured peak rates of one device.

    Attributes:
      matmul_tflops: achieved matmul rate, TFLOP/s.
      copy_gbps: device copy bandwidth (bytes read + written per second), GB/s.
      matmul_label, copy_label: what was measured (shape, dtype, device).
    """

    matmul_tflops: float
    copy_gbps: float
    matmul_label: str
    copy_label: str
    device: str


def _median_time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(device=None) -> Ceilings:
    """Times a square matmul and an array copy on `device` (default: the first)."""
    device = device or jax.devices()[0]
    gpu = device.platform == "gpu"
    n, dtype = (8192, jnp.bfloat16) if gpu else (1024, jnp.float32)
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), dtype), device)
    seconds = _median_time(jax.jit(jnp.matmul), a, b, iters=20 if gpu else 5)
    matmul = 2 * n**3 / seconds / 1e12
    size = 2**30 if gpu else 2**26  # bytes
    x = jax.device_put(jnp.ones((size // 4,), jnp.float32), device)
    seconds = _median_time(jax.jit(lambda v: v + 1.0), x, iters=20 if gpu else 5)
    copy = 2 * size / seconds / 1e9
    where = (
        device.device_kind
        if device.device_kind == device.platform
        else (f"{device.platform}: {device.device_kind}")
    )
    return Ceilings(
        matmul_tflops=matmul,
        copy_gbps=copy,
        matmul_label=f"{jnp.dtype(dtype).name} matmul {n}^3 ({where})",
        copy_label=f"copy of {size / 2**20:.0f} MiB, read + write ({where})",
        device=device.device_kind,
    )


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs and compulsory bytes of one kernel class, per device per step."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def matmul_work(config: LlamaConfig, tokens: int) -> Work:
    """Projections + LM head for `tokens` tokens on one device, forward + backward."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)] * config.num_layers
    shapes.append((d, config.vocab_size))
    flops = sum(2 * tokens * i * o for i, o in shapes)
    moved = sum(BF16 * (tokens * i + i * o + tokens * o) for i, o in shapes)
    return Work(flops=3 * flops, bytes=3 * moved)


def attention_work(config: LlamaConfig, seq_len: int, seq_shards: int, batch: int) -> Work:
    """Causal attention of one device's `seq_len / seq_shards` queries, fwd + bwd."""
    t_q, hq, hkv, hd = seq_len // seq_shards, config.num_heads, config.num_kv_heads, config.head_dim
    q_side = t_q * hq * hd  # elements of q (= o = dO = dQ)
    kv_side = seq_len * hkv * hd  # elements of all K (= V) blocks the ring brings
    lse = 4 * t_q * hq  # f32
    fwd_bytes = BF16 * (2 * q_side + 2 * kv_side) + lse
    bwd_bytes = BF16 * (4 * q_side + 4 * kv_side) + lse
    fwd_flops = 4 * t_q * seq_len * hq * hd / 2
    layers = config.num_layers * batch
    return Work(flops=3.5 * fwd_flops * layers, bytes=(fwd_bytes + bwd_bytes) * layers)


if __name__ == "__main__":
    import sys

    from train.tools import not_a_command

    sys.exit(not_a_command("train.tools.roofline"))
