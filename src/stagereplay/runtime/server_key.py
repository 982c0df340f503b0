"""Which job server a job may fork from: a server's key, a digest of what a job can know cheaply, before it imports
anything, of what the server's imports depend on; and the files the server did import (:func:`loaded_files`), which
it checks before each job. A job whose key differs (other code, another interpreter or environment, other control
groups) starts a server of its own; a server one of whose imported files changed forks no more jobs and exits (the
next job starts another, which imports the new file).

Why stat records, not hashes, for the imported files: a server imports a few thousand files (torch, transformers,
pandas, scipy, the stages; hundreds of MB with torch's libraries), which hashing would read again before every job,
while one ``stat`` each costs milliseconds; an install, an upgrade or an editor writes the file anew (a new
modification time, most often a new size). What the key itself holds of the packages (where each is found and its
entry file's stat) is what a job can compute without importing them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from stagereplay.runtime.import_state import THREAD_COUNTS, keyed
from stagereplay.runtime.run_markers import RUN_ENV
from stagereplay.runtime.server_folder import KEY_CHARS
from stagereplay.runtime.server_protocol import CHILD_ENV, LOCK_FD_ENV

# Environment variables that packages read while they are imported (a server imported under other values would
# not be what a fresh process of this job imports): a job whose values differ gets a server of its own. Not the
# thread counts (import_state.THREAD_COUNTS): a child sets its libraries' counts from its job's (one server serves
# jobs of any thread count). The locale's too: Python takes its character encoding from them as it starts.
IMPORT_TIME_ENV = ("PYTHON", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_", "CUBLAS_", "NVIDIA_", "OMP_",
                   "MKL_", "OPENBLAS_", "TOKENIZERS_", "TRITON_", "LD_", "KMP_", "SAFETENSORS_", "STAGEREPLAY_",
                   "LANG", "LC_")
# The packages whose code the server imports: a job that would find another copy gets a server of its own.
FOUND = ("stagereplay", "torch", "transformers", "tokenizers", "safetensors", "numpy", "snakemake",
         "huggingface_hub", "scipy")
OWN_ENV = (CHILD_ENV, LOCK_FD_ENV, RUN_ENV)


def server_key(env: dict | None = None, preload: tuple[str, ...] = ()) -> str:
    """What a server's imports depend on, as a short digest: the modules it imports (``preload``), the
    interpreter, where the packages it imports are found (and the stat record of each one's entry file), the stat
    records of this package's source files, and the import-time environment. (Not ``sys.path`` itself: its first
    entry is the script's folder, another for the server than for a job.) And the job's control groups: a child
    stays in its server's (their memory and CPU limits), which it may not leave for its job's."""
    import importlib.util

    env = os.environ if env is None else env
    package = Path(__file__).resolve().parents[1]
    files = sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in package.rglob("*.py"))
    found = []
    for name in FOUND:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None and spec.origin else None
        found.append((name, origin, os.stat(origin).st_mtime_ns if origin and os.path.exists(origin) else None))
    imported_with = sorted((k, v) for k, v in env.items()
                           if k.startswith(IMPORT_TIME_ENV) and k not in OWN_ENV and k not in THREAD_COUNTS)
    parts = {"preload": list(preload), "python": sys.executable, "version": sys.version, "found": found,
             "files": files, "env": imported_with, "thread_env": keyed(env), "cgroups": control_groups()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:KEY_CHARS]


def loaded_files() -> list[tuple[str, int, int]]:
    """The files of the modules this process has imported (Python sources and extension libraries; a module
    without a file of its own, or with a relative one, has none) with their modification times and sizes."""
    records = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path):
            try:
                st = os.stat(path)
            except OSError:
                continue
            records.append((path, st.st_mtime_ns, st.st_size))
    return sorted(set(records))


def changed_file(records: list[tuple[str, int, int]]) -> str | None:
    """The first of ``records`` (from :func:`loaded_files`) whose file changed or is gone since; None when none."""
    for path, mtime_ns, size in records:
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
            return path
    return None


def control_groups() -> str:
    """This process's control groups (Linux's /proc/self/cgroup; empty where there is none)."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""
