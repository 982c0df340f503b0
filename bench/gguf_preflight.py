"""The preflight's model check of a GGUF source on a run's first run (no prepared snapshot yet): where its time goes,
and two versions of the code against each other on the same file, in one run.

Writes (once, into ``--work``) a random-weight GGUF with the real Qwen2 vocabulary (151,936 tokens: 151,643
byte-level BPE tokens with their merges, the specials, padding) and a small model (2 layers of hidden 256; 31 MB,
``write_q4_mix`` of bench/prepared_load.py), then runs ``stagereplay.stages.preflight.check_model`` on it, each call
in a fresh process (the imports of torch, transformers and stagereplay timed apart, as the workflow has them before
its preflight), for every source tree of ``--src``, the trees' processes interleaved, so that old and new code are
compared under the same load. Each process also reports a digest of what the check built (the model config's values
and ``signatures.tokenizer_signature`` of the tokenizer: its pipeline, vocabulary, special tokens, chat template and
probe encodings), so the run says whether the trees build the same config and tokenizer.

``--profile`` adds one process per tree that splits the check into its parts by wrapping the functions it calls
(gguf-py's ``GGUFReader`` parse, transformers' ``load_gguf_checkpoint``, its own fast metadata reader, the
tokenizer conversion, ``AutoConfig`` / ``AutoTokenizer``), and prints cProfile's top functions by own time.

    git archive <commit before the change> src | tar -x -C /tmp/old     # the code to compare against
    taskset -c 0 python bench/gguf_preflight.py --work /tmp/gguf_preflight --src old=/tmp/old/src --src new=src \
        --repeats 3 --profile
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a small model with the vocabulary (and the rest of the configuration) of Qwen2.5-0.5B
SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=512)

# One check in a fresh process: the imports, then the timed check_model; prints one JSON line.
CHILD = r"""
import hashlib, json, sys, time
t0 = time.perf_counter()
import torch, transformers
from stagereplay.models.sources import ModelSource
try:
    from stagereplay.models.signatures import IGNORED_CONFIG_KEYS, tokenizer_signature
except ImportError:  # a tree from before the signatures had their own module
    from stagereplay.models.snapshot import IGNORED_CONFIG_KEYS, tokenizer_signature
from stagereplay.stages.preflight import check_model
imported = time.perf_counter() - t0
folder, gguf_file, mode = sys.argv[1:4]
source = ModelSource("gguf", folder, gguf_file=gguf_file)
parts, calls = {}, {}

def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            calls[name] = calls.get(name, 0) + 1
    return wrapper

if mode == "profile":
    import gguf.gguf_reader
    import transformers.configuration_utils, transformers.models.auto.tokenization_auto
    import transformers.tokenization_utils_tokenizers, transformers.modeling_gguf_pytorch_utils as mg
    from stagereplay.models import gguf_files
    R = gguf.gguf_reader.GGUFReader
    R.__init__ = timed("gguf-py GGUFReader parse", R.__init__)
    legacy = mg.load_gguf_checkpoint
    wrapped = timed("transformers load_gguf_checkpoint (with its gguf-py parse)", legacy)
    for module in list(sys.modules.values()):  # 5.17 binds it in several modules at import, 5.24 imports it late
        names = getattr(module, "__dict__", {})  # not getattr: a lazy module would import on it
        if str(names.get("__name__", "")).startswith("transformers") and names.get("load_gguf_checkpoint") is legacy:
            module.load_gguf_checkpoint = wrapped
    try:
        from transformers.integrations.gguf import reader as fast_reader
        fast_reader.read_gguf_metadata = timed("transformers read_gguf_metadata (its fast reader)",
                                               fast_reader.read_gguf_metadata)
    except ImportError:
        pass
    for owner in ("transformers.integrations.gguf.gguf_tokenizer_mapping", "transformers.integrations.ggml"):
        try:
            module = __import__(owner, fromlist=["convert_gguf_tokenizer"])
            module.convert_gguf_tokenizer = timed("convert_gguf_tokenizer", module.convert_gguf_tokenizer)
        except (ImportError, AttributeError):
            pass
    gguf_files.gguf_architecture = timed("stagereplay gguf_architecture (with its parse)", gguf_files.gguf_architecture)
    transformers.AutoConfig.from_pretrained = timed("AutoConfig.from_pretrained",
                                                    transformers.AutoConfig.from_pretrained)
    transformers.AutoTokenizer.from_pretrained = timed("AutoTokenizer.from_pretrained",
                                                       transformers.AutoTokenizer.from_pretrained)
    import cProfile, io, pstats
    profiler = cProfile.Profile()
    profiler.enable()
t0 = time.perf_counter()
config, tokenizer = check_model(source)
seconds = time.perf_counter() - t0
top = ""
if mode == "profile":
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    top = out.getvalue()
values = {k: v for k, v in config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
built = json.dumps({"config": values, "tokenizer": tokenizer_signature(tokenizer)}, sort_keys=True, default=str)
print(json.dumps({"seconds": seconds, "imports": imported, "parts": parts, "calls": calls, "profile": top,
                  "built_sha256": hashlib.sha256(built.encode()).hexdigest(), "vocab_size": config.vocab_size,
                  "tokens": len(tokenizer)}))
"""


def child(src: Path, folder: Path, gguf_file: str, mode: str) -> dict:
    path = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), gguf_file, mode], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"check_model ({src}, {mode}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - started
    return result


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "tokenizers", "gguf", "numpy")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the GGUF file (kept between runs)")
    parser.add_argument("--src", action="append", default=[], metavar="NAME=PATH",
                        help="a source tree holding the stagereplay package (repeatable); default: new=src")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also split one check per tree into its parts")
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (s.split("=", 1) for s in args.src)] or \
        [("new", REPO / "src")]

    args.work.mkdir(parents=True, exist_ok=True)
    gguf_file = "random-qwen2-vocab-2x256.gguf"
    if not (args.work / gguf_file).exists():
        from prepared_load import SHAPES, write_q4_mix

        t = time.perf_counter()
        write_q4_mix(args.work / gguf_file, dict(SHAPES["qwen2.5-0.5b"], **SMALL))
        print(f"wrote {args.work / gguf_file} ({(args.work / gguf_file).stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)

    print(json.dumps({"python": platform.python_version(), **versions(), "cpus": os.cpu_count(),
                      "load_average": os.getloadavg(), "file": str(args.work / gguf_file)}), flush=True)
    if args.profile:
        for name, src in trees:
            r = child(src, args.work, gguf_file, "profile")
            print(f"\n== {name}: check_model {r['seconds']:.2f} s (imports {r['imports']:.1f} s), its parts "
                  "(nested: a part's time includes the parts it calls):")
            for part, seconds in sorted(r["parts"].items(), key=lambda kv: -kv[1]):
                print(f"   {seconds:7.2f} s  {r['calls'][part]} call(s)  {part}")
            print(r["profile"], flush=True)

    runs = {name: [] for name, _ in trees}
    digests = {name: set() for name, _ in trees}
    for repeat in range(args.repeats):
        for name, src in trees:
            r = child(src, args.work, gguf_file, "time")
            runs[name].append(r["seconds"])
            digests[name].add(r["built_sha256"])
            print(f"repeat {repeat + 1} {name}: check_model {r['seconds']:.2f} s (imports {r['imports']:.1f} s; "
                  f"vocab_size {r['vocab_size']}, tokenizer {r['tokens']} tokens, built {r['built_sha256'][:12]}; "
                  f"load average {os.getloadavg()[0]:.2f})", flush=True)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    print("\nmedian check_model: " + ", ".join(f"{name} {m:.2f} s" for name, m in medians.items()))
    first = trees[0][0]
    for name, _ in trees[1:]:
        ratios = [a / b for a, b in zip(runs[first], runs[name])]
        print(f"{first} / {name}: per interleaved pair {', '.join(f'{x:.1f}x' for x in ratios)}; medians "
              f"{medians[first] / medians[name]:.1f}x")
    same = len(set().union(*digests.values())) == 1
    print(f"config and tokenizer built: {'the same in every process' if same else 'DIFFERENT'} "
          f"({ {name: sorted(d)[0][:12] if len(d) == 1 else sorted(d) for name, d in digests.items()} })")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
