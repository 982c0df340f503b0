"""Probe: llama.cpp's batch-1 greedy step on one context, tokens/s; run once as is and once with
GGML_CUDA_DISABLE_GRAPHS=1 (a separate process each) to see whether ggml's CUDA graphs are in use.

    python graphs_probe.py MODEL.gguf [STEPS]
"""
import os
import sys
import time

import llama_cpp
import numpy as np

path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300
loads = []
for _ in range(3):  # the first also starts CUDA
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_threads=4, verbose=False,
                          logits_all=False)
    loads.append(round(time.perf_counter() - start, 2))
print(f"model and context opened in {loads} s", flush=True)
n_vocab = llm.n_vocab()
for rep in range(2):  # the first warms up
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    llm.eval(list(range(100, 164)))
    start, tokens = time.perf_counter(), []
    for _ in range(steps):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        tokens.append(int(np.argmax(logits)))
        llm.eval([tokens[-1]])
    wall = time.perf_counter() - start
print(f"GGML_CUDA_DISABLE_GRAPHS={os.environ.get('GGML_CUDA_DISABLE_GRAPHS', '')!r}: {steps / wall:.0f} tok/s "
      f"({1e3 * wall / steps:.3f} ms a step), first ids {tokens[:4]}", flush=True)
