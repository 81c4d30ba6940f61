#!/usr/bin/env bash
# Stage-by-stage Mosaic smoke test with short timeouts (a hang is the failure mode), on a
# Hopper GPU. Arguments go to every stage: `bash benchmarks/mosaic_smoke.sh --interpret`
# runs them in jax's GPU interpreter on CPU.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
for args in "fwd 256 128 1" "fwd 1000 64 0" "fwd 4096 128 1" "bwd 256 128 1" "bwd 1000 64 0" "bwd 4096 128 1"; do
  echo "[$(date +%H:%M:%S)] $args"
  timeout 45 python3 benchmarks/mosaic_smoke.py $args "$@" 2>&1 | grep -v Warning | tail -4
  echo "rc=${PIPESTATUS[0]}"
done
