#!/usr/bin/env bash
# The transplant stages rerun alone at a checkpoint, unpacked then packed, after the 48-item warm run (RANDOM
# WEIGHTS, Q8_0 GGUF of the qwen2.5-0.5b shape; stage 96, suffix 128, batch 16, cuda_graph, 13 divergent items
# transplanted), in one call on the GPU machine (carry .whl/sm):
#   bash bench/runs/h100_stage_rerun/gpu.sh   (N=, SELECT=, LIMIT=, STOP_S= for a smaller run)
set -u
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/sm/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${STOP_S:-540}" python3 bench/turnaround.py --work /tmp/ta_rr --shape qwen2.5-0.5b --items "${N:-48}" \
    --batch-size 16 --stage 96 --suffix 128 --regime cuda_graph --skip-check --gpu-slots 4 --cores 16 --warm-only \
    --limit-s "${LIMIT:-230}" \
    --transplant-select "${SELECT:-divergent:13}" --pack on --rerun-transplants --json "$OUT/stage_rerun.json" \
    > "$OUT/stage_rerun.log" 2>&1
echo "rc $?"; grep -i "run warm\|rerun" "$OUT/stage_rerun.log" | tail -8
cp /tmp/ta_rr/snakemake_rerun_off.log /tmp/ta_rr/snakemake_rerun_on.log "$OUT/" 2>/dev/null
tar czf "$OUT/rerun_tables.tgz" -C /tmp/ta_rr rerun benchmarks 2>/dev/null
# the fingerprints' rates at the 14B shape (one row 656 MB of bf16 K/V), for the projection's pricing
timeout 40 python3 bench/fingerprint_rates.py --layers 48 --kv-heads 8 --head-dim 128 --positions 3327 --rows 4 \
    --json "$OUT/fingerprint_rates_14b.json" 2>&1 | tail -6
