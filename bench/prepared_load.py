"""Per-job model load: the run's GGUF source against its prepared snapshot, in one run.

Writes a random-weight GGUF file of a real shape (stagereplay.testing's writer and shapes; Qwen2-0.5B by default: 24
layers, hidden 896, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings) quantised as a Q4 mix (Q4_K blocks where a row is a multiple of 256
values, Q4_0 elsewhere, norms and biases F32) with a byte-level BPE tokenizer of the real size (151,643 tokens,
merges included), then times, each in a fresh process as a job is:

- ``source``: ``load_model`` of the GGUF file (what every model-loading job did before);
- ``prepare``: ``prepare_snapshot`` once (load the source, write the snapshot, load it back and prove it equal);
- ``snapshot``: ``load_prepared`` of the snapshot (what every job does now);
- ``preflight``: the preflight's model check of the GGUF source (config and tokenizer, no weights);
- for a local safetensors folder already in the precision's dtype (the snapshot itself, as a source): preparing
  it as links against converting it (a copy of the weights that loads the same).

Load times are the ``load_model``/``load_prepared`` call inside the process (the imports are reported apart);
every file is in the page cache (warm), so the snapshot's load is bounded by memory, not the disk. As in the
workflow, preparing records the snapshot's file digests in a digest cache, so a job checks the files by ``stat``.

    python bench/prepared_load.py --work /tmp/prep_bench            # 0.5B shape, bf16, 2 repeats
    python bench/prepared_load.py --work /tmp/prep_bench --precision fp32 --repeats 3

``--parts`` times only the snapshot's load, split into its parts (each a fresh process: the file check, the
config, importing the model's and the tokenizer's transformers code, ``from_pretrained``, the weights check, the
tokenizer, ``.to(device)`` and eval mode, and the rest), keeping a snapshot already prepared in ``--work``.
``--src NAME=PATH`` (repeatable) loads it with the package from another source tree as well, the trees'
processes interleaved, so that two versions of the code are compared in one run under the same load:

    git archive HEAD src | tar -x -C /tmp/old                       # the committed code, to compare against
    python bench/prepared_load.py --work /tmp/prep_bench --parts --repeats 3 --src old=/tmp/old/src --src new=src
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stagereplay.testing.gguf import byte_level_vocabulary, write_gguf
from stagereplay.testing.shapes import SHAPES

REPO = Path(__file__).resolve().parents[1]


def write_q4_mix(path: Path, shape: str | dict) -> None:
    """A random-weight GGUF of ``shape`` (a name in SHAPES, or such a dict) as this script describes it: a Q4 mix,
    tied embeddings, a byte-level BPE vocabulary of the shape's size (Qwen2's 151,643 regular tokens where it fits)."""
    size = (SHAPES[shape] if isinstance(shape, str) else shape)["vocab_size"]
    write_gguf(path, shape, vocabulary=byte_level_vocabulary(size), tied=True, quant="Q4_K", fallback="Q4_0")


# One measurement in a fresh process, as a job: the imports, then the timed call; prints one JSON line.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource
from stagereplay.models import snapshot
from stagereplay.stages.preflight import check_model
from stagereplay.io.file_hashes import HashCache
set_determinism(THREADS)
imported = time.perf_counter() - t0
what, precision, folder, gguf_file, out, hashes = sys.argv[1:7]
cache = HashCache(hashes)  # as in the workflow: preparing leaves the snapshot's digests, a job then stats its files
source = ModelSource("gguf", folder, gguf_file=gguf_file) if gguf_file != "-" else ModelSource("local", folder)
t0 = time.perf_counter()
if what == "source":
    load_model(source, precision, "cpu", "sdpa")
elif what == "snapshot":
    snapshot.load_prepared(out, source, precision, "cpu", "sdpa", cache=cache)
elif what in ("prepare", "link", "convert"):
    snapshot.prepare_snapshot(source, precision, out, mode="convert" if what == "convert" else "auto", cache=cache)
elif what == "preflight":
    check_model(source)
parts = {}
if what == "snapshot":  # its parts, again: the file check and the tokenizer alone
    t1 = time.perf_counter()
    manifest = snapshot.read_manifest(out)
    snapshot.check_snapshot(out, manifest, source, precision, None, cache)
    parts["check_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    loader = snapshot._tokenizer_loader(manifest)
    if loader:
        loader(out)
    else:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(out)
    parts["tokenizer_s"] = time.perf_counter() - t1
print(json.dumps({"what": what, "seconds": time.perf_counter() - t0 - sum(parts.values()), "imports": imported,
                  **parts}))
"""


# ``--parts``: one ``load_prepared`` of the snapshot in a fresh process, the time of each part taken by wrapping the
# functions it calls (so that the code timed is the code a job runs); the transformers modules the model class and
# the tokenizer class live in are imported first, timed apart (a job imports them inside its load).
PARTS_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import transformers
from stagereplay.models import loading, signatures, snapshot
from stagereplay.models.loading import set_determinism
from stagereplay.models.sources import ModelSource
from stagereplay.io.file_hashes import HashCache
set_determinism(THREADS)
imported = time.perf_counter() - t0
precision, folder, gguf_file, out, hashes, device = sys.argv[1:7]
cache = HashCache(hashes)
source = ModelSource("gguf", folder, gguf_file=gguf_file)
parts = {}

active = []

def timed(name, fn):
    def wrapper(*args, **kwargs):
        if active:  # called inside another part (from_pretrained calls eval): counted there
            return fn(*args, **kwargs)
        active.append(name)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            active.pop()
    return wrapper

t = time.perf_counter()
manifest = snapshot.read_manifest(out)
config = transformers.AutoConfig.from_pretrained(out)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports modeling_<type> (and modeling_utils, generation, losses)
getattr(transformers, manifest.get("tokenizer_class") or "AutoTokenizer")
parts["imports_model_tokenizer_code"] = time.perf_counter() - t
snapshot.check_snapshot = timed("check_snapshot", snapshot.check_snapshot)
loading.checked_config = timed("config", loading.checked_config)
loading.check_weights_match_config = timed("check_weights", loading.check_weights_match_config)
loading.checked_tokenizer = timed("tokenizer", loading.checked_tokenizer)
auto = transformers.AutoModelForCausalLM
auto.from_pretrained = timed("from_pretrained", auto.from_pretrained)
torch.nn.Module.to = timed("to_device", torch.nn.Module.to)
torch.nn.Module.eval = timed("eval", torch.nn.Module.eval)
t = time.perf_counter()
loaded = snapshot.load_prepared(out, source, precision, device, "sdpa", cache=cache)
total = time.perf_counter() - t
parts["rest"] = total - sum(v for k, v in parts.items() if k != "imports_model_tokenizer_code")
probe = loaded.tokenizer(signatures.PROBE_TEXTS[0])["input_ids"]
print(json.dumps({"load_prepared": total, "imports": imported, **parts, "probe": probe,
                  "dtype": str(next(loaded.model.parameters()).dtype), "training": loaded.model.training}))
"""


def parts_child(src: Path, precision: str, folder: Path, gguf_file: str, out: Path, threads: int,
                device: str) -> dict:
    path = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, TQDM_DISABLE="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PARTS_CHILD.replace("THREADS", str(threads)), precision,
                           str(folder), gguf_file, str(out), str(out.parent / "file_hashes.json"), device],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"parts ({src}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - started
    return result


def run_parts(args, gguf_name: str, snap: Path) -> int:
    """Time the snapshot's load in parts, for each source tree of ``--src``, interleaved."""
    import transformers
    import torch

    if not (snap / "stagereplay_snapshot.json").exists():
        child("prepare", args.precision, args.work, gguf_name, snap, args.threads)
    trees = dict(item.split("=", 1) for item in args.src) if args.src else {"current": str(REPO / "src")}
    results = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, src in trees.items():
            result = parts_child(Path(src).resolve(), args.precision, args.work, gguf_name, snap, args.threads,
                                 args.device)
            print(json.dumps({"src": name, **{k: (round(v, 3) if isinstance(v, float) else v)
                                               for k, v in result.items() if k != "probe"}}), flush=True)
            results[name].append(result)
    keys = [k for k in results[next(iter(trees))][0] if isinstance(results[next(iter(trees))][0][k], float)]
    table = {name: {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
             for name, runs in results.items()}
    probes = {name: [r["probe"] for r in runs] for name, runs in results.items()}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}, load on "
                  f"{args.device}",
        "load_average": os.getloadavg(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "shape": args.shape, "precision": args.precision, "repeats": args.repeats,
        "median_s": table,
        "same_probe_ids": len({json.dumps(p) for runs in probes.values() for p in runs}) == 1,
        "dtypes": sorted({r["dtype"] for runs in results.values() for r in runs}),
        "eval_mode": not any(r["training"] for runs in results.values() for r in runs),
    }
    print(json.dumps(report, indent=1))
    return 0


def child(what: str, precision: str, folder: Path, gguf_file: str, out: Path, threads: int) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, TQDM_DISABLE="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("THREADS", str(threads)), what, precision,
                           str(folder), gguf_file, str(out), str(out.parent / "file_hashes.json")],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - started
    print(json.dumps(result), flush=True)
    return result


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the GGUF file and the snapshots")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--precision", choices=["bf16", "fp32", "fp16"], default="bf16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each job (config threads)")
    parser.add_argument("--parts", action="store_true",
                        help="time only the snapshot's load, in parts (keeps a snapshot already in --work)")
    parser.add_argument("--src", action="append", default=[], metavar="NAME=PATH",
                        help="with --parts: a source tree (its src/ folder) to load with; repeat to compare")
    parser.add_argument("--device", default="cpu", help="with --parts: the device to load onto")
    args = parser.parse_args()
    import transformers
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    gguf_name = f"random-{args.shape}-q4mix.gguf"
    gguf_path = args.work / gguf_name
    if not gguf_path.exists():
        started = time.perf_counter()
        write_q4_mix(gguf_path, args.shape)
        print(f"wrote {gguf_path} ({gguf_path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s")
    snap = args.work / f"snapshot-{args.shape}-{args.precision}"
    if args.parts:
        return run_parts(args, gguf_name, snap)
    shutil.rmtree(snap, ignore_errors=True)
    run = lambda what, folder=args.work, name=gguf_name, out=snap: child(  # noqa: E731
        what, args.precision, folder, name, out, args.threads)

    results = {"prepare": run("prepare")}
    results["source"], results["snapshot"] = [], []
    for _ in range(args.repeats):  # interleaved, so that load from other processes falls on both
        results["source"].append(run("source"))
        results["snapshot"].append(run("snapshot"))
    results["preflight"] = run("preflight")
    # A local folder already in the dtype: link (what prepare does) against a converted copy.
    linked, copied = args.work / "as-links", args.work / "as-copy"
    for folder in (linked, copied):
        shutil.rmtree(folder, ignore_errors=True)
    results["link"] = run("link", snap, "-", linked)
    results["convert"] = run("convert", snap, "-", copied)
    results["local_source"] = run("source", snap, "-")
    results["local_linked"] = run("snapshot", snap, "-", linked)

    median = lambda key: statistics.median(r["seconds"] for r in results[key])  # noqa: E731
    source_s, snapshot_s = median("source"), median("snapshot")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}",
        "load_average": os.getloadavg(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "shape": args.shape, "precision": args.precision, "gguf_mb": round(gguf_path.stat().st_size / 1e6),
        "snapshot_mb": round(folder_bytes(snap) / 1e6),
        "source_load_s": [round(r["seconds"], 2) for r in results["source"]],
        "snapshot_load_s": [round(r["seconds"], 2) for r in results["snapshot"]],
        "snapshot_parts_s": [{k: round(r[k], 2) for k in ("check_s", "tokenizer_s")} for r in results["snapshot"]],
        "source_over_snapshot": round(source_s / snapshot_s, 1),
        "imports_s": round(statistics.median(r["imports"] for r in results["source"] + results["snapshot"]), 2),
        "prepare_s": round(results["prepare"]["seconds"], 2),
        "preflight_s": round(results["preflight"]["seconds"], 2),
        "local_in_dtype": {"link_s": round(results["link"]["seconds"], 3),
                           "convert_s": round(results["convert"]["seconds"], 2),
                           "convert_mb_written": round(folder_bytes(copied) / 1e6),
                           "load_source_s": round(results["local_source"]["seconds"], 2),
                           "load_links_s": round(results["local_linked"]["seconds"], 2)},
    }
    print(json.dumps(report, indent=1))
    print(f"per-job load, {args.shape} shape at {args.precision}: GGUF source {source_s:.1f} s, prepared snapshot "
          f"{snapshot_s:.2f} s: {source_s / snapshot_s:.1f}x (median of {args.repeats}; preparing once "
          f"{results['prepare']['seconds']:.1f} s; imports {report['imports_s']} s per process apart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
