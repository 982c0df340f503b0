"""Probe: llama.cpp's batch-1 greedy steps in separate processes started together on one GPU.

Run as on the H100 (2026-12-06), K processes of THREADS CPU threads each, starting their timed part together:
    for k in 1 4; do for th in 4 1; do T=$(( $(date +%s) + 8 ))
        for i in $(seq $k); do python process_probe.py /tmp/eg/model.gguf 400 $th $T & done; wait; done; done
"""
import sys, time, llama_cpp, numpy as np
llm = llama_cpp.Llama(model_path=sys.argv[1], n_gpu_layers=-1, n_ctx=512, n_batch=512, n_threads=int(sys.argv[3]),
                      verbose=False)
def work():
    llm.reset(); llm.eval(list(range(100, 164)))
    for _ in range(int(sys.argv[2])):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
work(); time.sleep(max(0, float(sys.argv[4]) - time.time()))
s = time.perf_counter(); work(); print(f"{int(sys.argv[2]) / (time.perf_counter() - s):.0f} tok/s", flush=True)
