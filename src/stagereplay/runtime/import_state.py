"""What the libraries a job server preloaded read from their process once, as they loaded, and a forked child
sets again as a fresh process of its job would have it: the thread counts (``OMP_NUM_THREADS`` and its kin, and
the CPUs the process may run on) and the temp folder.

A fresh process's native libraries size their thread pools when they load: torch's OpenMP from MKL's count (which
reads ``MKL_NUM_THREADS``, else ``OMP_NUM_THREADS``, else counts the CPUs the process may use, and keeps at most
one thread per core), the OpenBLAS copies of numpy and scipy from ``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS``
or ``OMP_NUM_THREADS`` (at most one per usable CPU), pyarrow's CPU pool from ``OMP_NUM_THREADS`` or the usable
CPUs. In a child forked from the server they hold the server's counts; :func:`take_job_state` sets each loaded
one again by its library's rule from the job's environment and CPU affinity, so that one server serves jobs of
any thread count. A thread variable whose value is not a plain count stays part of the server's key
(:func:`keyed`): its jobs get a server of their own, which loads the libraries under it.

What a module read from the working folder as it was imported cannot be read again: a server whose preload
imports one of :data:`FOLDER_AT_IMPORT` (matplotlib, which reads ./matplotlibrc) refuses to serve, and the server
imports in a folder of its own, not in the folder of the job that started it.

Knows nothing of the job server's protocol or of the stages; tests/test_job_server.py compares a forked child's
counts with a fresh process's.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile

# Modules that read the working folder as they are imported, which a child could not read again from its job's:
# a server whose preload imports one refuses to serve (its jobs import it themselves, in their own folders).
FOLDER_AT_IMPORT = {"matplotlib": "it read its rc file, ./matplotlibrc first, into rcParams"}
# The variables a child sets its libraries' thread counts from (Snakemake sets them all to a job's threads).
THREAD_COUNTS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")


def count(env, name: str) -> int | None:
    """``env[name]`` as a thread count, where it is a plain positive integer."""
    value = env.get(name, "")
    return int(value) if re.fullmatch(r"[1-9][0-9]{0,5}", value) else None


def keyed(env) -> dict:
    """The thread variables of ``env`` that a server's imports depend on: those whose value is not a plain count
    (a child cannot set what its libraries would make of them)."""
    return {name: env[name] for name in THREAD_COUNTS if name in env and count(env, name) is None}


def take_job_state(env=None) -> None:
    """In a forked child that has taken its job's environment and CPU affinity: the temp folder and the loaded
    libraries' thread counts as a fresh process of the job would find them."""
    env = os.environ if env is None else env
    tempfile.tempdir = None  # cached by the server's first gettempdir(): the job's $TMPDIR is read again
    cpus = len(os.sched_getaffinity(0))
    if "torch" in sys.modules:
        torch_threads(env, cpus)
    for library in loaded_libraries("openblas"):
        openblas_threads(library, env, cpus)
    if "pyarrow" in sys.modules:  # its CPU pool: OMP_NUM_THREADS, else the usable CPUs, at most OMP_THREAD_LIMIT
        threads, limit = count(env, "OMP_NUM_THREADS") or cpus, count(env, "OMP_THREAD_LIMIT")
        sys.modules["pyarrow"].set_cpu_count(min(threads, limit) if limit else threads)


def torch_threads(env, cpus: int) -> None:
    """torch's intra-op threads: its OpenMP takes MKL's count (torch's ``init_num_threads``), which MKL derives
    from the environment as it starts; set MKL's count as it would read it (MKL keeps its own per-core cap), then
    OpenMP's to it. (torch's inter-op pool reads no variable.)"""
    import torch

    wanted = count(env, "MKL_NUM_THREADS") or count(env, "OMP_NUM_THREADS")
    mkl = symbols(loaded_libraries("libtorch_cpu"), "mkl_serv_set_num_threads", "mkl_get_max_threads")
    if mkl is not None and torch.backends.mkl.is_available():
        set_mkl, get_mkl = mkl
        set_mkl(wanted or cpus)
        threads = get_mkl()
    elif wanted:
        threads = wanted  # torch without MKL: its OpenMP takes the variable as it is
    else:
        return
    for library in loaded_libraries("libgomp", "libiomp", "libomp"):
        found = symbols([library], "omp_set_num_threads")
        if found is not None:
            found[0](threads)


def openblas_threads(library: ctypes.CDLL, env, cpus: int) -> None:
    """An OpenBLAS copy's count: the first of ``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` and
    ``OMP_NUM_THREADS``, else as many as the CPUs, at most the CPUs configured and usable (OpenBLAS caps it at its
    build's maximum itself)."""
    setter = None
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_"):
            setter = setter or symbols([library], f"{prefix}openblas_set_num_threads{suffix}")
    if setter is None:
        return
    usable = min(cpus, os.sysconf("SC_NPROCESSORS_CONF"))
    wanted = count(env, "OPENBLAS_NUM_THREADS") or count(env, "GOTO_NUM_THREADS") or count(env, "OMP_NUM_THREADS")
    setter[0](min(wanted or usable, usable))


def loaded_libraries(*names: str) -> list[ctypes.CDLL]:
    """The shared libraries mapped into this process whose file name contains one of ``names``."""
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            base = os.path.basename(path).lower()
            if ".so" in base and any(name in base for name in names) and path not in paths:
                paths.append(path)
    return [ctypes.CDLL(path) for path in paths]  # already loaded: dlopen hands back the same copy


def symbols(libraries, *names: str):
    """The functions ``names`` (returning int) of the first of ``libraries`` that has them all, or None."""
    for library in libraries:
        try:
            return tuple(getattr(library, name) for name in names)
        except AttributeError:
            continue
    return None
