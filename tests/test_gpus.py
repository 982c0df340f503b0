"""The GPU-slot allocator's logic, on CPU: the number of visible GPUs is passed in, locks are real files."""

import subprocess
import sys
import textwrap

import pytest

from stagereplay.gpus import GpuSlotTimeout, claim_gpu, visible_gpus


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
        from stagereplay.gpus import claim_gpu
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
