"""The suffix-only schedule against the lockstep live schedule, byte for byte, with a control that can fail.

In a static batch of several rows a built construction (``prefill``, ``chunked``, ``prefix_cached``) used to run
the live schedule: teacher-forced through the other rows' stage steps, its cache swapped in at each row's
boundary. It now continues each row from its own boundary, the rows stepping together each at its own position
(:mod:`stagereplay.decode.greedy`). This script runs the same cells both ways on one model and compares what the
results record: every row's token ids, its margins as float32 bytes, its boundary-cache fingerprints and layout
(pad, position), the bytes of its kept boundary cache, and transplant cells (the ``incremental`` cache's layers
edited into the built rows at their boundaries). Rows have stages of uneven length (one row without a prefix), and
an end-of-sequence id taken from a first run ends some rows early.

The control runs the same built rows in another layout (``--control alone``: two of them each in a batch of its
own; ``rows``: the batch without its last row; ``span``: a buffer 64 positions longer) and counts the continuation
values (margins, ids) that then differ: a layout that changes the bits shows that the comparison can fail.

    python bench/suffix_schedule.py [--model data/toy/primary | --shape qwen2.5-1.5b] --device cpu|cuda \\
        --precision bf16 fp32 --regime static cuda_graph --attention masked triton --kernels library fused \\
        [--numerics default invariant] [--rows 8] [--suffix 24] [--json OUT.json]
    python bench/suffix_schedule.py ... --schedule lockstep --digest OUT.json   # one schedule's bytes, for a
    python bench/suffix_schedule.py --compare A.json B.json                      # check against another tree
    (--src OLD/src runs another tree's package, e.g. ``git archive COMMIT src | tar -x -C OLD``)

Every option combination that cannot run here (Triton options off CUDA, fused kernels under invariant numerics)
is skipped and listed. Exit status 1 if any combination's schedules differ. A control without a difference says
that this layout does not change this combination's bits here (the invariant numerics change none by design; on
the CPU a bf16 row's bits did not depend on its batch); only a combination with a differing control shows that
its comparison can fail.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import os
import random
import sys
from pathlib import Path

if __name__ == "__main__" and "--src" in sys.argv:
    # --src DIR: another tree's package (say, an earlier commit's src, for its lockstep bytes). The script runs
    # again with DIR first on PYTHONPATH, so that every import below is that tree's.
    _src = str(Path(sys.argv[sys.argv.index("--src") + 1]).resolve())
    _path = os.environ.get("PYTHONPATH", "")
    if _path.split(os.pathsep)[0] != _src:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_src, _path]))})

import numpy as np
import torch

from stagereplay.decode.greedy import decode_rows
from stagereplay.decode.protocol import RegimeError
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments import constructions

REPO = Path(__file__).resolve().parents[1]

BUILT = ("prefill", "chunked", "prefix_cached")


def random_model(shape: str, precision: str, device: str, seed: int = 0):
    """A random-weight Qwen2 of a real shape (scripts/make_random_qwen.py's table), in memory."""
    spec = importlib.util.spec_from_file_location("make_random_qwen", REPO / "scripts" / "make_random_qwen.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shapes.SHAPES[shape], torch_dtype="float32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def load(args, precision: str, numerics: str):
    from stagereplay.models.loading import set_determinism

    set_determinism(1)
    if args.shape:
        model = random_model(args.shape, precision, args.device)
    else:
        from stagereplay.models.loading import load_model
        from stagereplay.models.sources import ModelSource

        model = load_model(ModelSource("local", str(args.model)), precision, args.device).model
    if numerics == "invariant":
        from stagereplay.models import invariant

        invariant.apply(model)
    return model


def cells(rows: int, vocab: int, seed: int):
    """A batch: random prompts and stages of uneven lengths (row 1 without a prefix)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 24))] for _ in range(rows)]
    stages = [None if r == 1 else [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
              for r in range(rows)]
    return prompts, stages


def row_bytes(res) -> dict:
    layers = None
    if res.layers is not None:
        digest = hashlib.sha256()
        for k, v in res.layers:
            for t in (k, v):  # the stored bytes, whatever the dtype
                digest.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        layers = digest.hexdigest()
    return {"stage": res.stage_ids, "suffix": res.suffix_ids, "stop": res.stop_reason,
            "margins": np.asarray(res.margins, dtype="<f4").tobytes().hex(), "pad": res.pad,
            "position": res.position, "fingerprints": list(res.fingerprints) if res.fingerprints else None,
            "layers": layers}


def run_cells(decoder, prompts, stages, suffix: int, chunk: int) -> dict:
    """Every built construction (kept caches), the same with an all-layer and a K-only half transplant of the
    incremental cache, and a boundary cache without a suffix; keyed by cell."""
    keep = {r for r, s in enumerate(stages) if s is not None}
    out = {}
    donor = decode_rows(decoder, prompts, stages=stages, build=constructions.get("incremental").cache_build(chunk),
                        max_new_tokens=suffix, keep=keep)
    out["incremental"] = [row_bytes(r) for r in donor]
    half = range(decoder.n_layers // 2)
    for name in BUILT:
        build = constructions.get(name).cache_build(chunk)
        out[name] = [row_bytes(r) for r in decode_rows(decoder, prompts, stages=stages, build=build,
                                                        max_new_tokens=suffix, keep=keep)]
        out[name + "/no_suffix"] = [row_bytes(r) for r in decode_rows(decoder, prompts, stages=stages, build=build,
                                                                      max_new_tokens=0)]
        for label, layers, parts in (("all", range(decoder.n_layers), "kv"), ("k_half", half, "k")):
            def edit(r, cache, layers=layers, parts=parts):
                for i in layers:
                    k, v = cache[i]
                    dk, dv = donor[r].layers[i]
                    if "k" in parts:
                        k.copy_(dk)
                    if "v" in parts:
                        v.copy_(dv)
            out[f"{name}/transplant_{label}"] = [row_bytes(r) for r in decode_rows(
                decoder, prompts, stages=stages, build=build, max_new_tokens=suffix, edit=edit)]
    return out


def schedule(decoder, which: str) -> None:
    if which == "lockstep" and hasattr(decoder, "suffix_schedule"):
        decoder.suffix_schedule = False
    elif which == "suffix":
        decoder.suffix_schedule = True


def differing(a: dict, b: dict) -> list[str]:
    return [f"{cell}[{r}].{key}" for cell in a for r, (x, y) in enumerate(zip(a[cell], b[cell]))
            for key in x if x[key] != y[key]]


def combination(args, precision, regime, attention, kernels, numerics) -> dict:
    model = load(args, precision, numerics)
    vocab = int(model.config.vocab_size)
    prompts, stages = cells(args.rows, vocab, args.seed)
    max_len = 24 + 20 + args.suffix + 8
    decoder = make_decoder(model, (), regime, max_len=max_len, max_rows=args.rows, attention=attention,
                           kernels=kernels)
    # an end-of-sequence id that ends some rows early: a token the first run chose mid-suffix
    probe = decode_rows(decoder, prompts, stages=stages, build=constructions.get("prefill").cache_build(args.chunk),
                        max_new_tokens=args.suffix)
    mids = [r.suffix_ids[len(r.suffix_ids) // 2] for r in probe if len(r.suffix_ids) > 2]
    rows_with = {t: sum(t in r.suffix_ids for r in probe) for t in mids}
    eos = (min(mids, key=lambda t: (rows_with[t], t)),) if mids else ()  # in as few rows as any
    decoder = make_decoder(model, eos, regime, max_len=max_len, max_rows=args.rows, attention=attention,
                           kernels=kernels)
    found = {}
    for which in ("lockstep", "suffix") if args.schedule == "both" else (args.schedule,):
        schedule(decoder, which)
        found[which] = run_cells(decoder, prompts, stages, args.suffix, args.chunk)
    result = {"eos": list(eos), "rows": args.rows, "max_len": max_len, "cells": found}
    if args.schedule != "both":
        return result
    result["differs"] = differing(found["lockstep"], found["suffix"])
    ended = sum(r["stop"] == "eos" for r in found["suffix"]["prefill"])
    result["rows_ended_by_eos"] = ended
    if args.control == "none":
        result["control"] = {"layout": "none", "differs": None}
        return result
    # the control: the same built rows in another layout
    schedule(decoder, "suffix")
    other = make_decoder(model, eos, regime, max_len=max_len + (64 if args.control == "span" else 0),
                         max_rows=args.rows, attention=attention, kernels=kernels)
    if args.control == "alone":  # each row with a prefix in a batch of its own
        base, moved = {}, {}
        for r in [r for r, s in enumerate(stages) if s is not None][:2]:
            for cell, rows in run_cells(other, prompts[r:r + 1], stages[r:r + 1], args.suffix, args.chunk).items():
                moved.setdefault(cell, []).extend(rows)
                base.setdefault(cell, []).append(found["suffix"][cell][r])
    else:
        rows = args.rows - 1 if args.control == "rows" else args.rows
        moved = run_cells(other, prompts[:rows], stages[:rows], args.suffix, args.chunk)
        base = {cell: found["suffix"][cell][:rows] for cell in moved}
    control = [d for d in differing(base, moved) if d.endswith((".margins", ".suffix"))]  # the continuations
    result["control"] = {"layout": args.control, "differs": len(control), "examples": control[:5]}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "data" / "toy" / "primary"))
    ap.add_argument("--shape", default=None, help="a random-weight shape of scripts/make_random_qwen.py instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--regime", nargs="+", default=["static"])
    ap.add_argument("--attention", nargs="+", default=["masked"])
    ap.add_argument("--kernels", nargs="+", default=["library"])
    ap.add_argument("--numerics", nargs="+", default=["default"])
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control", choices=["alone", "rows", "span", "none"], default="alone")
    ap.add_argument("--schedule", choices=["both", "lockstep", "suffix"], default="both")
    ap.add_argument("--src", default=None,
                    help="the package tree to import (default: the installed package, or PYTHONPATH's)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--digest", default=None, help="write every cell's bytes here (one schedule)")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"))
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        bad = {key: differing(a[key], b[key]) for key in a if key in b}
        missing = sorted(set(a) ^ set(b))
        for key, d in bad.items():
            print(f"{key}: {'equal' if not d else f'{len(d)} differ, e.g. {d[:3]}'}")
        if missing:
            print("only in one file:", missing)
        return 1 if any(bad.values()) or not bad else 0
    import stagereplay

    print(f"package: {Path(stagereplay.__file__).parent}", flush=True)
    summary, digests, failed = {}, {}, False
    for precision, regime, attention, kernels, numerics in itertools.product(
            args.precision, args.regime, args.attention, args.kernels, args.numerics):
        key = f"{precision}/{regime}/{attention}/{kernels}/{numerics}"
        try:
            result = combination(args, precision, regime, attention, kernels, numerics)
        except (RegimeError, ImportError) as e:
            print(f"{key}: skipped ({e})", flush=True)
            summary[key] = {"skipped": str(e)}
            continue
        if args.schedule != "both":
            digests[key] = result["cells"][args.schedule]
            print(f"{key}: {sum(len(v) for v in digests[key].values())} rows recorded", flush=True)
            continue
        failed |= bool(result["differs"])
        rows = sum(len(v) for v in result["cells"]["suffix"].values())
        print(f"{key}: schedules {'byte-identical' if not result['differs'] else 'DIFFER'} over {rows} rows of "
              f"{len(result['cells']['suffix'])} cells ({result['rows_ended_by_eos']} prefill rows ended by eos); "
              f"control ({result['control']['layout']}): {result['control']['differs']} values differ", flush=True)
        if result["differs"]:
            print("   differs:", result["differs"][:6])
        summary[key] = {k: v for k, v in result.items() if k != "cells"}
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "torch": torch.__version__,
                                               "device": torch.cuda.get_device_name() if args.device.startswith(
                                                   "cuda") else "cpu", "combinations": summary}, indent=1))
    if args.digest:
        Path(args.digest).write_text(json.dumps(digests))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
