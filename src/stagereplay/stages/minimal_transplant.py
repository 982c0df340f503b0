"""Stage ``find_minimal_transplants``: per divergent selected item and direction, the minimal sufficient transplant
(:mod:`stagereplay.experiments.minimal_transplant`), each run in the item's recorded batch and layout through the one
recipe, as the transplant stage runs its sweeps.

Items come from the transplant selection (outcome-blind, written before any transplant runs); selected items whose
two constructions continue alike are left out, since following the donor cannot be told from following the
recipient there. The caches are rebuilt and checked against the baseline as in the transplant stage
(:class:`~stagereplay.stages.transplant.Rebuild`).
"""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow as pa

from stagereplay.experiments.minimal_transplant import search_together, span_shares
from stagereplay.experiments.transplant import (Transplant, check_placebo, directions, run_shams, run_transplants,
                                                transplanted_bytes_equal)
from stagereplay.experiments.transplant_specs import layer_set_name
from stagereplay.io.fingerprints import check_fingerprint_scheme
from stagereplay.io.keys import ITEM_FIELDS
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.stages.jobs import config_of, load_as_recorded
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import MinimalTransplantSettings
from stagereplay.stages.transplant import Packing, Rebuild, batches_with
from stagereplay.stages.transplant_selection import baseline_pair, baseline_rows

log = logging.getLogger("stagereplay")

MINIMAL_TRANSPLANT_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("donor", pa.string()),
    ("recipient", pa.string()),
    ("direction", pa.string()),  # "<donor>-><recipient>"
    ("budget", pa.int32()),  # transplant runs allowed for this item and direction
    ("runs", pa.int32()),  # transplant runs used, the whole-cache one included
    ("full_sufficient", pa.bool_()),  # the whole-cache transplant followed the donor (the search's start)
    ("budget_exhausted", pa.bool_()),  # the search wanted a run the budget did not allow
    ("locally_minimal", pa.bool_()),  # no half along layers or positions, nor K or V alone, sufficed
    # the minimal set found (null where the whole cache did not suffice)
    ("layer_lo", pa.int32()),
    ("layer_hi", pa.int32()),  # exclusive
    ("layer_set", pa.string()),  # "all", "L7", "0-11"
    ("num_layers", pa.int32()),
    ("component", pa.string()),  # kv | k | v
    ("position_lo", pa.int32()),  # cache positions [position_lo, position_hi)
    ("position_hi", pa.int32()),
    ("cache_length", pa.int32()),  # boundary-cache positions (the prefix but its last token)
    ("prompt_length", pa.int32()),
    ("share_of_layers", pa.float64()),
    ("share_of_cache", pa.float64()),  # of the cache's positions
    ("share_of_prompt", pa.float64()),  # of the prompt's positions (null: no prompt position cached)
    ("share_of_stage", pa.float64()),  # of the cached stage ids' positions (null: none cached)
    ("share_of_state", pa.float64()),  # of the cache's K and V entries: layers x positions x (1 for KV, 1/2 for K or V)
    ("trials", pa.list_(pa.string())),  # every box tried, in order
    ("trial_outcomes", pa.list_(pa.string())),  # donor | recipient | neither, per trial
    # the control: every trial's box also runs its placebo (experiments.transplant.placebo_bytes) in the same batch
    # layout; a box counts as sufficient only where the donor's bytes carry and its placebo does not
    ("trial_placebo_outcomes", pa.list_(pa.string())),  # donor | recipient | neither, per trial
    ("trial_noops", pa.list_(pa.bool_())),  # the box's bytes are identical in donor and recipient, per trial
    ("whole_placebo_follows", pa.bool_()),  # the whole cache's placebo carried the donor's continuation too
    ("verdict", pa.string()),  # localised | not separable from its placebo | whole cache does not carry
    ("sham_cache_fingerprint", pa.string()),  # the recipient's own bytes written back: equals its own, or the stage stops
    ("live_fingerprint_match", pa.bool_()),  # null where the pair has no live construction
])


VERDICTS = ("localised", "not separable from its placebo", "whole cache does not carry")


def verdict(outcomes: dict[str, list]) -> str:
    """What the search could tell for one item and direction, from its first trial (the whole cache): whether the
    donor's bytes carried there, and whether its placebo did too."""
    if outcomes["donor"][0] != "donor":
        return VERDICTS[2]
    return VERDICTS[1] if outcomes["placebo"][0] == "donor" else VERDICTS[0]


def _row(item, s, donor, recipient, result, outcomes, num_layers, cache_length, prompt_length, match,
         sham) -> dict:
    box = result.box
    row = {"item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": s.revision,
           "precision": s.precision, "donor": donor, "recipient": recipient, "direction": f"{donor}->{recipient}",
           "budget": s.budget, "runs": result.runs, "full_sufficient": outcomes["donor"][0] == "donor",
           "budget_exhausted": result.budget_exhausted, "locally_minimal": result.locally_minimal,
           "num_layers": num_layers, "cache_length": cache_length, "prompt_length": prompt_length,
           "trials": [b.label(num_layers) for b, _ in result.trials], "trial_outcomes": outcomes["donor"],
           "trial_placebo_outcomes": outcomes["placebo"], "trial_noops": outcomes["noop"],
           "whole_placebo_follows": outcomes["placebo"][0] == "donor", "verdict": verdict(outcomes),
           "sham_cache_fingerprint": sham, "live_fingerprint_match": match}
    if box is not None:
        share_layers = (box.layer_hi - box.layer_lo) / num_layers
        shares = span_shares(box.position_lo, box.position_hi, prompt_length, cache_length)
        row.update(layer_lo=box.layer_lo, layer_hi=box.layer_hi, layer_set=layer_set_name(box.layers, num_layers),
                   component=box.component, position_lo=box.position_lo, position_hi=box.position_hi,
                   share_of_layers=share_layers, **shares,
                   share_of_state=share_layers * shares["share_of_cache"] * (1.0 if box.component == "kv" else 0.5))
    return row


def controlled_trials(decoder, rebuild: Rebuild, settings, rows, pack: bool = True):
    """The search's test of a round of boxes (one per batch row and direction still searching, keyed
    ``(row, donor)``) and the record it keeps: each box's donor bytes and their placebo, every one of the round
    in packed decodes (``pack``; else one decode of the batch per direction and arm). A box suffices only where the
    donor's bytes carry the donor's continuation and the placebo's do not; a placebo whose cache is the donor
    transplant's stops the stage (:func:`check_placebo`). Returns (sufficient, outcomes per key)."""
    recipient_of = dict(directions(rebuild.own))
    outcomes = {(r, donor): {"donor": [], "placebo": [], "noop": []} for r in rows for donor in recipient_of}

    def sufficient(boxes: dict) -> dict:
        order = sorted(boxes, key=lambda key: (list(recipient_of).index(key[1]), key[0]))
        transplants = [Transplant(r, donor, recipient_of[donor], boxes[r, donor].spec(), arm)
                       for arm in ("donor", "placebo") for r, donor in order]
        done = run_transplants(decoder, rebuild.prompts, rebuild.stages, settings, rebuild.own, transplants, pack)
        by = {(t.row, t.donor, t.arm): d for t, d in zip(transplants, done)}
        verdicts = {}
        for r, donor in order:
            recipient, spec = recipient_of[donor], boxes[r, donor].spec()
            carried, control = by[r, donor, "donor"], by[r, donor, "placebo"]
            noop = transplanted_bytes_equal(spec, rebuild.own[donor][r].layers, rebuild.own[recipient][r].layers,
                                            len(rebuild.prompts[r]))
            check_placebo(f"row {r} {donor}->{recipient} {boxes[r, donor]}", control.result, carried.result, noop)
            record = outcomes[r, donor]
            record["donor"].append(carried.outcome.outcome)
            record["placebo"].append(control.outcome.outcome)
            record["noop"].append(noop)
            verdicts[r, donor] = carried.outcome.outcome == "donor" and control.outcome.outcome != "donor"
        return verdicts

    return sufficient, outcomes


def find_minimal_transplants(selection_path: str, baseline_path: str, out_path: str,
                             s: MinimalTransplantSettings) -> pd.DataFrame:
    """Search every divergent selected item of this shard's batches in both directions (``s.budget`` runs each; 0
    writes an empty table and loads no model). Whether the model loads depends on the whole selection, not on the
    shard: every shard's part records the same provenance."""
    if s.budget < 0:
        raise ValueError(f"transplant.minimal.budget must be >= 0, got {s.budget}")
    selection = read_parquet(selection_path)
    chosen = {int(i) for i in selection.loc[selection["divergent"].astype(bool), "item_index"]} if s.budget else set()
    rows, job, plan = [], None, None
    if chosen:
        baseline = read_parquet(baseline_path)
        check_fingerprint_scheme(baseline_path)
        pair = baseline_pair(baseline_path, s.constructions)
        by_index = {int(p["item_index"]): p for p in baseline_rows(baseline, s.precision, pair).to_dict("records")}
        missing = sorted(chosen - set(by_index))
        if missing:
            raise ValueError(f"items {missing} of the selection have no baseline rows at {s.precision}; rerun the "
                             "selection")
        job = load_as_recorded(s, s.precision, baseline_path)
        settings = job.decode_settings()
        plan, batches = batches_with(baseline_path, baseline, s.precision, chosen, s.shard, s.n_shards)
        packing = Packing(s.pack, job.decoder)
        for batch in progress(batches, f"find_minimal_transplants {s.revision}/{s.precision} shard {s.shard}",
                              enabled=s.progress):
            wanted = {r for r, it in enumerate(batch.items) if int(it["item_index"]) in chosen}
            rebuild = Rebuild(job, batch, by_index, pair, settings, keep=wanted)
            shape = {}
            for r in sorted(wanted):
                layers = rebuild.own[pair[0]][r].layers
                shape[r] = (len(layers), int(layers[0][0].shape[2]))  # (1, kv_heads, seq, head_dim)
                if rebuild.own[pair[0]][r].suffix_ids == rebuild.own[pair[1]][r].suffix_ids:
                    raise ValueError(f"item {batch.items[r]['item_id']!r} is divergent in the selection but its "
                                     "rebuilt constructions continue alike; rerun the selection")
            pack = packing.on(len(batch.items))
            shams = run_shams(job.decoder, rebuild.prompts, rebuild.stages, settings, rebuild.own, sorted(wanted),
                              pack)
            # both directions' searches in lockstep: each round's boxes and their placebos in the same decodes
            sufficient, outcomes = controlled_trials(job.decoder, rebuild, settings, sorted(wanted), pack)
            starts = {(r, donor): shape[r] for donor, _ in directions(rebuild.own) for r in sorted(wanted)}
            searched = {key: (result, outcomes[key])
                        for key, result in search_together(sufficient, starts, s.budget).items()}
            for r in sorted(wanted):
                name = rebuild.names[r]
                for donor, recipient in directions(rebuild.own):
                    result, outcomes = searched[r, donor]
                    rows.append(_row(batch.items[r], s, name[donor], name[recipient], result, outcomes, *shape[r],
                                     len(rebuild.prompts[r]), rebuild.match[r], shams[recipient][r]))
    df = pd.DataFrame(rows, columns=MINIMAL_TRANSPLANT_SCHEMA.names).astype(
        {c: "object" for c in ("layer_lo", "layer_hi", "position_lo", "position_hi", "share_of_prompt",
                               "share_of_stage", "live_fingerprint_match", "whole_placebo_follows")})
    df = df.sort_values(["item_index", "direction"], kind="stable").reset_index(drop=True)
    found = df[df["full_sufficient"]]
    log.info("minimal transplants %s/%s: %d rows (budget %d); whole cache sufficient %d; budget ran out %d; "
             "runs used %d", s.revision, s.precision, len(df), s.budget, len(found),
             int(df["budget_exhausted"].sum()), int(df["runs"].sum()))
    base = (job.provenance("find_minimal_transplants", config_of(s), packing=packing.record()) if job else
            {**software_versions(), "stage": "find_minimal_transplants", "config": config_of(s)})
    prov = {**base, "selection": read_provenance(selection_path).get("selection"),
            "search": {"budget": s.budget, "method": "greedy bisection: component (K, then V), layers and positions "
                       "(lower half first), in passes until none narrows; sufficient = the donor's bytes carry the "
                       "donor's continuation and the box's placebo (the difference shifted within its span) does "
                       "not; minimal "
                       "against halving, not a global minimum; the searches of a batch's rows run in lockstep, one decode of "
                       "the batch per round (packed: a round's boxes and placebos of both directions share decodes, "
                       "beside the shams)"},
            "batch_plan": None if plan is None else plan.record()}
    write_parquet(df, out_path, prov, MINIMAL_TRANSPLANT_SCHEMA)
    return df
