"""GPU slots on one host: every running job gets a GPU of its own.

When several GPUs are visible and the device is ``auto`` or ``cuda`` (no index), a job claims one by taking
an exclusive ``flock`` on one lock file per GPU in a lock folder that all jobs of the host share. The lock
lives as long as the claim (the job): the operating system drops it when the process ends, crashes
included, so a killed job never leaves a GPU claimed. A job that finds every GPU taken waits for one to
free up (Snakemake's ``--resources gpu=N`` keeps that from happening when each job declares ``gpu: 1``).

One visible GPU (a cluster job given its own by the scheduler), an explicit ``cuda:N`` or ``cpu`` claim
nothing. Knows nothing of models or Snakemake; the claim is recorded in each output's provenance.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("stagereplay")

LOCK_DIR_ENV = "STAGEREPLAY_GPU_LOCK_DIR"


class GpuSlotTimeout(RuntimeError):
    """Every visible GPU stayed claimed by other jobs for longer than the caller would wait."""


def default_lock_dir() -> Path:
    """``$STAGEREPLAY_GPU_LOCK_DIR``, else a per-user folder in the system temp dir (shared by the user's jobs)."""
    if os.environ.get(LOCK_DIR_ENV):
        return Path(os.environ[LOCK_DIR_ENV])
    return Path(tempfile.gettempdir()) / f"stagereplay-gpu-locks-{os.getuid()}"


def visible_gpus(count: int) -> list[str]:
    """Names of the ``count`` visible GPUs: their ``CUDA_VISIBLE_DEVICES`` entries (index or UUID) when set,
    else ``0..count-1``. The lock file is named after it, so jobs that see the same GPU share its lock."""
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if len(entries) >= count:
        return entries[:count]
    return [str(i) for i in range(count)]


@dataclass
class GpuSlot:
    """The device a job runs on, and the GPU lock it holds (if it claimed one)."""

    device: str  # what to pass on: "cuda:1", or the device asked for when nothing was claimed
    visible_index: int | None = None  # index among the visible GPUs (torch's cuda:N)
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES entry of that GPU
    visible: list[str] = field(default_factory=list)
    lock_path: str | None = None
    _handle: object = field(default=None, repr=False)

    @property
    def claimed(self) -> bool:
        return self._handle is not None

    def record(self) -> dict:
        """What provenance keeps: which GPU this job used and out of which."""
        return {"device": self.device, "claimed": self.claimed, "visible_index": self.visible_index,
                "gpu": self.gpu, "visible": list(self.visible), "host": os.uname().nodename}

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the flock
            self._handle = None

    def __enter__(self) -> "GpuSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _try_lock(path: Path):
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    return handle


def claim_gpu(device: str, n_visible: int | None = None, lock_dir: str | Path | None = None,
              timeout_s: float | None = None, poll_s: float = 2.0) -> GpuSlot:
    """Claim a GPU of its own for this job when ``device`` leaves the choice open and several are visible.

    ``n_visible`` defaults to ``torch.cuda.device_count()`` (tests pass it to run without a GPU). The claim
    lasts until :meth:`GpuSlot.release`, the end of a ``with`` block, or the end of the process.
    ``timeout_s`` None waits as long as it takes.
    """
    if device not in ("auto", "cuda"):
        return GpuSlot(device)
    if n_visible is None:
        import torch

        n_visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_visible <= 1:
        return GpuSlot(device, visible=visible_gpus(n_visible))
    names = visible_gpus(n_visible)
    folder = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    start = last_note = time.monotonic()
    while True:
        for index, name in enumerate(names):
            path = folder / f"gpu-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.lock"
            handle = _try_lock(path)
            if handle is not None:
                log.info("claimed GPU %s (cuda:%d of %d visible) with lock %s", name, index, n_visible, path)
                return GpuSlot(f"cuda:{index}", index, name, names, str(path), handle)
        waited = time.monotonic() - start
        if timeout_s is not None and waited >= timeout_s:
            raise GpuSlotTimeout(
                f"all {n_visible} visible GPUs ({', '.join(names)}) stayed claimed for {waited:.0f} s (locks in "
                f"{folder}); run at most as many jobs as GPUs (snakemake --resources gpu={n_visible} with "
                "gpus_per_job: 1), or remove stale lock holders"
            )
        if time.monotonic() - last_note >= 60:
            log.info("waiting for a free GPU: all %d claimed (locks in %s)", n_visible, folder)
            last_note = time.monotonic()
        time.sleep(poll_s)


def start_device(device: str):
    """Start CUDA on ``device`` in a background thread (the driver, the device's context, its lazy module loads),
    so that the start overlaps with reading the weights and the tokenizer; the first use of the device waits for
    it (torch's lazy start holds a lock). Returns the thread to join, or None where there is no GPU to start. A
    failure is left for that first use to raise, with the loader's message."""
    import threading

    import torch

    if device.startswith("cpu") or not torch.cuda.is_available():
        return None
    target = torch.device("cuda" if device == "auto" else device)

    def start():
        try:
            torch.empty(1, device=target)
        except Exception:  # noqa: BLE001 (the load's own use of the device raises it, with its context)
            pass

    thread = threading.Thread(target=start, name="cuda-start", daemon=True)
    thread.start()
    return thread
