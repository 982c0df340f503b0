#!/usr/bin/env bash
# One-host multi-GPU demo: the workflow with shards: 2 and device: auto on a machine with 2 GPUs, run as
#   snakemake --cores 2 --resources gpu=2
# Each generation job claims a GPU of its own (stagereplay.models.gpus); the script prints which GPU each job used,
# read from the provenance of its ledger part, and whether the two jobs overlapped in time.
#
# The model is a RANDOM-WEIGHT Qwen2.5-1.5B-shaped Qwen2ForCausalLM built here (scripts/make_random_qwen.py): no
# network, no download; its outputs mean nothing. Needs python with torch (CUDA build), transformers, snakemake>=8,
# pandas, pyarrow, tqdm, safetensors, pyyaml, jsonschema (`pip install -e .` in the repository installs them); the
# package itself is taken from this checkout (PYTHONPATH=src), so it need not be installed.
#
#   bash scripts/multigpu_demo.sh [WORKDIR]          # default WORKDIR: a fresh temp folder
#   SHAPE=tiny bash scripts/multigpu_demo.sh         # a 2-layer model instead: a smoke test that also runs on CPU
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHAPE="${SHAPE:-qwen2.5-1.5b}"
WORK="${1:-$(mktemp -d "${TMPDIR:-/tmp}/stagereplay-multigpu.XXXXXX")}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export STAGEREPLAY_GPU_LOCK_DIR="$WORK/gpu-locks"   # the two jobs share this folder of per-GPU locks
export HF_HUB_OFFLINE=1
PY="${PYTHON:-python}"

"$PY" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "snakemake", "pandas", "pyarrow", "tqdm", "safetensors", "yaml",
                       "jsonschema") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)}; install them (pip install -e . in the repository "
             f"installs all of them, snakemake included), then rerun")
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = [torch.cuda.get_device_name(i) for i in range(n)]
print(f"torch {torch.__version__}; {n} visible GPU(s): {names}")
EOF

echo "== building a RANDOM-WEIGHT $SHAPE-shaped model in $WORK/model"
"$PY" "$REPO/scripts/make_random_qwen.py" "$WORK/model" --shape "$SHAPE"

cat > "$WORK/config.yaml" <<EOF
# multi-GPU demo on a random-weight $SHAPE-shaped model (outputs mean nothing)
run: multigpu-demo
n_items: 8
seed: 0
dataset: {source: synthetic, size: 100, seed: 0}
model: $WORK/model
revisions: [local]
precisions: [bf16]
# random weights almost only emit filler tokens "~N": the boundary is the 16th of them
boundary: {marker: "~", occurrence: 16}
max_stage_tokens: 64
max_new_tokens: 32
shards: 2
threads: 1
device: auto
attn_implementation: sdpa
gpus_per_job: 1
mem_mb_per_job: 16000
runtime_per_job: 30
EOF

echo "== snakemake --cores 2 --resources gpu=2 (shards: 2, device: auto)"
"$PY" -m snakemake -s "$REPO/Snakefile" --directory "$WORK" --configfile "$WORK/config.yaml" \
    --cores 2 --resources gpu=2 --printshellcmds results/multigpu-demo/local/ledger.parquet

echo "== which GPU each job used (from the provenance of its ledger part)"
"$PY" - "$WORK" <<'EOF'
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from stagereplay.io.parquet import read_provenance

work = Path(sys.argv[1])
res = work / "results/multigpu-demo/local"
jobs = []
for shard in (0, 1):
    part = res / f"parts/matched_bf16_{shard}.parquet"
    prov = read_provenance(part)
    slot = prov["gpu_slot"]
    seconds = float(pd.read_csv(work / f"benchmarks/multigpu-demo/local/reconstruct_prefixes_bf16_{shard}.tsv",
                                sep="\t")["s"].iloc[0])
    end = part.stat().st_mtime
    ledger = pd.read_parquet(part)
    jobs.append((shard, slot, prov["device"], end - seconds, end))
    when = lambda t: datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S")
    print(f"shard {shard}: {slot['device']:7s} GPU {slot['gpu']} of visible {slot['visible']} ({prov['device']}), "
          f"claimed={slot['claimed']}, host {slot['host']}; {ledger['item_index'].nunique()} items, "
          f"{len(ledger)} ledger rows, statuses { {k: int(v) for k, v in ledger['status'].value_counts().items()} }; "
          f"ran {when(end - seconds)}-{when(end)} UTC ({seconds:.1f} s)")
print("model: RANDOM weights,", (work / "model/RANDOM_WEIGHTS.json").read_text().split('"shape": ')[1].split(",")[0])
visible = len(jobs[0][1]["visible"])
if visible < 2:
    print(f"only {visible} GPU visible: nothing to allocate (each job ran on {jobs[0][2]})")
    sys.exit(0)
gpus = {j[1]["gpu"] for j in jobs}
overlap = min(j[4] for j in jobs) - max(j[3] for j in jobs)
print(f"distinct GPUs: {len(gpus) == 2} ({sorted(gpus)}); jobs overlapped in time by {max(overlap, 0):.1f} s")
if len(gpus) != 2 or not all(j[1]["claimed"] for j in jobs):
    sys.exit("FAIL: the two jobs did not each claim a GPU of their own")
print("OK: each running job had a GPU of its own")
EOF
