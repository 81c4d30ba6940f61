#!/usr/bin/env bash
# The longest context on one GPU: the sequence-tiled MLP (--mlp_tile), host-offloaded
# remat residuals (--remat_policy offload_attn | offload_full) and the optimizer state
# in host memory (--optimizer_offload), on Llama-3.2-1B and the Llama-3.1-8B shape.
# Written for one NVIDIA H200; run from the repository root:
#
#   PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false bash benchmarks/long_context.sh [PART...]
#
# Parts (default: all of them, in this order, within BUDGET seconds):
#   hlo       the compiled 1B step under offload_attn at 8k holds host buffers (S(5)) and
#             XLA's host-side memory sizes; the same for --optimizer_offload
#   capacity  python -m train.tools.capacity, 1B and 8B, each remat policy in
#             CAP_POLICIES with the tiled MLP and --optimizer-offload (doubling only)
#   train1b   1B at LEN_1B tokens (512k), the knobs on (KNOBS_ON), STEPS_1B steps
#   train8b   the 8B shape (random init) at LEN_8B tokens (128k), KNOBS_8B (offload_full:
#             offload_attn's residuals and the 8B's AdamW state outgrow 112 GB of host)
#   onoff     1B at LEN_MID tokens (128k, where the knobs-off step also fits one H200):
#             KNOBS_MID (every knob on, MLP tiles forced) against KNOBS_OFF, tokens/s each
#
# Results go to $OUT (default benchmarks/results/long_context): long_context.log (every
# line printed), summary.md (the table printed at the end), steps.tsv (one line per
# step: part, name, status, exit code, seconds, limit), runs.jsonl (every training run's
# log.jsonl records, with the run's name), capacity.json (every capacity run). Scratch
# (train output dirs) goes to $WORK (default /tmp/jflash-long-context).
#
# Each step runs under `timeout`: min(its cap, what is left of BUDGET minus the minimum
# that the later steps need); a step without its minimum left is skipped and recorded.
# Estimates for one H200 (model FLOPs at ~400 TFLOP/s, causal attention dominating):
# 1B at 512k ~150 s a step, at 256k ~40 s, at 128k ~11 s; the 8B at 128k ~55 s after
# ~2 minutes of start-up and compilation; a capacity probe is one compile (~10-30 s).
# The first step of a run is compilation (not timed), so tokens/s needs 2 steps. The
# whole default run does not fit one 10-minute call; run a part or two per call (e.g.
# `bash benchmarks/long_context.sh train1b`, or `train8b onoff` as one call).
#
# Every size is a variable, so the pipeline dry-runs on CPU with the tiny preset:
#   JAX_PLATFORMS=cpu PYTHON=.venv/bin/python MODEL_1B=tiny MODEL_8B=tiny LEN_1B=512 \
#   LEN_8B=256 LEN_MID=256 CAP_START=256 CAP_MAX=1024 CAP_LIMIT_GIB=0.1 MLP_TILE=64 \
#   OUT=/tmp/lc/out WORK=/tmp/lc/work PYTHONPATH=. bash benchmarks/long_context.sh
set -u -o pipefail

PY=${PYTHON:-python3}
MODEL_1B=${MODEL_1B:-llama3.2-1b}
MODEL_8B=${MODEL_8B:-llama3.1-8b}
LEN_1B=${LEN_1B:-524288}
LEN_8B=${LEN_8B:-131072}
LEN_MID=${LEN_MID:-131072}
LEN_HLO=${LEN_HLO:-8192}
STEPS_1B=${STEPS_1B:-2}
STEPS_8B=${STEPS_8B:-2}
STEPS_MID=${STEPS_MID:-2}
MLP_TILE=${MLP_TILE:--1}
CAP_POLICIES=${CAP_POLICIES:-save_attn offload_attn offload_full}
CAP_START=${CAP_START:-131072}
CAP_MAX=${CAP_MAX:-2097152}
CAP_LIMIT_GIB=${CAP_LIMIT_GIB:-}
KNOBS_ON=${KNOBS_ON:---mlp_tile $MLP_TILE --remat_policy offload_attn --optimizer_offload true}
KNOBS_8B=${KNOBS_8B:---mlp_tile $MLP_TILE --remat_policy offload_full --optimizer_offload true}
# The knobs at LEN_MID: tiles forced (the automatic tiles start at 256k tokens per device).
KNOBS_MID=${KNOBS_MID:---mlp_tile ${MID_TILE:-8192} --remat_policy offload_attn --optimizer_offload true}
KNOBS_OFF=${KNOBS_OFF:---mlp_tile 0 --remat_policy save_attn --optimizer_offload false}
BUDGET=${BUDGET:-540}
# Per-run caps (seconds): CAP_TRAIN1B (450), CAP_TRAIN8B (330), CAP_ONOFF (110 each),
# CAP_CAPACITY (60 per model and policy).
# XLA's pinned host pool (default 64 GB): the 1B's offloaded residuals at 512k alone
# are ~64 GiB. Keep it below the machine's RAM (128 GB on the H200 machines).
HOST_LIMIT_GB=${HOST_LIMIT_GB:-112}
OUT=${OUT:-benchmarks/results/long_context}
WORK=${WORK:-/tmp/jflash-long-context}

cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=${PYTHONPATH:-.}
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
START=$(date +%s)
WORK="$WORK/run-$START"  # this run's own scratch: the summary reads only its runs
mkdir -p "$OUT" "$WORK"
LOG="$OUT/long_context.log"
STEPS_TSV="$OUT/steps.tsv"
: >"$LOG"
printf 'part\tname\tstatus\texit\tseconds\tlimit\n' >"$STEPS_TSV"
PARTS=${*:-hlo capacity train1b train8b onoff}

say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

left() { echo $((BUDGET - ($(date +%s) - START))); }

# run_step PART NAME CAP MIN RESERVE CMD...: CMD under `timeout min(CAP, left-RESERVE)`.
run_step() {
    local part=$1 name=$2 cap=$3 min=$4 reserve=$5
    shift 5
    local limit=$(($(left) - reserve))
    ((limit > cap)) && limit=$cap
    if ((limit < min)); then
        say "$part/$name: skipped ($limit s left, needs $min)"
        printf '%s\t%s\tskipped\t-\t0\t%s\n' "$part" "$name" "$limit" >>"$STEPS_TSV"
        return 0
    fi
    say "$part/$name: $* (limit $limit s)"
    local t0 rc
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | while IFS= read -r line; do
        echo "[$(date -u +%H:%M:%S)] $line"
    done | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local status=ok
    ((rc == 124 || rc == 137)) && status=timeout
    [[ $rc != 0 && $status == ok ]] && status=failed
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$part" "$name" "$status" "$rc" \
        $(($(date +%s) - t0)) "$limit" >>"$STEPS_TSV"
    say "$part/$name: $status (exit $rc)"
}

want() { [[ " $PARTS " == *" $1 "* ]]; }

# The steps after each part need at least this much (seconds), given what is asked.
reserve_after() {
    local total=0 seen=0 p
    for p in hlo capacity train1b train8b onoff; do
        if ((seen)) && want "$p"; then
            case $p in
            capacity) total=$((total + 60)) ;;
            train1b) total=$((total + 120)) ;;
            train8b) total=$((total + 150)) ;;
            onoff) total=$((total + 100)) ;;
            esac
        fi
        [[ $p == "$1" ]] && seen=1
    done
    echo "$total"
}

# train_cmd NAME MODEL LEN STEPS KNOBS...: the trainer's command line, in CMD.
train_cmd() {
    local name=$1 model=$2 len=$3 steps=$4
    shift 4
    CMD=(env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="$HOST_LIMIT_GB"
        "$PY" -m train
        --model_name_or_path "$model" --data_path sample --sample_num_examples $((steps + 1))
        --model_max_length "$len" --mesh data=1,fsdp=1,seq=1 --max_steps "$steps"
        --logging_steps 1 --save_strategy no --export_hf false --report_to none
        --progress false --overwrite_output_dir --output_dir "$WORK/$name" "$@")
}

if want hlo; then
    run_step hlo offload-in-hlo 120 40 "$(reserve_after hlo)" "$PY" - "$MODEL_1B" "$LEN_HLO" <<'EOF'
import sys

import jax

from train.build import model_config, plan_step
from train.config import parse_args

model, length = sys.argv[1], sys.argv[2]
for knobs in (["--remat_policy", "offload_attn"], ["--optimizer_offload", "true"]):
    cfg = parse_args(
        ["--model_name_or_path", model, "--model_max_length", length, "--mesh", "seq=1", *knobs]
    )
    plan = plan_step(cfg, model_config(cfg), jax.devices()[:1])
    with jax.set_mesh(plan.mesh):
        compiled = plan.step_fn.lower(plan.abstract_state, plan.abstract_batch(1, 1, int(length)))
        compiled = compiled.compile()
    text, mem = compiled.as_text(), compiled.memory_analysis()
    host = {k: getattr(mem, k, None) for k in dir(mem) if k.startswith("host_")}
    found = text.count("S(5)")
    print(f"{' '.join(knobs)}: {found} host-memory (S(5)) shapes in the compiled HLO; {host}")
    if found == 0 and jax.default_backend() == "gpu":
        sys.exit(f"{' '.join(knobs)}: no host-memory buffers in the compiled step")
    if found == 0:
        print(f"  ({jax.default_backend()} lowers no host memory space; the GPU run checks it)")
EOF
fi

if want capacity; then
    limit_flag=()
    [[ -n $CAP_LIMIT_GIB ]] && limit_flag=(--limit-gib "$CAP_LIMIT_GIB")
    for model in "$MODEL_1B" "$MODEL_8B"; do
        start=$CAP_START
        [[ $model == "$MODEL_8B" ]] && start=$((CAP_START / 2))
        for policy in $CAP_POLICIES; do
            run_step capacity "$model-$policy" "${CAP_CAPACITY:-60}" 25 "$(reserve_after capacity)" \
                env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="$HOST_LIMIT_GB" \
                "$PY" -m train.tools.capacity --models "$model" --mesh seq=1 \
                --remat "$policy" --mlp-tile "$MLP_TILE" --optimizer-offload \
                --start "$start" --max "$CAP_MAX" --refine 0 "${limit_flag[@]}" \
                --out "$WORK/capacity-$model-$policy.json"
        done
    done
fi

# shellcheck disable=SC2086  # the knobs are words
if want train1b; then
    train_cmd "1b-$LEN_1B-on" "$MODEL_1B" "$LEN_1B" "$STEPS_1B" $KNOBS_ON
    run_step train1b "1b-$LEN_1B-on" "${CAP_TRAIN1B:-450}" 120 "$(reserve_after train1b)" "${CMD[@]}"
fi

if want train8b; then
    train_cmd "8b-$LEN_8B-on" "$MODEL_8B" "$LEN_8B" "$STEPS_8B" $KNOBS_8B
    run_step train8b "8b-$LEN_8B-on" "${CAP_TRAIN8B:-330}" 150 "$(reserve_after train8b)" "${CMD[@]}"
fi

if want onoff; then
    train_cmd "1b-$LEN_MID-on" "$MODEL_1B" "$LEN_MID" "$STEPS_MID" $KNOBS_MID
    run_step onoff "1b-$LEN_MID-on" "${CAP_ONOFF:-110}" 50 50 "${CMD[@]}"
    train_cmd "1b-$LEN_MID-off" "$MODEL_1B" "$LEN_MID" "$STEPS_MID" $KNOBS_OFF
    run_step onoff "1b-$LEN_MID-off" "${CAP_ONOFF:-110}" 50 0 "${CMD[@]}"
fi

"$PY" - "$WORK" "$OUT" "$STEPS_TSV" <<'EOF' | tee "$OUT/summary.md" | tee -a "$LOG"
import glob
import json
import os
import sys

work, out, steps = sys.argv[1:4]
print("| run | status | tokens/s | peak GiB (device) | loss |")
print("|---|---|---|---|---|")
status = {}
with open(steps) as f:
    next(f)
    for line in f:
        part, name, state, rc, seconds, limit = line.rstrip("\n").split("\t")
        status[name] = f"{state} ({seconds} s of {limit})"
runs = open(os.path.join(out, "runs.jsonl"), "w")
speed = {}
for log in sorted(glob.glob(os.path.join(work, "*", "log.jsonl"))):
    name = os.path.basename(os.path.dirname(log))
    records = [json.loads(line) for line in open(log) if line.strip()]
    for r in records:
        runs.write(json.dumps({"run": name, **r}) + "\n")
    timed = [r for r in records if "tokens_per_s" in r]
    tps = f"{timed[-1]['tokens_per_s']:,.0f}" if timed else "–"
    peak = max((r.get("peak_memory_gib", 0) for r in records), default=0)
    loss = f"{records[-1]['loss']:.4f}" if records else "–"
    print(f"| {name} | {status.get(name, '')} | {tps} | {peak:.1f} | {loss} |")
    if timed:
        speed[name] = timed[-1]["tokens_per_s"]
runs.close()
for name in sorted(speed):  # onoff: the knobs' cost as a same-machine ratio
    off = name[: -len("-on")] + "-off" if name.endswith("-on") else None
    if off in speed:
        print(f"\n{name} / {off}: {speed[name] / speed[off]:.3f} of the tokens/s")
rows = []
print("\n| capacity: model | remat | longest | GiB device | GiB host | GiB/1k dev | GiB/1k host |")
print("|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(work, "capacity-*.json"))):
    result = json.load(open(path))
    rows.append(result)
    for r in result["rows"]:

        def num(key, fmt=".3g"):
            return "–" if r.get(key) is None else format(r[key], fmt)

        at_least = ">= " if r.get("incomplete") else ""  # the probe in flight timed out
        print(
            f"| {r['model']} | {result['settings']['remat']} | {at_least}{r['longest'] or 'none'} | "
            f"{num('gib')} | {num('host_gib')} | {num('gib_per_1k', '.4f')} | "
            f"{num('host_gib_per_1k', '.4f')} |"
        )
with open(os.path.join(out, "capacity.json"), "w") as f:
    json.dump(rows, f, indent=1)
print("\nsteps:")
for name, state in status.items():
    print(f"  {name}: {state}")
EOF
if want capacity; then  # the probes per model and remat policy, the training runs' peaks on them
    plot=(--out "$OUT/capacity-memory.png" --overwrite)  # the summary, rewritten with capacity.json
    for log in "$WORK"/*/log.jsonl; do
        [[ -f $log ]] && plot+=(--measured "$(dirname "$log")")
    done
    "$PY" -m train.tools.capacity plot "$OUT/capacity.json" "${plot[@]}" 2>&1 | tee -a "$LOG"
fi
say "done in $(($(date +%s) - START)) s; results in $OUT"
