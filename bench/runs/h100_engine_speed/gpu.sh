#!/usr/bin/env bash
# Issue 49's engine row on one GPU: the llama.cpp engine's replay and audit before (BEFORE_SRC, the tree at 51be7b7,
# carried as .bench_old/src) and after (this tree), 16 items x 2 KV types x 2 stage sources, RANDOM-WEIGHT
# qwen2.5-0.5b-shaped F16 GGUF, with bench/engine_speed.py. Two calls on one warm machine (carry .whl and
# .bench_old), or the two in one call (N=12 K=8 bash ... all: 1 and K contexts after):
#   bash bench/runs/h100_engine_speed/gpu.sh before   # llama.cpp built for CUDA, the inputs, the tree before
#   bash bench/runs/h100_engine_speed/gpu.sh after    # this tree at 1, 4 and 8 contexts, the comparison, the probe
set -u
export PYTHONPATH=/tmp/site INSTALL_TARGET=/tmp/site PYTHONUNBUFFERED=1
ES=/tmp/es N="${N:-16}" LOG="${OUT:-/tmp}/engine_speed.log"
quiet() { grep -v "^llama\|^load\|^print_info\|^llm_load\|^ggml_cuda_init\|^  Device" ; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
case "$1" in
    all)  # both in one call, the probe only while time is left: one machine start
        START=$SECONDS
        bash "$0" before
        PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py run $ES --tag after --threads "${THREADS:-1}" --contexts 1 "${K:-8}" 2>&1 \
            | quiet | tee -a "$LOG"
        PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py compare $ES --tags before after 2>&1 | tee -a "$LOG"
        for t in before after; do cp $ES/$t/times.json "$OUT/times_$t.json"; done
        if [ $((SECONDS - START)) -lt 520 ]; then
            timeout $((570 - SECONDS + START)) python bench/runs/h100_engine_speed/graphs_probe.py $ES/model.gguf 2>&1 \
                | quiet | tee -a "$LOG"
        fi ;;
    before)
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/sm/gguf-*.whl 2>&1 | tail -1
        bash scripts/engine_gpu.sh build 2>&1 | tail -2 | tee -a "$LOG"
        wheel=$(ls build/llama-wheel/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -1)
        if [ -n "$wheel" ] && [ "$(stat -c %s "$wheel")" -lt 45000000 ]; then
            split -b 15M "$wheel" "$OUT/llama_cuda_whl.part_"; ls -la "$wheel" | tee -a "$LOG"
        fi
        PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py inputs $ES --items "$N" 2>&1 | quiet | tee -a "$LOG"
        PYTHONPATH=$PWD/.bench_old/src:/tmp/site python bench/engine_speed.py run $ES --tag before --threads "${THREADS:-1}" 2>&1 | quiet \
            | tee -a "$LOG" ;;
    after)
        PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py run $ES --tag after --threads "${THREADS:-1}" --contexts 1 4 8 2>&1 | quiet \
            | tee -a "$LOG"
        PYTHONPATH=$PWD/src:/tmp/site python bench/engine_speed.py compare $ES --tags before after 2>&1 | tee -a "$LOG"
        python bench/runs/h100_engine_speed/graphs_probe.py $ES/model.gguf 2>&1 | quiet | tee -a "$LOG"
        GGML_CUDA_DISABLE_GRAPHS=1 python bench/runs/h100_engine_speed/graphs_probe.py $ES/model.gguf 2>&1 | quiet \
            | tee -a "$LOG"
        for t in before after; do cp $ES/$t/times.json "$OUT/times_$t.json"; done ;;
esac
python3 -c "import torch, transformers, llama_cpp as l; print(torch.__version__, transformers.__version__, l.__version__)" \
    2>/dev/null | tee -a "$LOG"
