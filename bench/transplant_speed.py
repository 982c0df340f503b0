"""The transplant stage's core and the minimal search, unpacked (the path before packing) against packed, in one
run on one device, with the slot-invariance proof and its controls (issue 49, steps 2, 3 and 6).

One recorded batch in the stage's shape (``--rows`` rows, varied prompt and stage lengths, ``--new`` suffix
tokens, ``--edited`` rows selected), both constructions (incremental, prefill) rebuilt with their caches kept, as
the stage's ``Rebuild`` does. Then, each timed whole (the device synchronised):

- **proof**: every edited row continued in a packed decode from another slot (each row twice), per construction;
  its witness (suffix ids, margins as float32 bytes, cache fingerprints, layout, stop reason) must equal its
  recorded result. Controls: one slot's cache nudged by one step of its dtype must be caught (that slot only);
  the rows continued in decodes of one row (a row count not kept) are reported, caught or not.
- **transplants**: the default sweeps, both directions, donor and placebo arms and the shams, ``pack=False`` then
  ``pack=True``; every record must be equal but ``rows_transplanted``.
- **minimal search**: every edited row, both directions, ``--budget`` runs each, its placebo in every round,
  ``pack=False`` then ``pack=True``; every trial and outcome must be equal.

The ratios are printed with and without the batch's rebuild (what the stage pays per batch whatever the path).

    python scripts/make_random_qwen.py /tmp/m --shape qwen2.5-0.5b
    python bench/transplant_speed.py --model /tmp/m --out OUT.json

RANDOM WEIGHTS: speed and bit-exactness only.
"""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import numpy as np
import torch

from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.minimal_transplant import search_together
from stagereplay.experiments.packing import Task, run_packed
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.experiments.transplant import transplant_batch
from stagereplay.experiments.transplant_specs import enumerate_sweeps
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource
from stagereplay.stages.minimal_transplant import controlled_trials

from random_models import timed  # the device synchronised around the call: (seconds, result)

DEFAULT_SWEEPS = ["all", "quarters", "halves", "k_only", "v_only", "prompt_positions", "stage_positions"]


def witness(res) -> tuple:
    return (list(res.suffix_ids), np.asarray(res.margins, "<f4").tobytes(), res.fingerprints, res.pad,
            res.position, res.stop_reason)


def proof(decoder, prompts, stages, settings, own, edited) -> dict:
    """Slot invariance for each construction, with its two controls."""
    out = {}
    rows = len(prompts)

    def nudge(layers):
        k = layers[0][0]
        k[0, 0, 0, 0] = torch.nextafter(k[0, 0, 0, 0], torch.tensor(float("inf"), dtype=k.dtype, device=k.device))

    for name, results in own.items():
        order = edited[::-1] + edited[1:] + edited[:1]
        tasks = [Task((j, r), rows, results[r].pad, prompts[r], stages[r], results[r].layers)
                 for j, r in enumerate(order)]
        seconds, packed = timed(lambda: run_packed(decoder, tasks, settings))
        moved = sum(1 for j, r in packed if j % rows != r)
        differ = sorted(k for k, p in packed.items() if witness(p.result) != witness(results[k[1]]))
        nudged = [Task(t.key, t.rows, t.pad, t.prompt, t.stage, t.cache, nudge if t.key[0] == 1 else None)
                  for t in tasks]
        caught = sorted(k for k, p in run_packed(decoder, nudged, settings).items()
                        if witness(p.result) != witness(results[k[1]]))
        alone = [Task(t.key, 1, t.pad, t.prompt, t.stage, t.cache) for t in tasks[: len(edited)]]
        alone_differ = sorted(k for k, p in run_packed(decoder, alone, settings).items()
                              if witness(p.result) != witness(results[k[1]]))
        out[name] = {"tasks": len(tasks), "moved_out_of_their_slot": moved, "differing": [list(k) for k in differ],
                     "slot_invariant": not differ, "seconds": seconds,
                     "control_nudged_slot_caught": caught == [(1, order[1])],
                     "control_one_row_batches_differing": len(alone_differ), "control_one_row_tasks": len(alone)}
    return out


def without_count(record: dict) -> dict:
    r = dict(record, rows_transplanted=None)
    r["margins"] = np.asarray(r["margins"], "<f4").tobytes()
    return r


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--regime", default="cuda_graph", choices=["eager", "static", "cuda_graph"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--edited", type=int, default=4)
    parser.add_argument("--stage", type=int, nargs=2, default=[40, 160], help="stage lengths drawn in [lo, hi)")
    parser.add_argument("--prompt", type=int, nargs=2, default=[60, 140])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--sweeps", nargs="+", default=DEFAULT_SWEEPS)
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    set_determinism(1)
    loaded = load_model(ModelSource("local", args.model), args.precision, args.device)
    vocab = int(loaded.model.config.vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(*args.prompt))] for _ in range(args.rows)]
    stages = [[rng.randrange(100, vocab) for _ in range(rng.randrange(*args.stage))] for _ in range(args.rows)]
    settings = RunSettings("random", args.precision, None, args.new, decode_regime=args.regime)
    max_len = max(len(p) for p in prompts) + max(len(s) for s in stages) + args.new + 8
    decoder = make_decoder(loaded.model, (), args.regime, max_len=max_len, max_rows=args.rows)
    edited = list(range(0, args.rows, max(1, args.rows // args.edited)))[: args.edited]
    keep = set(edited)
    for name in ("incremental", "prefill"):  # warm: graphs captured, allocator pools filled
        run(decoder, name, prompts, settings, stages=stages, keep=keep)
    own, rebuild_s = {}, 0.0
    for name in ("incremental", "prefill"):
        seconds, own[name] = timed(lambda n=name: run(decoder, n, prompts, settings, stages=stages, keep=keep))
        rebuild_s += seconds
    divergent = sum(own["incremental"][r].suffix_ids != own["prefill"][r].suffix_ids for r in edited)
    out = {"random_weights": True, "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
           "torch": torch.__version__, "regime": args.regime, "precision": args.precision, "rows": args.rows,
           "edited": edited, "divergent_edited": divergent, "new": args.new, "max_len": max_len,
           "sweeps": args.sweeps, "budget": args.budget, "rebuild_s": rebuild_s}
    out["proof"] = proof(decoder, prompts, stages, settings, own, edited)
    specs = enumerate_sweeps(args.sweeps, decoder.n_layers)
    out["specs"] = len(specs)
    runs = {}
    for pack in (False, True):
        seconds, runs[pack] = timed(lambda p=pack: transplant_batch(decoder, prompts, stages, settings, own, edited,
                                                                    specs, pack=p))
        out[f"transplants_{'packed' if pack else 'unpacked'}_s"] = seconds
    out["transplants_identical"] = all(
        [without_count(a) for a in runs[True][r]] == [without_count(b) for b in runs[False][r]] for r in edited)
    holder = SimpleNamespace(prompts=prompts, stages=stages, own=own)
    searches = {}
    for pack in (False, True):
        sufficient, outcomes = controlled_trials(decoder, holder, settings, edited, pack)
        starts = {(r, donor): (decoder.n_layers, len(prompts[r]) + len(stages[r]) - 1)
                  for donor in own for r in edited}
        seconds, result = timed(lambda: search_together(sufficient, starts, args.budget))
        searches[pack] = ({k: (v.box, v.runs, v.trials) for k, v in result.items()}, outcomes)
        out[f"minimal_{'packed' if pack else 'unpacked'}_s"] = seconds
        out[f"minimal_{'packed' if pack else 'unpacked'}_runs"] = sum(v.runs for v in result.values())
    out["minimal_identical"] = searches[True] == searches[False]
    for stage in ("transplants", "minimal"):
        old, new = out[f"{stage}_unpacked_s"], out[f"{stage}_packed_s"]
        out[f"{stage}_ratio"] = old / new
        out[f"{stage}_ratio_with_rebuild"] = (old + rebuild_s) / (new + rebuild_s)
    print(json.dumps(out, indent=1, default=str))
    print(f"transplants: unpacked {out['transplants_unpacked_s']:.2f} s, packed {out['transplants_packed_s']:.2f} s, "
          f"ratio {out['transplants_ratio']:.2f}x ({out['transplants_ratio_with_rebuild']:.2f}x with the batch's "
          f"rebuild, {rebuild_s:.2f} s); identical: {out['transplants_identical']}")
    print(f"minimal search: unpacked {out['minimal_unpacked_s']:.2f} s, packed {out['minimal_packed_s']:.2f} s, "
          f"ratio {out['minimal_ratio']:.2f}x ({out['minimal_ratio_with_rebuild']:.2f}x with the rebuild); "
          f"identical: {out['minimal_identical']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
