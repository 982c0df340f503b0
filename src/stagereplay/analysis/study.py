"""The reference study's numbers: the one place in the package that holds them.

"The reference study" is the measurement stagereplay was built to reproduce (docs/STUDY.md, section "The reference
study's claims", which says what each number means and the sign conventions). The report prints these beside each
run's own numbers and the figures draw them; nothing else in the package may write one of them down, so a number
here, in the report and on a figure cannot disagree. Every figure below is the study's, not a run's: the report
labels it "reference study" wherever it shows one.

Sign convention: an accuracy difference is the baseline construction's accuracy minus that of ``prefill`` over the
same items (live - prefill in the matched experiment), as a proportion (0.01 is one percentage point).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "the reference study (docs/STUDY.md)"

MODEL = "a Qwen2.5-derived reasoning model"
LAYERS = 48
N_ITEMS = 200
BOUNDARY = "the end of the reasoning stage"


@dataclass(frozen=True)
class Count:
    """k of n, as the study gives it."""

    k: int
    n: int

    def __str__(self) -> str:
        return f"{self.k} / {self.n}"

    @property
    def rate(self) -> float:
        return self.k / self.n


# Claim 1. Matched experiment, bf16: replicas of both constructions bit-identical (token ids and cache bytes).
REPLICAS_EXACT = {"bf16": True}

# Claim 2. Matched experiment, bf16: items whose live and prefill suffixes differ (token ids).
MATCHED_DISAGREEMENTS = {"bf16": Count(166, N_ITEMS)}

# Claim 3. Matched experiment, bf16: items whose correctness labels differ, and the paired accuracy difference
# live - prefill: live alone right on 11 items, prefill alone on 9, so (11 - 9) / 200 = +1 point; the paired 95%
# interval [-3.5, +5.5] points covers 0.
MATCHED_LABEL_FLIPS = {"bf16": Count(20, N_ITEMS)}
MATCHED_ACCURACY = {"bf16": {"difference": 0.01, "low": -0.035, "high": 0.055, "live_only": 11, "prefill_only": 9,
                             "n": N_ITEMS}}

# Claim 4. Fixed-prefix 2x2 (incremental vs prefill, prefix ids held fixed): in bf16 the disagreements "recur"
# (no count given: None); in fp32 0 / 200, whose 95% Wilson upper bound is 1.88%.
FIXED_PREFIX_DISAGREEMENTS = {"bf16": None, "fp32": Count(0, N_ITEMS)}
FIXED_PREFIX_FP32_WILSON_HIGH = 0.0188
FIXED_PREFIX_BF16_WORDS = "recur"

# Claim 5. Bridge: rows whose token-by-token incremental cache equals the retained live cache byte for byte.
BRIDGE_BIT_EXACT = Count(12, 12)

# Claim 6. Saved-ledger audit: retained trajectories (one per item: the live generation) recomputed from the model,
# the items and the recorded ids alone, their comparison fingerprints included. The study counts trajectories,
# not ledger rows.
AUDIT_TRAJECTORIES = Count(N_ITEMS, N_ITEMS)

# Claim 7. Bidirectional transplant of all 48 K/V layers: divergent continuations that follow their cache donor.
TRANSPLANT_ALL_LAYERS = (
    {"count": Count(24, 24), "selection": "selected set", "checkpoint": "primary checkpoint"},
    {"count": Count(43, 43), "selection": "outcome-blind", "checkpoint": "later checkpoint"},
)


def transplant_text() -> str:
    return "every divergent continuation follows its cache donor: " + ", ".join(
        f"{t['count']} ({t['selection']}, {t['checkpoint']})" for t in TRANSPLANT_ALL_LAYERS)


def accuracy_text(precision: str = "bf16") -> str:
    acc = MATCHED_ACCURACY[precision]
    return (f"{100 * acc['difference']:+g} point, paired 95% CI [{100 * acc['low']:+g}, {100 * acc['high']:+g}] "
            f"(live alone right {acc['live_only']}, prefill alone {acc['prefill_only']})")


def fixed_prefix_text(precision: str) -> str:
    """The study's fixed-prefix figure for one precision, or an em dash where it gives none."""
    if precision not in FIXED_PREFIX_DISAGREEMENTS:
        return "—"
    count = FIXED_PREFIX_DISAGREEMENTS[precision]
    if count is None:
        return f"{FIXED_PREFIX_BF16_WORDS} (no count given)"
    if precision == "fp32":
        return f"{count} (95% Wilson upper bound {100 * FIXED_PREFIX_FP32_WILSON_HIGH:.2f}%)"
    return str(count)


def summary() -> dict:
    """The numbers as plain data, for stats.json."""
    return {
        "source": SOURCE, "model": MODEL, "layers": LAYERS, "n_items": N_ITEMS,
        "replicas_exact": REPLICAS_EXACT,
        "matched_disagreements": {p: {"k": c.k, "n": c.n} for p, c in MATCHED_DISAGREEMENTS.items()},
        "matched_label_flips": {p: {"k": c.k, "n": c.n} for p, c in MATCHED_LABEL_FLIPS.items()},
        "matched_accuracy_difference_live_minus_prefill": MATCHED_ACCURACY,
        "fixed_prefix_disagreements": {p: None if c is None else {"k": c.k, "n": c.n}
                                       for p, c in FIXED_PREFIX_DISAGREEMENTS.items()},
        "fixed_prefix_fp32_wilson_high": FIXED_PREFIX_FP32_WILSON_HIGH,
        "bridge_bit_exact": {"k": BRIDGE_BIT_EXACT.k, "n": BRIDGE_BIT_EXACT.n},
        "audit_trajectories": {"k": AUDIT_TRAJECTORIES.k, "n": AUDIT_TRAJECTORIES.n},
        "transplant_all_layers": [{"k": t["count"].k, "n": t["count"].n, "selection": t["selection"],
                                   "checkpoint": t["checkpoint"]} for t in TRANSPLANT_ALL_LAYERS],
    }
