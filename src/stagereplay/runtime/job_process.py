"""The attributes of a job's process that a child forked for it must keep, where a fork would give it the job
server's: the CPUs it may run on (``taskset``), its scheduling policy and niceness (``chrt``, ``nice``) and its
resource limits (``prlimit``, ``ulimit``). The job sends them (:func:`job_process`); the child takes them before
anything of the job runs (:func:`take_job_process`) or says why it cannot, and then it does not run the job: the job
runs in its own process, as without the server.

A child cannot always take them: an unprivileged process may not lower its niceness below what its ``RLIMIT_NICE``
allows, raise a hard limit, or run on CPUs its cgroup does not have. Two it never takes: the C library sized new
threads' stacks by ``RLIMIT_STACK`` when the server started, and OpenMP bound its threads to the CPUs it found as it
loaded where ``OMP_PROC_BIND``, ``OMP_PLACES`` or ``GOMP_CPU_AFFINITY`` asked it to. Knows nothing of the job
server's protocol.
"""

from __future__ import annotations

import os
import resource

# Where OpenMP binds its threads to the CPUs it found when it loaded (in the server): a job on other CPUs is refused.
BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
RLIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))


def job_process() -> dict:
    """This process's CPU affinity, scheduling policy and priority, niceness and resource limits."""
    return {"affinity": sorted(os.sched_getaffinity(0)),
            "scheduler": [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority],
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS}}


def take_job_process(wanted: dict | None, env) -> str | None:
    """In the forked child, before it takes anything else of the job: the job's attributes (``wanted``, from
    :func:`job_process`), or why they cannot all be taken (then the child must not run the job). ``env`` is the
    job's environment."""
    if not wanted:
        return "the job sent no process attributes"
    cpus = set(wanted["affinity"])
    if cpus != os.sched_getaffinity(0):
        bound = [name for name in BINDING_ENV if env.get(name)]
        if bound:
            return (f"the job runs on CPUs {sorted(cpus)}, the server on {sorted(os.sched_getaffinity(0))}, and "
                    f"{bound[0]} is set: OpenMP placed its threads on the server's CPUs when it loaded")
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            return f"cannot run on the job's CPUs {sorted(cpus)}: {exc}"
    stack = wanted["rlimits"].get("RLIMIT_STACK")
    if stack is not None and tuple(stack) != resource.getrlimit(resource.RLIMIT_STACK):
        return ("the job's RLIMIT_STACK differs from the server's: the C library sized new threads' stacks by the "
                "server's when it started")
    # A lower niceness or another policy can need the job's RLIMIT_NICE (which may allow more than the server's):
    # where the server's does not allow it, the limits go first.
    if scheduling(wanted) is not None:
        refused = limits(wanted) or scheduling(wanted)
        if refused:
            return refused
    return limits(wanted)


def scheduling(wanted: dict) -> str | None:
    """Take the job's scheduling policy and niceness, or say why not."""
    policy, priority = wanted["scheduler"]
    try:
        if (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) != (policy, priority):
            os.sched_setscheduler(0, policy, os.sched_param(priority))
        if os.getpriority(os.PRIO_PROCESS, 0) != wanted["nice"]:
            os.setpriority(os.PRIO_PROCESS, 0, wanted["nice"])
    except OSError as exc:
        return (f"cannot take the job's niceness {wanted['nice']} and scheduling policy {policy} (the server's: "
                f"{os.getpriority(os.PRIO_PROCESS, 0)}, {os.sched_getscheduler(0)}): {exc}")
    return None


def limits(wanted: dict) -> str | None:
    """Take the job's resource limits, or say which one cannot be taken (raising a hard limit needs privilege)."""
    for name, (soft, hard) in sorted(wanted["rlimits"].items()):
        which = getattr(resource, name, None)
        if which is None or resource.getrlimit(which) == (soft, hard):
            continue
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError) as exc:
            return f"cannot take the job's {name} {soft}:{hard} (the server's: {resource.getrlimit(which)}): {exc}"
    return None
