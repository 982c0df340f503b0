"""Which job server a job may fork from: a server's key, a digest of everything its imports depend on. A job whose
key differs (other code, another interpreter or environment, other control groups) starts a server of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from stagereplay.runtime.import_state import THREAD_COUNTS, keyed
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
OWN_ENV = (CHILD_ENV, LOCK_FD_ENV)


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
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def control_groups() -> str:
    """This process's control groups (Linux's /proc/self/cgroup; empty where there is none)."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""
