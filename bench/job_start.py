"""What a job costs before it does its work: a model job's start, part by part, and each rule script's imports.

A model job (``reconstruct_prefixes``, ``audit_ledger``, ...) is a fresh Python process that imports its stage
module, sets the numerics flags, loads its revision's prepared snapshot (the transformers code of the model and the
tokenizer, the weights, the tokenizer), builds its decoder and steps it. This script times each part in fresh
processes, as CPU seconds (``time.process_time``, every thread of the process) and wall seconds, on a prepared
snapshot of the Qwen2-0.5B shape with **random weights** (from ``bench/prepared_load.py``; every number is a time,
never model quality):

- ``imports``: the stage module the rule script imports (``stagereplay.stages.reconstruct`` and its settings);
- ``determinism``: :func:`stagereplay.models.loading.set_determinism`;
- ``model_code``: importing the transformers code the load runs (config, the model class's module, the tokenizer
  class), timed apart from the load that would import it;
- ``weights``: ``load_prepared`` less its tokenizer (the file check, config, ``from_pretrained``, eval mode);
- ``tokenizer``: the snapshot's tokenizer, as ``load_prepared`` loads it;
- ``decoder``: ``decoder_from_record`` in the regime asked (``--regime``);
- ``prefill`` and ``first_step``: the decoder's ``open`` of one prompt and its first one-token ``step``;
- ``process``: the whole child process, interpreter start included (``getrusage`` of the child).

Then, each in a fresh process: the package imports of every rule script under workflow/scripts (the
``stagereplay`` modules it imports, read from the script), with the heavy packages each pulls in (torch,
transformers, scipy, matplotlib, ...); one ``python -X importtime`` run of the model job's start, its largest
imports and the chain that pulls in ``torch._dynamo``, ``torch.distributed.tensor``, sympy and scipy; and the
tokenizer's serialised forms (``Tokenizer.from_file``, ``from_str``, pickle) against the job's load, each checked
to give the same tokenizer (vocabulary, special tokens, the ids of probe texts).

``--src NAME=PATH`` (repeatable; the first is the baseline) runs every part with the package from another source
tree as well (each rule script's imports as the tree's own ``workflow/scripts`` beside its ``src`` has them), the
trees' processes interleaved so that load from elsewhere falls on both, and prints each part's ratio against the
first tree:

    git archive <commit> src workflow | tar -x -C /tmp/jobstart-base   # the code before, to compare against
    python bench/prepared_load.py --work /tmp/jobstart --parts --repeats 1   # once: the GGUF and its snapshot
    python bench/job_start.py --work /tmp/jobstart --src base=/tmp/jobstart-base/src --src new=src --repeats 3

Prints one JSON line per measurement and a JSON report last (``--out`` writes it to a file too).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "scipy", "matplotlib", "sympy", "torch._dynamo",
         "torch.distributed.tensor", "triton", "gguf")
PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Answer step by step.")

# A model job's start in a fresh process, part by part; prints one JSON line. The parts of ``load_prepared`` are
# taken by wrapping the tokenizer loader it calls (the code timed is the code a job runs).
MODEL_CHILD = r"""
import json, sys, time
clock = lambda: (time.process_time(), time.perf_counter())
parts = {}
def took(name, since):
    now = clock()
    parts[name] = {"cpu": now[0] - since[0], "wall": now[1] - since[1]}
    return now
folder, gguf_folder, gguf_file, regime, threads, hashes = sys.argv[1:7]
t = clock()
import stagereplay.stages.reconstruct, stagereplay.stages.settings  # what workflow/scripts/reconstruct_prefixes.py imports
t = took("imports", t)
from stagereplay.models.loading import set_determinism
set_determinism(int(threads))
t = took("determinism", t)
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from stagereplay.models import snapshot
from stagereplay.models.sources import ModelSource
manifest = snapshot.read_manifest(folder)
config = transformers.AutoConfig.from_pretrained(folder)
MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports modeling_<type> (and modeling_utils, masking_utils, ...)
getattr(transformers, manifest.get("tokenizer_class") or "AutoTokenizer")
t = took("model_code", t)
tokenizer_clock = {}
make_loader = snapshot._tokenizer_loader
def timed_loader(record):
    inner = make_loader(record)
    if inner is None:
        return None
    def load(path):
        since = clock()
        try:
            return inner(path)
        finally:
            now = clock()
            tokenizer_clock["cpu"], tokenizer_clock["wall"] = now[0] - since[0], now[1] - since[1]
    return load
snapshot._tokenizer_loader = timed_loader
source = ModelSource("gguf", gguf_folder, gguf_file=gguf_file) if gguf_file != "-" else ModelSource("local", gguf_folder)
from stagereplay.io.file_hashes import HashCache
cache = HashCache(hashes)  # as in the workflow: preparing left the snapshot's digests, the job stats its files
loaded = snapshot.load_prepared(folder, source, manifest["precision"], "cpu", "sdpa", cache=cache)
t = took("weights", t)
if tokenizer_clock:
    parts["tokenizer"] = dict(tokenizer_clock)
    parts["weights"] = {k: parts["weights"][k] - tokenizer_clock[k] for k in ("cpu", "wall")}
from stagereplay.decode.regimes import decoder_from_record
from stagereplay.models.loading import eos_token_ids
import torch
prompt = loaded.tokenizer(PROMPT)["input_ids"]
t = clock()
record = {"decode_regime": regime, "decode_max_len": len(prompt) + 64, "decode_max_rows": 1}
decoder = decoder_from_record(loaded.model, eos_token_ids(loaded), record)
t = took("decoder", t)
with torch.inference_mode():
    batch, logits = decoder.open([prompt])
    first = int(torch.argmax(logits[0]))
    t = took("prefill", t)
    logits = decoder.step(batch, [first])
    second = int(torch.argmax(logits[0]))
t = took("first_step", t)
print(json.dumps({"parts": parts, "modules": sorted(m for m in HEAVY if m in sys.modules), "prompt_tokens": len(prompt),
                  "ids": [first, second], "torch": torch.__version__, "transformers": transformers.__version__}))
"""

# The imports of one rule script's ``stagereplay`` modules in a fresh process; prints one JSON line.
IMPORT_CHILD = r"""
import importlib, json, sys, time
c, w = time.process_time(), time.perf_counter()
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"cpu": time.process_time() - c, "wall": time.perf_counter() - w,
                  "modules": sorted(m for m in HEAVY if m in sys.modules)}))
"""

# The tokenizer's forms, each timed in this (fresh) process and checked against the job's own load.
TOKENIZER_CHILD = r"""
import copy, json, pickle, sys, time
folder = sys.argv[1]
import transformers
from tokenizers import Tokenizer
from stagereplay.models import snapshot
try:
    from stagereplay.models import signatures
except ImportError:  # a tree from before the signatures had their own module
    signatures = snapshot
manifest = snapshot.read_manifest(folder)
cls = getattr(transformers, manifest.get("tokenizer_class") or "AutoTokenizer")
path = folder + "/tokenizer.json"
text = open(path, encoding="utf-8").read()
def timed(fn):
    c, w = time.process_time(), time.perf_counter()
    out = fn()
    return out, {"cpu": time.process_time() - c, "wall": time.perf_counter() - w}
times, pipelines = {}, {}
pipelines["from_file"], times["from_file"] = timed(lambda: Tokenizer.from_file(path))
pipelines["from_str"], times["from_str"] = timed(lambda: Tokenizer.from_str(text))
blob = pickle.dumps(pipelines["from_file"])
pipelines["pickle"], times["pickle"] = timed(lambda: pickle.loads(blob))
_, times["deepcopy"] = timed(lambda: copy.deepcopy(pipelines["from_file"]))  # what tokenizer_object costs again
loader = snapshot._tokenizer_loader(manifest)
job, times["job_load"] = timed(lambda: loader(folder) if loader else transformers.AutoTokenizer.from_pretrained(folder))
backend, times["backend_from_file"] = timed(lambda: transformers.TokenizersBackend.from_pretrained(folder))
probes = [*signatures.PROBE_TEXTS, PROMPT, "12 + 30 = 42\n\n<|im_start|>user\nnaïve café 😀<|im_end|>"]
ref = pipelines["from_file"]
def same_pipeline(p):
    return (p.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
            and p.to_str() == ref.to_str()
            and all(p.encode(t).ids == ref.encode(t).ids for t in probes))
exact = {name: same_pipeline(p) for name, p in pipelines.items()}
exact["job_pipeline"] = same_pipeline(job.backend_tokenizer)
job_signature = signatures.tokenizer_signature(job)
exact["backend_from_file_signature"] = signatures.tokenizer_signature(backend) == job_signature
print(json.dumps({"times": times, "exact": exact, "job_class": type(job).__name__, "vocab": len(job),
                  "merges_bytes": len(text)}))
"""


def run_child(code: str, src: Path, args: list[str], importtime: bool = False) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])),
               TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    header = f"HEAVY = {HEAVY!r}\nPROMPT = {PROMPT!r}\n"
    proc = subprocess.run([sys.executable, *(["-X", "importtime"] if importtime else []), "-c", header + code, *args],
                          capture_output=True, text=True, env=env, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({src}, {args}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = {"cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
                         "wall": time.perf_counter() - started}
    return result, proc.stderr


def script_modules(script: Path) -> list[str]:
    """The ``stagereplay`` modules a rule script imports (``from stagereplay.x import y``: ``stagereplay.x``)."""
    names = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagereplay"):
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("stagereplay")]
    return names


def importtime_rows(stderr: str) -> list[tuple[int, int, int, str]]:
    """(self us, cumulative us, depth, module) per line of ``-X importtime`` output, in its order (children first)."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, name = line[len("import time:"):].split("|")
        rows.append((int(own), int(cumulative), (len(name) - len(name.lstrip()) - 1) // 2, name.strip()))
    return rows


def import_chain(rows, target: str) -> list[str]:
    """Who imported ``target`` first: its parents up to the top level, with their cumulative seconds."""
    for i, (_, cumulative, depth, name) in enumerate(rows):
        if name != target:
            continue
        chain = [f"{name} ({cumulative / 1e6:.2f} s)"]
        for _, cum2, depth2, name2 in rows[i + 1:]:
            if depth2 < depth:
                chain.append(f"{name2} ({cum2 / 1e6:.2f} s)")
                depth = depth2
                if depth == 0:
                    break
        return chain
    return []


def median_parts(runs: list[dict]) -> dict:
    names = list(runs[0]["parts"]) + ["process"]
    out = {}
    for name in names:
        values = [r["parts"][name] if name != "process" else r["process"] for r in runs]
        out[name] = {k: round(statistics.median(v[k] for v in values), 3) for k in ("cpu", "wall")}
    start = [sum(v["cpu"] for k, v in r["parts"].items()) for r in runs]
    out["start_to_first_step"] = {"cpu": round(statistics.median(start), 3),
                                  "wall": round(statistics.median(sum(v["wall"] for v in r["parts"].values())
                                                                  for r in runs), 3)}
    return out


def command_line() -> argparse.ArgumentParser:
    """The options: the snapshot, the source trees to compare, the repeats and the parts to skip."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/jobstart"),
                        help="bench/prepared_load.py's --work: the GGUF file and its snapshot")
    parser.add_argument("--snapshot", type=Path, help="a prepared snapshot (default: WORK/snapshot-0.5B-bf16)")
    parser.add_argument("--src", action="append", default=[], metavar="NAME=PATH",
                        help="a source tree (its src/ folder) to run with; repeat to compare (the first is the baseline)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--regime", default="eager", choices=["eager", "static"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the config's threads)")
    parser.add_argument("--skip", action="append", default=[], choices=["model", "scripts", "importtime", "tokenizer"])
    parser.add_argument("--out", type=Path, help="also write the report here")
    return parser


def model_job_parts(trees: dict, child_args: list[str], repeats: int) -> dict:
    """A model job's start part by part, ``repeats`` times in each tree: the median of each part, each part's
    ratio against the first tree, and whether every run decoded the same two tokens."""
    base = next(iter(trees))
    runs = {name: [] for name in trees}
    for i in range(repeats):
        # the trees' order alternates between repeats: the second of two processes in a row was seen to be
        # slower whatever its tree (memory the first one frees, other processes on the cores)
        for name, src in (list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]):
            result, _ = run_child(MODEL_CHILD, src, child_args)
            print(json.dumps({"src": name, **{k: result[k] for k in ("parts", "process", "modules")}}),
                  flush=True)
            runs[name].append(result)
    report = {"versions": {"torch": runs[base][0]["torch"], "transformers": runs[base][0]["transformers"]}}
    report["prompt_tokens"] = runs[base][0]["prompt_tokens"]
    report["same_ids"] = len({json.dumps(r["ids"]) for rs in runs.values() for r in rs}) == 1
    table = {name: median_parts(rs) for name, rs in runs.items()}
    report["model_job_median"] = table
    report["model_job_ratio_cpu"] = {
        name: {part: round(v["cpu"] / table[base][part]["cpu"], 2) if table[base][part]["cpu"] > 0.005 else None
               for part, v in parts.items()} for name, parts in table.items() if name != base}
    return report


def import_times(trees: dict, child_args: list[str]) -> dict:
    """One ``-X importtime`` run of the model job's start in each tree: its top-level and largest imports, and
    the chains that pull in the heavy modules."""
    found = {}
    for name, src in trees.items():
        _, stderr = run_child(MODEL_CHILD, src, child_args, importtime=True)
        rows = importtime_rows(stderr)
        top = sorted(rows, key=lambda r: -r[1])
        found[name] = {
            "top_level": [f"{n} {c / 1e6:.2f} s" for _, c, d, n in top if d == 0][:12],
            "largest": [f"{'  ' * d}{n} {c / 1e6:.2f} s (self {s / 1e6:.2f})" for s, c, d, n in top[:40]],
            "chains": {t: import_chain(rows, t) for t in ("torch._dynamo", "torch.distributed.tensor", "sympy",
                                                         "scipy", "torch._inductor.config")},
        }
        print(json.dumps({"src": name, "importtime_top_level": found[name]["top_level"]}), flush=True)
    return found


def script_imports(trees: dict, repeats: int) -> dict:
    """Each rule script's package imports in a fresh process, in each tree: the median CPU seconds and the heavy
    packages they pull in (or the error of a module the tree does not have)."""
    scripts = sorted((REPO / "workflow" / "scripts").glob("*.py"))
    results = {name: {} for name in trees}
    for script in scripts:
        for name, src in trees.items():
            # a tree's own scripts where it has them beside its src/ (git archive <commit> src workflow)
            own = src.parent / "workflow" / "scripts" / script.name
            modules = script_modules(own if own.exists() else script)
            runs = []
            for _ in range(repeats):
                try:
                    runs.append(run_child(IMPORT_CHILD, src, modules)[0])
                except RuntimeError as exc:  # a module the tree does not have (a script newer than the tree)
                    runs = [{"error": str(exc).splitlines()[-1]}]
                    break
            if "error" in runs[0]:
                results[name][script.stem] = runs[0]
            else:
                results[name][script.stem] = {
                    "cpu": round(statistics.median(r["cpu"] for r in runs), 2),
                    "process_cpu": round(statistics.median(r["process"]["cpu"] for r in runs), 2),
                    "modules": runs[0]["modules"]}
            print(json.dumps({"src": name, "script": script.stem, "imports": modules,
                              **results[name][script.stem]}), flush=True)
    return results


def tokenizer_forms(src: Path, snap: Path, repeats: int) -> dict:
    """The tokenizer's serialised forms against the job's load, timed in ``src``'s package: median CPU seconds of
    each, and whether each gives the same tokenizer."""
    runs = [run_child(TOKENIZER_CHILD, src, [str(snap)])[0] for _ in range(repeats)]
    forms = {
        "cpu_s": {k: round(statistics.median(r["times"][k]["cpu"] for r in runs), 3) for k in runs[0]["times"]},
        "exact": runs[0]["exact"], "job_class": runs[0]["job_class"], "vocab": runs[0]["vocab"],
        "tokenizer_json_bytes": runs[0]["merges_bytes"]}
    print(json.dumps({"tokenizer_forms": forms}), flush=True)
    return forms


def main() -> int:
    args = command_line().parse_args()
    snap = args.snapshot or args.work / "snapshot-0.5B-bf16"
    if not (snap / "stagereplay_snapshot.json").exists():
        sys.exit(f"no prepared snapshot in {snap}: run python bench/prepared_load.py --work {args.work} --parts "
                 "--repeats 1 first (writes the random-weight GGUF file and prepares it)")
    manifest = json.loads((snap / "stagereplay_snapshot.json").read_text())
    source = Path(manifest["source"])
    gguf_args = [str(source.parent), source.name] if manifest.get("source_kind") == "gguf" else [str(source), "-"]
    hashes = snap.parent / "file_hashes.json"  # bench/prepared_load.py's digest cache, beside the snapshot
    child_args = [str(snap), *gguf_args, args.regime, str(args.threads), str(hashes)]  # MODEL_CHILD's argv
    trees = {name: Path(path).resolve() for name, path in (s.split("=", 1) for s in args.src)} \
        or {"current": REPO / "src"}
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}",
              "python": platform.python_version(), "snapshot": str(snap), "precision": manifest["precision"],
              "weights": "random (bench/prepared_load.py)", "regime": args.regime, "repeats": args.repeats,
              "trees": {k: str(v) for k, v in trees.items()},
              "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    if "model" not in args.skip:
        report.update(model_job_parts(trees, child_args, args.repeats))
    if "importtime" not in args.skip:
        report["importtime"] = import_times(trees, child_args)
    if "scripts" not in args.skip:
        report["script_imports"] = script_imports(trees, args.repeats)
    if "tokenizer" not in args.skip:
        report["tokenizer_forms"] = tokenizer_forms(trees[list(trees)[-1]], snap, args.repeats)
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]  # other processes on the cores
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
