"""Layout parity on a real-shape model: batched all-layer transplants follow their donor, as at batch 1.

Decodes random prompts in batches (the static or cuda_graph regime, default numerics), builds the ``live`` and
``prefill`` boundary caches of every row in the batch's one layout, and transplants all layers in both directions
for every row whose two continuations diverge; then does the same for every row alone (batch 1). As a contrast it
also emulates the layout the engine used before the rebuild (a batch's prefill rows decoded apart, padded so that
their prefixes end together) and counts how often a transplant between the two layouts follows its donor.

    python scripts/make_random_qwen.py /tmp/m --shape qwen2.5-0.5b
    python bench/layout_parity.py --model /tmp/m --rows 48 --batch 16 --regime cuda_graph --out OUT.json

With a random-weight model (no real weights here) the numbers say nothing about a real model's divergences, only
whether the mechanics hold. Prints and writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from stagereplay.io.ids import first_divergence
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.experiments.transplant import transplant_batch, transplant_edit
from stagereplay.experiments.transplant_specs import TransplantSpec
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource

from batch_invariance import StageOfLength


def follows(decoder, prompts, stages, settings, rows) -> dict:
    """Live vs prefill in one batch, and every divergent row's all-layer transplant in both directions."""
    keep = set(range(len(prompts)))
    own = {"live": run(decoder, "incremental", prompts, settings, stages=stages, keep=keep),
           "prefill": run(decoder, "prefill", prompts, settings, stages=stages, keep=keep)}
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    out = {"divergent": 0, "follow_donor": 0, "follow_donor_margin_bytes": 0, "transplants": 0}
    divergent = [r for r in rows if first_divergence(own["live"][r].suffix_ids, own["prefill"][r].suffix_ids) is not None]
    done = transplant_batch(decoder, prompts, stages, settings, own, divergent, [every]) if divergent else {}
    for r in divergent:
        out["divergent"] += 1
        for row in done[r]:
            out["transplants"] += 1
            out["follow_donor"] += row["outcome"] == "donor"
            out["follow_donor_margin_bytes"] += margin_bytes(row["margins"]) == margin_bytes(own[row["donor"]][r].margins)
    return out


def margin_bytes(margins) -> bytes:
    return np.asarray(margins, dtype="<f4").tobytes()


def old_layout(decoder, prompts, stages, settings) -> dict:
    """The pre-rebuild batched layout: live rows in the live run's layout, prefill rows decoded apart (prefixes
    aligned at their end); a transplant between the two layouts."""
    keep = set(range(len(prompts)))
    live = run(decoder, "incremental", prompts, settings, stages=stages, keep=keep)
    cuts = [p + s[:-1] for p, s in zip(prompts, stages)]
    prefill = run(decoder, "incremental", cuts, settings, stages=[[s[-1]] for s in stages], keep=keep)
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    out = {"divergent": 0, "follow_donor": 0, "follow_donor_margin_bytes": 0, "transplants": 0}
    for r in range(len(prompts)):
        if first_divergence(live[r].suffix_ids, prefill[r].suffix_ids) is None:
            continue
        out["divergent"] += 1
        to_prefill = run(decoder, "incremental", cuts, settings, stages=[[s[-1]] for s in stages],
                         edit=transplant_edit(r, every, live[r].layers, len(cuts[r])))[r]
        to_live = run(decoder, "incremental", prompts, settings, stages=stages,
                      edit=transplant_edit(r, every, prefill[r].layers, len(prompts[r])))[r]
        out["transplants"] += 2
        out["follow_donor"] += (to_prefill.suffix_ids == live[r].suffix_ids) + (to_live.suffix_ids ==
                                                                                prefill[r].suffix_ids)
        out["follow_donor_margin_bytes"] += ((margin_bytes(to_prefill.margins) == margin_bytes(live[r].margins))
                                             + (margin_bytes(to_live.margins) == margin_bytes(prefill[r].margins)))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--regime", default="cuda_graph", choices=["static", "cuda_graph"])
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--stage", type=int, default=24, help="generated tokens up to the boundary")
    parser.add_argument("--new", type=int, default=32, help="suffix tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    set_determinism(1)
    loaded = load_model(ModelSource("local", args.model), args.precision, args.device)
    vocab = int(loaded.model.config.vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(16, 128))] for _ in range(args.rows)]
    settings = RunSettings("random", args.precision, args.stage, args.new)
    longest = max(len(p) for p in prompts) + args.stage + args.new
    batched = make_decoder(loaded.model, (), args.regime, max_len=longest, max_rows=args.batch)
    summary = {"model": args.model, "random_weights": True, "precision": args.precision, "regime": args.regime,
               "rows": args.rows, "batch": args.batch, "batched": {}, "alone": {}, "old_layout": {}}

    def add(into, counts):
        for k, v in counts.items():
            into[k] = into.get(k, 0) + v

    for start in range(0, args.rows, args.batch):
        chunk = prompts[start:start + args.batch]
        live = run(batched, "live", chunk, settings, matcher=StageOfLength(args.stage))
        stages = [res.stage_ids for res in live]
        add(summary["batched"], follows(batched, chunk, stages, settings, range(len(chunk))))
        add(summary["old_layout"], old_layout(batched, chunk, stages, settings))
        for p, s in zip(chunk, stages):
            add(summary["alone"], follows(batched, [p], [s], settings, [0]))
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
