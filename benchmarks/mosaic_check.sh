#!/usr/bin/env bash
# The Mosaic GPU kernels on a Hopper GPU: compiled correctness tests, then the
# same-run kernel table against cuDNN and the Triton kernel; `ptxas` (not in `all`)
# prints each kernel's registers and spills as ptxas reports them (and, with nvdisasm,
# where they sit per loop: benchmarks/sass.py), for a kernel change
# to be read before it is timed.
#   bash benchmarks/mosaic_check.sh [tests|table|tune|split|ptxas|all]
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
part=${1:-all}
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
if [[ $part == table || $part == all ]]; then
  stamp "kernel table"
  timeout 540 python3 benchmarks/kernel.py --impls jflash_mosaic,jflash_mosaic_det,jflash,cudnn --out "$OUT" 2>&1 \
    | grep -v Warning | tail -40
fi
if [[ $part == tune || $part == all ]]; then
  # TUNE_WHICH=fwd|bwd|both, TUNE_SEQS: the lengths tuned at D=128.
  for seq in ${TUNE_SEQS:-16384 65536}; do
    stamp "tune mosaic D=128 S=$seq"
    timeout 240 python3 benchmarks/kernel.py --tune --tune-impl jflash_mosaic --head-dim 128 \
      --seq "$seq" --which "${TUNE_WHICH:-both}" --out "$OUT" 2>&1 \
      | grep -v Warning | grep -v "^{" | tail -20
  done
fi
if [[ $part == split || $part == all ]]; then
  # Forward+backward time per GPU kernel, ours against cuDNN's.
  for shape in "16384 128" "65536 128" "16384 64"; do
    set -- $shape
    stamp "kernel split S=$1 D=$2"
    timeout 180 python3 benchmarks/kernel.py --kernels --seq "$1" --head-dim "$2" \
      --impls jflash_mosaic,jflash_mosaic_det,cudnn --out "$OUT" 2>&1 | grep -v Warning | tail -20
  done
fi
if [[ $part == tests || $part == all ]]; then
  stamp "compiled tests (Mosaic)"
  # Four workers share the GPU (compiling dominates): about 5 minutes on an H100.
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 480 python3 -m pytest -q -n 4 \
    tests/test_flash.py tests/test_mosaic_segments.py tests/test_ring.py tests/test_ring_rank.py \
    tests/test_work_items.py -k "mosaic or repeated" -p no:cacheprovider 2>&1 | tail -25
fi
stamp done
if [[ $part == ptxas ]]; then
  # Each kernel a causal forward+backward compiles (bf16, 16/4 heads; PTXAS_SHAPES: "S:D ...").
  for shape in ${PTXAS_SHAPES:-4096:64 16384:64 16384:128}; do
    seq=${shape%%:*} hd=${shape##*:}
    dir=$(mktemp -d)
    stamp "ptxas S=$seq D=$hd"
    MOSAIC_GPU_DUMP_TO="$dir" MOSAIC_GPU_DUMP_PTXAS=1 timeout 240 python3 - "$seq" "$hd" <<'PY' 2>&1 | grep -v Warning | tail -3
import sys

import jax
import jax.numpy as jnp

import jflash

seq, hd = map(int, sys.argv[1:])
q = jnp.ones((1, seq, 16, hd), jnp.bfloat16)
kv = jnp.ones((1, seq, 4, hd), jnp.bfloat16)


def loss(q, k, v):
    return jflash.flash_attention(q, k, v, causal=True).astype(jnp.float32).sum()


jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))
PY
    for f in "$dir"/*.ptxas; do
      [[ -e $f ]] || { echo "  no ptxas report (not a Hopper GPU?)"; break; }
      echo "  $(basename "$f" .ptxas): $(grep -h -o 'Used [0-9]* registers\|[0-9]* bytes spill stores' "$f" | paste -sd ' ')"
    done
    # Where the spills sit, per loop (ptxas and nvdisasm needed: benchmarks/sass.py).
    compgen -G "$dir/*.ptx" >/dev/null && python3 benchmarks/sass.py "$dir"/*.ptx 2>&1 | tail -40
    rm -rf "$dir"
  done
fi
