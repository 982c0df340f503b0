"""The figures' captions: one text per figure, used by the report (below each image) and, word for word, by the
``workflow/report/<figure>.rst`` files that ``snakemake --report`` shows (a test checks that they agree).

Captions sit outside the images. They say how each figure encodes its data, never what the data show: a finding
is built from a run's files by the report, not written here.
"""

from __future__ import annotations

import textwrap

# name -> (title, caption); the order is the figures' numbering.
CAPTIONS = {
    "fig1_disagreement": (
        "Suffix disagreement between constructions.",
        "For each precision and experiment (rows), the share of compared items whose greedy suffixes differ "
        "between the two constructions of an experiment: the matched experiment (retained live cache vs one-shot "
        "prefill of the identical prefix ids; filled bars) and the fixed-prefix 2x2 (two rebuilt caches over prefix "
        "ids held fixed across precisions, as the legend names them: token-by-token incremental vs one-shot "
        "prefill unless the run chose others; hatched bars). Error bars: Wilson 95% "
        "intervals. Right of "
        "each row: k/n of this run, and in parentheses the reference study's count where the study gives one "
        "(matched bf16; fixed-prefix fp32 when that compares incremental with prefill), which the open diamond "
        "marks on the axis. One panel per revision. "
        "Items without a stage boundary or with non-finite logits are excluded (listed in the report).",
    ),
    "fig2_first_divergence": (
        "Where suffixes first diverge.",
        "Empirical cumulative distribution of the first-divergence position (index of the first suffix token that "
        "differs between the two constructions; a length difference counts) among the items whose suffixes "
        "disagree. Colour: precision; line style and marker: experiment (solid, circles: matched live vs prefill; "
        "dashed, squares: the fixed-prefix pair, incremental vs prefill unless the run chose others). Each series is "
        "drawn up to 0.15 token left or right of its positions, so that series with equal steps stay visible side "
        "by side. The x axis spans the whole suffix. n in the legend is the number of disagreeing items. A "
        "fixed-prefix cell whose rows repeat the matched rows item for item is drawn once, as matched (the report "
        "names such cells). One panel per revision.",
    ),
    "fig3_margins": (
        "Are divergences near-ties?",
        "One point per disagreeing item: the baseline construction's (live in the matched experiment, incremental "
        "in the fixed-prefix one, or the first the report names there) top-2 logit margin at the first divergence "
        "(y) against the median of its margins at the other decode steps of the same suffix (x; the divergence step left out). Both axes symmetric-log, "
        "linear near 0 so that exact ties stay visible; ×k beside a point: k items on it. Points below the diagonal "
        "split where the greedy choice was closer to a tie than at the item's typical step; the report gives the "
        "exact sign test across items. "
        "Colour: precision; marker: experiment. A fixed-prefix cell whose rows repeat the matched rows is drawn "
        "once, as matched. One panel per revision.",
    ),
    "fig4_cache_differences": (
        "Per-layer difference between incremental and prefill boundary caches.",
        "For a seeded sample of items (config cache_differences.n_items, drawn among the items that reached the "
        "boundary before any cache is looked at), both boundary caches are rebuilt from the identical prefix ids at "
        "each precision and compared layer by layer. Top: share of items whose layer's bytes differ. Bottom: among "
        "those items, the max absolute difference over positions, heads and channels (line: median; shaded band: "
        "10th to 90th percentile; no point where no item differs). K: solid line, filled circles, drawn a little "
        "left of the layer; V: dashed line, open squares, a little right, so that equal values stay visible. "
        "Colour: precision. One column per revision. RMS differences and first differing positions are in "
        "cache_differences.parquet and the report.",
    ),
    "fig5_transplant": (
        "Transplant outcomes.",
        "Share of divergent continuations that follow their cache donor (suffix bit-identical to the donor "
        "construction's own continuation) after the donor's K/V replace the recipient's in the layers, components "
        "(K, V or both) and positions of each row, per direction (column); each cell gives donor-following "
        "runs / transplants. The top row (all layers, K and V, all positions) hands over the donor's whole "
        "boundary state and is a check of the construction; the rows below it localise the divergence. Beside each "
        "direction, its placebo: the same transplant with the donor-minus-recipient difference shifted within its "
        "span; a part carries the divergence only where its donor column exceeds its placebo column (the report "
        "gives McNemar's exact test). No-op items (identical bytes) are left out. One panel per revision and "
        "precision.",
    ),
    "fig6_accuracy": (
        "Paired accuracy difference between constructions.",
        "Accuracy of the baseline construction (live in the matched experiment, incremental in the fixed-prefix "
        "one, or the first the report names there) minus that of the other (one-shot prefill unless the run chose "
        "another) over the same items, in percentage points, with the seeded paired "
        "bootstrap 95% percentile interval (10,000 resamples of items), per revision, experiment and precision. "
        "Colour: precision; marker: experiment. Top row, open diamond: the reference study's value (matched, bf16, "
        "200 items). The exact McNemar test on the discordant pairs is in the report.",
    ),
    "fig7_minimal_transplant": (
        "Where the minimal sufficient transplants lie.",
        "For each divergent selected item and direction, a greedy bisection within a budget of transplant runs "
        "(config transplant.minimal.budget) finds a band of layers x a span of cache positions x K, V or both whose "
        "transplant alone still carries the donor's continuation: a part none of whose halves suffices, not a "
        "global minimum. Each cell gives the share of these minimal sets that include that layer (rows) and cache "
        "position (columns, counted from the first stage token: left of the dotted line, the prompt), among the "
        "items whose cache reaches that position; K (upper) and V (lower panel of each pair); both directions "
        "pooled; n: the minimal sets a panel counts. The colour scale runs from 0 to the largest share drawn "
        "(rounded up to a tenth; the colour bar names it); hatched grey: no cache reaches the position (a share of "
        "0 is the scale's palest blue). One pair of panels per "
        "revision and precision. The sets, runs used and whether the budget ran out are in "
        "minimal_transplant.parquet and the report.",
    ),
    "fig8_divergence_onset": (
        "How the cache difference of divergent items grows with depth, and the margin where they split.",
        "For every item whose two transplant constructions (live and prefill unless the run chose others) continue "
        "differently, both boundary caches are rebuilt from the identical prefix ids and compared layer by layer. "
        "Top: the RMS of the difference per layer (the larger of K and V), one thin line per item and the median "
        "over items as a thick line with circles, on a symmetric-log axis, linear near 0. Bottom: one open circle "
        "per item, the first construction's top-2 logit margin at the first divergent suffix token (y) against "
        "the max absolute difference of the caches at the last layer (x, symmetric-log); ×k beside a circle: k "
        "items on that point. Colour: precision. One column per revision. Items are chosen by divergence; the "
        "onset layer and position and the rank correlation are in divergence_onset.parquet and the report.",
    ),
    "fig9_fidelity": (
        "Fidelity along the suffix: per-step KL divergence from live.",
        "For every compared item, the live construction's greedy suffix is teacher-forced through each other "
        "construction's boundary cache (built over the same prefix ids, in the same batch and layout), and at every "
        "suffix step the KL divergence KL(P_live || P_construction) of the two next-token distributions is computed "
        "in nats (float64 from the fp32 logits). One row per precision (colour) and construction. Right, on a log "
        "axis: the steps whose KL is above 0 (box: quartiles; bar inside: median; whiskers: 5th to 95th "
        "percentile; open circle: the largest). Left, the strip \"exactly 0\": the share of steps whose KL is "
        "exactly 0 (byte-equal logits give exactly 0), k/n steps beside it. One panel per revision. The share of "
        "steps with byte-equal logits is in fidelity.parquet and the report.",
    ),
    "fig10_split_predictors": (
        "What is associated with a split (an association across items, not a prediction).",
        "One row of panels per revision and precision. Left: one marker per compared item and construction (colour "
        "and marker): what the boundary state reads out at the first suffix step, before any suffix token is "
        "compared: live's top-2 margin (y) against the max-abs logit difference between the two constructions (x), "
        "both symmetric-log, linear near 0 so that exact zeros stay visible; filled: items whose greedy suffixes "
        "split at a later step (the argmax differs under teacher forcing), open: items that do not split. Items "
        "split at step 0 itself are left out of this panel (their difference there is the split; the report counts "
        "them). No score is taken over the "
        "suffix, which would include the split step and grow with the suffix's length. Right: the share of all "
        "compared items split within the first k suffix tokens, k = 1 to the suffix budget (step line, one line "
        "style per construction), with pointwise Wilson 95% intervals (band); no curve is fitted. Constructions "
        "alike on every item are drawn once and named in the panel (a = b); a precision with no split says so "
        "instead of drawing lines at 0. The AUCs of these scores and of the same scores at the step before each split "
        "(split items compared only with unsplit items observed past their split step; DeLong intervals) and the "
        "suffix-length control are in the report.",
    ),
}


def rst_text(name: str, number: int | None = None) -> str:
    """The caption as ``workflow/report/<name>.rst`` holds it: one paragraph, wrapped at 116 columns."""
    number = number or list(CAPTIONS).index(name) + 1
    title, caption = CAPTIONS[name]
    return textwrap.fill(f"**Figure {number}. {title}** {caption}", width=116, break_long_words=False,
                         break_on_hyphens=False) + "\n"
