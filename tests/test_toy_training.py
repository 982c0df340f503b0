"""The toy retrain check: a retrained revision matches the shipped weights byte for byte, or the check fails
naming the training conditions (torch build, CPU kernel set, threads) that differ; it never passes silently."""

import json
import shutil
from pathlib import Path

import pytest

from stagereplay.data.toy import ToyNotReproduced, check_reproduced

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data/toy"


def reproduced_copy(root: Path, weights: bytes | None = None, **record_changes) -> Path:
    """A stand-in for a retrained primary revision: the shipped record (with ``record_changes``) and weights."""
    folder = root / "primary"
    folder.mkdir(parents=True)
    record = json.loads((SHIPPED / "primary/training.json").read_text())
    record.update(record_changes)
    (folder / "training.json").write_text(json.dumps(record))
    if weights is None:
        shutil.copyfile(SHIPPED / "primary/model.safetensors", folder / "model.safetensors")
    else:
        (folder / "model.safetensors").write_bytes(weights)
    return root


def test_identical_weights_pass_with_the_conditions_of_both(tmp_path):
    result = check_reproduced("primary", reproduced_copy(tmp_path, cpu_capability="AVX512"), SHIPPED)
    assert result["identical"] is True and result["shipped_sha256"] == result["reproduced_sha256"]
    assert result["reproduced_conditions"] == {"torch": "2.13.0+cpu", "cpu_capability": "AVX512", "threads": 2}


def test_other_weights_fail_naming_the_kernel_set(tmp_path):
    root = reproduced_copy(tmp_path, weights=b"retrained elsewhere", cpu_capability="AVX2")
    with pytest.raises(ToyNotReproduced) as caught:
        check_reproduced("primary", root, SHIPPED)
    message = str(caught.value)
    shipped_cpu = json.loads((SHIPPED / "primary/training.json").read_text()).get("cpu_capability")
    assert f"cpu_capability {shipped_cpu!r} (shipped) vs 'AVX2' (here)" in message
    assert "torch '" not in message  # the same build: not named among the differences
    assert "ATEN_CPU_CAPABILITY" in message


def test_other_weights_under_the_same_conditions_fail_as_a_real_difference(tmp_path):
    shipped_cpu = json.loads((SHIPPED / "primary/training.json").read_text()).get("cpu_capability")
    root = reproduced_copy(tmp_path, weights=b"retrained elsewhere", cpu_capability=shipped_cpu)
    with pytest.raises(ToyNotReproduced, match="so this is a real difference"):
        check_reproduced("primary", root, SHIPPED)
