"""Witnesses of the decode core: one sha256 per regime and construction over every row's suffix ids, margins (as
float32 bytes), boundary-cache fingerprints, layout and stop reason, and one over a batch's transplants. Run it
from two trees on one device and compare the files: a change to the decode core that claims to change nothing must
give the same witnesses (``--compare A.json B.json`` prints the cases that differ and exits 1 on any).

    PYTHONPATH=OLD/src python bench/decode_witness.py --model /tmp/m --out old.json
    PYTHONPATH=src python bench/decode_witness.py --model /tmp/m --out new.json
    python bench/decode_witness.py --compare old.json new.json

Control: ``--nudge`` changes one margin's last bit before hashing, so the comparison is shown to fail.
Uses only entry points that are older than the packing (make_decoder, recipe.run, transplant_batch without
``pack``) so that a tree from before it can run it. RANDOM WEIGHTS: exactness only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys

import numpy as np


def digest(results, nudge=False) -> str:
    h = hashlib.sha256()
    for i, res in enumerate(results):
        margins = np.asarray(res.margins, "<f4")
        if nudge and i == 0 and margins.size:
            margins = margins.copy()
            margins.view("<u4")[0] ^= 1
        h.update(json.dumps([list(res.stage_ids), list(res.suffix_ids), res.fingerprints, res.pad, res.position,
                             res.stop_reason]).encode())
        h.update(margins.tobytes())
    return h.hexdigest()


def records_digest(records) -> str:
    h = hashlib.sha256()
    for rec in records:
        rec = {k: v for k, v in rec.items() if k != "rows_transplanted"}
        rec["margins"] = np.asarray(rec["margins"], "<f4").tobytes().hex()
        h.update(json.dumps(rec, sort_keys=True, default=str).encode())
    return h.hexdigest()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--regimes", nargs="+", default=["eager", "static", "cuda_graph"])
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--nudge", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        print(f"{len(set(a) & set(b))} cases in both; differing: {differ or 'none'}")
        sys.exit(1 if differ else 0)
    import torch

    from stagereplay.decode.greedy import BoundaryMatcher
    from stagereplay.decode.regimes import make_decoder
    from stagereplay.experiments.recipe import run
    from stagereplay.experiments.rows import RunSettings
    from stagereplay.experiments.transplant import transplant_batch
    try:
        from stagereplay.experiments.transplant_specs import enumerate_sweeps
    except ImportError:  # a tree from before the specs had their own module
        from stagereplay.experiments.transplant import enumerate_sweeps
    from stagereplay.models.loading import load_model, set_determinism
    from stagereplay.models.sources import ModelSource

    set_determinism(1)
    loaded = load_model(ModelSource("local", args.model), args.precision, args.device)
    vocab = int(loaded.model.config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(20, 50))] for _ in range(args.rows)]
    stages = [[rng.randrange(100, vocab) for _ in range(rng.randrange(10, 40))] for _ in range(args.rows)]
    out = {}
    for regime in args.regimes:
        if regime == "cuda_graph" and args.device != "cuda":
            continue
        settings = RunSettings("random", args.precision, 40, args.new, decode_regime=regime)
        max_len = max(len(p) for p in prompts) + 60 + args.new
        decoder = make_decoder(loaded.model, (), regime, max_len=max_len, max_rows=args.rows)
        own = {}
        for name in ("incremental", "prefill", "chunked", "prefix_cached"):
            results = run(decoder, name, prompts, settings, stages=stages, keep=set(range(args.rows)))
            out[f"{regime}/{name}"] = digest(results, args.nudge)
            if name in ("incremental", "prefill"):
                own[name] = results
        # live: greedy from the prompts to a boundary (an id the model chose; rows that never meet it within 40
        # ids end without one, which is witnessed too)
        matcher = BoundaryMatcher(1, token_ids=[int(own["prefill"][0].suffix_ids[0])])
        out[f"{regime}/live"] = digest(run(decoder, "live", prompts, settings, matcher=matcher), args.nudge)
        specs = enumerate_sweeps(["all", "halves", "stage_positions"], decoder.n_layers)
        records = transplant_batch(decoder, prompts, stages, settings, own, [0, 3], specs)
        out[f"{regime}/transplants"] = records_digest([rec for r in sorted(records) for rec in records[r]])
        print(regime, "done", flush=True)
    out["_device"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
