"""The llama.cpp engine's replay and audit (issue 49's engine row), timed in one process per source tree, then
compared across trees byte for byte, with ratios against a baseline tree timed on the same card in the same call.

``inputs`` writes, once, a RANDOM-WEIGHT GGUF of ``--shape`` with the filler vocabulary of
:mod:`stagereplay.testing` (its stage ends at the 64th "~", as scripts/engine_gpu.sh's does) and ``--items`` items:
prompts, and reference stage ids (the vocabulary's last 64 fillers, "~k" each), so that both stage sources run:
llama.cpp's own stage (``live`` and the four rebuilds) and the given ids (four constructions), at every KV type of
``--kv-types``, 2 replicas.

``run`` (with a tree's ``src`` first on ``PYTHONPATH``) runs ``replay_on_engine`` then ``audit_engine`` over those
inputs at each ``--contexts`` K, each timed whole, and writes the tables and the times under FOLDER/TAG.

``compare`` reads every TAG's tables: each must equal the first tag's at one context (the ledger's rows and the
audit's records, value for value, without the provenance); the control moves one margin by one ulp and must differ.
It prints each timing's ratio against the first tag's one-context timing.

    python bench/engine_speed.py inputs /tmp/es --items 16 --shape qwen2.5-0.5b
    PYTHONPATH=OLD/src python bench/engine_speed.py run /tmp/es --tag before --device cuda
    PYTHONPATH=NEW/src python bench/engine_speed.py run /tmp/es --tag after --device cuda --contexts 1 4 8
    python bench/engine_speed.py compare /tmp/es --tags before after

RANDOM WEIGHTS: speed and bit-exactness only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

MAX_NEW, MAX_STAGE, STAGE_MARKS = 32, 96, 64


def write_inputs(folder: Path, n_items: int, shape: str) -> None:
    from stagereplay.engines import llama_cpp as engine
    from stagereplay.io.parquet import write_parquet
    from stagereplay.testing.gguf import filler_vocabulary, write_gguf
    from stagereplay.testing.shapes import SHAPES

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.gguf"
    write_gguf(path, shape, vocabulary=filler_vocabulary(SHAPES[shape]["vocab_size"]), tied=False, quant="F16",
               seed=0)
    questions = [f"{7 * i + 3}+{11 * i + 5}" for i in range(n_items)]
    with engine.LlamaCppEngine(path, engine.EngineSettings(kv_type="f16", n_ctx=256)) as e:
        prompts = [e.llm.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n".encode(),
                                  add_bos=False, special=True) for q in questions]
        stage = [e.n_vocab - 1 - j for j in range(STAGE_MARKS)]  # the last fillers, "~k" each
    items = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "gold_answer": "0", "question": q,
                           "source_row": i} for i, q in enumerate(questions)])
    write_parquet(items, folder / "items.parquet", {})
    prefixes = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "revision": "random", "precision": "bf16",
                              "status": "ok", "prompt_ids": p, "stage_ids": stage, "prefix_fingerprint": "",
                              "gold_answer": "0"} for i, p in enumerate(prompts)])
    write_parquet(prefixes, folder / "prefixes.parquet", {})
    print(f"{n_items} items, {shape} RANDOM WEIGHTS, reference stage {len(stage)} ids, in {folder}")


def settings(folder: Path, contexts: int, kv_types: list[str], device: str, threads: int):
    from stagereplay.stages.engine import EngineReplaySettings

    path = folder / "model.gguf"
    return EngineReplaySettings(engine="llama_cpp", model=str(path), revision=path.name, precision="bf16",
                                max_new_tokens=MAX_NEW, boundary={"marker": "~", "occurrence": STAGE_MARKS},
                                max_stage_tokens=MAX_STAGE, stage_sources=("engine", "reference"),
                                contexts=contexts,
                                settings=dict(kv_types=kv_types, n_gpu_layers=-1 if device == "cuda" else 0,
                                              threads=threads, chunk_size=16))


def run(folder: Path, tag: str, contexts: list[int], kv_types: list[str], device: str, threads: int) -> None:
    from stagereplay.stages.engine import audit_engine, replay_on_engine

    out = folder / tag
    out.mkdir(parents=True, exist_ok=True)
    inputs = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    times = {}
    for k in contexts:
        s = settings(folder, k, kv_types, device, threads)
        rows, audit = out / f"rows_{k}.parquet", out / f"audit_{k}.parquet"
        start = time.perf_counter()
        replay_on_engine(*inputs, str(rows), s)
        middle = time.perf_counter()
        audit_engine(*inputs, str(rows), str(audit), s)
        times[k] = {"replay_s": round(middle - start, 2), "audit_s": round(time.perf_counter() - middle, 2)}
        print(f"{tag}, {k} context(s): replay {times[k]['replay_s']} s, audit {times[k]['audit_s']} s", flush=True)
    (out / "times.json").write_text(json.dumps(times, indent=1))


def table(path: Path) -> pa.Table:
    return pq.read_table(path).replace_schema_metadata(None)


def compare(folder: Path, tags: list[str]) -> bool:
    base_rows, base_audit = table(folder / tags[0] / "rows_1.parquet"), table(folder / tags[0] / "audit_1.parquet")
    base_times = json.loads((folder / tags[0] / "times.json").read_text())["1"]
    same = True
    for tag in tags:
        for k, t in json.loads((folder / tag / "times.json").read_text()).items():
            rows, audit = table(folder / tag / f"rows_{k}.parquet"), table(folder / tag / f"audit_{k}.parquet")
            equal = rows.equals(base_rows) and audit.equals(base_audit)
            same &= equal
            print(f"{tag}, {k} context(s): rows {rows.num_rows}, audit {audit.num_rows} (all reproduced: "
                  f"{pc.all(audit['reproduced']).as_py()}), identical to {tags[0]} at 1: {equal}; replay "
                  f"{t['replay_s']} s ({base_times['replay_s'] / t['replay_s']:.2f}x), audit {t['audit_s']} s "
                  f"({base_times['audit_s'] / t['audit_s']:.2f}x), both {t['replay_s'] + t['audit_s']:.1f} s "
                  f"({(base_times['replay_s'] + base_times['audit_s']) / (t['replay_s'] + t['audit_s']):.2f}x)")
    from stagereplay.testing.controls import first_margin_nudged

    caught = not first_margin_nudged(base_rows).equals(base_rows)
    print(f"control: the first margin moved by one ulp is told apart: {caught}")
    return same and caught


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("inputs", "run", "compare"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--tags", nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1])
    parser.add_argument("--kv-types", nargs="+", default=["f16", "f32"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    if args.step == "inputs":
        write_inputs(args.folder, args.items, args.shape)
    elif args.step == "run":
        run(args.folder, args.tag, args.contexts, args.kv_types, args.device, args.threads)
    elif not compare(args.folder, args.tags):
        raise SystemExit("the tables differ, or the control was not caught")


if __name__ == "__main__":
    main()
