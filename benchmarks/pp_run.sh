export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
s() { echo "[$(date +%H:%M:%S)] $*"; }
for args in "bwd 4096 128 1" "bwd 1000 64 0" "fwd 4096 128 1"; do
  s smoke $args
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 benchmarks/mosaic_smoke.py $args > $OUT/smoke.log 2>&1; rc=$?
  grep -i -E "spill|error|max" $OUT/smoke.log | grep -v Warning | sort | uniq -c | tail -8; echo rc=$rc
  [ $rc -ne 0 ] && exit 1
done
s ab
timeout 330 python3 benchmarks/pp_ab.py 65536x128,16384x128,16384x64 3 2>&1 | grep -v -i warning
s tests
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 python3 -m pytest -q -x tests/test_flash.py -k mosaic -p no:cacheprovider 2>&1 | tail -4
s done
