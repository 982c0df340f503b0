"""Tidy tables derived from the ledger and the later stages' Parquet files: what the report and the figures share.

The report prints these tables' numbers and the figures draw them, so a number in a table and a bar in a figure
cannot disagree. This module knows nothing of torch, Snakemake or matplotlib: it takes DataFrames with the
columns of the results contract (docs/STUDY.md) and returns DataFrames or plain dicts.

Every pairing refuses a table in which a key occurs twice (:func:`.row_keys.check_unique`).

Construction pairs compared per experiment (the first one is the reference, the stand-in for the live state):
``matched``: ``live`` vs ``prefill``; ``fixed_prefix``: ``incremental`` vs ``prefill``. A run may build more than two
constructions in the fixed-prefix experiment (``fixed_prefix.constructions``): the 2x2 and every table keyed by
experiment compare the first two (:func:`fixed_prefix_pair`), and :func:`replay_cells` sets each other construction
against the reference.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from stagereplay.analysis import placebo, stats
from stagereplay.analysis.row_keys import check_unique
from stagereplay.io.ids import first_divergence
from stagereplay.io.keys import ITEM_KEY

# The experiments whose two constructions are compared item by item, in the report's order.
EXPERIMENTS = ("matched", "fixed_prefix")
MATCHED = ("matched", "live", "prefill")
# The reference study's fixed-prefix pair; a run may compare any two constructions there (fixed_prefix.constructions).
STUDY_FIXED_PREFIX = ("incremental", "prefill")
PRECISION_ORDER = ("bf16", "fp16", "fp32")

PAIR_COLUMNS = ["item_index", "item_id", "revision", "experiment", "precision", "construction_a", "construction_b",
                "disagree", "first_divergence", "margin_a", "margin_b", "correct_a", "correct_b", "label_differs",
                "suffix_length_a", "suffix_length_b", "truncated_a", "truncated_b"]
# The ledger's stop_reason of a suffix that reached max_new_tokens before EOS: its answer is read from a cut-off
# continuation.
STOP_AT_BUDGET = "max_new_tokens"

def sort_precisions(values) -> list[str]:
    order = {p: i for i, p in enumerate(PRECISION_ORDER)}
    return sorted(set(values), key=lambda p: (order.get(p, len(order)), p))


def fixed_prefix_constructions(ledger: pd.DataFrame | None) -> tuple[str, ...]:
    """Every construction of the ledger's fixed-prefix rows, the reference first: ``incremental`` (the live
    schedule's own construction) where it is one of them, then ``prefill`` where it is, then the others by name. The
    study's pair when the ledger has no fixed-prefix rows."""
    if ledger is None or ledger.empty:
        return STUDY_FIXED_PREFIX
    names = set(ledger.loc[ledger["experiment"] == "fixed_prefix", "construction"])
    if not names:
        return STUDY_FIXED_PREFIX
    if len(names) < 2:
        raise ValueError(f"the ledger's fixed-prefix rows hold {len(names)} construction {sorted(names)}; the 2x2 "
                         "compares at least two: rebuild the ledger from one run's parts")
    return tuple(sorted(names, key=lambda n: (n != "incremental", n != "prefill", n)))


def fixed_prefix_pair(ledger: pd.DataFrame | None) -> tuple[str, str]:
    """The 2x2's two constructions: the reference and the next of :func:`fixed_prefix_constructions` (with the
    default two, the ledger's two)."""
    a, b = fixed_prefix_constructions(ledger)[:2]
    return a, b


def comparisons(ledger: pd.DataFrame | None) -> list[tuple[str, str, str]]:
    """(experiment, baseline construction, other construction) for each experiment of :data:`EXPERIMENTS`."""
    return [MATCHED, ("fixed_prefix", *fixed_prefix_pair(ledger))]


def replay_comparisons(ledger: pd.DataFrame | None) -> list[tuple[str, str, str]]:
    """("fixed_prefix", reference, other) for every other construction of the ledger's fixed-prefix rows, in
    :func:`fixed_prefix_constructions`' order: each replay construction against the stand-in for live."""
    reference, *others = fixed_prefix_constructions(ledger)
    return [("fixed_prefix", reference, other) for other in others]


def pair_table(ledger: pd.DataFrame, experiment: str, a: str, b: str) -> pd.DataFrame:
    """One row per (item, revision, precision) with ``status == ok`` on both sides: replica 1 of ``a`` against ``b``.

    ``margin_a``/``margin_b`` are each construction's top-2 logit margin at the first divergence (None when the
    suffixes agree or the position lies past a suffix's end); ``truncated_a``/``truncated_b`` whether its suffix
    stopped at max_new_tokens before EOS (None where the ledger records no stop reason).
    """
    if ledger is None or ledger.empty:
        return pd.DataFrame(columns=PAIR_COLUMNS)
    check_unique(ledger, "ledger")
    sel = ledger[(ledger["experiment"] == experiment) & (ledger["replica"] == 1)]
    keys = list(ITEM_KEY)
    left = sel[sel["construction"] == a]
    right = sel[sel["construction"] == b]
    merged = left.merge(right, on=keys, suffixes=("_a", "_b"))
    stops = "stop_reason" in ledger.columns
    rows = []
    for r in merged.itertuples(index=False):
        if r.status_a != "ok" or r.status_b != "ok":
            continue
        sa, sb = r.suffix_ids_a, r.suffix_ids_b
        pos = first_divergence(sa, sb)
        ma, mb = r.margins_a, r.margins_b
        rows.append({
            "item_index": int(r.item_index), "item_id": r.item_id_a, "revision": r.revision,
            "experiment": experiment, "precision": r.precision, "construction_a": a, "construction_b": b,
            "disagree": pos is not None, "first_divergence": pos,
            "margin_a": float(ma[pos]) if pos is not None and pos < len(ma) else None,
            "margin_b": float(mb[pos]) if pos is not None and pos < len(mb) else None,
            "correct_a": bool(r.correct_a), "correct_b": bool(r.correct_b),
            "label_differs": bool(r.correct_a) != bool(r.correct_b),
            "suffix_length_a": len(sa), "suffix_length_b": len(sb),
            "truncated_a": r.stop_reason_a == STOP_AT_BUDGET if stops else None,
            "truncated_b": r.stop_reason_b == STOP_AT_BUDGET if stops else None,
        })
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def all_pairs(ledger: pd.DataFrame) -> pd.DataFrame:
    """:func:`pair_table` for every comparison of :func:`comparisons` the ledger holds."""
    frames = [pair_table(ledger, *c) for c in comparisons(ledger)]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PAIR_COLUMNS)


def disagreement_cells(pairs: pd.DataFrame) -> pd.DataFrame:
    """Suffix disagreements and label flips per (revision, experiment, precision), with Wilson/Clopper-Pearson."""
    rows = []
    if pairs is not None and not pairs.empty:
        for (revision, experiment, precision), g in pairs.groupby(["revision", "experiment", "precision"], sort=True):
            dis = stats.proportion(int(g["disagree"].sum()), len(g))
            flips = stats.proportion(int(g["label_differs"].sum()), len(g))
            rows.append({"revision": revision, "experiment": experiment, "precision": precision,
                         "construction_a": g["construction_a"].iloc[0], "construction_b": g["construction_b"].iloc[0],
                         "n": dis["n"], "k": dis["k"], "rate": dis["rate"], "wilson_low": dis["wilson_low"],
                         "wilson_high": dis["wilson_high"], "label_flips": flips["k"]})
    return pd.DataFrame(rows, columns=["revision", "experiment", "precision", "construction_a", "construction_b",
                                       "n", "k", "rate", "wilson_low", "wilson_high", "label_flips"])


REPLAY_COLUMNS = ["revision", "precision", "construction_a", "construction_b", "n", "k", "rate", "wilson_low",
                  "wilson_high", "label_flips"]


def replay_cells(ledger: pd.DataFrame | None) -> pd.DataFrame:
    """Per (revision, precision, other construction) of :func:`replay_comparisons`: items whose suffix ids differ
    from the reference's (k of n compared, with status ok on both sides), Wilson and Clopper-Pearson intervals, and
    label flips; counted by :func:`pair_table`, as the 2x2."""
    if ledger is None or ledger.empty:
        return pd.DataFrame(columns=REPLAY_COLUMNS)
    rows, compared = [], replay_comparisons(ledger)
    for experiment, a, b in compared:
        cells = disagreement_cells(pair_table(ledger, experiment, a, b))
        for r in cells.itertuples(index=False):
            rows.append({c: getattr(r, c) for c in REPLAY_COLUMNS})
    order = {p: i for i, p in enumerate(sort_precisions(r["precision"] for r in rows))}
    others = [b for _, _, b in compared]
    rows.sort(key=lambda r: (r["revision"], order[r["precision"]], others.index(r["construction_b"])))
    return pd.DataFrame(rows, columns=REPLAY_COLUMNS)


def identical_caches(ledger: pd.DataFrame | None) -> dict[tuple[str, str], list[dict]]:
    """Per (revision, precision) of the fixed-prefix rows: the sets of constructions (two or more) whose boundary
    caches have the same fingerprint on every item that all of them reached the boundary on (replica 1), with that
    number of items: {"constructions": [...], "n": items}. Decided from the fingerprints (sha256 of the bytes),
    never from a tolerance; a construction alike with none is not listed."""
    found: dict[tuple[str, str], list[dict]] = {}
    if ledger is None or ledger.empty:
        return found
    rows = ledger[(ledger["experiment"] == "fixed_prefix") & (ledger["replica"] == 1)
                  & ledger["cache_fingerprint"].notna()]
    for (revision, precision), cell in rows.groupby(["revision", "precision"], sort=True):
        wide = cell.pivot_table(index="item_index", columns="construction", values="cache_fingerprint",
                                aggfunc="first").dropna()
        if len(wide) == 0:
            continue
        order = [c for c in fixed_prefix_constructions(ledger) if c in wide.columns]
        groups: dict[tuple, list[str]] = {}
        for construction in order:
            groups.setdefault(tuple(wide[construction]), []).append(construction)
        alike = [{"constructions": names, "n": len(wide)} for names in groups.values() if len(names) > 1]
        if alike:
            found[(str(revision), str(precision))] = alike
    return found


def replica_agreement(ledger: pd.DataFrame) -> pd.DataFrame:
    """Per (revision, experiment, precision, construction): how many items' replicas are bit-identical.

    Compared on fingerprints (suffix and cache) and the stage ids, never with a tolerance. Items with a single
    replica are not counted.
    """
    cols = ["revision", "experiment", "precision", "construction", "n", "identical"]
    if ledger is None or ledger.empty:
        return pd.DataFrame(columns=cols)
    check_unique(ledger, "ledger")
    rows = []
    keys = ["revision", "experiment", "precision", "construction"]
    for key, g in ledger.groupby(keys, sort=True):
        n = identical = 0
        for _, item in g.groupby("item_index"):
            if len(item) < 2:
                continue
            n += 1
            first = item.iloc[0]
            same = all(
                other["suffix_fingerprint"] == first["suffix_fingerprint"]
                and other["cache_fingerprint"] == first["cache_fingerprint"]
                and list(other["stage_ids"]) == list(first["stage_ids"])
                and other["status"] == first["status"]
                for _, other in item.iloc[1:].iterrows()
            )
            identical += int(same)
        rows.append(dict(zip(keys, key), n=n, identical=identical))
    return pd.DataFrame(rows, columns=cols)


MARGIN_COLUMNS = ["revision", "experiment", "precision", "item_index", "item_id", "first_divergence",
                  "margin_divergence", "other_margins", "median_other", "within_item_percentile"]


def margin_pairs(ledger: pd.DataFrame, pairs: pd.DataFrame, skip=()) -> pd.DataFrame:
    """One row per disagreeing item: the baseline construction's top-2 margin at the first divergence and its
    margins at every other decode step of the same suffix (the divergence step left out), with their median and
    the item's within-item percentile (share of other steps at or below the divergence margin).

    ``skip`` holds (revision, experiment, precision) comparisons to leave out (those that repeat another's data,
    :func:`coinciding_comparisons`). Items whose divergence lies past the reference suffix's end have no margin
    there and are left out.
    """
    if ledger is None or ledger.empty or pairs is None or pairs.empty:
        return pd.DataFrame(columns=MARGIN_COLUMNS)
    check_unique(ledger, "ledger")
    ref = ledger[ledger["replica"] == 1].set_index(["revision", "experiment", "precision", "construction",
                                                    "item_index"])
    rows = []
    for r in pairs[pairs["disagree"].astype(bool)].itertuples(index=False):
        if (r.revision, r.experiment, r.precision) in set(skip) or r.margin_a is None or pd.isna(r.margin_a):
            continue
        margins = np.asarray(ref.loc[(r.revision, r.experiment, r.precision, r.construction_a, r.item_index),
                                     "margins"], dtype=float)
        pos = int(r.first_divergence)
        others = np.delete(margins, pos)
        rows.append({"revision": r.revision, "experiment": r.experiment, "precision": r.precision,
                     "item_index": int(r.item_index), "item_id": r.item_id, "first_divergence": pos,
                     "margin_divergence": float(margins[pos]), "other_margins": others.tolist(),
                     "median_other": float(np.median(others)) if others.size else None,
                     "within_item_percentile": float(np.mean(others <= margins[pos])) if others.size else None})
    return pd.DataFrame(rows, columns=MARGIN_COLUMNS)


def coinciding_comparisons(ledger: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Fixed-prefix comparisons that repeat the matched experiment's data: {(revision, precision): reason}.

    At the precision that generated the prefixes, the fixed-prefix ``incremental`` cache is the live cache (the
    bridge's claim) and its ``prefill`` the matched ``prefill``: where, for every compared item, the two
    experiments' caches, suffixes and margins are the same bytes on both sides, the fixed-prefix cell is the matched
    cell again and is shown once. Decided from the ledger's fingerprints and margins, never assumed.
    """
    found: dict[tuple[str, str], str] = {}
    if ledger is None or ledger.empty:
        return found
    check_unique(ledger, "ledger")
    rows = ledger[ledger["replica"] == 1]
    if fixed_prefix_pair(ledger) != STUDY_FIXED_PREFIX:
        return found  # only incremental and prefill can repeat the matched live and prefill cells

    def side(frame, construction):
        sub = frame[(frame["construction"] == construction) & (frame["status"] == "ok")]
        return {int(r.item_index): (r.cache_fingerprint, r.suffix_fingerprint,
                                    tuple(np.asarray(r.margins, dtype=float).tolist()))
                for r in sub.itertuples(index=False)}

    for (revision, precision), cell in rows.groupby(["revision", "precision"], sort=True):
        matched, fixed = cell[cell["experiment"] == "matched"], cell[cell["experiment"] == "fixed_prefix"]
        if matched.empty or fixed.empty:
            continue
        if side(matched, "live") == side(fixed, "incremental") and side(matched, "prefill") == side(fixed, "prefill"):
            found[(revision, precision)] = (
                f"the fixed-prefix {precision} rows repeat the matched {precision} rows item for item (incremental "
                "cache = live cache, prefill = prefill: same cache and suffix fingerprints, same margins)")
    return found


def accuracy_differences(pairs: pd.DataFrame, seed: int = 0, n_boot: int = 10000) -> pd.DataFrame:
    """Paired accuracy difference (a minus b) per (revision, experiment, precision), from :mod:`stats`."""
    cols = ["revision", "experiment", "precision", "n", "accuracy_a", "accuracy_b", "difference",
            "bootstrap_low", "bootstrap_high", "mcnemar_p", "discordant_a_only", "discordant_b_only", "seed"]
    rows = []
    if pairs is not None and not pairs.empty:
        for (revision, experiment, precision), g in pairs.groupby(["revision", "experiment", "precision"], sort=True):
            acc = stats.paired_accuracy_difference(g["correct_a"].tolist(), g["correct_b"].tolist(),
                                                   n_boot=n_boot, seed=seed)
            rows.append({"revision": revision, "experiment": experiment, "precision": precision,
                         **{c: acc[c] for c in cols[3:]}})
    return pd.DataFrame(rows, columns=cols)


def transplant_label(row) -> str:
    """Row label of the transplant matrix: layer set and component, plus the positions when not all. A single layer
    (stored as ``L4``) reads "layer 4", a band "layers 0-1", all of them "layers all"."""
    single = re.fullmatch(r"L(\d+)", str(row["layer_set"]))
    layers = f"layer {single.group(1)}" if single else f"layers {row['layer_set']}"
    label = f"{layers} · {row['component'].upper()}"
    if row.get("positions", "all") != "all":
        label += f" · {row['positions']} positions"
    return label


def transplant_matrix(transplant: pd.DataFrame) -> pd.DataFrame:
    """Share of transplants following the donor per (revision, layer set/component/positions, direction), beside
    its placebo's (:mod:`stagereplay.analysis.placebo`; None where the file predates the controls): no-op rows are
    counted in ``noop`` and left out of ``n`` and of both rates."""
    cols = ["revision", "precision", "label", "layer_set", "component", "positions", "direction", "n", "donor",
            "recipient", "neither", "rate", "wilson_low", "wilson_high", "noop", "placebo", "placebo_rate",
            "only_donor", "only_placebo", "p_value"]
    if transplant is None or transplant.empty:
        return pd.DataFrame(columns=cols)
    check_unique(transplant, "transplant")
    df = transplant.copy()
    if "divergent" in df.columns:  # where both sides continue alike, following the donor tells nothing
        df = df[df["divergent"].astype(bool)]
    if "positions" not in df.columns:
        df["positions"] = "all"
    controlled = placebo.has_controls(df)
    rows = []
    keys = ["revision", "precision", "layer_set", "component", "positions", "direction"]
    for key, g in df.groupby(keys, sort=False):
        d = dict(zip(keys, key))
        control = {"noop": 0, "placebo": None, "placebo_rate": None, "only_donor": None, "only_placebo": None,
                   "p_value": None}
        if controlled:
            cell = placebo.controlled_rates(g)
            control = {"noop": cell["noop"], "placebo": cell["placebo"], "placebo_rate": cell["placebo_rate"]["rate"],
                       "only_donor": cell["only_donor"], "only_placebo": cell["only_placebo"],
                       "p_value": cell["p_value"]}
            g = g[~g["noop"].fillna(False).astype(bool)]
        fr = stats.follow_rate(g["outcome"].tolist())
        rows.append({**d, "label": transplant_label(d), "n": fr["n"], "donor": fr["donor"],
                     "recipient": fr["recipient"], "neither": fr["neither"], "rate": fr["follows_donor"]["rate"],
                     "wilson_low": fr["follows_donor"]["wilson_low"],
                     "wilson_high": fr["follows_donor"]["wilson_high"], **control})
    return pd.DataFrame(rows, columns=cols)


def transplant_row_key(row) -> tuple:
    """Order of the transplant matrix's rows: all layers first (K and V, then K only, V only, then position
    ranges), then bands of layers, then single layers, each by its first layer."""
    layer_set = str(row.layer_set)
    digits = "".join(ch if ch.isdigit() else " " for ch in layer_set).split()
    kind = 0 if layer_set == "all" else 1 if "-" in layer_set else 2
    component = {"kv": 0, "k": 1, "v": 2}.get(row.component, 3)
    positions = {"all": 0, "prompt": 1, "stage": 2}.get(row.positions, 3)
    return (kind, positions, int(digits[0]) if digits else 0, layer_set, component)


def cache_difference_profile(differences: pd.DataFrame) -> pd.DataFrame:
    """Per (revision, precision, component, layer): over how many items the layer's bytes differ, and the spread of
    the max-abs and RMS differences among those items (quantiles of an empty set are None).

    Differences in bf16 are sparse (rounding to bf16 absorbs most of them), so statistics over all items would be
    mostly zeros; they are taken over the items whose bytes differ and the share of such items is reported beside.
    """
    cols = ["revision", "precision", "component", "layer", "n", "bit_equal", "n_differ", "share_differ",
            "max_abs_median", "max_abs_p10", "max_abs_p90", "max_abs_max", "rms_median"]
    if differences is None or differences.empty:
        return pd.DataFrame(columns=cols)
    check_unique(differences, "cache_differences")
    rows = []
    for (revision, precision, component, layer), g in differences.groupby(
            ["revision", "precision", "component", "layer"], sort=True):
        differ = g[~g["bit_equal"].astype(bool)]
        q = (lambda col, x: float(differ[col].quantile(x)) if len(differ) else None)
        rows.append({"revision": revision, "precision": precision, "component": component, "layer": int(layer),
                     "n": len(g), "bit_equal": len(g) - len(differ), "n_differ": len(differ),
                     "share_differ": len(differ) / len(g), "max_abs_median": q("max_abs", 0.5),
                     "max_abs_p10": q("max_abs", 0.1), "max_abs_p90": q("max_abs", 0.9),
                     "max_abs_max": float(g["max_abs"].max()), "rms_median": q("rms", 0.5)})
    return pd.DataFrame(rows, columns=cols)


EXCLUSION_COLUMNS = ["item_index", "item_id", "revision", "experiment", "precision", "reason"]
_REASONS = {
    "boundary_missing": "never reached the stage boundary within max_stage_tokens",
    "nonfinite": "non-finite logits",
}


def exclusions(ledger: pd.DataFrame) -> pd.DataFrame:
    """Items of each comparison that :func:`pair_table` leaves out, with the reason (one row per item and cell)."""
    if ledger is None or ledger.empty:
        return pd.DataFrame(columns=EXCLUSION_COLUMNS)
    check_unique(ledger, "ledger")
    rows = []
    for experiment, a, b in comparisons(ledger):
        sel = ledger[(ledger["experiment"] == experiment) & (ledger["replica"] == 1)]
        for (revision, precision), cell in sel.groupby(["revision", "precision"], sort=True):
            for item_index, item in cell.groupby("item_index", sort=True):
                by_construction = {r["construction"]: r for _, r in item.iterrows()}
                reasons = []
                for construction in (a, b):
                    row = by_construction.get(construction)
                    if row is None:
                        if not reasons:  # a boundary_missing item has no rebuilt construction by design
                            reasons.append(f"no {construction} row")
                    elif row["status"] != "ok":
                        reasons.append(f"{row['status']} ({construction}): {_REASONS.get(row['status'], row['status'])}")
                if reasons:
                    rows.append({"item_index": int(item_index), "item_id": item["item_id"].iloc[0],
                                 "revision": revision, "experiment": experiment, "precision": precision,
                                 "reason": "; ".join(reasons)})
    return pd.DataFrame(rows, columns=EXCLUSION_COLUMNS)
