#!/usr/bin/env bash
# llama.cpp beside this pipeline's own constructions on one GPU, with no network on the GPU machine.
#
# A RANDOM-WEIGHT Qwen2.5-0.5B-shaped GGUF (stagereplay.testing: the prompts' characters, then filler tokens; its
# outputs mean nothing) is run by the workflow with engines: [llama_cpp] on N_ITEMS (default 64; at least MIN_ITEMS,
# default 48, must reach the boundary): the pipeline's matched experiment and fixed-prefix constructions (incremental,
# prefill, prefix_cached) at bf16 and fp32; llama.cpp at KV_TYPES (default f16 and f32) on every layer offloaded, over
# its own stage (live: its greedy generation to the boundary; incremental, prefill, prompt_cache, chunked rebuilding
# it from its ids) and over the pipeline's stage ids (incremental, the reference there, and the same three); both
# audits. Then it prints the report's engine section: llama.cpp's own stage against the pipeline's, the split counts
# with Wilson intervals, and the cross-table of llama.cpp's and the pipeline's prefill splits with both marginals, the
# count expected under independence, the odds ratio and Fisher's exact p. OUT=folder (the device's $OUT) also gets
# the section (engine_section.md), its numbers (engine_numbers.json), the config, the logs and the engine's Parquet.
#
# Three steps; each skips what an earlier call left done, so they may run as separate commands on a warm machine:
#   bash scripts/engine_gpu.sh pack    # HERE, with network: the sdist trimmed to 8 MiB (what the build reads:
#                                      # CPU and CUDA) and the build's own packages, into .whl/ (git-ignored: carry it)
#   bash scripts/engine_gpu.sh build   # ON THE GPU: llama-cpp-python built with CUDA from .whl/, installed
#   bash scripts/engine_gpu.sh run     # ON THE GPU: the workflow and the tables (WORK=... to keep its folder,
#                                      # OUT=... for the tables' files, N_ITEMS=48, KV_TYPES="f16",
#                                      # ENGINE_SHARDS=K GPU_SLOTS=K CORES=4K: K engine jobs side by side on
#                                      # the GPU, each with its own llama.cpp context (THREADS=4 each): on one
#                                      # GPU slower than one job, docs/ENGINES.md "Shards and GPUs")
#                                      # PRECISIONS="bf16": the pipeline at bf16 only (no fp32 cross-table)
#   bash scripts/engine_gpu.sh shards  # ON THE GPU: the engine's replay and audit at 1 shard, at SHARDS_MANY
#                                      # (default 4) side by side and at 1 shard of SHARDS_MANY contexts, on the
#                                      # same pipeline outputs: tables compared byte for byte, times as ratios
#                                      # (PARTS="pipeline", "1", "K", "C", "compare")
#   BACKEND=cpu bash scripts/engine_gpu.sh build          # the build step without CUDA (a check on a CPU)
#   SHAPE=tiny DEVICE=cpu bash scripts/engine_gpu.sh run   # a CPU smoke test of the run step (2-layer model)
# Needs on the GPU machine: torch with CUDA, this package's dependencies and gguf (pip install -e ".[gguf]"), nvcc
# and cmake >= 3.21. CUDA_ARCH (default 90, the H200's) limits the CUDA build to one architecture (minutes, not
# tens of minutes).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEP="${1:?give a step: pack, build or run}"
CARRY="${CARRY:-$REPO/.whl}"  # CARRY=... for another folder (a carry has a size limit)
TARGET="${INSTALL_TARGET:+--target $INSTALL_TARGET}"  # INSTALL_TARGET=... where site-packages is read-only
SDIST_NAME="llama_cpp_python-0.3.36.tar.gz"
PY="${PYTHON:-python}"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"

pack() {
    mkdir -p "$CARRY"
    if [ ! -f "$CARRY/$SDIST_NAME" ]; then
        local tmp
        tmp="$(mktemp -d)"
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" llama-cpp-python==0.3.36
        tar xzf "$tmp/$SDIST_NAME" -C "$tmp"
        # read by no step of this build: vocabulary test files, documentation, tests, benches, media, the server's
        # web UI and the ggml backends other than CPU and CUDA (the .git folder stays: llama.cpp's commit comes from it)
        local vendor="$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp
        rm -rf "$vendor"/models/ggml-vocab-* "$vendor"/docs "$vendor"/tests "$vendor"/benches "$vendor"/media \
            "$vendor"/tools/ui "$vendor"/ggml/src/ggml-{vulkan,sycl,opencl,hexagon,openvino,webgpu,et,metal}
        # llama.cpp's git folder keeps its commit and trees but not the files' contents (a 38 MiB pack, 0.1 MiB
        # after): the build asks git for the short commit, the commit count and whether the files differ from
        # the commit, and each answer is the same as with the whole pack (0c1e570, 1, differ: "0c1e570-dirty")
        local gitdir="$tmp"/llama_cpp_python-0.3.36/.git/modules/vendor/llama.cpp before after
        before="$(git -C "$vendor" rev-parse --short HEAD) $(git -C "$vendor" rev-list --count HEAD)"
        before="$before $(git -C "$vendor" diff-index --quiet HEAD -- . && echo same || echo differ)"
        git -C "$vendor" rev-list --objects --filter=blob:none HEAD | cut -d' ' -f1 \
            | git -C "$vendor" pack-objects -q "$tmp/trees" >/dev/null
        rm -f "$gitdir"/objects/pack/*
        mv "$tmp"/trees-*.pack "$tmp"/trees-*.idx "$gitdir"/objects/pack/
        after="$(git -C "$vendor" rev-parse --short HEAD) $(git -C "$vendor" rev-list --count HEAD)"
        after="$after $(git -C "$vendor" diff-index --quiet HEAD -- . && echo same || echo differ)"
        [ "$before" = "$after" ] || { echo "git answers differ after the repack: $before / $after" >&2; exit 1; }
        tar czf "$CARRY/$SDIST_NAME" -C "$tmp" llama_cpp_python-0.3.36
        rm -rf "$tmp"
    fi
    # the build backend and the binding's one dependency a torch environment lacks: installed offline on the GPU
    "$PY" -m pip download -q --no-deps -d "$CARRY" "scikit-build-core>=0.9.2" pathspec diskcache
    du -sh "$CARRY"
    echo "carry $CARRY to the GPU machine"
}

build() {
    # --exclude-libs,ALL: without it, the CUDA 13.0 build exported C++ library code from libggml-cuda, and a process that
    # had loaded pyarrow, pandas or torch crashed in llama_model_load_from_file (seen on the H200 image, 2026-12-03)
    local flags="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_CUDA_FA=${CUDA_FA:-OFF}"
    flags="$flags -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
    if [ "${BACKEND:-cuda}" = cpu ]; then
        flags=""  # BACKEND=cpu: the same offline build without CUDA, to check the step on a machine without a GPU
    elif "$PY" -c "import pyarrow, torch, llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())" \
            2>/dev/null; then  # a build that crashes beside pyarrow and torch is built again
        echo "llama-cpp-python with GPU offload is installed already, and loads beside pyarrow and torch"
        return
    fi
    [ -f "$CARRY/$SDIST_NAME" ] || { echo "no $CARRY/$SDIST_NAME: run 'bash scripts/engine_gpu.sh pack' where the" \
        "package index is reachable and carry .whl/" >&2; exit 1; }
    if [ -n "$flags" ] && ! command -v nvcc >/dev/null; then
        echo "nvcc is not on PATH: the CUDA build needs the CUDA toolkit" >&2
        exit 1
    fi
    "$PY" -m pip install -q $TARGET --no-deps --no-index --find-links "$CARRY" scikit-build-core pathspec diskcache
    # a fixed source folder and a kept build folder: a build stopped part way (a 10-minute limit) resumes when
    # called again instead of starting over
    local src="$REPO/build/llama-src/llama_cpp_python-0.3.36" start end
    [ -d "$src" ] || { mkdir -p "$REPO/build/llama-src" && tar xzf "$CARRY/$SDIST_NAME" -C "$REPO/build/llama-src"; }
    start=$(date +%s)
    # flash attention's CUDA kernels are most of the compile time, and the engine runs with flash_attn off:
    # CUDA_FA=ON builds them too
    CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$PY" -m pip wheel -q --no-deps --no-build-isolation -C build-dir="$REPO/build/llama-cuda" \
        -w "$REPO/build/llama-wheel" "$src"
    end=$(date +%s)
    echo "build of llama-cpp-python: $((end - start)) s on $(nproc) cores (CMAKE_ARGS: ${flags:-none})"
    "$PY" -m pip install -q $TARGET --no-deps --force-reinstall "$REPO"/build/llama-wheel/llama_cpp_python-0.3.36-*.whl
    "$PY" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    # the engine shares its process with pyarrow and torch: a build whose libraries clash with theirs fails here
    "$PY" -c "import pyarrow, torch, llama_cpp; print('llama.cpp loads beside pyarrow and torch')"
}

prepare() {
    # the model and the config, in $work (global: run and shards read work and gpus); ENGINE_SHARDS=K sets the shards
    work="${WORK:-$REPO/build/engine-gpu}" shape="${SHAPE:-qwen2.5-0.5b}" device="${DEVICE:-cuda}"
    offload=-1 regime=cuda_graph gpus=1
    if [ "$device" = cpu ]; then offload=0 regime=static gpus=0; fi
    mkdir -p "$work"
    if [ "$device" != cpu ]; then
        "$PY" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 'llama-cpp-python is not built with CUDA here: bash scripts/engine_gpu.sh build')"
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    fi
    if [ ! -f "$work/model.gguf" ]; then
        echo "== writing a RANDOM-WEIGHT $shape-shaped GGUF (F16) to $work/model.gguf"
        # the filler vocabulary (stagereplay.testing): the prompts' characters, then fillers ~0, ~1, ..., which a
        # random model emits almost only, so the stage boundary is the 64th "~" and nearly every item reaches it (as
        # in the 48-item turnaround); a boundary token picked from a pilot may never appear in the pipeline's decode
        "$PY" - "$work/model.gguf" "$shape" <<'EOF'
import sys

from stagereplay.testing.gguf import filler_vocabulary, write_gguf
from stagereplay.testing.shapes import SHAPES

path, shape = sys.argv[1:]
vocabulary = filler_vocabulary(SHAPES[shape]["vocab_size"])
written = write_gguf(path, shape, vocabulary=vocabulary, tied=False, quant="F16", seed=0)
print(f"{written.parameters:,} parameters, {sum(t.startswith('~') for t in vocabulary.tokens):,} filler tokens, "
      f"{written.tensor_types}")
EOF
    fi
    echo "== boundary: the 64th filler (marker ~)"
    cat > "$work/config.yaml" <<EOF
# llama.cpp beside the pipeline, on a random-weight qwen2.5-0.5b-shaped GGUF (outputs mean nothing)
run: engine-gpu
n_items: ${N_ITEMS:-64}
seed: 0
dataset: {source: synthetic, size: 1000, seed: 0}
model: $work/model.gguf
revisions: [random-0.5b]
precisions: [${PRECISIONS:-bf16, fp32}]
reference_precision: bf16
boundary: {marker: "~", occurrence: 64}
max_stage_tokens: 96
max_new_tokens: 32
stage_end: null
device: $device
threads: ${THREADS:-4}
gpus_per_job: $gpus
decode_regime: $regime
batch_size: 16
fixed_prefix: {constructions: [incremental, prefill, prefix_cached]}
engines: [llama_cpp]
llama_cpp: {n_gpu_layers: $offload, kv_types: [${KV_TYPES:-f16, f32}], stage_sources: [engine, reference],
            constructions: [live, incremental, prefill, prompt_cache, chunked], shards: ${ENGINE_SHARDS:-1},
            contexts: ${ENGINE_CONTEXTS:-1}}
EOF
}

run() {
    prepare
    local start end
    start=$(date +%s)
    # (--configfile and --resources take every word after them: the targets come first)
    "$PY" -m snakemake results/engine-gpu/random-0.5b/ledger.parquet results/engine-gpu/random-0.5b/audit_check.json \
        results/engine-gpu/random-0.5b/engine_llama_cpp_audit.parquet -s "$REPO/Snakefile" --directory "$work" \
        --configfile "$work/config.yaml" --cores "${CORES:-4}" --resources gpu="${GPU_SLOTS:-$gpus}"
    end=$(date +%s)
    echo "== workflow: $((end - start)) s"
    "$PY" - "$work/results/engine-gpu/random-0.5b" "${OUT:-}" "${MIN_ITEMS:-48}" <<'EOF'
import json
import sys
from pathlib import Path

from stagereplay.analysis.engine_report import engine_section
from stagereplay.catalogue import engine
from stagereplay.analysis.revision_data import RevisionData

folder, out, least = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
data = RevisionData("random-0.5b", {"ledger": str(folder / "ledger.parquet"),
                                    "engine_llama_cpp": str(folder / "engine_llama_cpp.parquet"),
                                    "engine_llama_cpp_audit": str(folder / "engine_llama_cpp_audit.parquet")})
lines, numbers = engine_section(data, engine("llama_cpp"))
print("\n".join(lines))
prefixes = data.ledger[(data.ledger["experiment"] == "matched") & (data.ledger["replica"] == 1)]
print("items per precision that reached the boundary (pipeline):",
      prefixes[prefixes["status"] == "ok"].groupby("precision")["item_index"].nunique().to_dict())
rows = data.frame("engine_llama_cpp")
own = rows[(rows["stage_source"] == "engine") & (rows["construction"] == "live") & (rows["status"] == "ok")]
print("items per KV type whose own llama.cpp stage reached the boundary:",
      own.groupby("precision")["item_index"].nunique().to_dict())
if out:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "engine_section.md").write_text("\n".join(lines) + "\n")
    (Path(out) / "engine_numbers.json").write_text(json.dumps(numbers, indent=1, default=str) + "\n")
replayed = rows.loc[rows["stage_source"] == "reference", "item_index"].nunique()
if replayed < least:
    sys.exit(f"only {replayed} items reached the boundary at the reference precision, fewer than {least}: rerun "
             "with a larger N_ITEMS in a fresh WORK folder")
EOF
    if [ -n "${OUT:-}" ]; then
        cp "$work/config.yaml" "$work"/results/engine-gpu/random-0.5b/engine_llama_cpp*.parquet "$OUT"/
        cp -r "$work/logs" "$OUT/logs" 2>/dev/null || true
        cp -r "$work/benchmarks" "$OUT/benchmarks" 2>/dev/null || true  # each rule's seconds
        echo "== the tables, their numbers, the config, the logs, the rules' timings and the engine's Parquet are in $OUT"
    fi
}

shards() {
    # the engine's replay and audit at 1 shard, then at K shards side by side (SHARDS_MANY, default 4; one model
    # each, THREADS cores each), then at 1 shard of K contexts on threads of one job, over the same pipeline outputs;
    # then every run's tables compared with the first's byte for byte and the stage's times as ratios. PARTS (default
    # "pipeline 1 K C compare") picks the parts this call runs; a part done by an earlier call on a warm machine is
    # skipped, so each fits one 10-minute call.
    local k="${SHARDS_MANY:-4}" threads="${THREADS:-4}" parts="${PARTS:-pipeline 1 K C compare}" part start end
    local rev=results/engine-gpu/random-0.5b n c name
    ENGINE_SHARDS=1 prepare
    for part in $parts; do
        case "$part" in
            pipeline)
                [ -f "$work/$rev/audit_check.json" ] && continue
                start=$(date +%s)
                "$PY" -m snakemake "$rev/ledger.parquet" "$rev/audit_check.json" -s "$REPO/Snakefile" \
                    --directory "$work" --configfile "$work/config.yaml" --cores "${CORES:-16}" --resources gpu=1
                echo "== the pipeline's part: $(( $(date +%s) - start )) s" ;;
            1|K|C)
                n=1 c=1 name=1
                [ "$part" = K ] && n=$k name=$k
                [ "$part" = C ] && c=$k name="contexts_$k"
                [ -f "$work/shards/$name/wall_ms" ] && continue
                ENGINE_SHARDS=$n ENGINE_CONTEXTS=$c prepare
                rm -rf "$work/$rev"/engine_llama_cpp*.parquet "$work/$rev"/parts/engine_llama_cpp* \
                    "$work"/benchmarks/engine-gpu/random-0.5b/*_engine_llama_cpp_*
                start=$(date +%s%N)
                "$PY" -m snakemake "$rev/engine_llama_cpp_audit.parquet" -s "$REPO/Snakefile" --directory "$work" \
                    --configfile "$work/config.yaml" --rerun-triggers mtime --cores $((threads * n)) \
                    --resources gpu="$n"
                end=$(date +%s%N)
                mkdir -p "$work/shards/$name"
                cp "$work/$rev"/engine_llama_cpp*.parquet \
                    "$work"/benchmarks/engine-gpu/random-0.5b/*_engine_llama_cpp_* "$work/shards/$name/"
                echo "$(( (end - start) / 1000000 ))" > "$work/shards/$name/wall_ms"
                echo "== the engine at $n shard(s) of $c context(s): $(cat "$work/shards/$name/wall_ms") ms" ;;
            compare)
                "$PY" - "$work/shards" <<'EOF'
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from stagereplay.testing.controls import first_margin_nudged, first_verdict_flipped

folder = Path(sys.argv[1])
one = folder / "1"
others = [d for d in sorted(folder.iterdir()) if d.is_dir() and d.name != "1" and (d / "wall_ms").exists()]


def words(d):
    return f"{d.name} shards side by side" if d.name.isdigit() else f"1 shard of {d.name.split('_')[1]} contexts"


for d in others:
    for name in ("engine_llama_cpp.parquet", "engine_llama_cpp_audit.parquet"):
        a, b = (pq.read_table(x / name).replace_schema_metadata(None) for x in (one, d))
        print(f"{name}: {a.num_rows} rows at 1 shard, {b.num_rows} at {words(d)}; identical: {a.equals(b)}")
        # the control: the first margin moved by one ulp (the rows), the first verdict flipped (the audit): each
        # must make the comparison fail
        column = "margins" if "margins" in b.column_names else "reproduced"
        nudged = first_margin_nudged(b) if column == "margins" else first_verdict_flipped(b)
        print(f"  control: {column} of the first row changed; identical: {a.equals(nudged)}")


def seconds(d, rule):
    return [float(pd.read_csv(f, sep="\t")["s"].iloc[0]) for f in sorted(d.glob(f"{rule}_*.tsv"))]


for d in others:
    print(f"\n| what | 1 shard, 1 context | {words(d)} | ratio |")
    print("| --- | --- | --- | --- |")
    for rule in ("replay_on_engine", "audit_engine"):
        a, b = seconds(one, rule), seconds(d, rule)
        print(f"| {rule}: longest job (s) | {max(a):.1f} | {max(b):.1f} (jobs {', '.join(f'{x:.1f}' for x in b)}) "
              f"| {max(a) / max(b):.2f}x |")
    wa, wb = (int((x / "wall_ms").read_text()) / 1000 for x in (one, d))
    print(f"| the engine's four rules, wall (s) | {wa:.1f} | {wb:.1f} | {wa / wb:.2f}x |")
EOF
                if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/shards" && cp -r "$work/shards/." "$OUT/shards/"; fi ;;
            *) echo "unknown part $part: give pipeline, 1, K, C or compare" >&2; exit 1 ;;
        esac
    done
}

case "$STEP" in
    pack) pack ;;
    build) build ;;
    run) run ;;
    shards) shards ;;
    *) echo "unknown step $STEP: give pack, build, run or shards" >&2; exit 1 ;;
esac
