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
    "fixed_prefix": "bf16 disagreements recur; fp32: 0 / 200 (95% Wilson upper bound 1.88%)",
    "bridge_exact": "12 / 12",
    "audit_reproduced": "all 200 retained trajectories and comparison fingerprints",
}

BRIDGE_NOTE = (
    "What the bridge shows on CPU: the live generation feeds the prompt in one forward pass and then one token per "
    "step. An `incremental` rebuild that feeds the same ids in the same chunks reproduces the live cache bit for "
    "bit at every layer (K and V), and with it the live continuation. A one-shot `prefill` of the very same ids "
    "(the contrast column) computes other matrix shapes, hence other kernels and summation orders, and its cache is "
    "in general not the live one (in bf16, rounding can absorb the difference on some rows; in fp32 it rarely "
    "does). A "
    "construction matches `live` bit for bit only if it feeds tokens in the same chunks as the original "
    "generation did; that is what lets the fixed-prefix 2x2 use `incremental` in place of `live` at a precision "
    "that did not generate the prefix."
)


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
        regime = ", ".join(sorted(sub["numerics"].unique())) if "numerics" in sub else "default"
        out[precision] = {"numerics": regime, "n_items": n_items, "n_compared": n,
                          "boundary_missing": int(len(missing)), "nonfinite_items": int(len(nonfinite)), "suffix_disagreements": dis,
                          "label_flips": flips, "accuracy_difference": acc}
        lines += [
            f"### Matched experiment, {precision} ({revision})",
            "",
            f"{n_items} items; {len(missing)} never reached the stage boundary (`boundary_missing`, excluded from "
            f"the comparison){'; ' + str(len(nonfinite)) + ' with non-finite logits (excluded)' if len(nonfinite) else ''}.",
            f"Numerics regime: `{regime}`.",
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


def fixed_prefix_section(ledger: pd.DataFrame, revision: str,
                         reference_precision: str | None = None) -> tuple[list[str], dict]:
    """The fixed-prefix 2x2 per precision: incremental vs prefill over the same prefix ids."""
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    if fixed.empty:
        return [], {}
    source = f"the {reference_precision} generation" if reference_precision else "the reference generation"
    lines = [f"### Fixed-prefix 2x2 ({revision})", "",
             f"Every item's prefix ids are held fixed (taken from {source}); at each precision the boundary cache is "
             "built `incremental` (prompt prefill, then the stage tokens one at a time) and by one-shot `prefill`, "
             "two bit-exact replicas each. Rows with non-finite logits are counted and never compared.", "",
             "| precision | items | non-finite rows | suffixes that differ (incremental vs prefill) | "
             "labels that differ | first divergence: median [q1, q3] (min-max) |",
             "| --- | --- | --- | --- | --- | --- |"]
    out = {}
    for precision in sorted(fixed["precision"].unique()):
        sub = fixed[fixed["precision"] == precision]
        n_items = int(sub["item_index"].nunique())
        nonfinite = sub[sub["status"] == "nonfinite"]
        cmp = compare_constructions(sub, "fixed_prefix", "incremental", "prefill")
        n = len(cmp)
        dis = stats.proportion(int(cmp["disagree"].sum()) if n else 0, n)
        flips = stats.proportion(int(cmp["label_differs"].sum()) if n else 0, n)
        positions = [int(p) for p in cmp["first_divergence"].dropna()] if n else []
        summary = stats.first_divergence_summary(positions)
        out[precision] = {"n_items": n_items, "n_compared": n, "nonfinite_rows": int(len(nonfinite)),
                          "nonfinite_items": int(nonfinite["item_index"].nunique()),
                          "suffix_disagreements": dis, "label_flips": flips, "first_divergence": summary}
        where = ("-" if summary["n"] == 0 else
                 f"{summary['median']:g} [{summary['q1']:g}, {summary['q3']:g}] ({summary['min']}-{summary['max']})")
        lines.append(f"| {precision} | {n_items} | {len(nonfinite)} | {_fmt_prop(dis)} | {_fmt_prop(flips)} | {where} |")
    lines += ["", f"Reference study: {REFERENCE['fixed_prefix']}.", ""]
    return lines, out


def bridge_section(bridge: pd.DataFrame, revision: str) -> tuple[list[str], dict]:
    """The bridge per precision: incremental rebuilds bit-exact with the retained live cache."""
    lines = [f"### Bridge: incremental rebuild vs retained live cache ({revision})", ""]
    out = {}
    if bridge.empty:
        return lines + ["No bridge rows (bridge.n_rows is 0).", ""], out
    lines += ["| precision | rows drawn | with a boundary | incremental bit-exact | continuations equal | "
              "one-shot prefill bit-exact (contrast) |", "| --- | --- | --- | --- | --- | --- |"]
    inexact = []
    for precision in sorted(bridge["precision"].unique()):
        sub = bridge[bridge["precision"] == precision]
        ok = sub[sub["status"] == "ok"]
        exact, equal = int(ok["bit_exact"].astype(bool).sum()), int(ok["suffix_equal"].astype(bool).sum())
        prefill_exact = int(ok["prefill_bit_exact"].astype(bool).sum())
        out[precision] = {"n_rows": int(len(sub)), "n_with_boundary": int(len(ok)), "bit_exact": exact,
                          "suffix_equal": equal, "prefill_bit_exact": prefill_exact}
        lines.append(f"| {precision} | {len(sub)} | {len(ok)} | {exact} / {len(ok)} | {equal} / {len(ok)} | "
                     f"{prefill_exact} / {len(ok)} |")
        inexact += ok[~ok["bit_exact"].astype(bool)].to_dict("records")
    lines += ["", f"Reference study: bit-exact on {REFERENCE['bridge_exact']} rows.", ""]
    for row in inexact:
        lines.append(f"- NOT bit-exact: `{row['item_id']}` ({row['precision']}): first differs at layer "
                     f"{int(row['first_layer_differs'])}, {row['component_differs']}, position "
                     f"{int(row['first_position_differs'])}")
    if inexact:
        lines.append("")
    lines += [BRIDGE_NOTE, ""]
    return lines, out


def audit_section(audit: pd.DataFrame, revision: str) -> tuple[list[str], dict]:
    """The saved-ledger audit: how many ledger rows were recomputed to the same ids and fingerprints."""
    n, k = len(audit), int(audit["reproduced"].astype(bool).sum()) if len(audit) else 0
    failed = audit[~audit["reproduced"].astype(bool)] if n else audit
    out = {"n_rows": n, "reproduced": k, "failed": [
        {"item_id": r["item_id"], "experiment": r["experiment"], "precision": r["precision"],
         "construction": r["construction"], "replica": int(r["replica"]), "differed": list(r["differed"])}
        for r in failed.to_dict("records")]}
    lines = [f"### Saved-ledger audit ({revision})", "",
             f"Every ledger row recomputed from the selection, the model and the ledger's ids alone: **{k} / {n} "
             f"reproduced** (token ids, cache and suffix fingerprints, margins, answers). Reference study: "
             f"{REFERENCE['audit_reproduced']} reproduced.", ""]
    for r in out["failed"][:50]:
        lines.append(f"- did not reproduce: `{r['item_id']}` {r['experiment']}/{r['precision']}/{r['construction']} "
                     f"replica {r['replica']}: {', '.join(r['differed'])}")
    if out["failed"]:
        lines.append("")
    return lines, out


def build_report(ledgers: dict[str, str], out_md: str, out_json: str, run: str, seed: int = 0,
                 bridges: dict[str, str] | None = None, audits: dict[str, str] | None = None,
                 reference_precision: str | None = None, transplants: dict[str, str] | None = None) -> None:
    """``ledgers`` maps a revision slug to its ledger.parquet (``bridges``, ``audits``: to those files)."""
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
        section, numbers = fixed_prefix_section(ledger, revision, reference_precision)
        lines += section
        if numbers:
            all_stats["revisions"][revision]["fixed_prefix"] = numbers
        if bridges and revision in bridges:
            section, all_stats["revisions"][revision]["bridge"] = bridge_section(read_parquet(bridges[revision]),
                                                                                  revision)
            lines += section
        if audits and revision in audits:
            section, all_stats["revisions"][revision]["audit"] = audit_section(read_parquet(audits[revision]),
                                                                                revision)
            lines += section
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
