"""Probe: llama.cpp contexts in threads of one process (one CUDA context) vs one context, batch-1 greedy steps."""
import sys
import threading
import time

import llama_cpp
import numpy as np

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200


def open_llm():
    return llama_cpp.Llama(model_path=path, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_threads=4, verbose=False,
                           logits_all=False)


def work(llm, out, i):
    llm.reset()
    llm.eval(list(range(100, 164)))
    tokens = []
    for _ in range(steps):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(t)
        llm.eval([t])
    out[i] = tokens


for k in (1, 2, 4, 8):
    llms = [open_llm() for _ in range(k)]
    out = [None] * k
    work(llms[0], out, 0)  # warm
    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(llms[i], out, i)) for i in range(k)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - start
    same = all(o == out[0] for o in out)
    print(f"K={k}: {k * steps / wall:.0f} tok/s over {k} threads ({wall:.2f} s), outputs equal across threads: {same}",
          flush=True)
    for llm in llms:
        llm.close()
