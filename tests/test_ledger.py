"""The whole-cache fingerprint (a hash list over the tensors' sha256 digests, scheme sha256-list-v2) and the
refusal of files whose cache fingerprints were made by another scheme."""

import hashlib
import json
import struct

import pandas as pd
import pytest
import torch

from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io import cache_dumps, fingerprints, provenance
from stagereplay.io.fingerprints import (
    CACHE_FINGERPRINT_SCHEME,
    SCHEME_KEY,
    FingerprintSchemeError,
    check_fingerprint_scheme,
    fingerprint_layers,
)
from stagereplay.io.parquet import write_parquet
from stagereplay.stages.gather import PREFIX_SCHEMA

from test_tampering import ledger_rows


def cache_layers(n_layers=5, shape=(1, 2, 7, 16), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=g).to(dtype) for _ in range(2)) for _ in range(n_layers)]


def raw_bytes(layers):
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for pair in layers for t in pair]


def by_hand(layers) -> str:
    """The definition, computed here with hashlib alone: sha256 over tag, uint64 count, the 32-byte digests."""
    digests = [hashlib.sha256(b).digest() for b in raw_bytes(layers)]
    return hashlib.sha256(b"stagereplay-cache-v2\0" + struct.pack("<Q", len(digests)) + b"".join(digests)).hexdigest()


@pytest.mark.parametrize("threshold", [0, 1 << 62])  # always in threads; never
def test_whole_fingerprint_is_sha256_over_the_digest_list(monkeypatch, threshold):
    monkeypatch.setattr(fingerprints, "PARALLEL_HASH_BYTES", threshold)
    layers = cache_layers()
    whole, ks, vs = fingerprint_layers(layers)
    assert whole == by_hand(layers)
    raw = raw_bytes(layers)
    # the per-layer fingerprints are unchanged: the plain sha256 of each tensor's bytes
    assert ks == [hashlib.sha256(b).hexdigest() for b in raw[0::2]]
    assert vs == [hashlib.sha256(b).hexdigest() for b in raw[1::2]]
    # never the plain sha256 of the bytes (the older sequential scheme)
    assert whole != hashlib.sha256(b"".join(raw)).hexdigest()


def test_same_fingerprints_with_and_without_threads(monkeypatch):
    layers = cache_layers(n_layers=24, shape=(1, 2, 64, 32))  # many tensors of unequal finishing order
    results = []
    for threshold in (0, 1 << 62, 0, 0):
        monkeypatch.setattr(fingerprints, "PARALLEL_HASH_BYTES", threshold)
        results.append(fingerprint_layers(layers))
    assert all(r == results[0] for r in results) and results[0][0] == by_hand(layers)


@pytest.mark.parametrize("threshold", [0, 1 << 62])
def test_one_byte_changes_the_whole_and_only_its_layer(monkeypatch, threshold):
    monkeypatch.setattr(fingerprints, "PARALLEL_HASH_BYTES", threshold)
    layers = cache_layers()
    whole, ks, vs = fingerprint_layers(layers)
    changed = [(k.clone(), v.clone()) for k, v in layers]
    changed[3][1].view(torch.uint8).view(-1)[5] ^= 0x01  # one bit of one byte of layer 3's V
    whole2, ks2, vs2 = fingerprint_layers(changed)
    assert whole2 != whole and whole2 == by_hand(changed)
    assert ks2 == ks and [i for i in range(len(vs)) if vs[i] != vs2[i]] == [3]
    # swapping K and V of a layer (the same bytes in another order) changes it too
    swapped = [(v, k) if i == 0 else (k, v) for i, (k, v) in enumerate(layers)]
    assert fingerprint_layers(swapped)[0] != whole


def test_empty_cache_has_a_well_defined_fingerprint():
    whole, ks, vs = fingerprint_layers([])
    assert (ks, vs) == ([], [])
    assert whole == hashlib.sha256(b"stagereplay-cache-v2\0" + bytes(8)).hexdigest()
    assert whole != hashlib.sha256(b"").hexdigest()
    # empty tensors are still counted
    empty = [(torch.zeros(1, 2, 0, 16, dtype=torch.bfloat16),) * 2]
    assert fingerprint_layers(empty)[0] == by_hand(empty) != whole


def test_pending_fingerprints_equal_fingerprint_layers_on_the_host():
    layers = cache_layers(n_layers=6)
    assert fingerprints.PendingFingerprints(layers).result() == fingerprint_layers(layers) != fingerprint_layers(
        cache_layers(n_layers=6, seed=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred path runs on a GPU only")
def test_pending_fingerprints_on_a_gpu_are_of_the_bytes_when_called():
    """On a GPU the hashing waits for the device; it must fingerprint the cache as it was when the pending
    fingerprints were begun, not as later work on the stream leaves it. Control: the same tensors, written after the
    call, fingerprint differently, so the test would catch a lazy read of the live tensors."""
    layers = [tuple(t.cuda() for t in pair) for pair in cache_layers(n_layers=24, shape=(1, 2, 512, 64))]
    before = fingerprint_layers(layers)
    pending = fingerprints.PendingFingerprints(layers)
    for _ in range(20):  # queued after the copies: long enough to still run when the worker hashes
        layers[3][0].mul_(1.0001).add_(1.0)
    assert pending.result() == before
    assert fingerprint_layers(layers) != before


def test_the_scheme_is_recorded_in_provenance():
    assert provenance.software_versions()[SCHEME_KEY] == CACHE_FINGERPRINT_SCHEME == "sha256-list-v2"


# -- refusing files made by another scheme ----------------------------------------------------------------------

CURRENT = {"stage": "reconstruct_prefixes", SCHEME_KEY: CACHE_FINGERPRINT_SCHEME}
STALE = {
    "none recorded": {"stage": "reconstruct_prefixes"},
    "another scheme": {"stage": "reconstruct_prefixes", SCHEME_KEY: "sha256-seq-v1"},
    "a gathered file with one old part": {"stage": "gather", "parts": [CURRENT, {"stage": "generate_fixed_prefix"}]},
}


def write_ledger(path, provenance):
    write_parquet(ledger_rows(), path, provenance, LEDGER_SCHEMA)
    return path


@pytest.mark.parametrize("case", list(STALE))
def test_a_ledger_of_another_scheme_is_refused_naming_file_and_fix(tmp_path, case):
    path = write_ledger(tmp_path / "primary" / "ledger.parquet", STALE[case])
    with pytest.raises(FingerprintSchemeError) as err:
        check_fingerprint_scheme(path)
    message = str(err.value)
    assert message.startswith(f"{path}: its cache fingerprints were made by ")
    assert ("an older scheme" in message) == (case != "another scheme")
    assert "sha256-list-v2" in message and "delete results/<run>" in message
    # the rule to rerun: the one that wrote the old records (in a gathered file, its old parts' only)
    rerun = "generate_fixed_prefix" if case == "a gathered file with one old part" else "reconstruct_prefixes"
    assert message.endswith(f"`snakemake --forcerun {rerun}`")


def test_files_of_this_scheme_or_without_cache_fingerprints_pass(tmp_path):
    check_fingerprint_scheme(write_ledger(tmp_path / "a.parquet", CURRENT))
    check_fingerprint_scheme(write_ledger(tmp_path / "b.parquet", {"stage": "gather", "parts": [CURRENT, CURRENT]}))
    # token-id fingerprints did not change: a file without cache fingerprints passes whatever it records
    prefixes = pd.DataFrame([{"item_index": 0, "item_id": "a", "revision": "primary", "precision": "bf16",
                              "status": "ok", "prompt_ids": [1, 2], "stage_ids": [3], "prefix_fingerprint": "ab" * 32,
                              "gold_answer": "1"}], columns=PREFIX_SCHEMA.names)
    write_parquet(prefixes, tmp_path / "prefixes.parquet", {"stage": "reconstruct_prefixes"}, PREFIX_SCHEMA)
    check_fingerprint_scheme(tmp_path / "prefixes.parquet")


def entry_points(tmp_path, ledger_path, items_path):
    from stagereplay.stages.controls import audit_ledger, batch_invariance
    from stagereplay.stages.settings import (
        BatchInvarianceSettings,
        ControlSettings,
        DumpSettings,
        TransplantSettings,
        from_params,
    )
    from stagereplay.stages.transplant import dump_caches, transplant_caches

    common = dict(model="never-loaded", revision="primary")
    decode = dict(common, boundary={"token_id": 3}, max_stage_tokens=4, max_new_tokens=4)
    return {
        "audit_ledger": lambda: audit_ledger(
            items_path, ledger_path, tmp_path / "audit.parquet",
            from_params(ControlSettings, dict(decode, precision="bf16", reference_precision="bf16"))),
        "batch_invariance": lambda: batch_invariance(
            items_path, ledger_path, tmp_path / "bi.parquet",
            from_params(BatchInvarianceSettings, dict(decode, precisions=("bf16",), sample=1, sample_seed=0))),
        "dump_caches": lambda: dump_caches(
            ledger_path, tmp_path / "caches", tmp_path / "dumps.parquet",
            from_params(DumpSettings, dict(common, items="all", max_new_tokens=4))),
        "transplant_caches": lambda: transplant_caches(
            items_path, ledger_path, tmp_path / "transplant.parquet",
            from_params(TransplantSettings, dict(common, sweeps=("all",), precision="bf16", max_new_tokens=4))),
    }


@pytest.mark.parametrize("stage", ["audit_ledger", "batch_invariance", "dump_caches", "transplant_caches"])
def test_stages_that_compare_cache_fingerprints_refuse_an_old_ledger(tmp_path, stage):
    from stagereplay.decode.plans import batch_plan

    rows = ledger_rows()
    items = rows.drop_duplicates("item_index")[["item_index", "item_id"]].assign(question="q", answer="1")
    items_path = tmp_path / "items.parquet"
    write_parquet(items, items_path, {"stage": "select_items"})
    plan = batch_plan(list(items["item_id"]), 2, 0).record()  # batch_invariance compares batched ledgers only
    ledger_path = write_ledger(tmp_path / "ledger.parquet", {"stage": "reconstruct_prefixes", "batch_plan": plan})
    with pytest.raises(FingerprintSchemeError, match="its cache fingerprints were made by an older scheme") as err:
        entry_points(tmp_path, str(ledger_path), str(items_path))[stage]()
    assert str(err.value).startswith(f"{ledger_path}: ")
    assert str(err.value).endswith("`snakemake --forcerun reconstruct_prefixes`")
    written = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".sha256"))  # without hash records
    assert written == ["items.parquet", "ledger.parquet"]  # nothing written


def test_a_dump_records_its_scheme_and_one_of_another_scheme_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    layers = cache_layers(n_layers=3)
    path = tmp_path / "c.safetensors"
    written = cache_dumps.save_cache(path, layers, {"item_id": "x"})
    assert written["fingerprint_scheme"] == CACHE_FINGERPRINT_SCHEME and written["cache_fingerprint"] == by_hand(layers)
    assert cache_dumps.load_cache(path).meta["cache_fingerprint"] == by_hand(layers)
    tensors = load_file(str(path))
    for label, change in (("an older scheme", lambda m: m.pop("fingerprint_scheme")),
                          ("another scheme", lambda m: m.update(fingerprint_scheme="sha256-seq-v1"))):
        meta = dict(written)
        meta.pop("bytes")
        change(meta)
        old = tmp_path / f"{label.split()[0]}.safetensors"
        save_file(tensors, str(old), metadata={cache_dumps.METADATA_KEY: json.dumps(meta, sort_keys=True)})
        with pytest.raises(FingerprintSchemeError, match=f"made by {label}") as err:
            cache_dumps.load_cache(old)
        assert str(err.value).startswith(f"{old}: ") and "snakemake --forcerun dump_caches" in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the page-locked host copy is for CUDA tensors")
def test_a_gpu_cache_fingerprints_and_dumps_like_its_host_copy(tmp_path):
    layers = cache_layers(n_layers=4, shape=(1, 2, 9, 16), dtype=torch.bfloat16, seed=3)
    def in_a_buffer(t):  # a window of a longer static buffer: not contiguous
        buffer = torch.zeros(1, 2, 20, 16, dtype=t.dtype, device="cuda")
        buffer[:, :, 3:12] = t.cuda()
        return buffer[:, :, 3:12]

    strided = [(in_a_buffer(k), v.cuda()) for k, v in layers]
    assert not strided[0][0].is_contiguous()
    assert fingerprints.fingerprint_layers(strided) == fingerprints.fingerprint_layers(layers) == (
        by_hand(layers), [hashlib.sha256(b).hexdigest() for b in raw_bytes(layers)[0::2]],
        [hashlib.sha256(b).hexdigest() for b in raw_bytes(layers)[1::2]])
    written = cache_dumps.save_cache(tmp_path / "dump.safetensors", strided, {"item_index": 0})
    assert written["cache_fingerprint"] == by_hand(layers)
    loaded = cache_dumps.load_cache(tmp_path / "dump.safetensors")
    assert [fingerprints.tensor_bytes(k) for k, _ in loaded.layers] == [fingerprints.tensor_bytes(k) for k, _ in layers]
