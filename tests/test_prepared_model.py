"""The prepared model: a revision's source (GGUF file, local folder) written once as a safetensors snapshot per
precision, which every model-loading job loads instead of the source and which must give the very same results."""

import json
import os
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from gguf_fixture import write_tiny_gguf
from stagereplay.io.file_hashes import HashCache
from stagereplay.io.parquet import read_provenance
from stagereplay.models import signatures, snapshot
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource
from stagereplay.stages.prepare import prepare_model
from stagereplay.stages.reconstruct import reconstruct_prefixes
from stagereplay.stages.select import select_items
from stagereplay.stages.settings import PrepareSettings, ReconstructSettings


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(folder / "tiny.gguf")
    return ModelSource("gguf", str(folder), gguf_file="tiny.gguf")


def state_bytes(loaded) -> dict[str, bytes]:
    return {name: t.contiguous().view(torch.uint8).numpy().tobytes() + str(t.dtype).encode()
            for name, t in loaded.model.state_dict().items()}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gguf_snapshot_loads_as_the_gguf_does(gguf_source, tmp_path, precision):
    set_determinism(1)
    manifest = snapshot.prepare_snapshot(gguf_source, precision, tmp_path / precision)
    assert manifest["mode"] == "converted" and manifest["tokenizer_class"] == "Qwen2Tokenizer"
    direct = load_model(gguf_source, precision, "cpu", "sdpa")
    prepared = snapshot.load_prepared(tmp_path / precision, gguf_source, precision, "cpu", "sdpa")
    assert state_bytes(prepared) == state_bytes(direct)  # bytes and dtype of every tensor, in its own words
    assert signatures.compare_signatures(signatures.model_signature(direct), signatures.model_signature(prepared)) == []
    assert prepared.info["model_source"] == direct.info["model_source"] == gguf_source.describe()
    assert prepared.info["model_snapshot"]["sha256"] == manifest["snapshot"]["sha256"]
    assert manifest["weights_sha256"] == snapshot.weights_sha256(signatures.tensor_digests(direct.model))


def test_the_check_sees_a_tokenizer_that_only_differs_in_its_normaliser(gguf_source, tmp_path):
    # Loaded by AutoTokenizer, the saved GGUF tokenizer gets its model class's pipeline (an NFC normaliser the GGUF
    # has not): ids agree on ASCII, yet the snapshot would not be the source. The verbatim loader keeps the GGUF's.
    snapshot.prepare_snapshot(gguf_source, "fp32", tmp_path / "fp32")
    direct = signatures.model_signature(load_model(gguf_source, "fp32", "cpu"))
    by_class = load_model(ModelSource("local", str(tmp_path / "fp32")), "fp32", "cpu")
    assert by_class.tokenizer.backend_tokenizer.normalizer is not None
    problems = signatures.compare_signatures(direct, signatures.model_signature(by_class))
    assert len(problems) == 1 and problems[0].startswith("tokenizer differs in") and "pipeline" in problems[0]


def tokenizer_state(tokenizer) -> dict:
    """A tokenizer as a job sees it, beyond its signature: class, added tokens and special tokens with their
    flags, the keywords it was built with."""
    return {"class": type(tokenizer).__name__, "signature": signatures.tokenizer_signature(tokenizer),
            "added": {i: repr(t) for i, t in tokenizer.added_tokens_decoder.items()},
            "special": {k: repr(v) for k, v in tokenizer._special_tokens_map.items()},
            "extra_special": [repr(t) for t in tokenizer._extra_special_tokens],
            "init_kwargs": {k: repr(v) for k, v in tokenizer.init_kwargs.items()},
            "split_special_tokens": tokenizer.split_special_tokens, "name_or_path": tokenizer.name_or_path}


def test_the_snapshot_tokenizer_is_what_from_pretrained_makes_of_its_pipeline(gguf_source, tmp_path):
    """The verbatim loader spares ``from_pretrained`` reading tokenizer.json twice more
    (``compat.tokenizer_object_keywords``); the tokenizer must be the one the plain call gives, and encode as the
    GGUF's own does. A legacy special_tokens_map.json, which only the skipped branch reads, turns the shortcut off."""
    from tokenizers import Tokenizer
    from transformers import Qwen2Tokenizer

    from stagereplay.models import compat

    folder = tmp_path / "bf16"
    snapshot.prepare_snapshot(gguf_source, "bf16", folder)
    load = snapshot.verbatim_tokenizer("Qwen2Tokenizer")

    def plain():
        pipeline = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return Qwen2Tokenizer.from_pretrained(str(folder), tokenizer_object=pipeline)

    assert set(compat.tokenizer_object_keywords(folder, Tokenizer.from_file(str(folder / "tokenizer.json")))) \
        == {"added_tokens_decoder", "tokenizer_file"}  # the shortcut is taken for a snapshot as written
    fast = load(str(folder))
    assert tokenizer_state(fast) == tokenizer_state(plain())
    assert fast.backend_tokenizer.normalizer is None  # the GGUF's pipeline, not the class's (NFC)
    source = load_model(gguf_source, "bf16", "cpu").tokenizer
    texts = [*signatures.PROBE_TEXTS, "12 + 7 = 19\n\n<|im_start|>user\ncaf\u00e9 <think>x</think>"]
    for text in texts:
        assert fast(text)["input_ids"] == source(text)["input_ids"], text
        assert fast.decode(fast(text)["input_ids"]) == source.decode(source(text)["input_ids"]), text
    assert fast.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True) == \
        source.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True)

    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|im_start|>"}))
    assert compat.tokenizer_object_keywords(folder, None) == {}
    legacy = load(str(folder))
    assert legacy.pad_token == "<|im_start|>" and tokenizer_state(legacy) == tokenizer_state(plain())


def test_a_snapshot_that_does_not_reproduce_its_source_is_not_kept(tiny_model_dir, tmp_path, monkeypatch):
    """A folder converted to another dtype: written from the loaded source, loaded back, compared with it."""
    write = snapshot._write_converted

    def write_then_perturb(loaded, source, folder, out):
        with torch.no_grad():
            loaded.model.model.norm.weight[0] += 1
        write(loaded, source, folder, out)

    monkeypatch.setattr(snapshot, "_write_converted", write_then_perturb)
    with pytest.raises(snapshot.SnapshotError, match=r"1 tensors differ in bytes.*model\.norm\.weight"):
        snapshot.prepare_snapshot(ModelSource("local", str(tiny_model_dir)), "bf16", tmp_path / "bf16")
    assert os.listdir(tmp_path) == []  # nothing half-written left behind


def test_a_gguf_snapshot_that_does_not_load_as_written_is_not_kept(gguf_source, tmp_path, monkeypatch):
    """A GGUF converted directly: every precision loaded back and refused unless it is the tensors written."""
    from stagereplay.models import gguf_convert
    from safetensors.torch import load_file, save_file

    convert = gguf_convert.convert_gguf

    def convert_then_perturb(path, outs, **kwargs):
        made = convert(path, outs, **kwargs)
        weights = Path(outs["fp32"]) / "model.safetensors"
        tensors = load_file(weights)
        tensors["model.norm.weight"][0] += 1
        save_file(tensors, weights, metadata={"format": "pt"})
        return made

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert_then_perturb)
    with pytest.raises(snapshot.SnapshotError, match=r"at fp32 does not load as it was written: 1 tensors differ "
                                                     r"\(\['model\.norm\.weight'\]\)"):
        snapshot.write_snapshots(gguf_source, {"bf16": tmp_path / "bf16", "fp32": tmp_path / "fp32"})


def test_a_folder_in_the_dtype_is_linked_another_converted(tiny_model_dir, tmp_path):
    source = ModelSource("local", str(tiny_model_dir))  # saved in fp32
    linked = snapshot.prepare_snapshot(source, "fp32", tmp_path / "fp32")
    converted = snapshot.prepare_snapshot(source, "bf16", tmp_path / "bf16")
    assert linked["mode"] == "linked" and converted["mode"] == "converted"
    weights = tmp_path / "fp32" / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (tiny_model_dir / "model.safetensors").resolve()
    assert not (tmp_path / "bf16" / "model.safetensors").is_symlink()
    # config and tokenizer files are the source's, byte for byte; the weights are the bf16 ones
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "bf16" / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    for precision in ("fp32", "bf16"):
        direct = load_model(source, precision, "cpu")
        prepared = snapshot.load_prepared(tmp_path / precision, source, precision, "cpu")
        assert state_bytes(prepared) == state_bytes(direct), precision


def test_a_changed_or_foreign_snapshot_is_refused(tiny_model_dir, tmp_path):
    source = ModelSource("local", str(tiny_model_dir))
    fingerprint = {"sha256": "a" * 64, "files": {}}
    snapshot.prepare_snapshot(source, "bf16", tmp_path / "bf16", source_fingerprint=fingerprint)
    with pytest.raises(snapshot.SnapshotError, match="holds a snapshot at 'bf16'.*not at 'fp32'"):
        snapshot.load_prepared(tmp_path / "bf16", source, "fp32", "cpu")
    with pytest.raises(snapshot.SnapshotError, match="was prepared from .* not from .* as this job was planned"):
        snapshot.load_prepared(tmp_path / "bf16", source, "bf16", "cpu", source_fingerprint={"sha256": "b" * 64})
    config = tmp_path / "bf16" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    with pytest.raises(snapshot.SnapshotError, match="config.json not the files it was prepared with"):
        snapshot.load_prepared(tmp_path / "bf16", source, "bf16", "cpu", source_fingerprint=fingerprint)


def test_the_reconstruct_stage_gives_the_same_tables_from_the_snapshot(gguf_source, tmp_path):
    """The stage as the workflow runs it: prepare_model, then reconstruct_prefixes from the snapshot, against the
    same stage loading the GGUF file itself; every table equal value for value (provenance aside)."""
    select_items({"source": "synthetic", "size": 20, "seed": 0}, 3, 0, str(tmp_path / "items.parquet"))
    common = dict(model=str(Path(gguf_source.path) / gguf_source.gguf_file), revision="primary", device="cpu",
                  progress=False, threads=1)
    record = str(tmp_path / "models" / "primary.json")
    prepare_model(record, PrepareSettings(**common, precisions=["bf16"], model_store=str(tmp_path / "store")))
    tables = {}
    for arm, prepared in (("direct", None), ("prepared", record)):
        out = tmp_path / arm
        out.mkdir()
        reconstruct_prefixes(str(tmp_path / "items.parquet"), str(out / "ledger.parquet"),
                             str(out / "prefixes.parquet"), str(out / "bridge.parquet"),
                             ReconstructSettings(**common, prepared_models=prepared, precision="bf16",
                                                 boundary={"marker": "K", "occurrence": 1}, max_stage_tokens=6,
                                                 max_new_tokens=6, bridge={"n_rows": 2, "seed": 0}))
        tables[arm] = {name: pq.read_table(out / f"{name}.parquet") for name in ("ledger", "prefixes", "bridge")}
    for name, table in tables["direct"].items():
        assert table.num_rows > 0 and table.equals(tables["prepared"][name]), name
    assert {r["status"] for r in tables["direct"]["ledger"].to_pylist()} >= {"ok"}  # prefill rows exercised
    prov = read_provenance(tmp_path / "prepared" / "ledger.parquet")
    assert prov["model_snapshot"]["mode"] == "converted" and prov["model_source"].endswith("tiny.gguf")
    assert "model_snapshot" not in read_provenance(tmp_path / "direct" / "ledger.parquet")


def assert_each_precision_prepared_once_and_loaded_by_every_job(workdir, cfg):
    """A finished workflow run in ``workdir`` (on ``cfg``): one snapshot per precision in the model store, named by
    the run's record, and every model-loading stage recorded that it loaded one of those. `tests/test_workflow.py`'s
    end-to-end run calls it, so that the suite runs the whole workflow once for both."""
    results = Path(workdir) / "results" / cfg["run"]
    record = json.loads((results / "models" / "primary.json").read_text())
    entries = {precision: Path(record["store"]) / snap["key"] for precision, snap in record["snapshots"].items()}
    assert sorted(entries) == sorted(cfg["precisions"])
    for precision, entry in entries.items():
        manifest = json.loads((entry / snapshot.MANIFEST).read_text())
        assert manifest["source"].endswith("data/toy/primary") and manifest["precision"] == precision
        assert not entry.is_relative_to(Path(workdir) / "results")
    # the toy is saved in fp32: its fp32 snapshot is links, its bf16 one converted weights
    assert (entries["fp32"] / "model.safetensors").is_symlink()
    loaded_from = {}
    for path in results.rglob("*.parquet"):
        prov = read_provenance(path)
        models = [{**m, "stage": prov["stage"]} for m in prov.get("models", [])]  # one job, several precisions
        for record in [prov, *prov.get("parts", []), *models]:
            if "model_source" in record:
                loaded_from.setdefault(record["stage"], set()).add(record["model_snapshot"]["path"])
    assert set(loaded_from) >= {"reconstruct_prefixes", "generate_fixed_prefix", "audit_ledger",
                                "measure_cache_differences"}
    assert set().union(*loaded_from.values()) <= {str(entry) for entry in entries.values()}
    audit = pd.read_parquet(results / "primary" / "audit.parquet")
    assert len(audit) > 0 and audit["reproduced"].all()


def test_the_preflight_reads_a_gguf_through_its_current_snapshot(gguf_source, tmp_path):
    """Reading a GGUF's config and tokenizer takes most of a minute at a real vocabulary: the preflight reads them
    from a prepared snapshot made from the GGUF's current bytes, and from the GGUF itself when there is none or
    the GGUF has changed since."""
    import shutil

    from stagereplay.stages.input_fingerprints import model_fingerprint
    from stagereplay.stages.preflight import check_run
    from test_bad_inputs_data import valid_config

    gguf = tmp_path / "model.gguf"
    shutil.copy(Path(gguf_source.path) / gguf_source.gguf_file, gguf)
    source = ModelSource("gguf", str(tmp_path), gguf_file="model.gguf")
    cfg = valid_config(model=str(gguf), revisions=["local"], n_items=3, precisions=["bf16"])
    cache = HashCache(tmp_path / "hashes.json")
    fingerprint = model_fingerprint(str(gguf), "local", cache=cache)
    folder = tmp_path / "models/local/bf16"

    def checked(fp):
        summary = check_run(cfg, prepared={"local": [folder]}, fingerprints={"local": fp}, cache=cache)
        return summary["revisions"]["local"]

    assert checked(fingerprint)["checked_from"] == "source"  # nothing prepared yet
    snapshot.prepare_snapshot(source, "bf16", folder, source_fingerprint=fingerprint, cache=cache)
    through_snapshot = checked(fingerprint)
    assert through_snapshot["checked_from"] == str(folder)
    directly = check_run(cfg)["revisions"]["local"]
    assert directly["checked_from"] == "source"
    assert {k: v for k, v in through_snapshot.items() if k != "checked_from"} == \
        {k: v for k, v in directly.items() if k != "checked_from"}  # the same context and prompt lengths

    write_tiny_gguf(gguf, seed=1)  # other weights in the same file: the snapshot no longer stands for it
    changed = model_fingerprint(str(gguf), "local", cache=cache)
    assert changed["sha256"] != fingerprint["sha256"]
    assert checked(changed)["checked_from"] == "source"
