"""Small synthetic results files in the agreed schemas, for the report and figure tests (no model involved)."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from stagereplay.io.parquet import write_parquet

# The ledger's columns (docs/STUDY.md, "Ledger columns"), written out here so that the analysis tests need no
# engine code.
LEDGER_COLUMNS = ["item_index", "item_id", "revision", "experiment", "precision", "construction", "replica", "status",
                  "prompt_ids", "stage_ids", "prefix_fingerprint", "cache_k_fingerprints", "cache_v_fingerprints",
                  "cache_fingerprint", "suffix_ids", "suffix_fingerprint", "margins", "stop_reason", "suffix_text",
                  "answer", "gold_answer", "correct", "decode_regime", "numerics", "batch_index", "batch_row",
                  "batch_rows"]


def _fp(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def synthetic_ledger(revision="primary", n_items=40, seed=0, missing=(3,), nonfinite=(5,),
                     replays=None, truncated=None) -> pd.DataFrame:
    """Matched (live/prefill, bf16) and fixed-prefix (incremental/prefill, bf16 and fp32) rows, two replicas each.

    The prefill side diverges from the reference side on a seeded subset of items (more often in bf16, never in
    fp32), sometimes flipping the correctness label; item ``missing`` never reaches its boundary and item
    ``nonfinite`` overflows on the prefill side. ``replays`` ({construction: {precision: items}}) adds fixed-prefix
    constructions beyond the pair, each equal to the reference except on its items at that precision, where its
    suffix differs from position 2 on (and its label flips). ``truncated`` ({(experiment, precision, construction):
    items}) are the suffixes that stopped at max_new_tokens; every other suffix of status ok ended at EOS.
    """
    rng = np.random.default_rng(seed)
    rows = []
    cells = [("matched", "bf16", ("live", "prefill")), ("fixed_prefix", "bf16", ("incremental", "prefill")),
             ("fixed_prefix", "fp32", ("incremental", "prefill"))]
    for item in range(n_items):
        base = [int(t) for t in rng.integers(3, 30, size=12)]
        margins = [float(m) for m in rng.exponential(2.0, size=12)]
        gold_right = bool(rng.random() < 0.5)
        for experiment, precision, constructions in cells:
            if experiment == "fixed_prefix" and replays:
                constructions = (*constructions, *replays)
            diverge_at = None
            if precision == "bf16" and rng.random() < (0.6 if experiment == "matched" else 0.4):
                diverge_at = int(rng.integers(0, 12))
            for construction in constructions:
                suffix, m = list(base), list(margins)
                correct = gold_right
                status = "ok"
                if diverge_at is not None and construction not in (replays or {}):  # a near-tie where they split
                    m[diverge_at] = float(rng.uniform(0, 0.05))
                if construction == "prefill" and diverge_at is not None:
                    suffix[diverge_at:] = [t + 1 for t in suffix[diverge_at:]]
                    correct = gold_right if diverge_at < 6 else not gold_right
                if item in (replays or {}).get(construction, {}).get(precision, ()):
                    suffix[2:] = [t + 2 for t in suffix[2:]]
                    correct = not gold_right
                if item in missing:
                    if construction != "live":
                        continue
                    status, suffix, correct = "boundary_missing", suffix, None
                if item in nonfinite and construction == "prefill" and experiment == "matched":
                    status, correct = "nonfinite", None
                cut = item in (truncated or {}).get((experiment, precision, construction), ())
                stop = status if status != "ok" else "max_new_tokens" if cut else "eos"
                for replica in (1, 2):
                    rows.append({
                        "item_index": item, "item_id": f"item-{item}", "revision": revision,
                        "experiment": experiment, "precision": precision, "construction": construction,
                        "replica": replica, "status": status, "prompt_ids": [1, 2, 3],
                        "stage_ids": [] if status == "boundary_missing" else [4, 5],
                        "prefix_fingerprint": _fp(item), "cache_fingerprint": _fp(item, experiment, precision, construction),
                        "cache_k_fingerprints": [], "cache_v_fingerprints": [], "suffix_ids": suffix,
                        "suffix_fingerprint": _fp(suffix), "margins": m, "stop_reason": stop,
                        "suffix_text": "", "answer": None, "gold_answer": "1", "correct": correct,
                    })
    return pd.DataFrame(rows, columns=LEDGER_COLUMNS)


def synthetic_transplant(revision="primary", n_items=6) -> pd.DataFrame:
    rows = []
    for item in range(n_items):
        for direction in ("incremental->prefill", "prefill->incremental"):
            for layer_set, layers, component, positions in [("all", [0, 1, 2, 3], "kv", "all"),
                                                            ("0-1", [0, 1], "kv", "all"), ("2-3", [2, 3], "kv", "all"),
                                                            ("L0", [0], "kv", "all"), ("L3", [3], "kv", "all"),
                                                            ("all", [0, 1, 2, 3], "k", "all"),
                                                            ("all", [0, 1, 2, 3], "v", "all"),
                                                            ("all", [0, 1, 2, 3], "kv", "stage")]:
                if layer_set == "all" and component == "kv" and positions == "all":
                    outcome = "donor"
                else:
                    outcome = ["donor", "recipient", "neither"][(item + len(layers) + len(component)) % 3]
                rows.append({"item_index": item, "item_id": f"item-{item}", "revision": revision, "precision": "bf16",
                             "donor": direction.split("->")[0], "recipient": direction.split("->")[1],
                             "direction": direction, "layer_set": layer_set, "layers": layers, "component": component,
                             "positions": positions, "outcome": outcome,
                             "first_divergence_donor": None if outcome == "donor" else 3,
                             "first_divergence_recipient": 2 if outcome != "recipient" else None,
                             "noop": False,
                             "placebo_outcome": ["recipient", "donor", "neither"][(item + len(layers)) % 3]})
    return pd.DataFrame(rows)


def synthetic_cache_differences(revision="primary", n_items=5, layers=4) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    rows = []
    for precision, scale in (("bf16", 4e-3), ("fp32", 2e-7)):
        for item in range(n_items):
            for layer in range(layers):
                for component in ("k", "v"):
                    equal = layer == 0 and precision == "bf16"
                    m = 0.0 if equal else float(scale * (layer + 1) * rng.uniform(0.5, 1.5))
                    rows.append({"item_index": item, "item_id": f"item-{item}", "revision": revision,
                                 "precision": precision, "construction_a": "incremental", "construction_b": "prefill",
                                 "layer": layer, "component": component, "bit_equal": equal, "max_abs": m,
                                 "rms": m / 5, "first_position_differs": None if equal else 3, "n_positions": 20,
                                 "prompt_length": 10})
    return pd.DataFrame(rows)


def synthetic_minimal_transplant(revision="primary", n_items=5, layers=4) -> pd.DataFrame:
    """Minimal sets of divergent items, both directions; the last item's search ran out of budget."""
    rows = []
    for item in range(n_items):
        for direction in ("live->prefill", "prefill->live"):
            prompt, cache = 10 + item, 18 + item
            lo, hi = (item % layers, item % layers + 1) if item % 2 else (0, layers)
            rows.append({"item_index": item, "item_id": f"item-{item}", "revision": revision, "precision": "bf16",
                         "donor": direction.split("->")[0], "recipient": direction.split("->")[1],
                         "direction": direction, "budget": 24, "runs": 10 + item,
                         "full_sufficient": True, "budget_exhausted": item == n_items - 1,
                         "locally_minimal": item != n_items - 1, "layer_lo": lo, "layer_hi": hi,
                         "layer_set": "all" if hi - lo == layers else f"L{lo}", "num_layers": layers,
                         "component": ("kv", "k", "v")[item % 3], "position_lo": prompt, "position_hi": cache,
                         "cache_length": cache, "prompt_length": prompt, "share_of_layers": (hi - lo) / layers,
                         "share_of_cache": (cache - prompt) / cache, "share_of_prompt": 0.0, "share_of_stage": 1.0,
                         "share_of_state": (hi - lo) / layers * (cache - prompt) / cache,
                         "trials": ["layers all · KV · positions [0, 18)"], "trial_outcomes": ["donor"],
                         "live_fingerprint_match": True})
    return pd.DataFrame(rows)


def synthetic_onset(revision="primary", n_items=6, layers=4) -> pd.DataFrame:
    """Per-layer differences of divergent items growing with depth, onset at layer 1 (item 0: at layer 0)."""
    rng = np.random.default_rng(2)
    rows = []
    for item in range(n_items):
        onset = 0 if item == 0 else 1
        margin = float(rng.uniform(0, 0.5))
        for layer in range(layers):
            for component in ("k", "v"):
                equal = layer < onset
                m = 0.0 if equal else float(1e-2 * 2 ** layer * rng.uniform(0.5, 1.5))
                rows.append({"item_index": item, "item_id": f"item-{item}", "revision": revision,
                             "precision": "bf16", "construction_a": "live", "construction_b": "prefill",
                             "layer": layer, "component": component, "bit_equal": equal, "max_abs": m,
                             "rms": m / 5, "first_position_differs": None if equal else 4 + item, "n_positions": 20,
                             "prompt_length": 10, "onset_layer": onset, "onset_position": 4 + item,
                             "first_divergence": 3, "margin_a": margin, "margin_b": margin / 2,
                             "live_fingerprint_match": True})
    return pd.DataFrame(rows)


def synthetic_fidelity(revision="primary", n_items=6, steps=8) -> pd.DataFrame:
    """Per-step fidelity rows: bf16 prefill and chunked differ from live (items 0 and 1 split), fp32 prefill differs
    by ulps (KL about 1e-14, no split), fp32 chunked is byte-equal on every step (exact zeros)."""
    rng = np.random.default_rng(3)
    rows = []
    for precision, construction, scale in (("bf16", "prefill", 1e-4), ("bf16", "chunked", 3e-4),
                                           ("fp32", "prefill", 1e-14), ("fp32", "chunked", 0.0)):
        for item in range(n_items):
            margins = rng.uniform(0.05, 3.0, steps).astype(np.float32)
            split_at = 3 + item if precision == "bf16" and item < 2 else None
            if split_at is not None:
                margins[split_at] = np.float32(0.01)
            for step in range(steps):
                kl = 0.0 if scale == 0 or step == 0 else float(scale * rng.uniform(0.1, 10))
                rows.append({"item_index": item, "item_id": f"item-{item}", "revision": revision,
                             "precision": precision, "reference": "live", "construction": construction,
                             "step": step, "token_id": 3, "kl_forward": kl, "kl_reverse": kl * 1.1,
                             "kl_sym": kl * 1.05, "max_abs_logit_diff": 0.0 if kl == 0 else float(np.sqrt(kl)),
                             "margin_reference": float(margins[step]), "margin_construction": float(margins[step]),
                             "argmax_differs": split_at is not None and step >= split_at, "logits_equal": kl == 0,
                             "cache_equal": scale == 0, "decode_regime": "eager", "numerics": "default",
                             "batch_index": None, "batch_row": None, "batch_rows": None, "layout_pad": 0,
                             "layout_position": 20})
    return pd.DataFrame(rows)


def synthetic_bridge(revision="primary", n=12, not_exact=()) -> pd.DataFrame:
    return pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "revision": revision, "precision": "bf16",
                          "bit_exact": i not in not_exact, "first_layer_differs": 2 if i in not_exact else None,
                          "component_differs": "k" if i in not_exact else None,
                          "first_position_differs": 7 if i in not_exact else None, "suffix_equal": True}
                         for i in range(n)])


def synthetic_audit(ledger: pd.DataFrame, failing=()) -> pd.DataFrame:
    audit = ledger[["item_index", "item_id", "revision", "experiment", "precision", "construction", "replica"]].copy()
    audit["reproduced"] = [i not in failing for i in range(len(audit))]
    return audit


def write(df: pd.DataFrame, path) -> str:
    write_parquet(df, path, {"stage": "synthetic test data"})
    return str(path)


def synthetic_batch_invariance(revision="primary") -> pd.DataFrame:
    """Four fp32 live rows: two compared and equal, one with no cache on either side (a boundary never reached,
    status boundary_missing on both), one whose alone run overflowed (status nonfinite, no cache)."""
    rows = []
    for item, (status_b, status_a, fp_b, fp_a, equal) in enumerate([
            ("ok", "ok", "a" * 64, "a" * 64, True), ("ok", "ok", "b" * 64, "b" * 64, True),
            ("boundary_missing", "boundary_missing", "", "", False), ("ok", "nonfinite", "c" * 64, "", False)]):
        rows.append({"item_index": item, "item_id": f"item-{item}", "revision": revision, "precision": "fp32",
                     "construction": "live", "batch_index": 0, "batch_row": item, "batch_rows": 4,
                     "status_batched": status_b, "status_alone": status_a, "cache_equal": equal and fp_b == fp_a,
                     "stage_equal": equal, "suffix_equal": equal, "first_divergence": None if equal else 0,
                     "label_equal": equal, "correct_batched": True, "correct_alone": True if equal else None,
                     "cache_fingerprint_batched": fp_b, "cache_fingerprint_alone": fp_a})
    return pd.DataFrame(rows)


def part_provenance(precision="bf16", experiment="matched", revision="primary", **extra) -> dict:
    """A generation part's provenance, shaped as the stages write it."""
    return {"stagereplay": "0.1.0", "torch": "2.13.0", "transformers": "4.99.0", "git_commit": "abc123",
            "cache_fingerprint_scheme": "sha256-list-v2", "model_source": f"data/toy/{revision}",
            "model_type": "qwen2", "num_layers": 4, "attn_implementation": "sdpa", "dtype": precision,
            "device": "cpu", "numerics_regime": {"numerics": "default"},
            "numerics": {"deterministic_algorithms": True, "tf32": False, "threads": 1},
            "stage": experiment,
            "config": {"model": "data/toy", "revision": revision, "precision": precision,
                       "boundary": {"marker": ";", "token_id": None, "occurrence": 1}, "max_stage_tokens": 32,
                       "max_new_tokens": 48, "threads": 1, "decode_regime": "eager", "batch_size": 1,
                       "seed": 0, "numerics": "default", "answer_format": "last_number"}, **extra}


def write_with(df: pd.DataFrame, path, provenance: dict) -> str:
    write_parquet(df, path, provenance)
    return str(path)
