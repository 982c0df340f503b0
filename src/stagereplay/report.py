"""The Markdown report and stats.json, built from the ledgers alone (no model, no torch).

Per revision and precision it puts this run's counts beside the reference study's figures (DESIGN.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from . import stats
from .engine import first_divergence
from .ledger import read_parquet, read_provenance, software_versions, write_text_atomic

REFERENCE = {
    "matched_disagreements": "166 / 200",
    "matched_label_flips": "20 / 200",
    "matched_accuracy_difference": "+1 point, paired 95% CI [-3.5, +5.5]",
    "replicas_exact": "yes",
}


def compare_constructions(ledger: pd.DataFrame, experiment: str, a: str, b: str) -> pd.DataFrame:
    """One row per (item, precision): replica 1 of construction ``a`` against replica 1 of ``b``."""
    sel = ledger[(ledger["experiment"] == experiment) & (ledger["replica"] == 1)]
    left = sel[sel["construction"] == a].set_index(["item_index", "precision"])
    right = sel[sel["construction"] == b].set_index(["item_index", "precision"])
    rows = []
    for key in left.index.intersection(right.index):
        la, rb = left.loc[key], right.loc[key]
        if la["status"] != "ok" or rb["status"] != "ok":
            continue
        sa, sb = list(la["suffix_ids"]), list(rb["suffix_ids"])
        pos = first_divergence(sa, sb)
        ma, mb = list(la["margins"]), list(rb["margins"])
        rows.append({
            "item_index": key[0], "item_id": la["item_id"], "precision": key[1],
            "disagree": pos is not None, "first_divergence": pos,
            f"margin_{a}": float(ma[pos]) if pos is not None and pos < len(ma) else None,
            f"margin_{b}": float(mb[pos]) if pos is not None and pos < len(mb) else None,
            f"correct_{a}": bool(la["correct"]), f"correct_{b}": bool(rb["correct"]),
            "label_differs": bool(la["correct"]) != bool(rb["correct"]),
        })
    return pd.DataFrame(rows)


def _fmt_prop(p: dict) -> str:
    if p["n"] == 0:
        return "0 / 0"
    return (f"{p['k']} / {p['n']} ({100 * p['rate']:.1f}%, Wilson 95% "
            f"[{100 * p['wilson_low']:.1f}, {100 * p['wilson_high']:.1f}])")


def matched_section(ledger: pd.DataFrame, revision: str, seed: int) -> tuple[list[str], dict]:
    lines, out = [], {}
    matched = ledger[ledger["experiment"] == "matched"]
    for precision in sorted(matched["precision"].unique()):
        sub = matched[matched["precision"] == precision]
        live1 = sub[(sub["construction"] == "live") & (sub["replica"] == 1)]
        n_items = len(live1)
        missing = live1[live1["status"] == "boundary_missing"]
        nonfinite = sub[sub["status"] == "nonfinite"]["item_id"].unique()
        cmp = compare_constructions(sub, "matched", "live", "prefill")
        n = len(cmp)
        dis = stats.proportion(int(cmp["disagree"].sum()) if n else 0, n)
        flips = stats.proportion(int(cmp["label_differs"].sum()) if n else 0, n)
        acc = (stats.paired_accuracy_difference(cmp["correct_live"].tolist(), cmp["correct_prefill"].tolist(),
                                                seed=seed) if n else None)
        out[precision] = {"n_items": n_items, "n_compared": n, "boundary_missing": int(len(missing)),
                          "nonfinite_items": int(len(nonfinite)), "suffix_disagreements": dis,
                          "label_flips": flips, "accuracy_difference": acc}
        lines += [
            f"### Matched experiment, {precision} ({revision})",
            "",
            f"{n_items} items; {len(missing)} never reached the stage boundary (`boundary_missing`, excluded from "
            f"the comparison){'; ' + str(len(nonfinite)) + ' with non-finite logits (excluded)' if len(nonfinite) else ''}.",
            "",
            "| claim | reference study (bf16) | this run |",
            "| --- | --- | --- |",
            f"| replicas on both sides exact | {REFERENCE['replicas_exact']} | yes (checked on token ids and cache "
            "bytes; a mismatch stops the run) |",
            f"| live cache vs one-shot prefill: suffixes that differ | {REFERENCE['matched_disagreements']} | "
            f"{_fmt_prop(dis)} |",
            f"| correctness labels that differ | {REFERENCE['matched_label_flips']} | {_fmt_prop(flips)} |",
        ]
        if acc is not None:
            lines.append(
                f"| accuracy live / prefill, difference | {REFERENCE['matched_accuracy_difference']} | "
                f"{100 * acc['accuracy_a']:.1f}% / {100 * acc['accuracy_b']:.1f}%, "
                f"{100 * acc['difference']:+.1f} points, paired bootstrap 95% CI "
                f"[{100 * acc['bootstrap_low']:+.1f}, {100 * acc['bootstrap_high']:+.1f}], exact McNemar "
                f"p = {acc['mcnemar_p']:.3g} |")
        if len(missing):
            lines += ["", "Items without a stage boundary: " + ", ".join(f"`{i}`" for i in missing["item_id"][:50])
                      + (" ..." if len(missing) > 50 else "")]
        lines.append("")
    return lines, out


def build_report(ledgers: dict[str, str], out_md: str, out_json: str, run: str, seed: int = 0,
                 transplants: dict[str, str] | None = None) -> None:
    """``ledgers`` (and ``transplants``) map a revision slug to its ledger.parquet (transplant.parquet)."""
    lines = [f"# stagereplay report: run `{run}`", "",
             "Built from the ledgers alone. The reference study: a Qwen2.5-derived reasoning model, 48 layers, "
             "200 items.", ""]
    all_stats = {"run": run, "software": software_versions(), "revisions": {}}
    for revision, path in sorted(ledgers.items()):
        ledger = read_parquet(path)
        lines += [f"## Revision `{revision}`", ""]
        section, numbers = matched_section(ledger, revision, seed)
        lines += section
        all_stats["revisions"][revision] = {"matched": numbers}
    if transplants:
        lines += ["## K/V transplants", "",
                  "Each revision's two constructions of the primary revision's prefix ids; a transplant continues from "
                  "the recipient's boundary cache carrying the donor's K/V in the layers, component and positions named.",
                  ""]
    for revision, path in transplants.items() if transplants else ():
        section, numbers = transplant_section(read_parquet(path), revision, read_provenance(path).get("selection"))
        lines += section
        all_stats["revisions"].setdefault(revision, {})["transplant"] = numbers
    write_text_atomic(out_md, "\n".join(lines) + "\n")
    write_text_atomic(out_json, json.dumps(all_stats, indent=2, sort_keys=True) + "\n")


TRANSPLANT_REFERENCE = ("24 / 24 (selected set, primary checkpoint); 43 / 43 (outcome-blind selection, later "
                        "checkpoint)")


def transplant_section(transplant: pd.DataFrame, revision: str, selection: dict | None = None) -> tuple[list[str], dict]:
    """Follow rates of one revision's transplants: the all-layer K/V transplant beside the study, then every sweep.

    Rates count divergent items only (the two constructions' own continuations differ); a non-divergent item has
    no donor to tell apart from its recipient.
    """
    div = transplant[transplant["divergent"].astype(bool)]
    whole = div[(div["layer_set"] == "all") & (div["component"] == "kv") & (div["positions"] == "all")]
    headline = stats.follow_rate(whole["outcome"].tolist())
    by_direction = {d: stats.follow_rate(g["outcome"].tolist()) for d, g in whole.groupby("direction", sort=True)}
    out = {"all_layers": headline, "all_layers_by_direction": by_direction, "selection": selection or {},
           "n_items": int(transplant["item_index"].nunique()), "n_divergent_items": int(div["item_index"].nunique()),
           "sweeps": []}
    sel = selection or {}
    lines = [f"### Transplants ({revision})", "",
             f"Selection `{sel.get('rule', '?')}` (seed {sel.get('seed', '?')}), decided from suffix token ids "
             f"before any transplant ran: {sel.get('n_selected', out['n_items'])} of {sel.get('n_candidates', '?')} "
             f"items, {out['n_divergent_items']} with divergent constructions.", ""]
    live = transplant.drop_duplicates("item_index")["live_fingerprint_match"]
    if live.notna().any():
        lines += [f"The rebuilt incremental cache was bit-exact with the ledger's live cache for "
                  f"{int(live.dropna().astype(bool).sum())} / {int(live.notna().sum())} items (called `live` where it "
                  "was).", ""]
    lines += ["| claim | reference study | this run |", "| --- | --- | --- |",
              f"| all-layer K/V transplant: divergent continuations that follow their cache donor | "
              f"{TRANSPLANT_REFERENCE} | {_fmt_prop(headline['follows_donor'])} |"]
    for direction, rate in by_direction.items():
        lines.append(f"| ... {direction} | | {_fmt_prop(rate['follows_donor'])}; recipient {rate['recipient']}, "
                     f"neither {rate['neither']} |")
    if headline["n"] and headline["donor"] < headline["n"]:
        misses = whole[whole["outcome"] != "donor"]
        lines += ["", "**Finding:** all-layer transplants that did not follow their donor (the cache should be the "
                  "whole state): " + ", ".join(f"`{r.item_id}` {r.direction} ({r.outcome})"
                                               for r in misses.itertuples())]
    if div.empty:
        lines += ["", "No selected item has divergent constructions: there is no donor to follow.", ""]
        return lines, out
    lines += ["", "| sweep | layers | component | positions | direction | donor | recipient | neither |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = ["sweep", "layer_set", "component", "positions", "direction"]
    for key, group in div.groupby(keys, sort=False):
        rate = stats.follow_rate(group["outcome"].tolist())
        out["sweeps"].append({**dict(zip(keys, key)), **rate})
        lines.append("| " + " | ".join(str(k) for k in key)
                     + f" | {rate['donor']} | {rate['recipient']} | {rate['neither']} |")
    lines.append("")
    return lines, out
