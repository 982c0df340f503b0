"""The measured rates a projection prices work at, and a model job's fixed cost.

A measure (one of ``bench/benchmark.py --only-projection``'s ``projection`` list, per precision and row count): a
decode step fitted as a + b * span at ``rows`` rows (``step_fit``, with the span ``bucket`` its decoder attended
over: 1 for the triton attention, which reads each row's keys up to its position), a one-shot prefill rate in
tokens/s, a cache-dump rate in GB/s, and the K/V bytes of a row. ``decode_seconds`` prices steps from one;
``Rates`` picks the one for a precision and row count.

Overhead. Every model job pays its process start and imports, and for each model it loads, the load, the decoder
and the CUDA-graph capture of its first step; its first load also imports the model's code. ``Overhead.from_seconds``
takes one job with one load, and the part of it that a job pays again for each further precision it loads (a job
that loads no model is then priced at the first less the second). ``Overhead.from_json`` takes them apart (start,
first load's extra, each precision's load) with the host rates of the greedy loop, the boundary matcher and the
fingerprints, as ``bench/pipeline_projection.py --measure-overhead`` measures them in a fresh Python process, the
way a job's script makes them, without Snakemake (the fingerprints' snapshot copy on a GPU:
``bench/fingerprint_rates.py``). Snakemake's scheduling and the benchmark wrapper are in none of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 151936  # Qwen2.5's vocabulary (the 14B's 152064): measure_fidelity's logits per row and step
# measure_fidelity's work beside its steps, per row-step, where the overhead's JSON does not give it (see counts):
OBSERVE_S = 1.0e-5  # one torch op a row and step (the logits' copy): a CUDA launch's host cost, assumed
COMPARE_S = 2.2e-5  # 16.5 us host (the table row and its DataFrame, timed on the VM's CPU) + 5.8 us device (bound)


@dataclass
class Overhead:
    """A model job's fixed cost: its start (process, imports) and per model loaded (load, decoder, first graph)."""

    start_s: float
    load_s: dict  # precision -> seconds of one load, its decoder and first step
    first_load_extra_s: float = 0.0  # what a job's first load costs more (the model's code imported)
    greedy_step_s: dict = field(default_factory=dict)  # rows -> host seconds per decode step (greedy choice, sync)
    matcher_s_per_row_step: float = 0.0
    fingerprint_GB_s: float | None = None  # sha256 of boundary caches, the copy to the host included
    # the pending fingerprints of a GPU job (io.fingerprints.PendingFingerprints): the cache's snapshot copied to
    # page-locked memory on the decode's stream at this rate, hashed beside the decode; None: hashed in turn
    fingerprint_copy_GB_s: float | None = None
    observe_s_per_row_step: float = 0.0  # measure_fidelity: a row's fp32 logits copied and kept, per step
    compare_s_per_row_step: float = 0.0  # measure_fidelity: step_measures and the table row, per compared step

    @classmethod
    def from_seconds(cls, overhead_s: float, load_s: float = 0.0) -> "Overhead":
        """``overhead_s``: a job with one load; ``load_s``: the part of it each further load costs again."""
        return cls(overhead_s - load_s, {"*": load_s})

    @classmethod
    def from_json(cls, measured: dict) -> "Overhead":
        return cls(measured["start_s"], measured["load_s"], measured.get("first_load_extra_s", 0.0),
                   {int(r): s for r, s in measured.get("greedy_step_s", {}).items()},
                   measured.get("matcher_s_per_row_step", 0.0), measured.get("fingerprint_GB_s"),
                   fingerprint_copy_GB_s=measured.get("fingerprint_copy_GB_s"),
                   observe_s_per_row_step=measured.get("observe_s_per_row_step", OBSERVE_S),
                   compare_s_per_row_step=measured.get("compare_s_per_row_step", COMPARE_S))

    def of_job(self, loads: list) -> float:
        """Start, and one load per precision loaded (one not measured: the mean of those measured)."""
        mean = sum(self.load_s.values()) / len(self.load_s) if self.load_s else 0.0
        first = self.first_load_extra_s if loads else 0.0
        return self.start_s + first + sum(self.load_s.get(p, mean) for p in loads)

    def greedy(self, rows: int) -> float:
        if not self.greedy_step_s:
            return 0.0
        nearest = min(self.greedy_step_s, key=lambda r: abs(r - rows))
        return self.greedy_step_s[nearest]


class Rates:
    """The measures by (precision, rows), and the overhead."""

    def __init__(self, measures: list[dict], overhead: Overhead, warnings: list):
        self.by = {(m["precision"], int(m["rows"])): m for m in measures}
        self.overhead, self.warnings = overhead, warnings
        self.vocab = VOCAB  # measure_fidelity's logits (the measures record no vocabulary)

    def nearest(self, precision: str, rows: int) -> dict:
        """The measure at ``precision`` whose row count is nearest ``rows``."""
        mine = {r: m for (p, r), m in self.by.items() if p == precision}
        if not mine:
            raise ValueError(f"no measure at precision {precision!r} (measured: {sorted(set(self.by))})")
        return mine[min(mine, key=lambda r: abs(r - rows))]

    def step_measure(self, precision: str, rows: int) -> dict:
        """The measure that prices a step at ``rows`` rows: the one measured there; else, between two measured row
        counts of the same attention, their fit interpolated linearly in the rows (a partial last batch); else the
        nearest row count's (noted)."""
        mine = {r: m for (p, r), m in self.by.items() if p == precision}
        if rows in mine:
            return mine[rows]
        below = max((r for r in mine if r < rows), default=None)
        above = min((r for r in mine if r > rows), default=None)
        if below is not None and above is not None and (
                mine[below]["step_fit"]["bucket"] == mine[above]["step_fit"]["bucket"]):
            lo, hi, t = mine[below], mine[above], (rows - below) / (above - below)
            fit = {key: lo["step_fit"][key] + t * (hi["step_fit"][key] - lo["step_fit"][key])
                   for key in ("a_s", "b_s_per_position")}
            note = (f"{precision} steps at {rows} rows priced by the step fit interpolated between the {below}- and "
                    f"{above}-row measures")
            if note not in self.warnings:
                self.warnings.append(note)
            return {**hi, "rows": rows, "step_fit": {**fit, "bucket": hi["step_fit"]["bucket"]},
                    "step_s": lo["step_s"] + t * (hi["step_s"] - lo["step_s"])}
        m = self.nearest(precision, rows)
        note = f"{precision} steps at {rows} rows priced at the {m['rows']}-row measure (none at {rows} rows)"
        if note not in self.warnings:
            self.warnings.append(note)
        return m

    def kv_GB_per_position(self, precision: str) -> float:
        m = self.nearest(precision, 1)
        return m["kv_GB_per_row"] / m["max_len"]


def decode_seconds(m: dict, start: int, count: int, bucketed: bool) -> float:
    """Wall time of ``count`` batched decode steps from cache length ``start``, per row."""
    if not bucketed:
        return count * m["step_s"] / m["rows"]
    fit, B, L = m["step_fit"], m["step_fit"]["bucket"], m["max_len"]
    spans = sum(min(L, -(-(p + 1) // B) * B) for p in range(start, start + count))
    return (count * fit["a_s"] + fit["b_s_per_position"] * spans) / m["rows"]


def step_seconds(m: dict, span: float) -> float:
    """One decode step of the measure's batch attending over ``span`` positions: ``decode_seconds`` of one step with
    the span its own bucket (its time per row, times the rows)."""
    span = int(round(span))
    at_span = {**m, "max_len": span, "step_fit": {**m["step_fit"], "bucket": span}}
    return decode_seconds(at_span, span - 1, 1, bucketed=True) * m["rows"]


def by_position(m: dict) -> bool:
    """Whether the measure is of an attention that reads each row's keys up to its position (the triton attention:
    ``bench/benchmark.py`` records its bucket as 1 position), so a step costs what its own position costs."""
    return m["step_fit"]["bucket"] == 1


def steps_seconds(m: dict, start: float, count: float, buffer: float) -> float:
    """``count`` decode steps of the measure's batch from cache length ``start``, each at its own position (up to
    the buffer): ``decode_seconds(bucketed=True)`` with a bucket of one position sums a + b * span over the steps.
    Fractional lengths (a ledger's means): the steps' mean cost at the rounded lengths, times ``count``."""
    whole = max(1, round(count))
    at = {**m, "max_len": int(round(buffer)), "step_fit": {**m["step_fit"], "bucket": 1}}
    return decode_seconds(at, int(round(start)), whole, bucketed=True) * m["rows"] * count / whole


def load_measures(path: str) -> list[dict]:
    saved = json.loads(Path(path).read_text())
    measures = saved["projection"] if isinstance(saved, dict) else saved
    if not measures:
        raise ValueError(f"{path} holds no projection measures (bench/benchmark.py --only-projection writes them)")
    return measures
