#!/usr/bin/env bash
# The 48-item workflow's warm turnaround with one model job on the GPU at a time against four side by side (RANDOM
# WEIGHTS, Q8_0 GGUF of the qwen2.5-0.5b shape; stage 96, suffix 128, batch 16, cuda_graph, 13 divergent items
# transplanted, packing on), each in a fresh folder (its store prepared first, not timed). One call per slot count
# on one warm machine (carry .whl):
#   bash bench/runs/h100_gpu_slots/gpu.sh 1
#   bash bench/runs/h100_gpu_slots/gpu.sh 4
set -u
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/sm/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
S="$1"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 560 python3 bench/turnaround.py --work /tmp/ta_s$S --shape qwen2.5-0.5b --items 48 --batch-size 16 --stage 96 \
    --suffix 128 --regime cuda_graph --skip-check --gpu-slots "$S" --cores 16 --warm-only --limit-s 300 \
    --transplant-select divergent:13 --pack on --json "$OUT/turnaround_s$S.json" > "$OUT/turnaround_s$S.log" 2>&1
echo "rc $?"; tail -30 "$OUT/turnaround_s$S.log"
