"""Preparing a GGUF source's snapshots: today's path against the direct converter, in one run.

Writes a random-weight GGUF file of a real shape with ``prepared_load.write_q4_mix`` (Qwen2-0.5B by default; its
quant mix: Q4_K for matrices whose rows are a multiple of 256 values, Q4_0 for the others, norms and biases F32,
the embedding tied, no output.weight; at 0.5B, hidden 896 is not a multiple of 256, so only ffn_down is Q4_K, at
7B and 14B every matrix is Q4_K), then measures, each in a fresh process, CPU seconds (user + system, of the process
alone, from ``wait4``) and peak resident memory (VmHWM, the process's own) of:

- ``today``: ``snapshot.prepare_snapshot(source, precision, out, mode="convert")`` for each precision (load the
  GGUF through transformers, ``save_pretrained``, load it back and compare);
- ``convert``: ``gguf_convert.convert_gguf`` for each precision alone, and for all of them from one read.

It checks that the converter's files are byte for byte the ones today's path wrote (the manifest's file digests),
and prints the ratios. ``--only-convert`` skips today's path (for the 7B and 14B shapes: it holds the whole
dequantised model, 15 GB at 7B bf16, more than the 2-core VM's 23 GB can spare).

    python bench/gguf_convert.py --work /tmp/gguf_convert_bench
    python bench/gguf_convert.py --work /tmp/gguf_convert_bench --shape qwen2.5-7b --only-convert
    python bench/gguf_convert.py --work /tmp/gguf_convert_bench --shape qwen2.5-14b --only-convert --precisions bf16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from stagereplay.io.file_hashes import sha256_of_file
from stagereplay.testing.shapes import SHAPES

import prepared_load

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[4]))
from stagereplay.models import snapshot
from stagereplay.models.gguf_convert import convert_gguf
from stagereplay.models.sources import ModelSource
imported = time.perf_counter() - t0
what, path, outs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
t0 = time.perf_counter()
if what == "today":
    (precision, out), = outs.items()
    source = ModelSource("gguf", os.path.dirname(path), gguf_file=os.path.basename(path))
    manifest = snapshot.prepare_snapshot(source, precision, out, mode="convert")
    result = {"files": {precision: manifest["snapshot"]["files"]}}
else:
    records = convert_gguf(path, outs)
    result = {"files": {p: r["files"] for p, r in records.items()},
              "parts_cpu_s": next(iter(records.values()))["cpu_seconds"]}
# VmHWM: the peak resident memory of this program's own address space (ru_maxrss would also count the parent's,
# whose address space a spawned child shares until exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"what": what, "seconds": time.perf_counter() - t0, "imports": imported, "peak_kb": peak, **result}))
"""


def _run(what: str, gguf: Path, outs: dict[str, Path], threads: int) -> dict:
    """One measurement in a fresh process, reaped with ``wait4`` for its own CPU time and peak memory."""
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, TQDM_DISABLE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    out_file = outs[next(iter(outs))].parent / f".{what}.stdout"
    err_file = out_file.with_suffix(".stderr")
    with open(out_file, "w") as stdout, open(err_file, "w") as stderr:
        pid = os.posix_spawn(sys.executable, [sys.executable, "-c", CHILD, what, str(gguf),
                                              json.dumps({p: str(o) for p, o in outs.items()}), str(threads)],
                             env, file_actions=[(os.POSIX_SPAWN_DUP2, stdout.fileno(), 1),
                                                (os.POSIX_SPAWN_DUP2, stderr.fileno(), 2)])
        _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{what} {sorted(outs)} failed:\n{err_file.read_text()[-3000:]}")
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    out_file.unlink()
    err_file.unlink()
    result.update(precisions=sorted(outs), wall_s=round(wall, 2), cpu_s=round(usage.ru_utime + usage.ru_stime, 2),
                  peak_rss_gb=round(result.pop("peak_kb") / 2**20, 2))
    print(json.dumps({k: v for k, v in result.items() if k != "files"}), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the GGUF file and the snapshots")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each process (a job's)")
    parser.add_argument("--only-convert", action="store_true", help="skip today's path; convert all precisions once")
    parser.add_argument("--keep", action="store_true", help="keep the GGUF file and the snapshots")
    args = parser.parse_args()
    import gguf
    import torch
    import transformers

    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / f"random-{args.shape}-q4mix.gguf"
    if not path.exists():
        started = time.perf_counter()  # in a process of its own: the writer holds the whole file in memory
        writer = multiprocessing.get_context("spawn").Process(target=prepared_load.write_q4_mix,
                                                              args=(path, args.shape))
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise RuntimeError(f"writing {path} failed")
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s", flush=True)
    gguf_gb = round(path.stat().st_size / 1e9, 2)
    snap = lambda what, p: args.work / f"{what}-{args.shape}-{p}"  # noqa: E731
    results = {}
    try:
        if not args.only_convert:
            for p in args.precisions:
                results[f"today {p}"] = _run("today", path, {p: snap("today", p)}, args.threads)
                results[f"convert {p}"] = _run("convert", path, {p: snap("convert", p)}, args.threads)
                today = results[f"today {p}"]["files"][p]  # the manifest's digests of the files it wrote
                ours = {name: (snap("convert", p) / name) for name in today}
                differing = sorted(n for n, f in ours.items() if not f.exists() or sha256_of_file(f) != today[n])
                results[f"same files {p}"] = {"compared": len(today), "differing": differing}
                print(json.dumps({f"same files {p}": results[f"same files {p}"]}), flush=True)
                shutil.rmtree(snap("today", p), ignore_errors=True)
        both = " + ".join(args.precisions)
        results[f"convert {both}"] = _run("convert", path, {p: snap("convert", p) for p in args.precisions},
                                          args.threads)
        if not args.only_convert:
            for p in args.precisions:
                written = results[f"convert {both}"]["files"][p]
                alone = results[f"convert {p}"]["files"][p]
                results[f"same files {p}"]["one read = alone"] = written == alone
    finally:
        for p in args.precisions:
            for what in ("today", "convert"):
                if not args.keep:
                    shutil.rmtree(snap(what, p), ignore_errors=True)
        if not args.keep and args.shape != "qwen2.5-0.5b":
            path.unlink(missing_ok=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}",
        "load_average": os.getloadavg(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "gguf": getattr(gguf, "__version__", None) or _version("gguf"),
                     "python": platform.python_version()},
        "shape": args.shape, "gguf_gb": gguf_gb,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "files"} for k, v in results.items()},
    }
    if not args.only_convert:
        ratios = {}
        for p in args.precisions:
            today, ours = results[f"today {p}"], results[f"convert {p}"]
            ratios[f"cpu today/convert {p}"] = round(today["cpu_s"] / ours["cpu_s"], 1)
            ratios[f"peak rss today/convert {p}"] = round(today["peak_rss_gb"] / ours["peak_rss_gb"], 1)
        today_all = sum(results[f"today {p}"]["cpu_s"] for p in args.precisions)
        ratios[f"cpu today (sum of {both})/convert {both}"] = round(today_all / results[f"convert {both}"]["cpu_s"], 1)
        report["ratios"] = ratios
    print(json.dumps(report, indent=1))
    return 0


def _version(name: str) -> str | None:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
