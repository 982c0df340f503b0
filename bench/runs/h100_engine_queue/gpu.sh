#!/usr/bin/env bash
# The engine's replay and audit with contexts taking the next item (this tree) against the engine before (BEFORE_SRC:
# the tree at 51be7b7, carried as .bench_old), 10 items x 2 KV types x 2 stage sources x 2 replicas, RANDOM-WEIGHT
# qwen2.5-0.5b-shaped F16 GGUF, bench/engine_speed.py; in one call (carry .whl and .bench_old):
#   N=10 bash bench/runs/h100_engine_queue/gpu.sh
set -u
export PYTHONPATH=/tmp/site INSTALL_TARGET=/tmp/site PYTHONUNBUFFERED=1
ES=/tmp/es N="${N:-10}" LOG="${OUT:-/tmp}/engine_queue.log"
quiet() { grep -v "^llama\|^load\|^print_info\|^llm_load\|^ggml_cuda_init\|^  Device" ; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/sm/gguf-*.whl 2>&1 | tail -1
bash scripts/engine_gpu.sh build 2>&1 | tail -2 | tee -a "$LOG"
PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py inputs $ES --items "$N" 2>&1 | quiet | tee -a "$LOG"
PYTHONPATH=$PWD/.bench_old/src:/tmp/site python bench/engine_speed.py run $ES --tag before --threads 1 2>&1 | quiet \
    | tee -a "$LOG"
PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py run $ES --tag after --threads 1 --contexts ${KS:-8 16} 2>&1 \
    | quiet | tee -a "$LOG"
# compare reads the first tag's one-context tables; after has no one-context run here
PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py compare $ES --tags before after 2>&1 | tee -a "$LOG"
for t in before after; do cp $ES/$t/times.json "$OUT/times_$t.json"; done
python3 -c "import torch, transformers, llama_cpp as l; print(torch.__version__, transformers.__version__, l.__version__)" \
    2>/dev/null | tee -a "$LOG"
