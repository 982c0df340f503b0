"""A local stand-in for ``sbatch``: what the cluster-executor test submits jobs with instead of a real scheduler.

    local_sbatch.py --parsable --job-name=NAME --cpus-per-task=N --mem=MB --time=MIN --gres=gpu:G
                    --output=PATTERN JOBSCRIPT

Takes the sbatch flags that profiles/cluster-generic's submit command passes, starts the job script as a process of
its own in the background (a new session, so it outlives this command, as a scheduler's job outlives sbatch),
prints that process's PID as the job id (what ``--parsable`` prints) and returns. The job's stdout and stderr go to
``--output`` with ``%j`` replaced by the job id and ``%x`` by the job name, as sbatch does.

Every submission is appended, as one JSON line, to the file named by ``$LOCAL_SBATCH_RECORD``: the job's rule and
wildcards (from the job script's ``# properties`` line, which Snakemake writes), the resources it was submitted
with (mem_mb, runtime, gpu, threads, read back from the flags) and the PID of the process that runs it.
Knows nothing of stagereplay; it is not a scheduler (no queue, no limits enforced).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from snakemake.utils import read_job_properties

RECORD_ENV = "LOCAL_SBATCH_RECORD"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="local_sbatch.py")
    parser.add_argument("--parsable", action="store_true")
    parser.add_argument("--job-name", required=True)
    parser.add_argument("--cpus-per-task", type=int, required=True)
    parser.add_argument("--mem", required=True, help="MB, with or without sbatch's M suffix")
    parser.add_argument("--time", type=int, required=True, help="minutes")
    parser.add_argument("--gres", required=True, help="gpu:N")
    parser.add_argument("--output", required=True)
    parser.add_argument("jobscript", type=Path)
    return parser.parse_args(argv)


def gpus(gres: str) -> int:
    kind, _, count = gres.partition(":")
    if kind != "gpu" or not count.isdigit():
        raise SystemExit(f"local_sbatch.py: --gres={gres!r} is not gpu:N")
    return int(count)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    record = os.environ.get(RECORD_ENV)
    if not record:
        raise SystemExit(f"local_sbatch.py: set ${RECORD_ENV} to the file that records the submissions")
    properties = read_job_properties(args.jobscript)
    # The job id is the job's PID, known only once it runs: write to a provisional name, then rename the open file.
    provisional = Path(args.output.replace("%x", args.job_name).replace("%j", f"pending-{os.getpid()}"))
    if not provisional.parent.is_dir():  # sbatch does not create it either (its job fails)
        raise SystemExit(f"local_sbatch.py: --output folder {provisional.parent} does not exist")
    with open(provisional, "wb") as out:
        job = subprocess.Popen(["/bin/sh", str(args.jobscript)], stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    output = Path(args.output.replace("%x", args.job_name).replace("%j", str(job.pid)))
    provisional.rename(output)
    submission = {
        "rule": properties["rule"],
        "wildcards": properties.get("wildcards", {}),
        "job_name": args.job_name,
        "mem_mb": int(args.mem.rstrip("M")),
        "runtime": args.time,
        "gpu": gpus(args.gres),
        "threads": args.cpus_per_task,
        "pid": job.pid,
        "output": str(output.resolve()),
    }
    with open(record, "a") as handle:  # one short append per submission: whole lines even with several submitters
        handle.write(json.dumps(submission) + "\n")
    print(job.pid if args.parsable else f"Submitted batch job {job.pid}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
