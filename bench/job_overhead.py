"""A model job's fixed cost, timed on the device in a fresh Python process, as a job's script makes it:

    python bench/pipeline_projection.py --measure-overhead MODEL_DIR --precision bf16 fp32 [...] [--json OUT.json]

``measure_overhead`` starts this file as that process (its settings as JSON, the parent's clock before the start),
which times the imports a job's script makes, each precision's model load and decoder as
``stagereplay.stages.jobs.load`` makes them, their first step (a CUDA graph's capture), and the host rates of the
greedy loop, the boundary matcher and the fingerprints; where Snakemake is installed it also times the import of
``snakemake.script`` (a job's script preamble makes it), inside ``start_s``. Snakemake is not run. What it prints
is what ``stagereplay.projection.rates.Overhead.from_json`` reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
# what the fresh process reads of the command line's arguments
SETTINGS = ("measure_overhead", "precision", "regime", "rows", "prompt", "stage", "max_len", "device", "revision",
            "prepared_models", "marker")


def measure_overhead(args) -> dict:
    """Run :func:`overhead_child` in a fresh Python process and return what it measured, with the process's whole
    wall time."""
    settings = json.dumps({name: getattr(args, name) for name in SETTINGS})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    spawned = time.time()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), settings, repr(spawned)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the overhead measurement failed:\n{done.stderr[-4000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    measured["process_s"] = time.time() - spawned
    measured["argv"] = sys.argv[1:]
    return measured


def overhead_child(args) -> dict:
    """In a fresh process (time from ``args.spawned``, the parent's clock before it started this one): the imports a
    job's script makes, then per precision the model load and decoder as ``stagereplay.stages.jobs.load`` makes them
    and their first step (the graph capture), then the first precision once more: a job's first load also imports
    the model's code, what the second load of the first precision does not pay. Then the host rates of the greedy
    loop on the last decoder."""
    started = time.time()
    try:  # a job's script preamble imports it (not counted where Snakemake is not installed)
        import snakemake.script  # noqa: F401
        snakemake_import_s = time.time() - started
    except ImportError:
        snakemake_import_s = None
    import torch  # noqa: F401 - the imports a job's script makes, timed
    import stagereplay.stages.controls  # noqa: F401
    import stagereplay.stages.reconstruct  # noqa: F401
    import stagereplay.stages.transplant  # noqa: F401

    imported = time.time()
    out = {"python_start_s": started - args.spawned, "imports_s": imported - started,
           "snakemake_import_s": snakemake_import_s, "start_s": imported - args.spawned, "load_s": {},
           "first_step_s": {}}
    cold = None
    for precision in [*args.precision, args.precision[0]]:
        job, batch, loaded_s, first_s = timed_load(precision, args)
        if cold is None:
            cold = loaded_s + first_s
        else:  # a warm load: the model's code imported already
            out["load_s"][precision], out["first_step_s"][precision] = loaded_s + first_s, first_s
        if precision == args.precision[0] and precision in out["load_s"]:
            out.update(host_rates(job, batch, args))
        del job, batch
        release_device()
    out["first_load_extra_s"] = max(0.0, cold - out["load_s"][args.precision[0]])
    return out


def timed_load(precision: str, args) -> tuple:
    """A job's model load and decoder at ``precision`` (``stagereplay.stages.jobs.load``) and its first step:
    (job, batch, load seconds, first-step seconds)."""
    from stagereplay.decode.regimes import make_decoder
    from stagereplay.models.loading import eos_token_ids
    from stagereplay.stages.jobs import load
    from stagereplay.stages.settings import ModelSettings

    settings = ModelSettings(model=args.measure_overhead, revision=args.revision, device=args.device,
                             prepared_models=args.prepared_models, progress=False)
    t0 = time.perf_counter()
    job = load(settings, precision, numerics="default", make_decoder=lambda loaded: make_decoder(
        loaded.model, tuple(eos_token_ids(loaded)), args.regime, max_len=args.max_len, max_rows=args.rows))
    loaded_s = time.perf_counter() - t0
    batch, first_s = first_step(job.decoder, args)
    return job, batch, loaded_s, first_s


def prompts_of(args) -> list[list[int]]:
    return [[5 + (r + j) % 7 for j in range(args.prompt)] for r in range(args.rows)]


def first_step(decoder, args) -> tuple:
    """The decoder's prompts forward and first one-token step at ``args.rows`` rows (a CUDA graph's capture)."""
    t0 = time.perf_counter()
    batch, _ = decoder.open(prompts_of(args))
    decoder.step(batch, [5] * args.rows)
    synchronize()
    return batch, time.perf_counter() - t0


def cache_length(batch) -> int:
    """Positions the batch's caches hold: a static batch's length; an eager batch's, its first row's cache's."""
    if hasattr(batch, "length"):
        return batch.length
    from stagereplay.models import compat

    return compat.cache_layers(batch.caches[0])[0][0].shape[2]


def host_rates(job, batch, args) -> dict:
    """Per decode step, the greedy choice and its sync at ``args.rows`` rows and at 1; the boundary matcher's text
    decode per live row and step, over the ids the model itself generates (mean over stage lengths 1..``args.stage``);
    the fingerprint rate of the batch's caches, stepped on to a boundary cache's length (prompt + stage - 1)."""
    import torch

    from stagereplay.decode.greedy import BoundaryMatcher, decode_rows, greedy_choice
    from stagereplay.io.fingerprints import fingerprint_layers

    vocab = job.loaded.model.config.vocab_size
    out = {"greedy_step_s": {}}
    for rows in sorted({args.rows, 1}):
        logits = torch.randn(rows, vocab, device=job.decoder.device)
        greedy_choice(logits)
        t0 = time.perf_counter()
        for _ in range(20):
            greedy_choice(logits)
        out["greedy_step_s"][rows] = (time.perf_counter() - t0) / 20
    while cache_length(batch) < min(args.prompt + args.stage - 1, args.max_len - 1):
        job.decoder.step(batch, [5] * args.rows)
    layers = [job.decoder.row_layers(batch, r, cache_length(batch)) for r in range(args.rows)]
    size = sum(t.numel() * t.element_size() for row in layers for pair in row for t in pair)
    t0 = time.perf_counter()
    for row in layers:
        fingerprint_layers(row)
    out["fingerprint_GB_s"] = size / 1e9 / (time.perf_counter() - t0)
    if args.marker:
        tokenizer = job.loaded.tokenizer
        matcher = BoundaryMatcher(args.stage, text=args.marker, decode=tokenizer.decode)
        budget = max(1, min(2 * args.stage, args.max_len - args.prompt - 1))
        generated = decode_rows(job.decoder, prompts_of(args)[:1], matcher=matcher, max_stage_tokens=budget,
                                max_new_tokens=0)[0]
        ids = generated.stage_ids or generated.suffix_ids
        t0 = time.perf_counter()
        for length in range(1, len(ids) + 1):
            matcher.reached(ids[:length])
        out["matcher_s_per_row_step"] = (time.perf_counter() - t0) / len(ids)
        out["matcher_stage_tokens"] = len(ids)
    return out


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(json.dumps(overhead_child(SimpleNamespace(**json.loads(sys.argv[1]), spawned=float(sys.argv[2])))))
