"""The transplants in the report: the localisation sweep (which part of the boundary cache carries the
divergence, beyond the study) and the all-layer bidirectional transplant (claim 7, a consistency check)."""

from __future__ import annotations

import pandas as pd

from stagereplay.analysis import placebo, stats, study
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import format_percent, join_words, table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique


def _all_layer_rows(transplant: pd.DataFrame) -> pd.DataFrame:
    sel = transplant[(transplant["layer_set"] == "all") & (transplant["component"] == "kv")]
    if "positions" in sel.columns:
        sel = sel[sel["positions"] == "all"]
    return sel


def _divergent(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["divergent"].fillna(False).astype(bool)] if "divergent" in frame.columns else frame


def transplant_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 7 and the localisation sweep beyond the study.

    Handing the recipient the donor's whole boundary state makes it the donor's state, so the all-layer transplant
    is a check of the construction (and of the two caches' layout parity), not a discovery: the report says so and
    puts the localisation (layer bands, K or V alone, position ranges) first, as the informative part. Rates count
    divergent items only (the two constructions' own continuations differ): a non-divergent item has no donor to
    tell apart from its recipient."""
    transplant = data.frame("transplant")
    check_unique(transplant, "transplant")
    matrix = analysis.transplant_matrix(transplant)
    if matrix.empty:
        n_items = int(transplant["item_index"].nunique()) if len(transplant) else 0
        return ["#### Transplants", "",
                f"_No divergent item to transplant: {n_items} item(s) were transplanted and on none do the two "
                "constructions' own continuations differ, so following the donor cannot be told apart from "
                "following the recipient._", "",
                f"Reference study (all {study.LAYERS} K/V layers): {study.transplant_text()}.", ""], {
            "n_items": n_items, "n_divergent": 0}
    full = matrix[(matrix["layer_set"] == "all") & (matrix["component"] == "kv") & (matrix["positions"] == "all")]
    rest = matrix.drop(full.index)
    out: dict = {"all_layers": {}, "sweep": []}
    lines: list[str] = []
    n_div = int(_divergent(transplant)["item_index"].nunique())
    constructions = sorted(set(transplant["donor"]) | set(transplant["recipient"])) if "donor" in transplant else []
    selection = data.provenance("transplant").get("selection") or {}
    split = (f"At revision `{data.revision}` the two constructions continue differently on "
             f"{selection['n_divergent']} of {selection['n_candidates']} items (the outcome-blind selection's count, "
             f"rule `{selection.get('rule')}`). " if {"n_divergent", "n_candidates"} <= set(selection) else "")
    if split:
        out["split"] = {"k": int(selection["n_divergent"]), "n": int(selection["n_candidates"])}
    lines += [split + f"{n_div} divergent item(s) of {transplant['item_index'].nunique()} transplanted"
              + (f", between `{constructions[0]}` and `{constructions[1]}`" if len(constructions) == 2 else "")
              + ", each in both directions.", ""]
    if len(rest):
        lines += localisation_lines(rest, out)
    lines += ["#### Claim: bidirectional transplant of all K/V layers (a consistency check)", "",
              "The boundary state is the whole decoder state (docs/STUDY.md), so handing the recipient the donor's K "
              "and V at every layer and position makes its cache the donor's cache: following the donor is what the "
              "construction guarantees. The all-layer transplant checks the construction and that the two caches "
              "are laid out alike; it is not a finding about the model.", "",
              f"Reference study (all {study.LAYERS} K/V layers): {study.transplant_text()}.", "",
              *table_head("precision", "direction", "this run: follows donor", "recipient", "neither",
                          "transplanted cache = donor's cache (fingerprint)")]
    for r in full.itertuples(index=False):
        sel = _divergent(_all_layer_rows(transplant[(transplant["precision"] == r.precision)
                                                    & (transplant["direction"] == r.direction)]))
        out["all_layers"].setdefault(r.precision, {})[r.direction] = stats.follow_rate(sel["outcome"].tolist())
        parity = "—"
        if {"cache_fingerprint", "donor_cache_fingerprint"} <= set(sel.columns):
            both = sel[sel["cache_fingerprint"].notna() & sel["donor_cache_fingerprint"].notna()]
            equal = int((both["cache_fingerprint"] == both["donor_cache_fingerprint"]).sum())
            parity = f"{equal} / {len(both)}"
            out["all_layers"][r.precision][r.direction]["cache_equals_donor"] = {"k": equal, "n": len(both)}
        lines.append(table_row(r.precision, r.direction, f"{r.donor} / {r.n}", r.recipient, r.neither, parity))
    if full.empty:
        lines.append(table_row("—", "—", "no all-layer K/V transplant over all positions in this file", "", "", ""))
    whole = _divergent(_all_layer_rows(transplant))
    whole = whole[whole["outcome"] != "donor"]
    out["all_layer_misses"] = [f"{r.item_id} {r.direction} ({r.outcome})" for r in whole.itertuples(index=False)]
    if len(whole):
        lines += ["", "**Finding:** all-layer transplants that did not follow their donor, although the transplanted "
                  "cache should be the donor's whole state (a fault of the construction or of the layout): "
                  + ", ".join(f"`{m}`" for m in out["all_layer_misses"])]
    if "live_fingerprint_match" in transplant.columns:
        match = transplant.drop_duplicates("item_index")["live_fingerprint_match"]
        known = match.dropna()
        if len(known):  # null where the baseline has no live row (a revision without a ledger of its own)
            lines += ["", f"The rebuilt `incremental` cache equals the ledger's live cache fingerprint for "
                      f"{int(known.astype(bool).sum())} / {len(known)} items (those are labelled `live`)."]
            out["live_fingerprint_match"] = {"k": int(known.astype(bool).sum()), "n": int(len(known))}
    return lines + [""], out


CONTROLS = ("Each row's control: the same transplant with its **placebo** (the donor-minus-recipient difference over "
            "the same layers, component and positions, shifted cyclically by half the span, or negated where the "
            "span is one position), run in the same batch layout. At a near-tie any push may tip the choice, so a "
            "part of the cache is said to carry the divergence only where the donor's bytes follow the donor more "
            "often than their placebo (McNemar's exact test over items, on the pairs where exactly one of them "
            "did). A **no-op** (the transplanted bytes identical in donor and recipient, e.g. prompt positions "
            "that both constructions prefill alike) is counted apart and is evidence of nothing. A **sham** (the "
            "recipient's own bytes written back through the same edit) reproduced the recipient byte for byte on "
            "every item and direction, or the stage would have stopped.")


def localisation_lines(rest: pd.DataFrame, out: dict) -> list[str]:
    """The localisation sweep's table, each row beside its placebo and no-ops, and what it shows net of placebo."""
    controlled = rest["placebo"].notna().any()
    lines = ["#### Localisation: which part of the cache carries the divergence (beyond the study)", "",
             "Share of divergent continuations that follow the donor when only part of its boundary cache is "
             "handed over" + (", beside the same share for its placebo." if controlled else "."), ""]
    if controlled:
        lines += [CONTROLS, "", *table_head("precision", "layers · component · positions", "direction",
                                            "follows donor", "placebo follows donor", "difference (points)",
                                            "only donor / only placebo",
                                            "McNemar exact p", "no-ops", "reading")]
    else:
        lines += ["_This file predates the placebo control: its rates are not shown to exceed what any push of "
                  "their size does._", "",
                  *table_head("precision", "layers · component · positions", "direction", "follows donor",
                              "recipient", "neither", "Wilson 95%")]
    ordered = sorted(rest.itertuples(index=False), key=lambda r: (r.precision, analysis.transplant_row_key(r),
                                                                  r.direction))
    readings: dict[str, list[str]] = {}
    for r in ordered:
        row = {"precision": r.precision, "layer_set": r.layer_set, "component": r.component,
               "positions": r.positions, "direction": r.direction, "n": int(r.n), "donor": int(r.donor),
               "recipient": int(r.recipient), "neither": int(r.neither),
               "method": "outcome counts; wilson interval on the donor share",
               "follows_donor": stats.proportion(int(r.donor), int(r.n))}
        if controlled:
            cell = {"n": int(r.n), "donor": int(r.donor), "placebo": int(r.placebo), "p_value": float(r.p_value),
                    "only_donor": int(r.only_donor), "only_placebo": int(r.only_placebo)}
            said = placebo.reading(cell)
            readings.setdefault(said, []).append(f"{r.label} ({r.precision}, {r.direction})")
            row.update(placebo=int(r.placebo), only_donor=int(r.only_donor), only_placebo=int(r.only_placebo),
                       p_value=float(r.p_value), noop=int(r.noop), reading=said, control_method=placebo.METHOD,
                       difference=None if not r.n else (int(r.donor) - int(r.placebo)) / int(r.n))
            difference = "—" if not r.n else f"{100 * (int(r.donor) - int(r.placebo)) / int(r.n):+.1f}"
            lines.append(table_row(r.precision, r.label, r.direction, f"{r.donor} / {r.n}", f"{r.placebo} / {r.n}",
                                   difference, f"{r.only_donor} / {r.only_placebo}", f"{r.p_value:.3g}", int(r.noop),
                                   said))
        else:
            lines.append(table_row(r.precision, r.label, r.direction, f"{r.donor} / {r.n}", r.recipient, r.neither,
                                   f"[{format_percent(r.wilson_low)}, {format_percent(r.wilson_high)}]%"))
        out["sweep"].append(row)
    if controlled:
        out["localisation_net_of_placebo"] = {k: len(v) for k, v in readings.items()}
        lines += ["", f"Rows tested: {len(ordered)}, each at alpha 0.05 unadjusted (expect about "
                  f"{0.05 * len(ordered):.1f} false 'carries' among them by chance alone)."]
        for said in ("carries beyond its placebo", "not separable from its placebo", "carries on no item",
                     "no-op: the transplanted bytes are identical in donor and recipient on every item"):
            if readings.get(said):
                lines.append(f"- {said[0].upper() + said[1:]}: {join_words(readings[said])}.")
    return lines + [""]
