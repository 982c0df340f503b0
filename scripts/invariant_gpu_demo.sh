#!/usr/bin/env bash
# The invariant numerics regime through the whole pipeline on a GPU, against the default regime, same model:
# two runs of every stage (matched experiment, fixed-prefix 2x2, bridge, audit, dumps, transplants, report), one
# with `numerics: default` and one with `numerics: invariant` (Triton kernels on CUDA), side by side on one GPU.
#
# The model is a RANDOM-WEIGHT Qwen2.5-shaped Qwen2ForCausalLM built here (scripts/make_random_qwen.py): no
# network, no download; its outputs mean nothing, and its greedy margins are tiny, so under the default regime
# nearly every bf16 suffix splits between live and prefill. Needs what scripts/multigpu_demo.sh needs, plus triton.
#
#   bash scripts/invariant_gpu_demo.sh [WORKDIR]            # default WORKDIR: a fresh temp folder
#   SHAPE=tiny N_ITEMS=4 DEVICE=cpu bash scripts/invariant_gpu_demo.sh  # a 2-layer smoke test, reference kernels
#   BATCH_SIZE=8 DECODE_REGIME=cuda_graph bash scripts/invariant_gpu_demo.sh  # batched, CUDA graphs: the
#                                          # batch-invariance control of both regimes, every batched stage on a GPU
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHAPE="${SHAPE:-qwen2.5-0.5b}"
N_ITEMS="${N_ITEMS:-16}"
DEVICE="${DEVICE:-cuda}"
BATCH_SIZE="${BATCH_SIZE:-1}"
DECODE_REGIME="${DECODE_REGIME:-eager}"
WORK="${1:-$(mktemp -d "${TMPDIR:-/tmp}/stagereplay-invariant.XXXXXX")}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
PY="${PYTHON:-python}"

echo "== building a RANDOM-WEIGHT $SHAPE-shaped model in $WORK/model"
"$PY" "$REPO/scripts/make_random_qwen.py" "$WORK/model" --shape "$SHAPE"

for numerics in default invariant; do
  mkdir -p "$WORK/$numerics"
  cat > "$WORK/$numerics/config.yaml" <<CFG
# numerics: $numerics on a random-weight $SHAPE-shaped model (outputs mean nothing)
run: $numerics
n_items: $N_ITEMS
seed: 0
dataset: {source: synthetic, size: 100, seed: 0}
model: $WORK/model
revisions: [local]
precisions: [bf16, fp32]
reference_precision: bf16
bridge: {n_rows: 8, seed: 0}
# random weights almost only emit filler tokens "~N": the boundary is the 16th of them
boundary: {marker: "~", occurrence: 16}
max_stage_tokens: 64
max_new_tokens: 32
shards: 1
threads: 1
device: $DEVICE
attn_implementation: sdpa
numerics: $numerics
batch_size: $BATCH_SIZE
decode_regime: $DECODE_REGIME
batch_invariance: {sample: 8, seed: 0}
cache_differences: {n_items: 8, precisions: [bf16, fp32], prefix_precision: null}
CFG
done

echo "== snakemake, numerics default and invariant side by side"
pids=()
for numerics in default invariant; do
  STAGEREPLAY_GPU_LOCK_DIR="$WORK/$numerics/gpu-locks" "$PY" -m snakemake -s "$REPO/Snakefile" \
      --directory "$WORK/$numerics" --configfile "$WORK/$numerics/config.yaml" --cores 4 \
      > "$WORK/$numerics/snakemake.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for numerics in default invariant; do
  echo "== $numerics: last lines of the log"; tail -n 3 "$WORK/$numerics/snakemake.log"
done
[ "$status" = 0 ] || { echo "FAIL: a run failed; logs in $WORK/*/snakemake.log"; exit 1; }

"$PY" - "$WORK" <<'PYEOF'
import sys
from pathlib import Path

import pandas as pd

from stagereplay.io.parquet import read_provenance

work = Path(sys.argv[1])
print("model: RANDOM weights,", (work / "model/RANDOM_WEIGHTS.json").read_text().split('"shape": ')[1].split(",")[0])
for numerics in ("default", "invariant"):
    res = work / numerics / "results" / numerics / "local"
    prov = read_provenance(res / "ledger.parquet")
    parts = [prov, *prov.get("parts", [])]
    regime = next((p["numerics_regime"] for p in parts if "numerics_regime" in p), {})
    device = next((p["device"] for p in parts if "device" in p), "?")
    print(f"\n## numerics {numerics}: {regime} on {device}")
    report = (work / numerics / "results" / numerics / "report" / "report.md").read_text().splitlines()
    keep = ("| bf16 |", "| fp32 |", "| rows bit-exact", "| continuations", "| contrast", "| ledger rows", "| | ")
    for line in report:
        if line.startswith(("#### Claim", "### Batch invariance")) or line.startswith(keep):
            print(line)
PYEOF
