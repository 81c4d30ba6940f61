"""`2^x` shared between two pipes: the SFU and a polynomial on the FMA units.

At D = 64 the forward's softmax takes one `ex2` per score, and an SM's special-function
units run 16 of them per clock against 4,096 FLOPs of wgmma: 256 FLOPs per score at D =
64 is the tensor cores' rate, so a warpgroup's softmax takes as long as the other's
matmuls and the two-warpgroup ping-pong waits on it. `split_exp2` hands a share of the
scores (one f32 register pair in `POLY_EVERY`) to a polynomial on the FMA units, as
FlashAttention-4 does: a clamp, a round to an integer by adding 1.5 * 2^23, a cubic for
`2^f` on `[-0.5, 0.5]` and the integer added into the exponent bits; eight FMA/ALU
instructions against one SFU one. The cubic's relative error is at most 7.5e-5 (a bf16
probability's rounding is up to 2^-9 = 2.0e-3).

The polynomial only takes inputs that are finite and at most 0 (a step with no mask:
`s * scale - max`); below -125 it returns 2^-125 instead of a smaller power (still zero
in every sum it meets next to the row's maximum, 1). Masked entries (`-inf`) go
through the SFU, which returns exactly 0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

# 2^f ~ C0 + C1 f + C2 f^2 + C3 f^3 on [-0.5, 0.5], least maximum relative error
# (7.5e-5, in float32 arithmetic).
POLY = (0.9999281, 0.69326097, 0.24261034, 0.05517134)
POLY_MIN = -125.0  # clamp: the result's exponent stays a normal one
ROUND = 12582912.0  # 1.5 * 2^23: `x + ROUND` is x rounded to an integer j, in its low bits
# One f32 register pair in this many takes the polynomial (the rest the SFU).
POLY_EVERY = 4


def poly_exp2(x):
    """The polynomial `2^x` in jnp (float32, `x` finite and <= 0), for tests and the
    interpreter: the kernels' arithmetic, with j rounded by `jnp.round` (the same
    round-half-to-even; XLA may reassociate `x - ((x + ROUND) - ROUND)` into 0)."""
    x = jnp.maximum(x, jnp.float32(POLY_MIN))
    j = jnp.round(x)
    f = x - j
    c0, c1, c2, c3 = (jnp.float32(c) for c in POLY)
    p = ((c3 * f + c2) * f + c1) * f + c0
    bits = lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(
        j.astype(jnp.int32), jnp.int32(23)
    )
    return lax.bitcast_convert_type(bits, jnp.float32)


def split_exp2(x, *, every: int = POLY_EVERY):
    """`2^x` of a compiled kernel's f32 array in the WGMMA layout (`x` finite, <= 0):
    one register pair of each thread's in `every` by the polynomial, the rest by
    `ex2.approx.ftz.f32`."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith
    from jaxlib.mlir.dialects import math as mlir_math

    def splat(vec_ty, value):
        elem = ir.VectorType(vec_ty).element_type
        if isinstance(elem, ir.FloatType):
            attr = ir.FloatAttr.get(elem, value)
        else:
            attr = ir.IntegerAttr.get(elem, value)
        return arith.constant(vec_ty, ir.DenseElementsAttr.get_splat(vec_ty, attr))

    def poly(reg):
        ty = reg.type
        [n] = ir.VectorType(ty).shape
        ity = ir.VectorType.get([n], ir.IntegerType.get_signless(32))
        x = arith.maxnumf(reg, splat(ty, POLY_MIN))
        # `x + ROUND` in inline PTX, so that LLVM cannot fold `x - ((x + ROUND) - ROUND)`.
        t = add_rn(x, splat(ty, ROUND))
        f = arith.subf(x, arith.subf(t, splat(ty, ROUND)))
        c0, c1, c2, c3 = POLY
        p = mlir_math.fma(splat(ty, c3), f, splat(ty, c2))
        p = mlir_math.fma(p, f, splat(ty, c1))
        p = mlir_math.fma(p, f, splat(ty, c0))
        # t's bits are ROUND's plus j: shifted by 23, ROUND's part leaves the word.
        shift = arith.shli(arith.bitcast(ity, t), splat(ity, 23))
        return arith.bitcast(ty, arith.addi(arith.bitcast(ity, p), shift))

    sfu = mgpu.FragmentedArray._lift_fast_instr("ex2.approx.ftz.f32")
    add_rn = mgpu.FragmentedArray._lift_fast_instr("add.rn.f32")

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=plgpu.Layout.WGMMA),
    )
    def body(_, fa):
        regs = fa.registers
        out = np.empty(regs.shape, dtype=object)
        for i, idx in enumerate(np.ndindex(regs.shape)):
            out[idx] = poly(regs[idx]) if i % every == 0 else sfu(regs[idx])
        return mgpu.FragmentedArray(_registers=out, _layout=fa.layout, _is_signed=None)

    return body(x)
