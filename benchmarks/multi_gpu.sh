#!/usr/bin/env bash
# Multi-GPU benchmark runs, one part per call, each within a 9-minute budget (written
# for 2x NVIDIA H200; `ring` also runs P = 4 where the machine has 4 GPUs).
#
#   bash benchmarks/multi_gpu.sh report      # profiling report (train.tools.profile), 3 models
#   bash benchmarks/multi_gpu.sh scale       # longest ring sequence + Llama-2-7B FSDP x seq
#   bash benchmarks/multi_gpu.sh capacity    # longest trainable context, jflash vs HF
#   bash benchmarks/multi_gpu.sh train32k    # 1B at 32k: 1 GPU vs HF, 2 GPUs as the config
#   bash benchmarks/multi_gpu.sh allgpus     # the trainer on every GPU: the Llama-2-7B
#                                            # reference job (8k, 32k), and the 1B at 32k
#                                            # per GPU on 1 GPU and on all of them
#   bash benchmarks/multi_gpu.sh fill        # XLA bytes (HBM GB/s) for the committed
#                                            # report's rows that lack them
#   bash benchmarks/multi_gpu.sh ring        # compiled ring tests, ring vs allgather at
#                                            # 8k/16k per GPU with a device-time
#                                            # breakdown, P = 2 and 4 where the machine
#                                            # has 4; then the 1B at 32k, seq=2, each
#                                            # strategy
#   bash benchmarks/multi_gpu.sh remat       # 1B at 32k, remat save_attn vs none on 1 GPU,
#                                            # none on 2, HF baseline
#   bash benchmarks/multi_gpu.sh seq2trace   # where the seq=2 step's time goes: the 32k
#                                            # config's step (save_dots, unrolled)
#                                            # profiled on 1 GPU and on 2 (sharded)
#   bash benchmarks/multi_gpu.sh gradcheck   # per-parameter gradients of the 32k config's
#                                            # first step: 1 GPU in f32 (the reference)
#                                            # and bf16, 2 GPUs in two weight layouts
#   bash benchmarks/multi_gpu.sh precision   # bf16 gradients against f32 per attention
#                                            # kernel (Mosaic, Triton, cuDNN)
#   bash benchmarks/multi_gpu.sh cp          # context parallelism on every GPU (P = all):
#                                            # compiled ring_attention_shard / Ulysses /
#                                            # hybrid tests; packed documents per layout
#                                            # (8k/16k per GPU); ring vs ulysses vs
#                                            # hybrid vs allgather (8k-32k) beside
#                                            # cp_model's prediction
#   bash benchmarks/multi_gpu.sh cpu-check   # the same pipeline, tiny, on 2 CPU devices
#                                            # (CPU_PARTS="capacity train32k": only those;
#                                            # cp runs on 4; the benchmark scripts that time
#                                            # GPU kernels get --interpret)
#
# Run from anywhere (it cds to the repo root). Results go to $OUT (default
# benchmarks/results/; cpu-check: /tmp/jflash-cpu-check/out), scratch (profile traces,
# work dirs, sample data, per-step logs) to $WORK (default /tmp/jflash-multi-gpu). $OUT
# gets at most 6 files per part, none in sub-folders: the device tool returns at most 8
# files of 16 MiB, 2 folders deep. Every line printed carries a timestamp; the whole
# output is also in $OUT/<part>.log and one line per step (status, exit code,
# seconds, limit) in $OUT/<part>-steps.tsv.
#
# Each step runs under `timeout`, limited to min(its cap, what is left of the part's
# budget minus what must follow); a step that fails is recorded and the part goes on;
# a step that no longer has its minimum time is skipped and recorded as such.
# PYTHON picks the interpreter (default python3; cpu-check: .venv/bin/python if present).
#
# ---- Time per step (estimates for 2x H200; basis below) -------------------------------
# Basis: benchmarks/results/profile-2xh200/report.json (Llama-3.2-1B, seq=2: compile
# 7.8 s; 168 ms/step at 8k, 889 ms at 32k; memory limit 104.85 GiB per GPU, i.e. the
# allocator's default 75% even with XLA_PYTHON_CLIENT_PREALLOCATE=false), ring-triton-2xh200.json
# (one-GPU causal fwd+bwd, 32/8 heads: 309 ms at 64k), and model FLOPs per step
# (models.training_flops_per_token) at ~250 TFLOP/s per GPU: 1B 0.15/0.35/0.9/2.7 s,
# 3B 0.4/0.9/2.4/7.0 s, 7B 0.8/1.7/4.3/12 s per step at 8k/16k/32k/64k. A profile row
# is a fresh process: ~25-35 s of start-up, sample data, init and compile, plus 6 steps
# (1 warm-up, 3 timed, 2 traced) and the trace parse.
#
# report (budget 530 s):
#   A  1B  8k,16k,32k (+ ceilings)        ~100 s   cap 180
#   B  3B  8k,16k,32k                     ~115 s   cap 190
#   C  7B  8k,16k  (--shard-over-seq)     ~110 s   cap 200, always gets >= 120 s
#   D  1B  64k                             ~50 s   cap 120, needs >= 60 s left
#   E  3B  64k                             ~80 s   cap 160, needs >= 100 s left
#   render + collect                       ~15 s
#   Sum ~470 s. All four contexts of 1B and 3B in one go (~330 s) plus the 7B would leave
#   ~60 s of margin on estimates this rough, so the 64k rows are trimmed from the
#   per-model runs and appended last (D, E): they run only if the time is there, and
#   the 7B rows cannot be crowded out by them. `--append
#   --reuse-ceilings` puts every run into one report and measures the ceilings once;
#   report.json is rewritten after every row, so a run stopped by its timeout keeps
#   the rows it finished, and the final `--report-only` renders them all.
#   7B: bf16 compute, f32 master weights + f32 Adam = 6.7e9 x 12 B = 81 GB; replicated
#   over seq=2 that is 75 GiB per GPU before gradients and activations (a CPU-compiled
#   estimate of the step: 125 GiB at 8k), over the 104.85 GiB limit. With
#   --shard-over-seq (ZeRO-3 over both GPUs) it is 37.7 GiB per GPU of state; the CPU
#   compile estimates 63 GiB at 16k (78 at 32k; CPU overestimates the GPU's temporaries
#   by ~2x on the 1B), so 8k and 16k fit with room; 32k is left out for time.
#
# scale (budget 530 s):
#   ring  benchmarks/ring.py --longest      ~130 s   cap 200
#         The plain `--longest` would first run the whole default table (5 lengths x
#         2 device counts x 2 layouts x 2 strategies: ~4 min); here the table is one
#         row (16k tokens/GPU, zigzag ring). The search
#         starts at 128k (known to run on one GPU), doubles, then bisects 4 times (to
#         1/16 of the last doubling): ~20 compiles of the attention alone at ~5 s,
#         compile only. `--longest-run` is left out: one fwd+bwd at the one-GPU
#         longest (~2.5M tokens) would take ~(2.5M/64k)^2 x 0.31 s = ~7.5 min.
#   data  python -m train.data sample, 12 x 64k tokens                       ~5 s
#   7B    Llama-2-7B shape, FSDP x seq on 2 GPUs, 64k context, 10 steps   ~200 s
#         (10 x ~12 s + start-up and compile), cap = what is left.
#         Memory per GPU, params/grads/optimizer sharded over both GPUs
#         (--mesh data=1,fsdp=1,seq=2 --shard_over_seq, configs/llama2_7b_8k_4gpu.yaml's setup):
#           f32 master weights 27 GB/2 + f32 Adam m,v 54 GB/2 = 40.4 GB (37.7 GiB),
#           f32 gradients 13.5 GB, bf16 weights gathered per layer (<= 13.5 GB if XLA
#           hoists the gathers), optimizer temporaries ~13.5 GB,
#           activations with remat=save_attn: per layer the layer input and the
#           attention output (bf16, 2 x 8 KiB per token) + LSE: ~0.53 MB per local
#           token over 32 layers: 32k local tokens (64k context) = 17 GB; one layer's
#           recompute (MLP 11008 wide) ~3 GB; chunked loss (1024 tokens) is small.
#           Total by hand ~100 GB (~94 GiB), an upper bound. A CPU compile of this
#           step (memory_analysis, 2 simulated devices) gives 37.7 GiB of state + 87.8
#           GiB of temporaries = 125.5 GiB; on the 1B at 32k the same CPU estimate is
#           36.4 GiB against 23.8 measured on the GPU (temporaries 22.6 vs 10.0), so
#           the GPU should need ~76-85 GiB at 64k.
#         So 64k fits the default 0.75 fraction (104.85 GiB) with ~20 GiB to spare;
#         the run raises it to 0.92 (129 GiB) as insurance. 128k (+17 GB of
#         activations, ~35 s per step) fits neither memory nor time. If 64k still runs
#         out of memory, 32k (CPU estimate 78 GiB, GPU ~50-60; ~4.3 s per step, ~110 s
#         in all) runs instead when the time is left.
#   Sum ~340 s.
#
# cp (budget 530 s; P = all GPUs). Measured on 4x H100, 2026-11-27 (benchmarks/results/
# cp-4xh100.log): the three steps need ~1,100 s there, more than two calls' worth, so on 4 GPUs
# run them as CP_STEPS=tests, then CP_STEPS=documents, then CP_STEPS=strategies (with
# CP_TOKENS=8192,16384 and =32768 in two calls if the first is cut); on 2 GPUs about
# half.
#   tests       test_ring_shard.py (24: P = 2 and 4, every layout, ring and allgather
#               with segment ids, a partial shard_map, MQA, Ulysses, the 2x2 hybrid,
#               Triton and Mosaic kernels in a user's shard_map, documents across
#               shards) then test_ring.py's GPU subset (allgather, Mosaic, lowering:
#               22); tests needing more GPUs skip (P = 4 ones on 2 GPUs, P = 8 ones).
#               ~2-5 s each on the xla path; a Mosaic test 8-25 s at P = 2 and 51 s
#               at P = 4 (compiling): 320 s for 45 on 4x H100   ~330 s  cap 420
#   documents   ring.py --documents: 3 layouts x 8k, 16k per GPU, forward+backward
#               only, one trace per row: ~45-60 s per 8k row at P = 4
#                                                                   ~330 s  cap 180
#               (the rest without strategies)
#   strategies  ring.py --cp-model: 4 strategies x 8k, 16k, 32k: ~40 s per 8k/16k row
#               and ~35 s per 32k row at P = 4 (first row of a process: +45 s
#               compile and link measurement)                       ~420 s  the rest
#   Both tables run --rounds 3: after each sequence's rows, they and the one-GPU ideal
#   are timed twice more, interleaved (~10-30 s per sequence at P = 4).
#   Rows go in order (8k first; strategies ring, ulysses, hybrid, allgather) and each
#   row's JSON is written as it finishes, so a cut step keeps its rows; CP_STEPS
#   ("tests documents strategies") and CP_DOC_TOKENS / CP_TOKENS (8192,16384 /
#   8192,16384,32768) run the rest in another call. CP_DOC_STRATEGIES (default ring;
#   e.g. ring,allgather: all-gather has no per-step f32 merges, and takes zigzag and
#   contiguous, not striped, when causal) picks the documents rows' strategies. The
#   trainer on all GPUs is the `allgpus` part.
#
# allgpus (budget 530 s). Measured on 4x H200, 2026-11-27, with the ring strategy
# (benchmarks/results/allgpus-4xh200.log): 323 s in all.
#   train-7b-8k    Llama-2-7B shape, 8k over P = 4 (2k tokens per GPU), full remat,
#                  scanned layers: start-up and compile + 8 steps x 0.38 s     61 s
#                  (Ulysses, the config's strategy now: 28 s)
#   train-7b-32k   the same at 32k: 8 steps x 1.5 s                            70 s
#   train-1b-1gpu  the 32k config on GPU 0: 15 steps x 1 s                     38 s
#   train-1b-4gpu  128k over 4 (32k per GPU, 50 GiB each): 15 x 2.9 s          139 s
#   sample data ~10 s.
set -u -o pipefail

PART=${1:-}
case "$PART" in
  report | scale | capacity | train32k | allgpus | fill | ring | cp | remat | seq2trace | gradcheck | precision) MODE=gpu ;;
  cpu-check) MODE=cpu ;;
  *)
    echo "usage: bash $0 report|scale|capacity|train32k|allgpus|fill|ring|cp|remat|seq2trace|gradcheck|precision|cpu-check" >&2
    exit 2
    ;;
esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1

export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

if [ "$MODE" = cpu ]; then
  OUT=${OUT:-/tmp/jflash-cpu-check/out}
  WORK=${WORK:-/tmp/jflash-cpu-check/work}
  if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
  # 2 simulated devices, like the 2 GPUs.
  BASE_XLA_FLAGS="--xla_force_host_platform_device_count=2"
  BUDGET=${BUDGET:-1800}
  GPU=cpu TAG=2xcpu
else
  OUT=${OUT:-benchmarks/results/}
  WORK=${WORK:-/tmp/jflash-multi-gpu}
  BASE_XLA_FLAGS=""
  BUDGET=${BUDGET:-530} # 9 minutes less 10 s
  # Result names say where: GPU is one GPU of the machine ("h200"), TAG all of it ("2xh200").
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
    grep -oE '[A-Z]+[0-9]+[A-Za-z]*' | head -1 | tr '[:upper:]' '[:lower:]')
  GPU=${GPU:-gpu}
  TAG=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")x$GPU
fi
PY=${PYTHON:-python3}
OUT=${OUT%/}
mkdir -p "$OUT" "$WORK/logs"
LOG="$OUT/$PART.log"
STEPS="$OUT/$PART-steps.tsv"
: >"$LOG"
printf 'step\tstatus\texit\tseconds\tlimit_s\n' >"$STEPS"
START=$(date +%s)

# ---------------------------------------------------------------------------------------
# Helpers

ts() { # prefix each line with the time and the seconds since the part started
  local line now
  while IFS= read -r line || [ -n "$line" ]; do
    printf -v now '%(%s)T' -1
    printf '[%(%H:%M:%S)T +%4ds] %s\n' -1 "$((now - START))" "$line"
  done
}

say() { echo "== $*" | ts; }

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME CAP MIN RESERVE cmd...: runs cmd under timeout for min(CAP, left - RESERVE)
# seconds (RESERVE: what later steps need), or skips it when that is under MIN.
# Output: timestamped, into the part's log and $WORK/logs/NAME.log. Returns cmd's status.
step() {
  local name=$1 cap=$2 min=$3 reserve=$4
  shift 4
  local limit=$(($(left) - reserve))
  if [ "$limit" -gt "$cap" ]; then limit=$cap; fi
  if [ "$limit" -lt "$min" ]; then
    say "$name: SKIPPED ($limit s left for it, needs $min s)"
    printf '%s\tskipped\t-\t0\t%s\n' "$name" "$limit" >>"$STEPS"
    return 99
  fi
  say "$name: start (limit $limit s): $*"
  local t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.log" | ts
  local rc=${PIPESTATUS[0]}
  local dt=$(($(date +%s) - t0))
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=timeout
  elif [ "$rc" -ne 0 ]; then
    status=failed
  fi
  say "$name: $status (exit $rc) after $dt s"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$dt" "$limit" >>"$STEPS"
  return "$rc"
}

env_info() {
  say "part=$PART mode=$MODE budget=${BUDGET}s OUT=$OUT WORK=$WORK python=$PY"
  {
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) changed files"
    "$PY" -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)'
    if [ "$MODE" = gpu ]; then
      timeout 30 nvidia-smi --query-gpu=index,name,memory.total,memory.used,clocks.sm --format=csv
    fi
    env | grep -E '^(XLA_|NCCL_NVLS|TORCH_SYMM|NVSHMEM_DISABLE|PYTHONPATH)' | sort
  } 2>&1 | ts
}

# ---------------------------------------------------------------------------------------
# report: the profiling report (train.tools.profile) for three models

part_report() {
  local prof="$WORK/profile-$TAG"
  rm -rf "$prof"
  local pxla="$BASE_XLA_FLAGS --xla_gpu_enable_command_buffer="
  pxla=${pxla# }
  local common=(--mesh seq=2 --steps 3 --warmup 1 --trace-steps 2 --no-xla-cost --out "$prof" --append)
  local m1 m3 m7 ctx ctx7 long1 long3 row_timeout
  if [ "$MODE" = gpu ]; then
    m1=llama3.2-1b m3=llama3.2-3b m7=llama2-7b
    ctx=8k,16k,32k ctx7=8k,16k long1=64k long3=64k row_timeout=150
  else # the same runs, tiny: distinct contexts keep the row names apart
    m1=tiny m3=tiny m7=tiny
    ctx=256,512 ctx7=256,512 long1=1024 long3=1536 row_timeout=300
    local ctx3=768
  fi
  local profile=(env "XLA_FLAGS=$pxla" "$PY" -m train.tools.profile "${common[@]}" --timeout "$row_timeout")
  local render_reserve=20
  # A and B keep back B's and C's minimum and the render's time, so that C (the 7B)
  # has >= 120 s even when A and B run to their caps (180 + 190 + 140 + 20 = 530).
  step profile-A-"$m1" 180 60 $((60 + 120 + render_reserve)) \
    "${profile[@]}" --models "$m1" --context "$ctx"
  step profile-B-"$m3" 190 60 $((120 + render_reserve)) \
    "${profile[@]}" --reuse-ceilings --models "$m3" --context "${ctx3:-$ctx}"
  step profile-C-"$m7" 200 120 "$render_reserve" \
    "${profile[@]}" --reuse-ceilings --shard-over-seq --models "$m7" --context "$ctx7"
  step profile-D-"$m1"-long 120 60 "$render_reserve" \
    "${profile[@]}" --reuse-ceilings --models "$m1" --context "$long1"
  step profile-E-"$m3"-long 160 100 "$render_reserve" \
    "${profile[@]}" --reuse-ceilings --models "$m3" --context "$long3"
  # Render whatever rows exist (a run stopped by its timeout skips its own render).
  step profile-render 60 5 0 "$PY" -m train.tools.profile --report-only "$prof"
  step profile-collect 60 5 0 "$PY" - "$prof" "$OUT" "profile-$TAG" <<'EOF'
import io, json, os, sys, tarfile, zlib

prof, out, name = sys.argv[1:]
report = os.path.join(prof, "report.json")
if not os.path.exists(report):
    sys.exit("no report.json: no profile run wrote a row")
with open(report) as f:
    rows = json.load(f)["rows"]
for r in rows:
    pct = lambda v, f: "–" if v is None else format(v, f)
    detail = f"{r['step_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, " \
        f"MFU {pct(r.get('mfu'), '.1%')}, peak {pct(r.get('peak_memory_gib'), '.1f')} GiB" \
        if r.get("status") == "ok" else (r.get("error") or "").replace("\n", " ")[:160]
    print(f"{r['name']:<40} {r.get('status'):<13} {detail}")
for ext in ("md", "json"):
    src = os.path.join(prof, f"report.{ext}")
    if os.path.exists(src):
        with open(src, "rb") as f, open(os.path.join(out, f"{name}.{ext}"), "wb") as g:
            g.write(f.read())
# The report with its plots, in one file.
with tarfile.open(os.path.join(out, f"{name}.tar.gz"), "w:gz") as tar:
    for entry in sorted(os.listdir(prof)):
        if entry.endswith((".md", ".json", ".png")):
            tar.add(os.path.join(prof, entry), arcname=f"{name}/{entry}")
# Traces (XProf / TensorBoard) of as many rows as fit in 15 MiB, largest model first.
tb = os.path.join(prof, "tensorboard")
runs = sorted(os.listdir(tb)) if os.path.isdir(tb) else []
order = {"llama2-7b": 0, "llama3.2-3b": 1, "llama3.2-1b": 2}
runs.sort(key=lambda n: (min((v for k, v in order.items() if n.startswith(k)), default=3), n))
budget, chosen, total = 15 * 2**20, [], 0
for run in runs:
    size = 0
    for dirpath, _, files in os.walk(os.path.join(tb, run)):
        for fn in files:
            with open(os.path.join(dirpath, fn), "rb") as f:
                size += len(zlib.compress(f.read(), 6))
    if total + size <= budget:
        chosen.append(run)
        total += size
    print(f"trace {run}: ~{size / 2**20:.1f} MiB compressed: {'kept' if run in chosen else 'left out'}")
if chosen:
    with tarfile.open(os.path.join(out, f"{name}-traces.tar.gz"), "w:gz") as tar:
        for run in chosen:
            tar.add(os.path.join(tb, run), arcname=f"tensorboard/{run}")
print(f"wrote {name}.md/.json/.tar.gz" + (f" and {name}-traces.tar.gz ({len(chosen)} rows)" if chosen else ""))
EOF
}

# ---------------------------------------------------------------------------------------
# scale: the longest ring sequence and the Llama-2-7B shape, FSDP x seq

summarise_jsonl() { # FILE: medians over the steady steps (3 on) of the trainer's JSONL log
  "$PY" - "$1" <<'EOF'
import json, statistics, sys

rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
if not rows:
    sys.exit(f"{sys.argv[1]}: no steps logged")
print(f"{sys.argv[1]}: {len(rows)} steps logged, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")
steady = [r for r in rows if r["step"] >= 3 and r.get("tokens_per_s")]


def med(key, fmt):
    values = [r[key] for r in steady if r.get(key) is not None]
    return format(statistics.median(values), fmt) if values else "–"


peak = max((r.get("peak_memory_gib") or 0.0) for r in rows)
if steady:
    print(
        f"steps {steady[0]['step']}-{steady[-1]['step']} (median): "
        f"{med('tokens_per_s', ',.0f')} tokens/s, {med('tflops_per_device', '.1f')} TFLOP/s "
        f"per device, MFU {med('mfu', '.1%')}; peak memory {peak:.1f} GiB"
    )
EOF
}

part_scale() {
  # (a) longest causal fwd+bwd on 1 vs 2 devices, and one row of the ring table
  local ring_args
  if [ "$MODE" = gpu ]; then
    ring_args=(--tokens-per-device 16384 --iters 5 --longest-start 131072)
  else
    ring_args=(--tokens-per-device 64 --iters 1 --warmup 0 --heads 2 --kv-heads 1 --head-dim 16
      --implementation xla --longest-start 128 --longest-max 65536 --longest-limit-gib 0.004
      --interpret)
  fi
  step ring-longest 200 60 150 env "XLA_FLAGS=$BASE_XLA_FLAGS" "$PY" benchmarks/ring.py \
    --devices 2 --layouts zigzag --strategies ring --longest --longest-refine 4 \
    "${ring_args[@]}" --out "$OUT/ring-longest-$TAG.json"

  # (b) Llama-2-7B shape: FSDP x seq over both devices (configs/llama2_7b_8k_4gpu.yaml's
  # 4-GPU setup, on 2)
  local model ctx fallback vocab steps mem_fraction
  if [ "$MODE" = gpu ]; then
    model=llama2-7b ctx=65536 fallback=32768 vocab=32000 steps=10 mem_fraction=0.92
  else
    model=tiny ctx=512 fallback=256 vocab=512 steps=3 mem_fraction=0.75
  fi
  train_at() { # CONTEXT: sample data, 10 steps, JSONL log copied to $OUT
    local c=$1 k=$1
    if [ $(($1 % 1024)) -eq 0 ]; then k=$(($1 / 1024))k; fi
    local data="$WORK/sample-$c.npy" run="$WORK/train-$model-$c"
    rm -rf "$run"
    step "data-$k" 60 5 120 "$PY" -m train.data sample --out "$data" \
      --num-samples 12 --seq-len "$c" --vocab-size "$vocab"
    step "train-$model-$k" 600 90 10 env "XLA_FLAGS=$BASE_XLA_FLAGS" \
      XLA_PYTHON_CLIENT_MEM_FRACTION="$mem_fraction" \
      "$PY" -m train --config configs/llama2_7b_8k_4gpu.yaml --model_name_or_path "$model" \
      --mesh data=1,fsdp=1,seq=2 --shard_over_seq true --ring_strategy ring \
      --model_max_length "$c" --data_path "$data" --max_steps "$steps" --logging_steps 1 --save_strategy no \
      --export_hf false --progress false --output_dir "$run"
    local rc=$?
    if [ -s "$run/log.jsonl" ]; then
      local dst="$OUT/train-$model-$k-seq2-$TAG.jsonl"
      cp "$run/log.jsonl" "$dst"
      summarise_jsonl "$dst" 2>&1 | ts
    fi
    return $rc
  }
  train_at "$ctx"
  local rc=$?
  # Fall back to the shorter context only when the longer one ran out of memory.
  local fall=0
  # (The allocator's "ran out of memory ... this is not a failure" warning does not count.)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 99 ] &&
    cat "$WORK/logs/train-$model-$((ctx / 1024))k.log" "$WORK/logs/train-$model-$ctx.log" \
      2>/dev/null | grep -iE 'resource_exhausted|out of (device )?memory|out_of_memory' |
    grep -qvi 'this is not a failure'; then
    fall=1
    say "context $ctx did not fit: trying $fallback"
  elif [ "$MODE" = cpu ] && [ "${CPU_CHECK_FALLBACK:-1}" = 1 ]; then
    fall=1
    say "cpu-check: runs the fallback context too, to check its command line"
  fi
  if [ "$fall" = 1 ]; then train_at "$fallback"; fi
}

part_capacity() {
  # Longest trainable context, Llama-3.2-1B shape: jflash on 1 vs 2 devices (compiled
  # memory plan of the trainer's step, never run) and HF transformers on 1 (real steps,
  # out of memory = does not fit).
  local cap_args hf_args
  if [ "$MODE" = gpu ]; then
    cap_args=(--models llama3.2-1b --start 64k --max 4m --refine 2)
    hf_args=(--model llama3.2-1b --context 16384 --max 1048576 --refine 3)
  else
    cap_args=(--models tiny --layers 1 --start 512 --max 8192 --refine 1 --limit-gib 0.05)
    hf_args=(--model tiny --layers 1 --context 128 --max 1024 --refine 1)
  fi
  step capacity 330 60 120 env "XLA_FLAGS=$BASE_XLA_FLAGS" "$PY" -m train.tools.capacity \
    --mesh seq=1 --mesh seq=2 "${cap_args[@]}" --out "$OUT/capacity-llama3.2-1b-$TAG.json"
  if "$PY" -c "import torch, transformers" 2>/dev/null; then
    step hf-longest 180 40 0 env CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/hf_baseline.py \
      --longest "${hf_args[@]}" --out "$OUT/hf-longest-llama3.2-1b-$GPU.json"
  else
    say "hf-longest: SKIPPED (no torch/transformers in $PY)"
  fi
}

hf_32k() { # CONTEXT: the HF/PyTorch baseline of the same shape on GPU 0
  local hf_model
  if ! "$PY" -c "import torch, transformers" 2>/dev/null; then
    say "hf-32k: SKIPPED (no torch/transformers in $PY)"
    return 0
  fi
  if [ "$MODE" = gpu ]; then hf_model=(--model llama3.2-1b); else hf_model=(--model tiny --layers 1); fi
  step hf-32k 150 60 0 env CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/hf_baseline.py \
    "${hf_model[@]}" --context "$1" --steps 3 --warmup 1 --out "$OUT/hf-llama3.2-1b-32k-$GPU.json"
}

setup_1b_32k() { # RESERVE: sample data and the trainer's common flags, Llama-3.2-1B at
  # 32k (cpu-check: tiny at 512). Sets the caller's locals ctx steps model vocab
  # log_every one_device data common.
  if [ "$MODE" = gpu ]; then
    ctx=32768 steps=15 model=llama3.2-1b vocab=32000 log_every=5 one_device=""
  else
    ctx=512 steps=3 model=tiny vocab=256 log_every=1
    one_device="--xla_force_host_platform_device_count=1"
  fi
  data="$WORK/sample-$ctx.npy"
  step data-32k 60 5 "$1" "$PY" -m train.data sample --out "$data" --num-samples 40 \
    --seq-len "$ctx" --vocab-size "$vocab" --stream
  common=(--config configs/llama3_2_1b_32k.yaml --model_name_or_path "$model"
    --model_max_length "$ctx" --data_path "$data" --max_steps "$steps" --logging_steps "$log_every"
    --save_strategy no --export_hf false --progress false)
}

part_train32k() {
  # The trainer against HF on 1 GPU (same call), and 2 GPUs as the config runs them (sharded over seq, weights gathered once per step; per-GPU
  # efficiency), Llama-3.2-1B shape at 32k.
  local ctx steps model vocab log_every one_device data common
  setup_1b_32k 300
  rm -rf "$WORK/t1" "$WORK/t2"
  step train-1gpu 150 60 200 env "XLA_FLAGS=$one_device" CUDA_VISIBLE_DEVICES=0 \
    "$PY" -m train "${common[@]}" --mesh data=1,fsdp=1,seq=1 --output_dir "$WORK/t1"
  [ -s "$WORK/t1/log.jsonl" ] && cp "$WORK/t1/log.jsonl" "$OUT/train-llama3.2-1b-32k-seq1-$TAG.jsonl"
  step train-2gpu 150 60 100 env "XLA_FLAGS=$BASE_XLA_FLAGS" "$PY" -m train "${common[@]}" \
    --mesh data=1,fsdp=1,seq=2 --output_dir "$WORK/t2"
  [ -s "$WORK/t2/log.jsonl" ] && cp "$WORK/t2/log.jsonl" "$OUT/train-llama3.2-1b-32k-seq2-$TAG.jsonl"
  hf_32k "$ctx"
}

part_allgpus() {
  # The trainer on every GPU of the machine (P of them): the PyTorch + LightSeq reference
  # job as configs/llama2_7b_8k_4gpu.yaml runs it (Llama-2-7B shape, the sequence and all
  # training state sharded over the P GPUs) at 8k and 32k, then the Llama-3.2-1B config
  # at 32k tokens per GPU on one GPU and on all P (seq=P, 32k x P context); their MFUs'
  # ratio is the per-GPU efficiency (MFU counts the longer context's attention).
  local n model vocab steps ctx7 xla=$BASE_XLA_FLAGS
  n=$(env "XLA_FLAGS=$xla" "$PY" -c 'import jax; print(len(jax.devices()))' 2>/dev/null || echo 1)
  if [ "$MODE" = gpu ]; then
    model=llama2-7b vocab=32000 steps=8 ctx7="8192 32768"
  else
    model=tiny vocab=256 steps=3 ctx7="256"
  fi
  local c k data run
  for c in $ctx7; do
    k=$c
    if [ $((c % 1024)) -eq 0 ]; then k=$((c / 1024))k; fi
    data="$WORK/sample7-$c.npy" run="$WORK/train7-$c"
    rm -rf "$run"
    step "data7-$k" 60 5 200 "$PY" -m train.data sample --out "$data" --num-samples 16 \
      --seq-len "$c" --vocab-size "$vocab"
    step "train-7b-$k" 200 60 200 env "XLA_FLAGS=$xla" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
      "$PY" -m train --config configs/llama2_7b_8k_4gpu.yaml --model_name_or_path "$model" \
      --mesh "data=1,fsdp=1,seq=$n" --model_max_length "$c" --data_path "$data" \
      --max_steps "$steps" --logging_steps 1 --save_strategy no --export_hf false \
      --progress false --output_dir "$run"
    if [ -s "$run/log.jsonl" ]; then
      cp "$run/log.jsonl" "$OUT/train-$model-$k-seq$n-$TAG.jsonl"
      summarise_jsonl "$OUT/train-$model-$k-seq$n-$TAG.jsonl" 2>&1 | ts
    fi
  done
  local ctx steps model vocab log_every one_device data common
  setup_1b_32k 190
  local long=$((ctx * n)) long_data="$WORK/sample-1b-long.npy"
  step data-1b-long 60 5 180 "$PY" -m train.data sample --out "$long_data" --num-samples 12 \
    --seq-len "$long" --vocab-size "$vocab"
  rm -rf "$WORK/a1" "$WORK/an"
  step train-1b-1gpu 150 60 90 env "XLA_FLAGS=$one_device" CUDA_VISIBLE_DEVICES=0 \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
    "$PY" -m train "${common[@]}" --mesh data=1,fsdp=1,seq=1 --output_dir "$WORK/a1"
  [ -s "$WORK/a1/log.jsonl" ] && cp "$WORK/a1/log.jsonl" "$OUT/train-llama3.2-1b-32k-seq1-$TAG.jsonl"
  step "train-1b-${n}gpu" 200 60 0 env "XLA_FLAGS=$xla" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
    "$PY" -m train "${common[@]}" \
    --mesh "data=1,fsdp=1,seq=$n" --model_max_length "$long" --data_path "$long_data" \
    --output_dir "$WORK/an"
  if [ -s "$WORK/an/log.jsonl" ]; then
    cp "$WORK/an/log.jsonl" "$OUT/train-llama3.2-1b-$((long / 1024))k-seq$n-$TAG.jsonl"
  fi
  local f
  for f in "$OUT"/train-llama3.2-1b-*-"$TAG".jsonl; do
    [ -s "$f" ] && summarise_jsonl "$f" 2>&1 | ts
  done
}

part_fill() {
  # `train.tools.profile --fill-xla-cost` on a copy of the report: compiles each row's step
  # (1- and 2-layer variants, never run) for XLA's bytes. Resumable: a row already
  # filled is skipped, and report.json is rewritten after every row, so a part cut by
  # its budget keeps what it filled (commit it and run the part again).
  local src dst="$WORK/fill-$TAG"
  if [ "$MODE" = gpu ]; then src=benchmarks/results/profile-$TAG; else src="$WORK/profile-$TAG"; fi
  if [ ! -s "$src/report.json" ]; then
    say "fill: SKIPPED (no $src/report.json)"
    return 0
  fi
  rm -rf "$dst" && mkdir -p "$dst" && cp "$src/report.json" "$dst/"
  step fill-xla-cost 520 30 15 env "XLA_FLAGS=$BASE_XLA_FLAGS" "$PY" -m train.tools.profile \
    --fill-xla-cost "$dst" --timeout 240
  # Render whatever was filled (a part cut by its budget skips its own render).
  step fill-render 60 5 0 "$PY" -m train.tools.profile --report-only "$dst"
  cp "$dst"/report.json "$dst"/report.md "$dst"/*.png "$OUT"/ 2>/dev/null
  say "fill: copied the report to $OUT (replace $src with it)"
}

part_ring() {
  # The ring on every GPU of the machine (P = 4 where it has 4): the ring's compiled
  # tests of both strategies and the Mosaic kernels, the table at 8k and 16k tokens per
  # GPU (zigzag; ring vs allgather; device-time breakdown of each pass), then the
  # 1B at 32k on 2 GPUs with each strategy. RING_TESTS=0 skips the tests.
  local n
  n=$(env "XLA_FLAGS=$BASE_XLA_FLAGS" "$PY" -c 'import jax; print(len(jax.devices()))' 2>/dev/null || echo 1)
  local devices=2 ring_args test_filter=(-k "allgather or mosaic or lowers")
  if [ "$n" -ge 4 ]; then devices=2,4; fi
  if [ "$MODE" = gpu ]; then
    ring_args=(--tokens-per-device 8192,16384 --iters 5 --profile-iters 3)
  else # a few tests and tiny shapes: checks the command lines
    test_filter=(-k "test_zigzag_order or (sampled and allgather and zigzag)")
    ring_args=(--tokens-per-device 128 --iters 1 --warmup 0 --heads 4 --kv-heads 2 --head-dim 32
      --implementation xla --profile-iters 1 --interpret)
  fi
  if [ "${RING_TESTS:-1}" != 0 ]; then
    step ring-tests 150 60 380 env "XLA_FLAGS=$BASE_XLA_FLAGS --xla_gpu_autotune_level=0" \
      "$PY" -m pytest tests/test_ring.py -q -p no:cacheprovider "${test_filter[@]}"
  fi
  step ring-table 330 120 150 env "XLA_FLAGS=$BASE_XLA_FLAGS" "$PY" benchmarks/ring.py \
    --devices "$devices" --layouts zigzag --strategies ring,allgather --profile \
    "${ring_args[@]}" --out "$OUT/ring-profile-$TAG.json"
  local ctx steps model vocab log_every one_device data common strategy
  setup_1b_32k 140
  for strategy in allgather ring; do
    rm -rf "$WORK/s2-$strategy"
    step "train-2gpu-$strategy" 75 50 0 env "XLA_FLAGS=$BASE_XLA_FLAGS" CUDA_VISIBLE_DEVICES=0,1 \
      "$PY" -m train "${common[@]}" --mesh data=1,fsdp=1,seq=2 --shard_over_seq true \
      --ring_strategy "$strategy" --output_dir "$WORK/s2-$strategy"
    if [ -s "$WORK/s2-$strategy/log.jsonl" ]; then
      cp "$WORK/s2-$strategy/log.jsonl" "$OUT/train-llama3.2-1b-32k-seq2-$strategy-$TAG.jsonl"
      summarise_jsonl "$OUT/train-llama3.2-1b-32k-seq2-$strategy-$TAG.jsonl" 2>&1 | ts
    fi
  done
}

part_cp() {
  # Context parallelism on every GPU of the machine (P = all of them), each table's
  # rows written to its JSON as they finish: (1) the compiled tests of
  # ring_attention_shard in a user's shard_map (segment ids, Ulysses, the 2x2 hybrid),
  # then test_ring.py's GPU subset; (2) packed documents (log-normal lengths, mean 4k)
  # per layout, efficiency on the mask area beside balance.py's predicted and the
  # trace's measured per-rank imbalance; (3) the strategies beside cp_model's
  # prediction (links measured in the same process). CPU: 4 simulated devices.
  local xla=$BASE_XLA_FLAGS n
  if [ "$MODE" != gpu ]; then xla="--xla_force_host_platform_device_count=4"; fi
  n=$(env "XLA_FLAGS=$xla" "$PY" -c 'import jax; print(len(jax.devices()))' 2>/dev/null || echo 1)
  local tag=${n}x$GPU strategies=ring,ulysses,allgather
  if [ "$n" -ge 4 ]; then strategies=ring,ulysses,hybrid,allgather; fi
  local shape doc_mean doc_tokens tokens test_filter
  if [ "$MODE" = gpu ]; then
    shape=(--iters 3 --warmup 1 --profile-iters 2 --rounds 3)
    doc_mean=4096 doc_tokens=${CP_DOC_TOKENS:-8192,16384} tokens=${CP_TOKENS:-8192,16384,32768}
    # test_ring_shard.py: P = 2 and 4, every layout, ring and allgather, segment ids;
    # a partial shard_map and MQA; Ulysses (xla and Triton); the 2x2 hybrid; Triton in
    # a user's shard_map; documents across shards. test_ring.py: the `ring` part's
    # subset (allgather, Mosaic, lowering) less its one-device allgather cases.
    test_filter="(test_ring_shard.py and ((user_shard_map and docs7 and (P4- or"
    test_filter+=" P2-D1-zigzag-ring or P2-D1-contiguous-allgather or P2-D1-striped)) or"
    test_filter+=" (meshes and (docs5-partial or N4K1)) or (ulysses and (P2-D1-zigzag or"
    test_filter+=" P4-D1-striped or P4-D1-contiguous-ulysses-causal)) or (P2x2-D1 and not"
    test_filter+=" full) or (pallas_kernels and (zigzag-ring-causal or striped)) or"
    test_filter+=" documents_across)) or (test_ring.py and ((allgather and not P1-) or mosaic"
    test_filter+=" or lowers))"
  else # tiny shapes: checks the command lines
    shape=(--heads 4 --kv-heads 2 --head-dim 32 --implementation xla --iters 1 --warmup 0
      --profile-iters 1 --rounds 2 --interpret)
    doc_mean=32 doc_tokens=64,128 tokens=64,128,256
    test_filter="P2x2-D1-zigzag-hybrid or (ulysses and P4-D1-striped) or test_zigzag_order"
    test_filter+=" or (user_shard_map and P4-D1-striped-ring-causal-N4K2-T96-docs7)"
  fi
  local steps=" ${CP_STEPS:-tests documents strategies} " r_docs=0 r_strategies=0 docs_cap=530
  if [[ $steps == *" strategies "* ]]; then r_strategies=90 docs_cap=180; fi
  if [[ $steps == *" documents "* ]]; then r_docs=90; fi
  if [[ $steps == *" tests "* ]]; then
    step cp-tests 420 60 $((r_docs + r_strategies)) \
      env "XLA_FLAGS=$xla --xla_gpu_autotune_level=0" "$PY" -m pytest \
      tests/test_ring_shard.py tests/test_ring.py -v -p no:cacheprovider -k "$test_filter"
  fi
  if [[ $steps == *" documents "* ]]; then
    step cp-documents "$docs_cap" "$r_docs" "$r_strategies" env "XLA_FLAGS=$xla" "$PY" benchmarks/ring.py \
      --devices "$n" --documents "$doc_mean" --tokens-per-device "$doc_tokens" \
      --layouts zigzag,striped,contiguous --strategies "${CP_DOC_STRATEGIES:-ring}" --passes fwdbwd --profile \
      "${shape[@]}" --out "$OUT/ring-documents-$tag.json"
  fi
  if [[ $steps == *" strategies "* ]]; then
    step cp-strategies 530 "$r_strategies" 0 env "XLA_FLAGS=$xla" "$PY" benchmarks/ring.py \
      --devices "$n" --tokens-per-device "$tokens" --layouts zigzag --strategies "$strategies" \
      --passes fwdbwd --cp-model "${shape[@]}" --out "$OUT/ring-strategies-$tag.json"
  fi
}

part_seq2trace() {
  # Per-phase and per-kernel time of the 32k config's step at seq=1 and seq=2
  # (--shard_over_seq --gather_once, as the config), same process tree (BENCHMARKS.md,
  # "Two GPUs, sequence split").
  local prof="$WORK/seq2trace-$TAG" model=llama3.2-1b ctx=32k
  if [ "$MODE" != gpu ]; then model=tiny ctx=512; fi
  rm -rf "$prof"
  local pxla="$BASE_XLA_FLAGS --xla_gpu_enable_command_buffer="
  step seq2trace 420 120 30 env "XLA_FLAGS=${pxla# }" "$PY" -m train.tools.profile --models "$model" \
    --context "$ctx" --mesh seq=1 --mesh seq=2 --shard-over-seq --gather-once --remat save_dots \
    --unroll-layers --steps 3 --warmup 1 --trace-steps 2 --no-xla-cost --out "$prof"
  step seq2trace-render 60 5 0 "$PY" -m train.tools.profile --report-only "$prof"
  local ext
  for ext in md json; do
    [ -s "$prof/report.$ext" ] && cp "$prof/report.$ext" "$OUT/seq2trace-$TAG.$ext"
  done
}

part_gradcheck() {
  # One step's gradients per parameter, the 32k config on 1 GPU in f32 (the
  # reference: Triton kernels) and bf16, and on 2 GPUs with replicated and gathered-once
  # weights in bf16 (~4 minutes). The layouts agree in f32 (2e-4); in bf16 the tied
  # embedding's gradient moves by 5-14%, one GPU's the farthest from f32 (BENCHMARKS.md).
  local ctx steps model vocab log_every one_device data common
  setup_1b_32k 280
  local seq2="--mesh data=1,fsdp=1,seq=2"
  step gradcheck 420 60 0 env "XLA_FLAGS=$BASE_XLA_FLAGS" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
    "$PY" -m train.tools.gradcheck "${common[@]}" \
    --layout "--mesh data=1,fsdp=1,seq=1 --bf16 false" \
    --layout "--mesh data=1,fsdp=1,seq=1" \
    --layout "$seq2 --shard_over_seq false --gather_once false" \
    --layout "$seq2 --shard_over_seq true --gather_once true" \
    --top 12 --out "$OUT/gradcheck-llama3.2-1b-32k-$TAG.json"
}

part_precision() {
  # In bf16 one GPU's tied embedding gradient sits 13.5% from f32 (2-GPU layouts 5%;
  # other parameters 2%) at 32k on GPUs; on CPU (2 layers, 2k) under 1.5%. Which attention kernel (Mosaic with
  # approximate exp2 / reciprocal, Triton, cuDNN) moves it? One step's gradients per
  # parameter at 8k on one GPU, f32 (Triton) as the reference (~2-3 minutes).
  local ctx=8192 model=llama3.2-1b vocab=32000 vendor=cudnn
  if [ "$MODE" != gpu ]; then ctx=512 model=tiny vocab=256 vendor=xla; fi
  local data="$WORK/sample-precision-$ctx.npy"
  step data-precision 60 5 200 "$PY" -m train.data sample --out "$data" --num-samples 8 \
    --seq-len "$ctx" --vocab-size "$vocab"
  local one="--mesh data=1,fsdp=1,seq=1"
  step precision 420 60 0 env "XLA_FLAGS=$BASE_XLA_FLAGS" CUDA_VISIBLE_DEVICES=0 \
    "$PY" -m train.tools.gradcheck --config configs/llama3_2_1b_32k.yaml --model_name_or_path "$model" \
    --model_max_length "$ctx" --data_path "$data" \
    --layout "$one --bf16 false" \
    --layout "$one" \
    --layout "$one --attention_implementation pallas_triton" \
    --layout "$one --attention $vendor" \
    --top 6 --out "$OUT/precision-llama3.2-1b-$ctx-$GPU.json"
}

part_remat() {
  # Llama-3.2-1B shape at 32k. jflash needs 0.42x HF's memory with remat=save_attn,
  # so remat=none (no recompute of the layers' matmuls) may fit: both on 1 GPU, none on
  # 2 GPUs (seq=2), and the HF baseline, in one call.
  local ctx steps model vocab log_every one_device data common
  setup_1b_32k 360
  local policy reserve
  for policy in save_attn none; do
    rm -rf "$WORK/r1-$policy"
    if [ "$policy" = save_attn ]; then reserve=280; else reserve=180; fi
    step "train-1gpu-$policy" 120 60 "$reserve" \
      env "XLA_FLAGS=$one_device" CUDA_VISIBLE_DEVICES=0 "$PY" -m train "${common[@]}" \
      --mesh data=1,fsdp=1,seq=1 --remat_policy "$policy" --output_dir "$WORK/r1-$policy"
    [ -s "$WORK/r1-$policy/log.jsonl" ] &&
      cp "$WORK/r1-$policy/log.jsonl" "$OUT/train-llama3.2-1b-32k-seq1-$policy-$TAG.jsonl"
  done
  rm -rf "$WORK/r2-none"
  step train-2gpu-none 120 60 90 env "XLA_FLAGS=$BASE_XLA_FLAGS" CUDA_VISIBLE_DEVICES=0,1 \
    "$PY" -m train "${common[@]}" --mesh data=1,fsdp=1,seq=2 --shard_over_seq true \
    --remat_policy none --output_dir "$WORK/r2-none"
  [ -s "$WORK/r2-none/log.jsonl" ] &&
    cp "$WORK/r2-none/log.jsonl" "$OUT/train-llama3.2-1b-32k-seq2-none-$TAG.jsonl"
  local f
  for f in "$OUT"/train-llama3.2-1b-32k-seq*-{save_attn,none}-"$TAG".jsonl; do
    [ -s "$f" ] && summarise_jsonl "$f" 2>&1 | ts
  done
  hf_32k "$ctx"
}

# ---------------------------------------------------------------------------------------

main() {
  env_info
  case "$PART" in
    report) part_report ;;
    scale) part_scale ;;
    capacity) part_capacity ;;
    train32k) part_train32k ;;
    allgpus) part_allgpus ;;
    fill) part_fill ;;
    ring) part_ring ;;
    cp) part_cp ;;
    remat) part_remat ;;
    seq2trace) part_seq2trace ;;
    gradcheck) part_gradcheck ;;
    precision) part_precision ;;
    cpu-check) # every part (or the ones named after cpu-check), each with the whole budget
      local p
      for p in ${CPU_PARTS:-report fill scale capacity train32k ring cp remat seq2trace gradcheck precision}; do
        START=$(date +%s) PART=$p "part_$p"
      done
      ;;
  esac
  say "done in $(($(date +%s) - START)) s of the part; steps:"
  column -t -s $'\t' "$STEPS" 2>/dev/null | ts || ts <"$STEPS"
  ls -la "$OUT" | ts
}

main 2>&1 | tee -a "$LOG"
