#!/bin/bash
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
F="grep -v ^WARNING\|^I0000\|^W0000"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 python3 -m pytest -q tests/test_ring.py -k "pallas or mosaic" 2>&1 | tail -3 | tee $OUT/ring-tests.log
for r in 1 2; do
timeout 120 python3 benchmarks/ring.py --devices 2 --tokens-per-device 16384,8192 --layouts zigzag --strategies ring --iters 5 --out $OUT/ring-2-run$r.json 2>&1 | $F | grep "^|" | tee $OUT/ring-run$r.log
done
python3 -m train.data sample --out /tmp/d.npy --num-samples 40 --seq-len 32768 --vocab-size 32000 >/dev/null 2>&1
C="--config configs/llama3_2_1b_32k.yaml --model_name_or_path llama3.2-1b --model_max_length 32768 --data_path /tmp/d.npy --max_steps 15 --logging_steps 5 --save_strategy no --export_hf false --progress false --overwrite_output_dir true"
CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m train $C --output_dir /tmp/t1 --mesh data=1,fsdp=1,seq=1 2>&1 | tail -1
cp /tmp/t1/log.jsonl $OUT/train-seq1.jsonl
timeout 110 python3 -m train $C --output_dir /tmp/t2 --mesh data=1,fsdp=1,seq=2 2>&1 | tail -1
cp /tmp/t2/log.jsonl $OUT/train-seq2.jsonl
