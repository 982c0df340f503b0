"""The catalogue of the package's extension points: every construction, figure, results file and engine, declared
once by name, and read by the modules that implement them.

- A construction (:class:`Construction`) is how the KV cache at the stage boundary is built (docs/STUDY.md): its
  name (config values, ledger rows), its label and figure style, what it does, and the name of its segment rule,
  the function of :mod:`stagereplay.experiments.constructions` that gives its forwards (none: only retained from
  the generation, as ``live`` is). The construction registry is built from these entries.
- A figure (:class:`Figure`) of the report: its name (files ``<name>.pdf|png``), title and caption (the report
  prints them beside the image; ``workflow/report/<name>.rst`` holds the same words for ``snakemake --report``),
  the results files it draws and its plotter, a dotted path to the function of :mod:`stagereplay.analysis` that
  draws it. Their order is the figures' numbering; the workflow's targets list them from here.
- A results file (:class:`ResultFile`): its name, where it lies in ``results/<run>/`` and the rule that writes it.
- An engine (:class:`Engine`): a serving engine that rebuilds the boundary state itself, its class (a dotted
  path to an implementation of :class:`stagereplay.engines.protocol.Engine`), the results files it writes and its
  own constructions (:class:`EngineConstruction`), each running the forwards of one of the pipeline's.

Where the config schema (``workflow/schemas/config.schema.yaml``) offers a choice among these, :data:`SCHEMA_ENUMS`
names the key and :func:`schema_enums` what it lists; the YAML leaves those keys open and the schema the workflow
validates with has these names filled in (:func:`stagereplay.config.schema`).

This module is data: it imports nothing beyond the standard library and knows nothing of torch, Snakemake or how
any entry is implemented. docs/EXTENDING.md walks through adding an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Construction:
    name: str
    label: str  # how a reader names it
    builds: str  # how it builds the boundary cache, in a few words
    segment_rule: str | None  # the forwards' rule in experiments.constructions; None: only retained (live)
    schedule: bool = False  # the live schedule's own cache (prompt, then one token per step)
    style: dict = field(default_factory=dict)  # colour, marker and line style where figures tell constructions apart

    @property
    def rebuildable(self) -> bool:
        return self.segment_rule is not None


# A line style each too: two curves that coincide on some positions stay told apart where they overlap. live has
# none: the figures set the others against it.
CONSTRUCTIONS = (
    Construction("live", "live cache", "retained from the greedy generation itself", None),
    Construction("incremental", "incremental (token by token)", "the prompt in one forward, then the stage one "
                 "token per forward (live's schedule, over given ids)", "incremental", schedule=True,
                 style={"color": "#56B4E9", "marker": "D", "linestyle": (0, (4, 1.5, 1, 1.5))}),
    Construction("prefill", "one-shot prefill", "every boundary-cache id in one forward", "prefill",
                 style={"color": "#CC79A7", "marker": "o", "linestyle": "-"}),
    Construction("chunked", "chunked prefill", "every boundary-cache id in forwards of chunk_size tokens, as "
                 "serving engines' chunked prefill", "chunked",
                 style={"color": "#009E73", "marker": "s", "linestyle": (0, (4, 2))}),
    Construction("prefix_cached", "prefix-cached prefill", "the prompt's cache from an earlier request, then the "
                 "stage ids in one forward, as automatic prefix caching", "prefix_cached",
                 style={"color": "#E69F00", "marker": "^", "linestyle": (0, (1, 1.5))}),
)


@dataclass(frozen=True)
class Figure:
    name: str
    inputs: tuple[str, ...]  # the results files (ResultFile names) it draws
    plotter: str  # dotted path of the function that draws it: plotter(table, paths, revision_order=, coinciding=)
    title: str
    caption: str  # how the figure encodes its data, never what the data show


# The order is the figures' numbering.
FIGURES = (
    Figure(
        "fig1_disagreement", ("ledger",), "stagereplay.analysis.ledger_figures.plot_disagreement",
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
    Figure(
        "fig2_first_divergence", ("ledger",), "stagereplay.analysis.ledger_figures.plot_first_divergence",
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
    Figure(
        "fig3_margins", ("ledger",), "stagereplay.analysis.ledger_figures.plot_margins",
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
    Figure(
        "fig4_cache_differences", ("cache_differences",), "stagereplay.analysis.cache_figures.plot_cache_differences",
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
    Figure(
        "fig5_transplant", ("transplant",), "stagereplay.analysis.cache_figures.plot_transplant",
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
    Figure(
        "fig6_accuracy", ("ledger",), "stagereplay.analysis.ledger_figures.plot_accuracy",
        "Paired accuracy difference between constructions.",
        "Accuracy of the baseline construction (live in the matched experiment, incremental in the fixed-prefix "
        "one, or the first the report names there) minus that of the other (one-shot prefill unless the run chose "
        "another) over the same items, in percentage points, with the seeded paired "
        "bootstrap 95% percentile interval (10,000 resamples of items), per revision, experiment and precision. "
        "Colour: precision; marker: experiment. Top row, open diamond: the reference study's value (matched, bf16, "
        "200 items). The exact McNemar test on the discordant pairs is in the report.",
    ),
    Figure(
        "fig7_minimal_transplant", ("minimal_transplant",),
        "stagereplay.analysis.cache_figures.plot_minimal_transplant",
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
    Figure(
        "fig8_divergence_onset", ("divergence_onset",), "stagereplay.analysis.cache_figures.plot_divergence_onset",
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
    Figure(
        "fig9_fidelity", ("fidelity",), "stagereplay.analysis.fidelity_figures.plot_fidelity",
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
    Figure(
        "fig10_split_predictors", ("fidelity",), "stagereplay.analysis.fidelity_figures.plot_split_predictors",
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
)


@dataclass(frozen=True)
class ResultFile:
    name: str
    path: str  # under results/<run>/; {revision}: one per revision
    rule: str  # the rule that writes it


RESULT_FILES = (
    ResultFile("items", "selection/items.parquet", "select_items"),
    ResultFile("ledger", "{revision}/ledger.parquet", "gather_ledger"),
    ResultFile("prefixes", "{revision}/prefixes.parquet", "gather_ledger"),
    ResultFile("bridge", "{revision}/bridge.parquet", "gather_bridge"),
    ResultFile("audit", "{revision}/audit.parquet", "gather_audit"),
    ResultFile("audit_check", "{revision}/audit_check.json", "check_audit"),
    ResultFile("batch_invariance", "{revision}/batch_invariance.parquet", "gather_batch_invariance"),
    ResultFile("cache_differences", "{revision}/cache_differences.parquet", "gather_cache_differences"),
    ResultFile("fidelity", "{revision}/fidelity.parquet", "gather_fidelity"),
    ResultFile("replay_baseline", "{revision}/replay_baseline.parquet", "gather_replay_baseline"),
    ResultFile("transplant_selection", "{revision}/transplant_selection.parquet", "select_transplant_items"),
    ResultFile("caches", "{revision}/caches.parquet", "gather_caches"),
    ResultFile("transplant", "{revision}/transplant.parquet", "gather_transplants"),
    ResultFile("minimal_transplant", "{revision}/minimal_transplant.parquet", "gather_minimal_transplants"),
    ResultFile("divergence_onset", "{revision}/divergence_onset.parquet", "gather_divergence_onset"),
    # an engine's two files (engine_<name>, engine_<name>_audit), written by the rules over the {engine} wildcard
    ResultFile("engine_llama_cpp", "{revision}/engine_llama_cpp.parquet", "gather_engine_rows"),
    ResultFile("engine_llama_cpp_audit", "{revision}/engine_llama_cpp_audit.parquet", "gather_engine_audit"),
)


@dataclass(frozen=True)
class EngineConstruction:
    name: str
    label: str
    forwards_of: str  # the pipeline's construction whose forwards it runs
    restores_prompt: bool = False  # the prompt's state is saved and restored after the prompt's forward
    generates: bool = False  # it generates its own stage (``live``): for the engine's own stage ids only


@dataclass(frozen=True)
class Engine:
    name: str  # the config's engines: [name], and its config block <name>: in the schema
    engine_class: str  # dotted path of its class, an stagereplay.engines.protocol.Engine
    outputs: tuple[str, ...]  # the results files (ResultFile names) it writes: engine_<name>, engine_<name>_audit
    constructions: tuple[EngineConstruction, ...]
    label: str = ""  # how the report names it ("llama.cpp"); empty: its name
    # the report section's first words: a format string over its rows' provenance columns (the engine's ``fields``;
    # booleans read "on" / "off"), saying what ran and how the engine's precision is to be read
    report_header: str = ""
    precision_word: str = "precision"  # what its ledger's precision is ("KV": llama.cpp's is its KV cache type)

    @property
    def words(self) -> str:
        return self.label or self.name


ENGINES = (
    Engine("llama_cpp", "stagereplay.engines.llama_cpp.LlamaCppEngine", ("engine_llama_cpp", "engine_llama_cpp_audit"),
           constructions=(
        EngineConstruction("live", "llama.cpp's own greedy generation, its retained state", "incremental",
                           generates=True),
        EngineConstruction("incremental", "llama.cpp token by token over given ids", "incremental"),
        EngineConstruction("prefill", "llama.cpp one batch", "prefill"),
        EngineConstruction("prompt_cache", "llama.cpp prompt cache (save_state/load_state)", "prefix_cached", True),
        EngineConstruction("chunked", "llama.cpp chunked (n_batch pieces)", "chunked"),
    ), label="llama.cpp", report_header=(
        "llama.cpp through llama-cpp-python {binding_version} (llama.cpp `{llama_cpp_commit}`, ggml {ggml_version}), "
        "n_ctx {n_ctx}, n_batch {n_batch}, n_ubatch {n_ubatch} (no forward is longer: a longer one is refused, not "
        "split), {n_threads} thread(s), {n_gpu_layers} layer(s) offloaded, flash attention {flash_attn}, chunk "
        "{chunk_size}; built with `{system_info}`. Its precision is the KV cache type (weights and activations are "
        "the GGUF's and llama.cpp's)."), precision_word="KV"),
)

# Where the config schema offers a choice among the catalogue's entries: dotted key -> which names it lists
# (rebuildable: the constructions with a segment rule; constructions: all; engines; engine:<name>: its own).
SCHEMA_ENUMS = {
    "fixed_prefix.constructions": "rebuildable",
    "transplant.constructions": "constructions",
    "fidelity.constructions": "rebuildable",
    "engines": "engines",
    "llama_cpp.constructions": "engine:llama_cpp",
}


def construction_names() -> list[str]:
    return [c.name for c in CONSTRUCTIONS]


def rebuildable_names() -> list[str]:
    return [c.name for c in CONSTRUCTIONS if c.rebuildable]


def engine_names() -> list[str]:
    return [e.name for e in ENGINES]


def figure_names() -> list[str]:
    return [f.name for f in FIGURES]


def _by_name(entries, kind: str, name: str):
    for entry in entries:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown {kind} {name!r}; the catalogue's: {[e.name for e in entries]}")


def construction(name: str) -> Construction:
    return _by_name(CONSTRUCTIONS, "construction", name)


def figure(name: str) -> Figure:
    return _by_name(FIGURES, "figure", name)


def result_file(name: str) -> ResultFile:
    return _by_name(RESULT_FILES, "results file", name)


def engine(name: str) -> Engine:
    return _by_name(ENGINES, "engine", name)


def schema_enums() -> dict[str, list[str]]:
    """{dotted config key: the names its schema enum must list, in this order} (:data:`SCHEMA_ENUMS`)."""
    lists = {"rebuildable": rebuildable_names, "constructions": construction_names, "engines": engine_names}
    enums = {}
    for key, which in SCHEMA_ENUMS.items():
        kind, _, name = which.partition(":")
        enums[key] = [c.name for c in engine(name).constructions] if kind == "engine" else lists[kind]()
    return enums
