"""The Markdown report and stats.json, built from the results files alone (no model is loaded).

Per revision, one table per claim of the reference study (DESIGN.md's table) puts the study's figure beside this
run's, then come what the study did not measure (margins at the divergence, per-layer cache differences, the
transplant sweep), the items excluded and why, and the figures. Every number in the tables is in ``stats.json``
with its n, method and seed.

Sections are functions of :class:`RevisionData` listed in :data:`SECTIONS` with the inputs they need; a section
whose inputs are absent (a stage that has not run) is skipped with a note, never an error. To add a section, write
``def my_section(data: RevisionData) -> tuple[list[str], dict]`` and append it to :data:`SECTIONS`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from stagereplay.analysis import tables as analysis
from stagereplay.analysis import stats
from stagereplay.engine import first_divergence
from stagereplay.io.parquet import read_parquet, read_provenance, write_text_atomic
from stagereplay.io.provenance import recorded_batch_plan, software_versions

REFERENCE = {
    "matched_disagreements": "166 / 200",
    "matched_label_flips": "20 / 200",
    "matched_accuracy_difference": "+1 point, paired 95% CI [-3.5, +5.5]",
    "replicas_exact": "yes",
    "fixed_prefix": "BF16 disagreements recur; FP32: 0 / 200 (95% Wilson upper bound 1.88%)",
    "bridge": "bit-exact on 12 / 12 rows",
    "audit": "all 200 retained trajectories and comparison fingerprints reproduced",
    "transplant": "every divergent continuation follows its cache donor: 24 / 24 (selected set, primary "
                  "checkpoint), 43 / 43 (outcome-blind, later checkpoint)",
}
FIXED_PREFIX_REFERENCE = {"bf16": "recur (no count given)", "fp32": "0 / 200 (Wilson upper bound 1.88%)"}
# Where each kind of input comes from, for the note of a skipped section.
PRODUCERS = {
    "ledger": "ledger.parquet (rule gather_ledger)",
    "bridge": "bridge.parquet (the bridge rule)",
    "audit": "audit.parquet (rule audit_ledger)",
    "transplant": "transplant.parquet (the transplant stage)",
    "cache_differences": "cache_differences.parquet (rule measure_cache_differences)",
    "batch_invariance": "batch_invariance.parquet (rule check_batch_invariance)",
}


BRIDGE_NOTE = (
    "What the bridge shows on CPU: the live generation feeds the prompt in one forward pass and then one token per "
    "step. An `incremental` rebuild that feeds the same ids in the same chunks reproduces the live cache bit for "
    "bit at every layer (K and V), and with it the live continuation. A one-shot `prefill` of the very same ids "
    "(the contrast row) computes other matrix shapes, hence other kernels and summation orders, and its cache is "
    "in general not the live one (in bf16, rounding can absorb the difference on some rows; in fp32 it rarely "
    "does). A construction matches `live` bit for bit only if it feeds tokens in the same chunks as the original "
    "generation did; that is what lets the fixed-prefix 2x2 use `incremental` in place of `live` at a precision "
    "that did not generate the prefix. On an H200 (bench/RESULTS.md, random-weight Qwen2.5-1.5B shape, "
    "deterministic mode) the same holds: live vs incremental bit-exact on 12 / 12 rows, prefill replicas bit-exact, "
    "prefill vs live different in every row."
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


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _fmt_acc(acc: dict) -> str:
    return (f"{_pct(acc['accuracy_a'])}% / {_pct(acc['accuracy_b'])}%, {_pct(acc['difference'], True)} points, "
            f"paired bootstrap 95% CI [{_pct(acc['bootstrap_low'], True)}, {_pct(acc['bootstrap_high'], True)}], "
            f"exact McNemar p = {acc['mcnemar_p']:.3g} ({acc['discordant_a_only']} vs {acc['discordant_b_only']} "
            "discordant)")


def _int(value) -> str:
    """An integer column value that pandas may have read as a float (nullable ints), or a dash."""
    return "—" if value is None or pd.isna(value) else str(int(value))


def _ids(values, limit: int = 30) -> str:
    values = [f"`{v}`" for v in values]
    return ", ".join(values[:limit]) + (f" ... ({len(values)} in all)" if len(values) > limit else "")


@dataclass
class RevisionData:
    """One revision's results files, read on first use; a kind whose file is absent reads as None."""

    revision: str
    paths: dict[str, str]
    seed: int = 0
    _frames: dict = field(default_factory=dict, repr=False)

    def has(self, kind: str) -> bool:
        path = self.paths.get(kind)
        return bool(path) and Path(path).is_file()

    def frame(self, kind: str) -> pd.DataFrame | None:
        if kind not in self._frames:
            self._frames[kind] = read_parquet(self.paths[kind]) if self.has(kind) else None
        return self._frames[kind]

    @property
    def ledger(self) -> pd.DataFrame:
        return self.frame("ledger")

    @property
    def pairs(self) -> pd.DataFrame:
        if "pairs" not in self._frames:
            self._frames["pairs"] = analysis.all_pairs(self.ledger)
        return self._frames["pairs"]


def _seeded(stat: dict, seed: int) -> dict:
    """A statistic as stats.json holds it: n and method from :mod:`stats`, and the run's seed where none applies."""
    return {**stat, "seed": stat.get("seed", seed)}


def _pair_statistics(cmp: pd.DataFrame, seed: int) -> tuple[dict, dict, dict | None]:
    """Suffix disagreements, label flips and the paired accuracy difference of one comparison table."""
    n = len(cmp)
    dis = _seeded(stats.proportion(int(cmp["disagree"].sum()), n), seed)
    flips = _seeded(stats.proportion(int(cmp["label_differs"].sum()), n), seed)
    acc = (stats.paired_accuracy_difference(cmp["correct_a"].tolist(), cmp["correct_b"].tolist(), seed=seed)
           if n else None)
    return dis, flips, acc


def _replica_rows(data: RevisionData, experiment: str) -> tuple[list[str], dict]:
    rep = analysis.replica_agreement(data.ledger)
    rep = rep[rep["experiment"] == experiment]
    lines, out = [], {}
    for r in rep.itertuples(index=False):
        out.setdefault(r.precision, {})[r.construction] = {
            "n": int(r.n), "identical": int(r.identical), "seed": data.seed,
            "method": "replica pairs compared on stage ids, cache fingerprint and suffix fingerprint (sha256 bytes)"}
        ref = REFERENCE["replicas_exact"] if (experiment, r.precision) == ("matched", "bf16") else "—"
        lines.append(f"| {r.precision} | {r.construction} | {ref} | {r.identical} / {r.n} bit-identical |")
    return lines, out


def matched_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claims 1-3: replicas exact; live vs prefill suffixes that differ; labels that differ and the accuracy."""
    ledger, seed = data.ledger, data.seed
    matched = ledger[ledger["experiment"] == "matched"]
    if matched.empty:
        return ["_No matched-experiment rows in the ledger._", ""], {}
    pairs = data.pairs[data.pairs["experiment"] == "matched"]
    out: dict = {}
    rep_lines, rep = _replica_rows(data, "matched")
    claim1 = ["#### Claim: matched experiment, replicas on both sides exact", "",
              "| precision | construction | reference study | this run: replica pairs |", "| --- | --- | --- | --- |",
              *rep_lines, ""]
    claim2 = ["#### Claim: live cache vs one-shot prefill of identical tokens, suffixes that differ", "",
              "| precision | reference study | this run |", "| --- | --- | --- |"]
    claim3 = ["#### Claim: correctness labels that differ, and the accuracy difference", "",
              "| precision | | reference study | this run |", "| --- | --- | --- | --- |"]
    for precision in analysis.sort_precisions(matched["precision"]):
        sub = matched[matched["precision"] == precision]
        live1 = sub[(sub["construction"] == "live") & (sub["replica"] == 1)]
        missing = live1[live1["status"] == "boundary_missing"]
        nonfinite = sub[sub["status"] == "nonfinite"]["item_id"].unique()
        cmp = pairs[pairs["precision"] == precision]
        n = len(cmp)
        dis, flips, acc = _pair_statistics(cmp, seed)
        ref = precision == "bf16"
        out[precision] = {"n_items": len(live1), "n_compared": n, "boundary_missing": int(len(missing)),
                          "nonfinite_items": int(len(nonfinite)), "suffix_disagreements": dis,
                          "label_flips": flips, "accuracy_difference": acc, "replicas": rep.get(precision, {}),
                          "first_divergence": _seeded(stats.first_divergence_summary(
                              cmp.loc[cmp["disagree"], "first_divergence"].tolist()), seed)}
        claim2.append(f"| {precision} | {REFERENCE['matched_disagreements'] if ref else '—'} | {_fmt_prop(dis)} |")
        claim3.append(f"| {precision} | labels that differ | {REFERENCE['matched_label_flips'] if ref else '—'} | "
                      f"{_fmt_prop(flips)} |")
        claim3.append(f"| {precision} | accuracy live / prefill, difference | "
                      f"{REFERENCE['matched_accuracy_difference'] if ref else '—'} | "
                      f"{_fmt_acc(acc) if acc else 'no compared items'} |")
    counts = "; ".join(f"{p}: {v['n_items']} items, {v['n_compared']} compared" for p, v in out.items())
    lines = [f"Items per precision: {counts} (exclusions listed below).", "", *claim1, *claim2, "", *claim3, ""]
    return lines, out


def fixed_prefix_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 4: the fixed-prefix 2x2 (construction x precision) over identical token states."""
    ledger, seed = data.ledger, data.seed
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    if fixed.empty:
        return ["#### Claim: fixed-prefix 2x2 (construction x precision)", "",
                f"Reference study: {REFERENCE['fixed_prefix']}.", "",
                "_Not run for this revision: the ledger holds no `fixed_prefix` rows (the fixed-prefix stage has "
                "not run)._", ""], {}
    pairs = data.pairs[data.pairs["experiment"] == "fixed_prefix"]
    rep_lines, rep = _replica_rows(data, "fixed_prefix")
    out: dict = {}
    lines = ["#### Claim: fixed-prefix 2x2 (construction x precision), all token states held fixed", "",
             f"Reference study: {REFERENCE['fixed_prefix']}.", "",
             "| precision | reference study: suffixes that differ | this run: incremental vs prefill, suffixes that "
             "differ | Wilson 95% upper bound | labels that differ | accuracy incremental / prefill, difference | "
             "first divergence (median [IQR]) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for precision in analysis.sort_precisions(fixed["precision"]):
        cmp = pairs[pairs["precision"] == precision]
        n = len(cmp)
        dis, flips, acc = _pair_statistics(cmp, seed)
        fd = _seeded(stats.first_divergence_summary(cmp.loc[cmp["disagree"], "first_divergence"].tolist()), seed)
        nonfinite = fixed[(fixed["precision"] == precision) & (fixed["status"] == "nonfinite")]
        out[precision] = {"n_compared": n, "suffix_disagreements": dis, "label_flips": flips,
                          "accuracy_difference": acc, "first_divergence": fd, "replicas": rep.get(precision, {}),
                          "nonfinite_rows": int(len(nonfinite)),
                          "nonfinite_items": int(nonfinite["item_index"].nunique())}
        fd_text = f"{fd['median']:g} [{fd['q1']:g}, {fd['q3']:g}] (n={fd['n']})" if fd["n"] else "—"
        lines.append(f"| {precision} | {FIXED_PREFIX_REFERENCE.get(precision, '—')} | {_fmt_prop(dis)} | "
                     f"{_pct(dis['wilson_high'])}% | {_fmt_prop(flips)} | "
                     f"{_fmt_acc(acc) if acc else 'no compared items'} | {fd_text} |")
    overflowed = {p: v["nonfinite_rows"] for p, v in out.items() if v["nonfinite_rows"]}
    if overflowed:
        lines += ["", "Rows with non-finite logits (marked `nonfinite`, never compared): " + ", ".join(
            f"{p}: {k} rows of {out[p]['nonfinite_items']} items" for p, k in overflowed.items()) + "."]
    lines += ["", "Replicas of each cell:", "", "| precision | construction | reference study | this run: replica pairs |",
              "| --- | --- | --- | --- |", *rep_lines, ""]
    return lines, out


def bridge_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 5: the bridge, token-by-token incremental cache against the retained live cache."""
    bridge = data.frame("bridge")
    no_boundary = 0
    if "status" in bridge.columns:  # rows whose item never reached the boundary have no cache to compare
        no_boundary = int((bridge["status"] != "ok").sum())
        bridge = bridge[bridge["status"] == "ok"]
    exact = int(bridge["bit_exact"].astype(bool).sum())
    stat = _seeded(stats.proportion(exact, len(bridge)), data.seed)
    # one column per precision: the bridge is a claim about each precision's caches, not about their sum
    groups = ([(str(p), g) for p, g in bridge.groupby("precision", sort=True)]
              if "precision" in bridge.columns and len(bridge) else [("this run", bridge)])
    by_precision = {name: _seeded(stats.proportion(int(g["bit_exact"].astype(bool).sum()), len(g)), data.seed)
                    for name, g in groups if name != "this run"}

    def row(label: str, reference: str, column: str) -> str:
        counts = " | ".join(f"{int(g[column].astype(bool).sum())} / {len(g)}" for _, g in groups)
        return f"| {label} | {reference} | {counts} |"

    lines = ["#### Claim: bridge, token-by-token incremental cache vs retained live cache", "",
             "| | reference study | " + " | ".join(name for name, _ in groups) + " |",
             "| --- | --- | " + " | ".join("---" for _ in groups) + " |",
             row("rows bit-exact (every layer's K and V bytes)", REFERENCE["bridge"], "bit_exact")]
    if "suffix_equal" in bridge.columns:
        lines.append(row("continuations identical", "—", "suffix_equal"))
    if "prefill_bit_exact" in bridge.columns:
        lines.append(row("contrast: one-shot prefill bit-exact with live", "—", "prefill_bit_exact"))
    bad = bridge[~bridge["bit_exact"].astype(bool)]
    if len(bad):
        lines += ["", "Rows that are not bit-exact:", "", "| item | precision | first layer | component | first position |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{r.item_id}` | {r.precision} | {_int(r.first_layer_differs)} | {r.component_differs} | "
                  f"{_int(r.first_position_differs)} |" for r in bad.itertuples(index=False)]
    if no_boundary:
        lines += ["", f"{no_boundary} bridge row(s) drawn for items that never reached the boundary are not counted."]
    lines += ["", BRIDGE_NOTE]
    plan = recorded_batch_plan(data.paths["bridge"]) if data.has("bridge") else None
    if plan is not None:
        lines += ["", f"Batched run (batch size {plan['batch_size']}, plan seed {plan['seed']}): each live row is "
                  "compared with the incremental rebuild in its own recorded batch (stage ids teacher-forced in the "
                  "live run's lockstep schedule, rows without a boundary fed padding); the prefill contrast is the "
                  "row's batched one-shot prefill."]
    return lines + [""], {"bit_exact": stat, "bit_exact_by_precision": by_precision,
                          "not_bit_exact_items": [str(i) for i in bad["item_id"]],
                          "batch_plan": None if plan is None else {k: plan[k] for k in ("seed", "batch_size")}}


def audit_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 6: the saved-ledger audit."""
    audit = data.frame("audit")
    ok = int(audit["reproduced"].sum())
    stat = _seeded(stats.proportion(ok, len(audit)), data.seed)
    lines = ["#### Claim: saved-ledger audit", "", "| | reference study | this run |", "| --- | --- | --- |",
             f"| ledger rows reproduced (trajectories and fingerprints) | {REFERENCE['audit']} | {ok} / {len(audit)} |"]
    bad = audit[~audit["reproduced"].astype(bool)]
    if len(bad):
        keys = [c for c in ("item_id", "experiment", "precision", "construction", "replica") if c in bad.columns]
        lines += ["", "Rows not reproduced: " + _ids(
            " ".join(str(v) for v in row) for row in bad[keys].itertuples(index=False, name=None))]
    return lines + [""], {"reproduced": stat}


def transplant_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 7: bidirectional all-layer transplants, and the localisation sweep beyond the study.

    Rates count divergent items only (the two constructions' own continuations differ): a non-divergent item has
    no donor to tell apart from its recipient."""
    matrix = analysis.transplant_matrix(data.frame("transplant"))
    if matrix.empty:
        transplant = data.frame("transplant")
        n_items = int(transplant["item_index"].nunique()) if len(transplant) else 0
        return ["#### Claim: bidirectional transplant of all K/V layers", "",
                f"Reference study: {REFERENCE['transplant']}.", "",
                f"_No divergent item to transplant: {n_items} item(s) were transplanted and on none do the two "
                "constructions' own continuations differ, so following the donor cannot be told apart from "
                "following the recipient._", ""], {"n_items": n_items, "n_divergent": 0}
    full = matrix[(matrix["layer_set"] == "all") & (matrix["component"] == "kv") & (matrix["positions"] == "all")]
    out: dict = {"all_layers": {}, "sweep": []}
    lines = ["#### Claim: bidirectional transplant of all K/V layers", "",
             f"Reference study: {REFERENCE['transplant']}.", "",
             "| precision | direction | this run: follows donor | recipient | neither |", "| --- | --- | --- | --- | --- |"]
    transplant = data.frame("transplant")
    for r in full.itertuples(index=False):
        sel = transplant[(transplant["precision"] == r.precision) & (transplant["direction"] == r.direction)
                         & (transplant["layer_set"] == "all") & (transplant["component"] == "kv")]
        if "positions" in sel.columns:
            sel = sel[sel["positions"] == "all"]
        if "divergent" in sel.columns:
            sel = sel[sel["divergent"].astype(bool)]
        out["all_layers"].setdefault(r.precision, {})[r.direction] = _seeded(
            stats.follow_rate(sel["outcome"].tolist()), data.seed)
        lines.append(f"| {r.precision} | {r.direction} | {r.donor} / {r.n} | {r.recipient} | {r.neither} |")
    if full.empty:
        lines.append("| — | — | no all-layer K/V transplant over all positions in this file | | |")
    whole = transplant[(transplant["layer_set"] == "all") & (transplant["component"] == "kv")
                       & (transplant.get("positions", "all") == "all") & (transplant["outcome"] != "donor")]
    if "divergent" in whole.columns:
        whole = whole[whole["divergent"].astype(bool)]
    out["all_layer_misses"] = [f"{r.item_id} {r.direction} ({r.outcome})" for r in whole.itertuples(index=False)]
    if len(whole):
        lines += ["", "**Finding:** all-layer transplants that did not follow their donor (the cache should be the "
                  "whole state): " + ", ".join(f"`{m}`" for m in out["all_layer_misses"])]
    if "live_fingerprint_match" in transplant.columns:
        match = transplant.drop_duplicates("item_index")["live_fingerprint_match"].astype(bool)
        lines += ["", f"The rebuilt `incremental` cache equals the ledger's live cache fingerprint for "
                  f"{int(match.sum())} / {len(match)} items (those are labelled `live`)."]
    rest = matrix.drop(full.index)
    if len(rest):
        lines += ["", "Localisation sweep (beyond the study): share following the donor.", "",
                  "| precision | layers · component · positions | direction | follows donor | Wilson 95% |",
                  "| --- | --- | --- | --- | --- |"]
        for r in sorted(rest.itertuples(index=False), key=lambda r: (r.precision, analysis.transplant_row_key(r),
                                                                     r.direction)):
            lines.append(f"| {r.precision} | {r.label} | {r.direction} | {r.donor} / {r.n} | "
                         f"[{_pct(r.wilson_low)}, {_pct(r.wilson_high)}]% |")
            out["sweep"].append({"precision": r.precision, "layer_set": r.layer_set, "component": r.component,
                                 "positions": r.positions, "direction": r.direction, "n": int(r.n),
                                 "donor": int(r.donor), "recipient": int(r.recipient), "neither": int(r.neither),
                                 "seed": data.seed, "method": "outcome counts; wilson interval on the donor share",
                                 "follows_donor": stats.proportion(int(r.donor), int(r.n))})
    return lines + [""], out


def margins_section(data: RevisionData) -> tuple[list[str], dict]:
    """Beyond the study: are first divergences near-ties?"""
    samples = analysis.margin_samples(data.ledger, data.pairs)
    if samples.empty or not (samples["kind"] == "divergence").any():
        return ["_No disagreeing suffixes: no margin at a first divergence to report._", ""], {}
    lines = ["Top-2 logit margin of the reference construction (live or incremental) at the first divergence, "
             "against its margins at every decode step (figure 3).", "",
             "| experiment | precision | divergences | median margin at divergence | median at all steps | share of "
             "steps at or below that median | Mann-Whitney p (divergence < all) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {}
    for (experiment, precision), g in samples.groupby(["experiment", "precision"], sort=True):
        cmp = _seeded(stats.margin_comparison(g.loc[g["kind"] == "divergence", "margin"].tolist(),
                                              g.loc[g["kind"] == "all", "margin"].tolist()), data.seed)
        out.setdefault(experiment, {})[precision] = cmp
        if not cmp["n"]:
            continue
        lines.append(f"| {experiment} | {precision} | {cmp['n']} | {cmp['median_divergence']:.3g} | "
                     f"{cmp['median_all']:.3g} | {_pct(cmp['share_of_steps_at_or_below_median_divergence'])}% | "
                     f"{cmp['mann_whitney_p_less']:.3g} |")
    return lines + [""], out


def cache_differences_section(data: RevisionData) -> tuple[list[str], dict]:
    """Beyond the study: where in the cache the constructions differ (figure 4)."""
    profile = analysis.cache_difference_profile(data.frame("cache_differences"))
    if profile.empty:
        return ["_cache_differences.parquet holds no rows._", ""], {}
    lines = ["Incremental vs prefill boundary caches rebuilt from identical prefix ids for a seeded sample of "
             "items (figure 4).", "",
             "| precision | component | items | layers bit-identical in every item | first layer that differs | "
             "items whose last layer differs | largest max-abs difference | median RMS at the last layer, items that "
             "differ |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {}
    for (precision, component), g in profile.groupby(["precision", "component"], sort=True):
        g = g.sort_values("layer")
        same = g[g["n_differ"] == 0]["layer"].tolist()
        differs = g[g["n_differ"] > 0]["layer"].tolist()
        last = g.iloc[-1]
        out.setdefault(precision, {})[component] = {
            "n": int(g["n"].max()), "layers_bit_identical": [int(x) for x in same],
            "first_layer_differs": int(differs[0]) if differs else None, "max_abs": float(g["max_abs_max"].max()),
            "items_differing_per_layer": [int(x) for x in g["n_differ"]],
            "rms_median_of_differing_per_layer": [None if pd.isna(x) else float(x) for x in g["rms_median"]],
            "seed": data.seed,
            "method": "per-layer byte comparison, max-abs and RMS of the difference (fp64) over a seeded item sample"}
        rms = "—" if pd.isna(last["rms_median"]) else f"{last['rms_median']:.3g}"
        lines.append(f"| {precision} | {component.upper()} | {int(g['n'].max())} | {len(same)} / {len(g)} | "
                     f"{differs[0] if differs else '—'} | {int(last['n_differ'])} / {int(last['n'])} | "
                     f"{g['max_abs_max'].max():.3g} | {rms} |")
    return lines + [""], out


def batch_invariance_section(data: RevisionData) -> tuple[list[str], dict]:
    """Batching as a construction factor (beyond the study): sampled items rerun alone against their batched rows."""
    table = data.frame("batch_invariance")
    prov = read_provenance(data.paths["batch_invariance"]) if data.has("batch_invariance") else {}
    control = prov.get("batch_invariance") or {}
    if control.get("status") == "not_applicable" or table.empty:
        reason = control.get("reason", "the control compared no rows")
        return [f"_Nothing to compare: {reason}._", ""], {"status": control.get("status", "empty"), "reason": reason}
    plan = prov.get("batch_plan") or {}
    lines = [f"A seeded sample of {table['item_index'].nunique()} items, each rerun alone (batch 1, the same decode "
             f"regime and precision) against its row in the recorded batch plan (batch size {plan.get('batch_size')}, "
             f"plan seed {plan.get('seed')}). Batch composition is a construction factor: a difference is a finding, "
             "not an error.", "",
             "| precision | construction | rows | boundary caches identical | stage + suffix ids identical | "
             "labels identical | first divergence (median [IQR]) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {"status": "compared", "batch_size": plan.get("batch_size"), "plan_seed": plan.get("seed")}
    for precision in analysis.sort_precisions(table["precision"]):
        for construction in sorted(table.loc[table["precision"] == precision, "construction"].unique()):
            g = table[(table["precision"] == precision) & (table["construction"] == construction)]
            n = len(g)
            counts = {key: _seeded(stats.proportion(int(g[key].astype(bool).sum()), n), data.seed)
                      for key in ("cache_equal", "suffix_equal", "label_equal")}
            fd = stats.first_divergence_summary([int(x) for x in g["first_divergence"].dropna()])
            out.setdefault(precision, {})[construction] = {**counts, "first_divergence": fd, "n": n}
            fd_text = f"{fd['median']:g} [{fd['q1']:g}, {fd['q3']:g}] (n={fd['n']})" if fd["n"] else "—"
            lines.append(f"| {precision} | {construction} | {n} | {_fmt_prop(counts['cache_equal'])} | "
                         f"{_fmt_prop(counts['suffix_equal'])} | {_fmt_prop(counts['label_equal'])} | {fd_text} |")
    return lines + [""], out


def exclusions_section(data: RevisionData) -> tuple[list[str], dict]:
    """Items left out of the comparisons, and why."""
    excluded = analysis.exclusions(data.ledger)
    if excluded.empty:
        return ["No item was excluded: every item has status ok on both constructions of every comparison.", ""], {
            "n": 0, "items": []}
    lines = ["| item | experiment | precision | reason |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r.item_id}` | {r.experiment} | {r.precision} | {r.reason} |"
              for r in excluded.itertuples(index=False)]
    items = [{"item_id": str(r.item_id), "experiment": r.experiment, "precision": r.precision, "reason": r.reason}
             for r in excluded.itertuples(index=False)]
    return lines + [""], {"n": len(items), "items": items}


@dataclass
class Section:
    key: str  # key in stats.json
    title: str | None  # a heading of its own, or None when the section brings its claim headings
    needs: tuple[str, ...]  # kinds of input files it reads
    build: Callable[[RevisionData], tuple[list[str], dict]]


SECTIONS: list[Section] = [
    Section("matched", "### Matched experiment (live vs prefill)", ("ledger",), matched_section),
    Section("fixed_prefix", "### Fixed-prefix 2x2", ("ledger",), fixed_prefix_section),
    Section("bridge", "### Bridge", ("bridge",), bridge_section),
    Section("audit", "### Saved-ledger audit", ("audit",), audit_section),
    Section("transplant", "### Transplants", ("transplant",), transplant_section),
    Section("margins", "### Margins at the first divergence (beyond the study)", ("ledger",), margins_section),
    Section("cache_differences", "### Per-layer cache differences (beyond the study)", ("cache_differences",),
            cache_differences_section),
    Section("batch_invariance", "### Batch invariance (beyond the study)", ("batch_invariance",),
            batch_invariance_section),
    Section("excluded", "### Items excluded and why", ("ledger",), exclusions_section),
]


def figures_section(figures: dict[str, str] | None, out_md: str) -> list[str]:
    """Links to the figures (name -> PNG path), relative to the report."""
    if not figures:
        return []
    lines = ["## Figures", ""]
    base = Path(out_md).resolve().parent
    for name, path in figures.items():
        try:
            rel = Path(path).resolve().relative_to(base)
        except ValueError:
            rel = Path(path).resolve()
        lines += [f"![{name}]({rel.as_posix()})", ""]
    return lines


def regime_line(ledger: pd.DataFrame) -> tuple[str, dict]:
    """The numerical regime the ledger's rows were made in (a construction factor: compare only within one)."""
    regime = {column: sorted(map(str, ledger[column].dropna().unique()))
              for column in ("numerics", "decode_regime") if column in ledger}
    named = "; ".join(f"{column} `{', '.join(values)}`" for column, values in regime.items())
    return f"Numerical regime of the ledger's rows: {named}.", regime


def build_report(ledgers: dict[str, str], out_md: str, out_json: str, run: str, seed: int = 0,
                 inputs: dict[str, dict[str, str]] | None = None, figures: dict[str, str] | None = None) -> dict:
    """``ledgers`` maps a revision slug to its ledger.parquet; ``inputs`` maps a kind of file (bridge, audit,
    transplant, cache_differences, ...) to {revision: path}, and a path that does not exist is fine: its sections
    are skipped with a note. ``figures`` maps a figure's name to its PNG, linked from the report."""
    inputs = {kind: dict(paths) for kind, paths in (inputs or {}).items()}
    inputs["ledger"] = dict(ledgers)
    lines = [f"# stagereplay report: run `{run}`", "",
             "Built from the results files alone. The reference study: a Qwen2.5-derived reasoning model, 48 layers, "
             "200 items. Intervals are 95%; every number below is in `stats.json` with its n, method and seed "
             f"(seed {seed}: item selection and bootstrap).", ""]
    all_stats = {"run": run, "seed": seed, "software": software_versions(), "revisions": {}}
    # Revisions with a ledger first; then those with other results only (transplants at a later revision).
    revisions = list(ledgers) + sorted({r for paths in inputs.values() for r in paths} - set(ledgers))
    for revision in revisions:
        data = RevisionData(revision, {kind: paths.get(revision) for kind, paths in inputs.items()}, seed)
        lines += [f"## Revision `{revision}`", ""]
        numbers: dict = {}
        if data.has("ledger"):
            line, numbers["regime"] = regime_line(data.ledger)
            lines += [line, ""]
        for section in SECTIONS:
            if section.title:
                lines += [section.title, ""]
            absent = [kind for kind in section.needs if not data.has(kind)]
            if absent:
                why = ", ".join(PRODUCERS.get(kind, f"{kind} input") for kind in absent)
                lines += [f"_Skipped: no {why} for revision `{revision}` yet._", ""]
                numbers[section.key] = {"skipped": f"absent input: {', '.join(absent)}"}
                continue
            section_lines, section_numbers = section.build(data)
            lines += section_lines
            numbers[section.key] = section_numbers
        all_stats["revisions"][revision] = numbers
    lines += figures_section(figures, out_md)
    write_text_atomic(out_md, "\n".join(lines) + "\n")
    write_text_atomic(out_json, json.dumps(all_stats, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return all_stats
