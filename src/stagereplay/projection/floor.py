"""The floor of a count of GPU work on one GPU at the datasheet rates: no run of it can take less than its arithmetic
at the peak rates, nor less than its memory traffic at the memory bandwidth. ``run_floor`` and ``fp32_floor`` count
the work as :func:`.paper.project` does; ``work_floor`` prices any count (the rule-by-rule one's too).
"""

from __future__ import annotations

from stagereplay.projection.paper import project

# The H200's fp32 rate without tensor cores (TF32 off, as the pipeline runs fp32), from NVIDIA's H200 datasheet
# ("FP32 67 TFLOPS", the SXM part; the same figure as the H100 SXM).
H200_FP32_TFLOPS = 67.0


def kv_positions_read(m: dict, items: int, divergent: float, **project_kwargs) -> float:
    """The K/V positions the decode steps :func:`project` counts for ``m``'s precision read, summed over rows and
    steps (each row's keys up to its position): :func:`project` on a measure whose step costs one unit per attended
    position and nothing else."""
    reading = {**m, "rows": 1, "prefill_tokens_s": float("inf"), "dump_GB": 0.0,
               "step_fit": {"a_s": 0.0, "b_s_per_position": 1.0, "bucket": 1}}
    return project([reading], items, divergent, bucketed=True, **project_kwargs)["parts"][m["precision"]]["decode_s"]


def fp32_floor(measures: list[dict], items: int, divergent: float, copy_TB_s: float,
               peak_tflops: float = H200_FP32_TFLOPS, **project_kwargs) -> dict:
    """The floor of the fp32 arm of :func:`project` (the same work, counted the same way): its linear maps
    at ``peak_tflops`` (every decode row-step and prefill token, 2 x parameters FLOPs each) plus its decode
    attention reading each row's K/V up to its position once at the copy rate; against the projected arm.

    The attention term counts the K/V positions read as :func:`kv_positions_read` does, so both count exactly the
    same rows, steps and spans."""
    out = {}
    arms = project(measures, items, divergent, bucketed=True, **project_kwargs)["parts"]
    for m in measures:
        if "linear_params" not in m or m["precision"] != "fp32":  # the datasheet rate is fp32's
            continue
        per_position = m["kv_GB_per_row"] * 1e9 / m["max_len"]  # one row's K and V of every layer, one position
        attention_s = (kv_positions_read(m, items, divergent, **project_kwargs) * per_position
                       / (copy_TB_s * 1e12))
        arm = arms[m["precision"]]
        linear_at_best = arm["linear_floor_s"]  # at the best GEMM rate measured in the run
        linear_at_peak = linear_at_best * m["gemm_TFLOP_s_large"] / peak_tflops
        projected = arm["decode_s"] + arm["prefill_s"]
        out[m["precision"]] = {
            "linear_at_peak_s": linear_at_peak, "linear_at_best_measured_s": linear_at_best,
            "best_measured_TFLOP_s": m["gemm_TFLOP_s_large"], "attention_at_copy_rate_s": attention_s,
            "floor_s": linear_at_peak + attention_s, "projected_s": projected,
            "share_of_floor": (linear_at_peak + attention_s) / projected}
    return out


# NVIDIA's H200 (SXM) datasheet: dense BF16 tensor-core rate (1,979 TFLOPS is with sparsity) and HBM3e bandwidth.
H200_BF16_TFLOPS = 989.0
H200_HBM_TB_S = 4.8
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def run_floor(measures: list[dict], items: int, divergent: float, copy_TB_s: float,
              peaks_tflops: dict | None = None, memory_TB_s: float = H200_HBM_TB_S, **project_kwargs) -> dict:
    """The floor of the whole projected run's GPU work on one GPU (the work :func:`project` counts, counted the same
    way; job start-up and dumps left out): no run of it can take less than its arithmetic at the datasheet rates,
    nor less than its memory traffic at ``memory_TB_s``, whichever is longer.

    Per arm (precision): arithmetic = 2 x linear parameters x (decode row-steps + prefill tokens) at the arm's peak;
    traffic = the weights read once per batched decode step (row-steps / rows of the batch) plus every row's K/V
    read up to its position, as :func:`fp32_floor` counts it. The run: max(sum of arithmetic, sum of traffic) (the
    arms overlapped perfectly), and the sum of each arm's own bound (the arms in turn); the traffic is also given at
    the measured copy rate ``copy_TB_s`` (read + write), a rate a run can reach. :func:`work_floor` prices the
    counts; ``report.project_config`` gives it the counts of the rule-by-rule model instead."""
    projected = project(measures, items, divergent, bucketed=True, **project_kwargs)
    counts = {}
    for m in measures:
        precision = m["precision"]
        part = projected["parts"][precision]
        positions = kv_positions_read(m, items, divergent, **project_kwargs)
        row_steps = items * part["decode_steps_per_item"]
        counts[precision] = {"row_steps": row_steps, "batch_steps": row_steps / m["rows"],
                             "kv_row_positions": positions, "prefill_tokens": part["prefill_tokens"],
                             "projected_s": part["decode_s"] + part["prefill_s"]}
    return work_floor(counts, measures, copy_TB_s, peaks_tflops, memory_TB_s)


def work_floor(counts: dict, measures: list[dict], copy_TB_s: float, peaks_tflops: dict | None = None,
               memory_TB_s: float = H200_HBM_TB_S) -> dict:
    """:func:`run_floor`'s pricing of given counts. ``counts``: {precision: {"row_steps": decode row-steps,
    "batch_steps": batched decode steps (each reads the weights once), "kv_row_positions": K/V positions read,
    summed over rows and steps (each row's keys up to its position), "prefill_tokens", "projected_s": the
    projected GPU seconds of that work}}; ``measures``: one per precision, for the shape's linear parameters and K/V
    bytes per position."""
    peaks = {"fp32": H200_FP32_TFLOPS, "bf16": H200_BF16_TFLOPS, **(peaks_tflops or {})}
    arms = {}
    for m in measures:
        precision = m["precision"]
        if precision not in counts or precision in arms:
            continue
        c = counts[precision]
        flops = 2 * m["linear_params"] * (c["row_steps"] + c["prefill_tokens"])
        weight_bytes = c["batch_steps"] * m["linear_params"] * ITEMSIZE[precision]
        kv_bytes = c["kv_row_positions"] * m["kv_GB_per_row"] * 1e9 / m["max_len"]
        arms[precision] = {"arithmetic_s": flops / (peaks[precision] * 1e12), "weights_GB": weight_bytes / 1e9,
                           "kv_GB": kv_bytes / 1e9, "projected_s": c["projected_s"]}
    arithmetic = sum(a["arithmetic_s"] for a in arms.values())
    traffic_bytes = sum((a["weights_GB"] + a["kv_GB"]) * 1e9 for a in arms.values())
    out = {"arms": arms, "arithmetic_s": arithmetic, "traffic_s": traffic_bytes / (memory_TB_s * 1e12),
           "traffic_at_copy_rate_s": traffic_bytes / (copy_TB_s * 1e12), "peaks_TFLOP_s": peaks,
           "memory_TB_s": memory_TB_s, "copy_TB_s": copy_TB_s,
           "projected_gpu_s": sum(a["projected_s"] for a in arms.values())}
    out["floor_s"] = max(out["arithmetic_s"], out["traffic_s"])
    out["floor_at_copy_rate_s"] = max(out["arithmetic_s"], out["traffic_at_copy_rate_s"])
    # the arms one after another (as model jobs that take the GPU in turn run them): each at its own bound
    out["floor_arms_in_turn_s"] = sum(
        max(a["arithmetic_s"], (a["weights_GB"] + a["kv_GB"]) * 1e9 / (memory_TB_s * 1e12)) for a in arms.values())
    return out
