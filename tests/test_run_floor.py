"""stagereplay.projection.floor.run_floor: the whole projected run's floor counts the work project() counts, at the
datasheet rates, and sits below the projection."""

import json
from pathlib import Path

from stagereplay.projection.floor import H200_HBM_TB_S, fp32_floor, run_floor

REPO = Path(__file__).resolve().parents[1]
SAVED = REPO / "bench/runs/h200_run7_projection_shared_rows.json"


def test_the_run_floor_is_the_longer_of_arithmetic_and_traffic_and_below_the_projection():
    saved = json.loads(SAVED.read_text())
    measures, copy = saved["projection"], saved["meta"]["copy_TB_s"]
    floor = run_floor(measures, 200, 166 / 200, copy)
    assert set(floor["arms"]) == {"bf16", "fp32"}
    assert floor["floor_s"] == max(floor["arithmetic_s"], floor["traffic_s"])
    # a measured copy rate below the datasheet's bandwidth makes the traffic longer
    assert copy < H200_HBM_TB_S and floor["traffic_at_copy_rate_s"] > floor["traffic_s"]
    assert floor["floor_s"] <= floor["floor_arms_in_turn_s"] < floor["projected_gpu_s"]
    # the fp32 arm's arithmetic is the fp32 floor's linear maps at the datasheet rate (the same work counted)
    fp32 = fp32_floor(measures, 200, 166 / 200, copy)["fp32"]
    assert abs(floor["arms"]["fp32"]["arithmetic_s"] - fp32["linear_at_peak_s"]) < 1e-6 * fp32["linear_at_peak_s"]
    # bf16 reads half the bytes per weight and per K/V position that fp32 does, over more decode steps (the matched
    # experiment and the transplants are bf16 only)
    bf16, f32 = floor["arms"]["bf16"], floor["arms"]["fp32"]
    assert bf16["weights_GB"] > f32["weights_GB"] / 2


def test_transplant_sweeps_add_bf16_traffic_only():
    saved = json.loads(SAVED.read_text())
    measures, copy = saved["projection"], saved["meta"]["copy_TB_s"]
    one = run_floor(measures, 200, 166 / 200, copy)
    sweeps = run_floor(measures, 200, 166 / 200, copy, transplant_specs=11)
    assert sweeps["arms"]["fp32"] == one["arms"]["fp32"]
    assert sweeps["arms"]["bf16"]["weights_GB"] > one["arms"]["bf16"]["weights_GB"]
    assert sweeps["arms"]["bf16"]["kv_GB"] > one["arms"]["bf16"]["kv_GB"]
    assert sweeps["floor_s"] > one["floor_s"]
