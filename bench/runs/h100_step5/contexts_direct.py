"""The llama.cpp engine's replay of N items in one job at 1 context and at K contexts on threads, in one process on
one card: the rows compared byte for byte (with a control that moves one margin by one ulp), the times as a ratio.
Over llama.cpp's own stage only (no pipeline prefixes are needed): a RANDOM-WEIGHT GGUF of SHAPE with the filler
vocabulary, the stage ending at the 64th "~", as scripts/engine_gpu.sh does.

    python contexts_direct.py FOLDER N_ITEMS K SHAPE cuda|cpu [--once]   (--once: 1 context, then K; no repeat)
"""
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stagereplay.engines import llama_cpp as engine
from stagereplay.io.parquet import write_parquet
from stagereplay.stages.engine import EngineReplaySettings, replay_on_engine
from stagereplay.testing.gguf import filler_vocabulary, write_gguf
from stagereplay.testing.shapes import SHAPES

folder, n, k, shape, device = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
folder.mkdir(parents=True, exist_ok=True)
path = folder / "model.gguf"
if not path.exists():
    write_gguf(path, shape, vocabulary=filler_vocabulary(SHAPES[shape]["vocab_size"]), tied=False, quant="F16", seed=0)
questions = [f"{7 * i + 3}+{11 * i + 5}" for i in range(n)]
with engine.LlamaCppEngine(path, engine.EngineSettings(kv_type="f16", n_ctx=256)) as e:
    prompts = [e.llm.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n".encode(), add_bos=False,
                              special=True) for q in questions]
items = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "gold_answer": "0", "question": q, "source_row": i}
                      for i, q in enumerate(questions)])
write_parquet(items, folder / "items.parquet", {})
prefixes = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "revision": "random", "precision": "bf16",
                          "status": "boundary_missing", "prompt_ids": p, "stage_ids": [], "prefix_fingerprint": "",
                          "gold_answer": "0"} for i, p in enumerate(prompts)])
write_parquet(prefixes, folder / "prefixes.parquet", {})


def settings(contexts):
    return EngineReplaySettings(engine="llama_cpp", model=str(path), revision=path.name, precision="bf16",
                                max_new_tokens=32, boundary={"marker": "~", "occurrence": 64}, max_stage_tokens=96,
                                stage_sources=("engine",), contexts=contexts,
                                settings=dict(kv_types=["f16"], n_gpu_layers=-1 if device == "cuda" else 0,
                                              threads=4, chunk_size=16))


times = {}
for contexts in (1, k, 1)[:2 if "--once" in sys.argv else 3]:  # 1 again last: the warm-up does not favour K
    out = folder / f"rows_{contexts}.parquet"
    start = time.perf_counter()
    replay_on_engine(str(folder / "items.parquet"), str(folder / "prefixes.parquet"), str(out), settings(contexts))
    times.setdefault(contexts, []).append(time.perf_counter() - start)
    print(f"{contexts} context(s): {times[contexts][-1]:.1f} s", flush=True)
one, many = (pq.read_table(folder / f"rows_{c}.parquet").replace_schema_metadata(None) for c in (1, k))
print(f"rows: {one.num_rows} at 1 context, {many.num_rows} at {k}; identical: {one.equals(many)}")
margins = many["margins"].combine_chunks()
values = margins.flatten().to_numpy().copy()
values[0] = np.nextafter(values[0], np.float32(np.inf))
nudged = many.set_column(many.column_names.index("margins"), "margins",
                         pa.ListArray.from_arrays(margins.offsets, pa.array(values, pa.float32())))
print(f"control: the first margin moved by one ulp; identical: {one.equals(nudged)}")
print(f"{n} items, own stage, 5 constructions x 2 replicas, KV f16: 1 context {min(times[1]):.1f} s "
      f"(best of {len(times[1])}), "
      f"{k} contexts {times[k][0]:.1f} s: {min(times[1]) / times[k][0]:.2f}x")
