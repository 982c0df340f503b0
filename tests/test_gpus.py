"""The GPU-slot allocator's logic, on CPU: the number of visible GPUs is passed in, locks are real files."""

import subprocess
import sys
import textwrap

import pytest

from stagereplay.models.gpus import GpuSlotTimeout, claim_gpu, visible_gpus


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_an_explicit_device_claims_nothing(device, tmp_path):
    slot = claim_gpu(device, n_visible=4, lock_dir=tmp_path)
    assert slot.device == device and not slot.claimed and not list(tmp_path.iterdir())


@pytest.mark.parametrize("n", [0, 1])
def test_one_gpu_or_none_claims_nothing(n, tmp_path):
    slot = claim_gpu("auto", n_visible=n, lock_dir=tmp_path)
    assert slot.device == "auto" and not slot.claimed
    assert slot.record()["claimed"] is False


def test_each_claim_gets_its_own_gpu_and_waits_when_all_are_taken(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slots = [claim_gpu("auto", n_visible=3, lock_dir=tmp_path) for _ in range(3)]
    assert [s.device for s in slots] == ["cuda:0", "cuda:1", "cuda:2"]
    assert all(s.claimed for s in slots)
    with pytest.raises(GpuSlotTimeout, match=r"all 3 visible GPUs \(0, 1, 2\) stayed claimed.*--resources gpu=3"):
        claim_gpu("cuda", n_visible=3, lock_dir=tmp_path, timeout_s=0)
    slots[1].release()
    with claim_gpu("cuda", n_visible=3, lock_dir=tmp_path, timeout_s=0) as again:
        assert again.device == "cuda:1" and again.record()["visible_index"] == 1
    assert claim_gpu("auto", n_visible=3, lock_dir=tmp_path, timeout_s=0).device == "cuda:1"  # released by `with`


def test_locks_follow_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,GPU-abc/6")
    assert visible_gpus(2) == ["4", "GPU-abc/6"]
    first = claim_gpu("auto", n_visible=2, lock_dir=tmp_path)
    second = claim_gpu("auto", n_visible=2, lock_dir=tmp_path)
    assert (first.device, first.gpu) == ("cuda:0", "4")
    assert (second.device, second.gpu) == ("cuda:1", "GPU-abc/6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-4.lock", "gpu-GPU-abc_6.lock"]
    assert second.record()["visible"] == ["4", "GPU-abc/6"]


def test_a_lock_held_by_another_process_is_respected_and_freed_when_it_dies(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from stagereplay.models.gpus import claim_gpu
        slot = claim_gpu("auto", n_visible=2, lock_dir={str(tmp_path)!r})
        print(slot.device, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "cuda:0"
        mine = claim_gpu("auto", n_visible=2, lock_dir=tmp_path, timeout_s=0)
        assert mine.device == "cuda:1"
        mine.release()
    finally:
        holder.kill()
        holder.wait()
    # the killed holder's lock went with it
    assert claim_gpu("auto", n_visible=2, lock_dir=tmp_path, timeout_s=0).device == "cuda:0"


def test_reconstruct_prefixes_runs_on_its_claimed_gpu_and_records_it(tmp_path, tiny_model_dir, monkeypatch):
    """Two visible GPUs, the first held by another job: the stage loads the model on cuda:1 and says so in
    provenance (the model itself is moved to the CPU here, where there is no GPU)."""
    import torch

    from stagereplay.io.parquet import read_provenance
    from stagereplay.models import opening
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.select import select_items
    from stagereplay.stages.settings import ReconstructSettings, from_params

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("STAGEREPLAY_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    other_job = claim_gpu("auto", lock_dir=tmp_path / "locks")
    assert other_job.device == "cuda:0"
    asked = []
    real_load = opening.load_model

    def load_on_cpu(source, precision, device, *args, **kwargs):
        asked.append(device)
        return real_load(source, precision, "cpu", *args, **kwargs)

    monkeypatch.setattr(opening, "load_model", load_on_cpu)
    select_items({"source": "synthetic", "size": 20, "seed": 0}, 1, 0, str(tmp_path / "items.parquet"))
    settings = from_params(ReconstructSettings, dict(
        model=str(tiny_model_dir), revision="local", precision="fp32", boundary={"marker": ";"}, max_stage_tokens=4,
        max_new_tokens=2, device="auto", progress=False, bridge={"n_rows": 0, "seed": 0}))
    reconstruct_prefixes(str(tmp_path / "items.parquet"), str(tmp_path / "ledger.parquet"),
                         str(tmp_path / "prefixes.parquet"), str(tmp_path / "bridge.parquet"), settings)
    assert asked == ["cuda:1"]
    slot = read_provenance(tmp_path / "ledger.parquet")["gpu_slot"]
    assert (slot["device"], slot["claimed"], slot["gpu"], slot["visible"]) == ("cuda:1", True, "1", ["0", "1"])
    # the stage let its GPU go when it finished
    assert claim_gpu("auto", lock_dir=tmp_path / "locks", timeout_s=0).device == "cuda:1"
