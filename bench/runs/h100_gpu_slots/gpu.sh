#!/usr/bin/env bash
# The N-item workflow's warm turnaround (default 48) with one model job on the GPU at a time against four side by
# side (RANDOM WEIGHTS, Q8_0 GGUF of the qwen2.5-0.5b shape; stage 96, suffix 128, batch 16, cuda_graph, 13 divergent
# items transplanted, packing on), each in a fresh folder (its store prepared first, not timed), one after the other
# in one call (carry .whl):
#   N=48 LIMIT=220 bash bench/runs/h100_gpu_slots/gpu.sh 1 4
# Give each slot count a call of its own with the run's 600 s (`... gpu.sh 1`, then `... gpu.sh 4` on the warm
# machine): writing the GGUF (27 s) and preparing the store come before each timed run, and a 270 s call of one slot
# count was stopped during its warm run (turnaround_s1_stopped.log, 2026-12-07).
set -u
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/sm/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for S in "$@"; do
    python3 bench/turnaround.py --work /tmp/ta_s$S --shape qwen2.5-0.5b --items "${N:-48}" --batch-size 16 --stage 96 \
        --suffix 128 --regime cuda_graph --skip-check --gpu-slots "$S" --cores 16 --warm-only --limit-s "${LIMIT:-220}" \
        --transplant-select divergent:13 --pack on --json "$OUT/turnaround_s$S.json" > "$OUT/turnaround_s$S.log" 2>&1
    echo "slots $S: rc $?"; grep -i "wall\|transplant\|minimal\|whole" "$OUT/turnaround_s$S.log" | tail -8
done
