"""Turnaround: the whole workflow on a GGUF source, twice in one working directory: a COLD run (empty model store:
``prepare_model`` converts the GGUF file at every precision) and a WARM run (the same store, a new run name: the
store already holds the snapshots, so ``prepare_model`` only writes the run's record). Prints and writes JSON with
each run's wall time, each rule's wall and CPU seconds (its benchmark file under benchmarks/<run>/), each job's start
and end (from the Snakemake log), the time before the first job (Snakemake's planning and the workflow's preflight,
which reads a GGUF source's metadata, or its prepared snapshot once the store has one), the GPU-busy share while each
run lasted (nvidia-smi), the ledger's rows by status (a random model may end an item before its boundary) and the
warm/cold ratios.

    python bench/turnaround.py --work /tmp/ta --shape tiny --device cpu --items 4           # CPU try-out
    python bench/turnaround.py --work /tmp/ta --shape qwen2.5-0.5b --items 4                 # on one H200
    python bench/turnaround.py --work /tmp/ta48 --shape qwen2.5-0.5b --items 48 --batch-size 16 \
        --regime cuda_graph --warm-only

``--warm-only`` prepares the store first with the workflow's own ``prepare_model`` job (run ``prime``, recorded but
not timed as a run), then times one warm run: a run's turnaround once its model is prepared.

``--rerun-transplants`` then reruns the two transplant stages alone, as a researcher does at a later checkpoint
(``snakemake --forcerun transplant_caches find_minimal_transplants`` on the warm run's results, one model job on
the GPU at a time): first with ``transplant.pack: false`` (the unpacked path, as the stages ran before packing),
then with packing on. Each stage's seconds come from its benchmark file; the JSON's ``rerun`` holds both and their
ratios, and whether the tables are equal: the packed rerun's against the warm run's (every column) and against the
unpacked rerun's (every column but ``rows_transplanted``), beside a control (the packed table with one margin moved
by one ulp) that the same comparison must tell apart.

The source is a RANDOM-WEIGHT GGUF file of a real Qwen2.5 shape (a shape of stagereplay/testing/shapes.py; ``tiny``
for trying it on a CPU) written with gguf-py as llama.cpp lays out a Qwen2 file: its tensor names, every 2-D weight
quantised (``--quant``, default Q8_0), norms and biases F32, untied embeddings (``output.weight``: a random model
with tied embeddings echoes its last input token), and a byte-level BPE tokenizer (``gpt2``, pre ``qwen2``, one
merge) spelled in GPT-2's byte alphabet. As in make_random_qwen.py the vocabulary is the characters the prompts use
(the toy's and the chat template's) padded with filler tokens ``~0``, ``~1``, ... to the shape's vocabulary size, so
the random model's greedy tokens are almost all fillers and the boundary ``{marker: "~", occurrence: --stage}`` is
reached after about --stage tokens. The numbers are speed only: the outputs mean nothing. Before the runs the file
is checked: transformers loads it (``from_pretrained(folder, gguf_file=name)``), the toy's prompts encode with no
unknown characters, and greedy decoding emits fillers (``--skip-check`` leaves that out).

The config is bench/pipeline_run.py's (``write_config``) with ``model`` the .gguf file, ``model_store`` WORK/store
and ``run`` cold / warm. Writes ``--json`` (default WORK/turnaround.json), each run summarised by
``bench/run_summary.py``; the runs' logs stay in WORK (snakemake_<run>.log, logs/<run>/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from stagereplay.testing.gguf import filler_vocabulary, prompt_characters, write_gguf
from stagereplay.testing.shapes import SHAPES  # the real Qwen2.5 shapes

from pipeline_run import GpuSampler, add_run_options, rule_times, write_config
from run_summary import compare, device_name, run_summary, store_entries, versions

REPO = Path(__file__).resolve().parents[1]

REVISION = "local"  # the config's revisions: a GGUF file named by model needs no revision; its slug names folders
QUANTS = ("Q8_0", "Q4_0")


# ---- The source: a random-weight GGUF file of a real shape -----------------------------------------------------------
def write_random_gguf(path: Path, shape_name: str, quant: str = "Q8_0", seed: int = 0) -> dict:
    """Write a random-weight Qwen2 GGUF of ``shape_name`` (stagereplay.testing.gguf: weights drawn as transformers
    initialises a Qwen2, normal with std 0.02, norms one, biases zero; every 2-D weight quantised as ``quant``, norms
    and biases F32) with :func:`stagereplay.testing.gguf.filler_vocabulary`; return what the report says of it."""
    vocabulary = filler_vocabulary(SHAPES[shape_name]["vocab_size"])
    tokens = vocabulary.tokens
    written = write_gguf(path, shape_name, vocabulary=vocabulary, tied=False, quant=quant, seed=seed)
    return {"file": path.name, "bytes": path.stat().st_size, "shape": shape_name, "parameters": written.parameters,
            "seed": seed, "vocab_size": len(tokens), "characters": "".join(prompt_characters()),
            "fillers": sum(t.startswith("~") for t in tokens),
            "tensor_types": {"2-D weights": quant, "norms and biases": "F32", "counts": written.tensor_types},
            "tied_embeddings": False, "tokenizer": "byte-level BPE (gpt2, pre qwen2), two merges (runs of spaces)",
            "weights": "random (normal, std 0.02; norms 1, biases 0): outputs mean nothing"}


def check_source(path: Path, questions: list[str], new_tokens: int = 8) -> dict:
    """What the runs rely on, checked before them: transformers loads the file (model and tokenizer), the
    questions' prompts encode with no unknown characters (the preflight's check), and greedy tokens are fillers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stagereplay.data.prompts import Prompter, unknown_characters

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded_s = time.perf_counter() - t0
    prompter, alone = Prompter(tokenizer), {}
    unknown = sorted({c for q in questions for c in unknown_characters(
        tokenizer, tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=False), alone)})
    ids = prompter(questions[0])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    generated = out[0, len(ids):].tolist()
    text = tokenizer.decode(generated)
    report = {"loads": True, "load_s": round(loaded_s, 1), "model_class": type(model).__name__,
              "tied_embeddings": bool(model.config.tie_word_embeddings), "num_layers": model.config.num_hidden_layers,
              "tokenizer_length": len(tokenizer), "eos_token": tokenizer.eos_token,
              "unknown_characters": unknown, "prompt_example": tokenizer.decode(ids), "prompt_tokens": len(ids),
              "greedy_tokens": len(generated), "greedy_fillers": text.count("~"), "greedy_text": text}
    del model
    gc.collect()
    if unknown:
        raise SystemExit(f"the prompts hold characters the GGUF tokenizer does not know: {unknown}")
    return report


# ---- The runs ----------------------------------------------------------------------------------------------------------
def run_config(work: Path, args, gguf_path: Path, run: str) -> Path:
    """bench/pipeline_run.py's config, with the GGUF file as the model, WORK/store as the model store and ``run``."""
    config = json.loads(write_config(work, args).read_text())
    config.update(run=run, model=str(gguf_path), revisions=[REVISION], model_store=str(work / "store"))
    if run == "fresh":  # the control: every job in its own process
        config.update(job_server=False)
    elif getattr(args, "job_server", None) is not None:  # else the config sets nothing about it: the schema's default
        config.update(job_server=args.job_server == "on")
    path = work / f"config_{run}.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    (work / "config.yaml").unlink()
    return path


def snakemake(work: Path, config: Path, run: str, args, env: dict, targets: list[str] = ()) -> dict:
    """One Snakemake run of ``config`` in ``work``: its wall time, status and GPU samples; its log is
    WORK/snakemake_<run>.log."""
    # the targets first: --resources takes every value after it
    command = [sys.executable, "-m", "snakemake", *targets, "-s", str(REPO / "Snakefile"), "--directory", str(work),
               "--configfile", str(config), "--cores", str(args.cores), "--resources", f"gpu={args.gpu_slots}"]
    log_path = work / f"snakemake_{run}.log"
    sampler = GpuSampler()
    status = "complete"
    load_before = os.getloadavg()  # a host shared with other work slows a run's wall and not its CPU seconds
    started = time.time()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=args.limit_s)
        except subprocess.TimeoutExpired:  # Snakemake and its running jobs, at once: what finished stays
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
            status = f"stopped after --limit-s {args.limit_s:g} s (the jobs running then were killed)"
    wall = time.perf_counter() - t0
    gpu = sampler.stop()
    if returncode != 0 and status == "complete":
        print(log_path.read_text()[-4000:], file=sys.stderr)
        status = f"failed (Snakemake exit {returncode})"
    return {"status": status, "wall_s": round(wall, 1), "started": started, "gpu": gpu, "log": log_path.name,
            "load_average": {"before": [round(x, 2) for x in load_before],
                             "after": [round(x, 2) for x in os.getloadavg()]}}


RERUN_PARTS = {"transplant_caches": "transplant", "find_minimal_transplants": "minimal_transplant"}  # rule: its part
RERUN_RULES = tuple(RERUN_PARTS)


def _stage_parts(work: Path, run: str) -> dict[str, list[Path]]:
    """Each transplant stage's part files in ``run``'s results (one per revision and shard)."""
    return {rule: sorted((work / "results" / run).glob(f"*/parts/{part}_*.parquet"))
            for rule, part in RERUN_PARTS.items()}


def _keep(parts: dict[str, list[Path]], folder: Path) -> None:
    """Copies of the part files in ``folder`` (no ``parts`` in their path: scripts/compare_tables.py skips those)."""
    folder.mkdir(parents=True, exist_ok=True)
    for files in parts.values():
        for path in files:
            shutil.copy2(path, folder / f"{path.parent.parent.name}__{path.name}")


def _compare(old: Path, new: Path, ignore: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "scripts/compare_tables.py"), str(old), str(new),
                           "--ignore-columns", ignore], capture_output=True, text=True)
    return {"equal": proc.returncode == 0, "ignored": ignore, "output": proc.stdout[-2000:]}


def rerun_transplants(work: Path, args, env: dict, run: str = "warm") -> dict:
    """The two transplant stages of ``run`` rerun alone, unpacked then packed (the module's docstring)."""
    import pyarrow.parquet as pq

    from stagereplay.testing.controls import first_margin_nudged

    parts = _stage_parts(work, run)
    if not all(parts.values()):
        return {"status": f"the {run} run has no transplant parts to rerun: {parts}"}
    keep = work / "rerun"
    _keep(parts, keep / run)
    targets = [str(p.relative_to(work)) for files in parts.values() for p in files]
    base = json.loads((work / f"config_{run}.yaml").read_text())
    one_slot = argparse.Namespace(**{**vars(args), "gpu_slots": 1})
    out: dict = {"rules": list(RERUN_RULES), "gpu_slots": 1, "targets": targets}
    for pack in ("off", "on"):
        config = json.loads(json.dumps(base))
        config.setdefault("transplant", {})["pack"] = pack == "on"
        path = work / f"config_rerun_{pack}.yaml"
        path.write_text(json.dumps(config, indent=1))
        # the targets, then the rules forced (their nargs end at -s), and no rerun for a changed parameter elsewhere
        measured = snakemake(work, path, f"rerun_{pack}", one_slot, env,
                             targets=[*targets, "--rerun-triggers", "mtime", "--forcerun", *RERUN_RULES])
        jobs = rule_times(work)  # the rerun's jobs overwrote the run's benchmark files
        jobs = jobs[jobs["job"].str.startswith(f"{run}/")]
        stages = {rule: round(float(jobs.loc[jobs["rule"] == rule, "s"].sum()), 2) for rule in RERUN_RULES}
        out[pack] = {"status": measured["status"], "wall_s": measured["wall_s"], "stages_s": stages,
                     "log": measured["log"]}
        print(f"rerun, pack {pack}: {measured['status']}, {measured['wall_s']} s, stages {stages}", file=sys.stderr)
        if measured["status"] != "complete":
            out["status"] = f"the rerun with pack {pack} did not complete"
            return out
        _keep(parts, keep / pack)
    out["ratios"] = {rule: round(out["off"]["stages_s"][rule] / out["on"]["stages_s"][rule], 2)
                     for rule in RERUN_RULES}
    control = keep / "control"
    _keep(parts, control)
    for path in control.glob("*transplant_*.parquet"):
        if "minimal" not in path.name:
            table = pq.read_table(path)
            pq.write_table(first_margin_nudged(table).replace_schema_metadata(table.schema.metadata), path)
    out["tables"] = {"packed_rerun_vs_warm_run": _compare(keep / run, keep / "on", ""),
                     "packed_vs_unpacked": _compare(keep / "off", keep / "on", "rows_transplanted"),
                     "control_packed_vs_nudged": _compare(keep / "on", control, "")}
    caught = not out["tables"]["control_packed_vs_nudged"]["equal"]
    same = out["tables"]["packed_rerun_vs_warm_run"]["equal"] and out["tables"]["packed_vs_unpacked"]["equal"]
    out["status"] = "complete" if caught and same else "tables differ" if caught else "control not caught"
    print(f"rerun tables: {out['status']}; ratios {out['ratios']}", file=sys.stderr)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="a fresh folder for the model, store, configs and runs")
    add_run_options(ap)
    ap.add_argument("--quant", default="Q8_0", choices=QUANTS, help="the 2-D weights' GGUF type")
    ap.add_argument("--job-server", choices=("on", "off"),
                    help="job_server in the timed runs' config (default: the key left out, so the schema's default)")
    ap.add_argument("--fresh-run", action="store_true",
                    help="after them, a run with job_server off on the same store, its tables compared with the "
                         "warm run's (scripts/compare_tables.py)")
    ap.add_argument("--warm-only", action="store_true",
                    help="prepare the store first (untimed), then time one warm run")
    ap.add_argument("--skip-check", action="store_true", help="do not load the GGUF file before the runs")
    ap.add_argument("--limit-s", type=float, default=None, help="stop each run after this many seconds")
    ap.add_argument("--rerun-transplants", action="store_true",
                    help="after the warm run, rerun transplant_caches and find_minimal_transplants alone, packing "
                         "off then on, and compare their tables (the module's docstring)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work).resolve()
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work {work} is not empty: give a fresh folder")
    (work / "model").mkdir(parents=True, exist_ok=True)
    # the store is the config's model_store; the variable too, so that nothing reaches the user's default store
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "STAGEREPLAY_MODEL_STORE": str(work / "store"),
           "STAGEREPLAY_JOB_SERVER_DIR": str(work / "job_servers")}
    gguf_path = work / "model" / f"random-{args.shape}-{args.quant.lower()}.gguf"
    t0 = time.perf_counter()
    source = write_random_gguf(gguf_path, args.shape, args.quant)
    source["built_s"] = round(time.perf_counter() - t0, 1)
    print(f"wrote {gguf_path} ({source['bytes'] / 1e6:.1f} MB, {source['parameters'] / 1e6:.1f}M random parameters, "
          f"{args.quant}) in {source['built_s']} s", file=sys.stderr)
    if not args.skip_check:
        from stagereplay.data.datasets import load_synthetic

        questions = [row["question"] for row in load_synthetic(max(100, 4 * args.items), 0)[:16]]
        source["check"] = check_source(gguf_path, questions)
        print(f"checked: {json.dumps(source['check'])}", file=sys.stderr)

    runs, prime = {}, None
    order = (["warm"] if args.warm_only else ["cold", "warm"]) + (["fresh"] if args.fresh_run else [])
    if args.warm_only:  # the store prepared by the workflow's own prepare_model job, not timed as a run
        config = run_config(work, args, gguf_path, "prime")
        prime = snakemake(work, config, "prime", args, env, targets=[f"results/prime/models/{REVISION}.json"])
        prime = run_summary(work, "prime", prime, REVISION)
        prime["store_after"] = store_entries(work)
        if prime["status"] != "complete":
            order = []
    for run in order:
        store_before = store_entries(work)
        config = run_config(work, args, gguf_path, run)
        print(f"run {run}: {len(store_before)} store entries before it", file=sys.stderr)
        measured = snakemake(work, config, run, args, env)
        runs[run] = {"store_before": store_before, **run_summary(work, run, measured, REVISION),
                     "store_after": store_entries(work)}
        print(f"run {run}: {runs[run]['status']}, {runs[run]['wall_s']} s", file=sys.stderr)
    if {"warm", "fresh"} <= runs.keys():
        proc = subprocess.run([sys.executable, str(REPO / "scripts/compare_tables.py"), str(work / "results/warm"),
                               str(work / "results/fresh")], capture_output=True, text=True)
        runs["fresh"]["tables_equal_warm"] = {"equal": proc.returncode == 0, "output": proc.stdout[-3000:]}
    rerun = None
    if args.rerun_transplants and runs.get("warm", {}).get("status") == "complete":
        rerun = rerun_transplants(work, args, env)
    import torch

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device_name(args.device), "cuda": torch.version.cuda, "cpus": os.cpu_count(),
        "versions": versions(), "weights": f"random, {args.shape} shape ({args.quant} GGUF)", "argv": sys.argv[1:],
        "status": "complete" if runs and all(r["status"] == "complete" for r in runs.values())
        and (rerun is None or rerun["status"] == "complete") else "incomplete",
        "source": source, "config": json.loads((work / f"config_{order[0] if order else 'prime'}.yaml").read_text()),
        "cores": args.cores, "gpu_slots": args.gpu_slots, "mode": "warm only" if args.warm_only else "cold then warm",
        "prime": prime, "runs": runs,
        "warm_over_cold": compare(runs["cold"], runs["warm"]) if {"cold", "warm"} <= runs.keys() else None,
        "rerun": rerun,
    }
    text = json.dumps(report, indent=1)
    print(text)
    out = Path(args.json or work / "turnaround.json")
    out.write_text(text + "\n")
    return 0 if report["status"] == "complete" else 1


if __name__ == "__main__":
    sys.exit(main())
