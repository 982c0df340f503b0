#!/usr/bin/env bash
# Issue 49 step 5 on one GPU: the llama.cpp engine's replay and audit at 1 shard and at 4 side by side, 48 items,
# KV f16, the pipeline at bf16 (RANDOM-WEIGHT qwen2.5-0.5b-shaped GGUF, F16). Three calls on one warm machine:
#   bash bench/runs/h100_step5/gpu.sh build    # snakemake's wheels, llama.cpp built for CUDA, the pipeline's part
#   bash bench/runs/h100_step5/gpu.sh one      # the engine at 1 shard
#   bash bench/runs/h100_step5/gpu.sh many     # the engine at 4 shards, then the comparison and the ratios
# and, in one call on a fresh machine, the build, the pipeline's part on 24 items, the engine at 1 shard of 1 context
# and at 1 shard of 4 contexts on threads of one job, the comparison and the ratios:
#   bash bench/runs/h100_step5/gpu.sh contexts
# or, where the device time left is short, without the workflow (llama.cpp's own stage only, 12 items):
#   bash bench/runs/h100_step5/gpu.sh direct
set -u
[ -d /tmp/site/snakemake ] || [ "$1" = direct ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/sm/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site INSTALL_TARGET=/tmp/site
export WORK=/tmp/eg N_ITEMS=48 KV_TYPES=f16 PRECISIONS=bf16 THREADS=4 SHARDS_MANY=4 CORES=16
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$1" in
    build) bash scripts/engine_gpu.sh build 2>&1 | tail -4; PARTS=pipeline bash scripts/engine_gpu.sh shards 2>&1 | tail -4 ;;
    one) PARTS=1 bash scripts/engine_gpu.sh shards > /tmp/eg_one.log 2>&1; echo "rc $?"; tail -4 /tmp/eg_one.log ;;
    many) PARTS="K compare" bash scripts/engine_gpu.sh shards > /tmp/eg_many.log 2>&1; echo "rc $?"; tail -16 /tmp/eg_many.log
          cp /tmp/eg_one.log /tmp/eg_many.log "$OUT/" ;;
    contexts) bash scripts/engine_gpu.sh build 2>&1 | tail -2
          WORK=/tmp/ec N_ITEMS=24 PARTS="pipeline 1 C compare" bash scripts/engine_gpu.sh shards > /tmp/ec.log 2>&1
          echo "rc $?"; grep -v "^\[\|^=*$" /tmp/ec.log | grep "==\|identical\||" | tail -24
          cp /tmp/ec.log "$OUT/"; tar czf "$OUT/ec_shards.tgz" -C /tmp/ec shards logs ;;
    direct) python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/sm/gguf-*.whl 2>&1 | tail -1
          bash scripts/engine_gpu.sh build 2>&1 | tail -2
          PYTHONPATH=$PWD/src:$PYTHONPATH timeout "${DIRECT_S:-100}" python bench/runs/h100_step5/contexts_direct.py /tmp/cd "${N:-12}" 4 qwen2.5-0.5b cuda \
              --once 2>&1 | grep -v "^llama\|^load\|^print_info" ;;
esac
python -c "import torch, transformers, llama_cpp; print(torch.__version__, transformers.__version__, llama_cpp.__version__)" 2>/dev/null
