"""Temporary A/B: the backward kernels with and without turns (ping-pong), one process."""

import hashlib
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import jit_passes  # noqa: E402
from benchmarks.kernel import attention_fn, draw_inputs  # noqa: E402
from jflash import _mosaic_bwd  # noqa: E402
from train.trace import kernel_durations  # noqa: E402

ITERS = 10
SHAPES = [(int(s), int(d)) for s, d in (x.split("x") for x in sys.argv[1].split(","))]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
out = []


def traced(compiled, inputs):
    jax.block_until_ready([compiled(*inputs) for _ in range(3)])
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready([compiled(*inputs) for _ in range(ITERS)])
        spent = kernel_durations(d)
    return {k[:40]: v / ITERS / 1e6 for k, v in spent.items() if v / ITERS / 1e6 > 0.05}


for seq, hd in SHAPES:
    inputs = draw_inputs(1, seq, 32, 8, hd)
    impls = ["jflash_mosaic"] + (["jflash_mosaic_det"] if hd == 64 else [])
    compiled = {}
    grads = {}
    for impl in impls:
        for on in (False, True):
            _mosaic_bwd.TURNS.update(dkv=on, dq=on)
            fn = jit_passes(attention_fn(impl))["fwdbwd"][0]
            lowered = fn.lower(*inputs)
            h = hashlib.md5(lowered.as_text().encode()).hexdigest()[:8]
            compiled[impl, on] = lowered.compile()
            o, g = compiled[impl, on](*inputs)
            grads[impl, on] = g
            print(f"compiled {seq=} {hd=} {impl} turns={on} hlo={h}", flush=True)
        diff = [
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(grads[impl, False], grads[impl, True], strict=True)
        ]
        print(f"  {impl}: max |grad(off) - grad(on)| dq/dk/dv = {diff}", flush=True)
    cudnn = jit_passes(attention_fn("cudnn"))["fwdbwd"][0].lower(*inputs).compile()
    for r in range(ROUNDS):
        row = {"seq": seq, "hd": hd, "round": r, "cudnn": traced(cudnn, inputs)}
        for impl in impls:
            for on in (False, True):
                row[f"{impl}/{'on' if on else 'off'}"] = traced(compiled[impl, on], inputs)
        out.append(row)
        print(json.dumps(row, indent=None), flush=True)

os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "pp_ab.json"), "w") as f:
    json.dump(out, f, indent=1)
