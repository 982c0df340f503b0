"""Bad model inputs and run settings (docs/BAD_INPUTS.md): weights that do not match their config, a model
folder without a tokenizer, truncated weights, CUDA asked for where there is none, settings across keys that
cannot work, a results folder that is a file, and the checks of a dry run.

Each is caught before any result is computed and named with its fix; the checks run on the package functions,
and the workflow only where Snakemake itself is what is tested.
"""

import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from snakemake.utils import validate

from conftest import make_tiny_model
from gguf_fixture import write_tiny_gguf
from stagereplay.config import schema_file
from stagereplay.models.loading import load_model
from stagereplay.models.sources import ModelLoadError, ModelSource
from stagereplay.stages.preflight import check_model, check_run
from workflow_runner import snakemake, tiny_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = schema_file()  # the schema the workflow validates with


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("four") / "model", layers=4)


def copy_with_config(folder: Path, dest: Path, **changes) -> Path:
    """A copy of a model folder whose config.json has ``changes`` (the weights untouched)."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    if "num_hidden_layers" in changes:
        cfg["layer_types"] = ["full_attention"] * changes["num_hidden_layers"]
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def load_local(folder, precision="fp32"):
    return load_model(ModelSource("local", str(folder)), precision, "cpu")


def valid_config(**overrides):
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(n_items=4, dataset={"source": "synthetic", "size": 50, "seed": 0})
    cfg.update(overrides)
    validate(cfg, SCHEMA, set_default=True)
    cfg["model"] = str(REPO / cfg["model"]) if cfg["model"] == "data/toy" else cfg["model"]
    return cfg


# --- weights that do not match their config -----------------------------------------------------------------

def test_a_config_with_more_layers_than_the_weights_is_refused_naming_the_tensors(tmp_path, four_layers):
    folder = copy_with_config(four_layers, tmp_path / "six", num_hidden_layers=6)
    with pytest.raises(ModelLoadError) as err:
        load_local(folder)
    message = str(err.value)
    assert "24 tensors the config needs are missing from the weights" in message  # 2 layers x 12 tensors
    assert "model.layers.4.input_layernorm.weight" in message
    assert "and 18 more" in message  # the list is capped, the count is whole
    assert "restore the config.json saved with these weights" in message


def test_a_config_with_fewer_layers_or_other_sizes_is_refused_naming_the_tensors(tmp_path, four_layers):
    fewer = copy_with_config(four_layers, tmp_path / "three", num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match=r"12 tensors in the weights have no place .*model\.layers\.3\."):
        load_local(fewer)
    narrower = copy_with_config(four_layers, tmp_path / "narrow", intermediate_size=96)
    with pytest.raises(ModelLoadError) as err:
        load_local(narrower)
    assert "12 tensors have another shape than the config gives" in str(err.value)
    assert "model.layers.0.mlp.down_proj.weight ([64, 128] in the weights, [64, 96] by the config)" in str(err.value)


def test_tied_embeddings_saved_buffers_and_gguf_are_not_refused(tmp_path, four_layers):
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    # lm_head tied to the embeddings: not saved, not missing
    cfg = AutoConfig.from_pretrained(four_layers)
    cfg.tie_word_embeddings = True
    tied = tmp_path / "tied"
    Qwen2ForCausalLM(cfg).save_pretrained(tied)
    AutoTokenizer.from_pretrained(four_layers).save_pretrained(tied)
    loaded = load_local(tied)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()

    # an older checkpoint that saved each layer's rotary inv_freq buffer: transformers computes it, not unexpected
    old = tmp_path / "old"
    shutil.copytree(four_layers, old)
    weights = load_file(old / "model.safetensors")
    inv_freq = loaded.model.model.rotary_emb.inv_freq.clone()
    weights.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in range(4)})
    save_file(weights, old / "model.safetensors", metadata={"format": "pt"})
    load_local(old)

    write_tiny_gguf(tmp_path / "tiny.gguf")
    load_model(ModelSource("gguf", str(tmp_path), gguf_file="tiny.gguf"), "fp32", "cpu")


def test_a_gguf_whose_architecture_field_lies_is_refused_naming_the_tensors_left_over(tmp_path):
    """Qwen2's tensors labelled llama: transformers' loader dropped the six q/k/v biases and the logits changed."""
    write_tiny_gguf(tmp_path / "labelled-llama.gguf", architecture="llama")
    with pytest.raises(ModelLoadError, match=(
            r"labelled-llama.gguf.*: 6 GGUF tensors give no parameter of the 'llama' model its general.architecture "
            r"field names, and would be dropped: blk.0.attn_k.bias, blk.0.attn_q.bias, blk.0.attn_v.bias, "
            r"blk.1.attn_k.bias, blk.1.attn_q.bias, blk.1.attn_v.bias. The file's architecture field and its tensors "
            r"must describe the same model")):
        load_model(ModelSource("gguf", str(tmp_path), gguf_file="labelled-llama.gguf"), "fp32", "cpu")
    with pytest.raises(ModelLoadError, match=r"6 GGUF tensors give no parameter of the 'llama' model"):
        check_model(ModelSource("gguf", str(tmp_path), gguf_file="labelled-llama.gguf"))  # the preflight


@pytest.mark.parametrize("qtype,older_gguf", [("Q8_K", False), ("IQ2_XXS", True), ("TQ1_0", True), ("IQ1_M", True)])
def test_a_gguf_tensor_of_a_type_that_cannot_be_read_is_refused_by_the_preflight_from_the_header(
        tmp_path, monkeypatch, qtype, older_gguf):
    """A type gguf-py cannot dequantise ended in "cannot reshape array of size 0" while loading: the gguf-py the
    issue was found with gave an empty array for IQ2_XXS, TQ1_0 and IQ1_M (played here), this one raises for Q8_K."""
    import gguf.quants

    from stagereplay.models import gguf_files

    if older_gguf:
        dequantize = gguf.quants.dequantize
        monkeypatch.setattr(gguf.quants, "dequantize", lambda data, kind: np.empty(0, dtype=np.float32)
                            if kind.name == qtype else dequantize(data, kind))
    gguf_files.dequantizable.cache_clear()
    write_tiny_gguf(tmp_path / "q.gguf", raw_types={"blk.0.attn_q.weight": qtype})
    source = ModelSource("gguf", str(tmp_path), gguf_file="q.gguf")
    try:
        with pytest.raises(ModelLoadError, match=(
                r"GGUF file .*q.gguf: 1 tensors cannot be read \(transformers dequantises a GGUF through gguf-py "
                rf"[0-9.]+\): blk.0.attn_q.weight \({qtype}, which gguf-py cannot dequantise\). Use a file "
                "quantised to a type it reads")):
            check_model(source)
        write_tiny_gguf(tmp_path / "f32.gguf")
        check_model(ModelSource("gguf", str(tmp_path), gguf_file="f32.gguf"))
    finally:
        gguf_files.dequantizable.cache_clear()


# --- the preflight: what it refuses before any job -----------------------------------------------------------

def test_a_model_folder_without_tokenizer_files_is_refused_by_the_preflight(tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(REPO / "data/toy/primary" / name, folder / name)
    with pytest.raises(ModelLoadError, match=r"has no usable tokenizer: it turns '0123456789' into no tokens "
                                             r"\(tokenizer files found: none\)"):
        check_model(ModelSource("local", str(folder)))


def test_cuda_asked_for_where_there_is_none_is_refused_by_the_preflight(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"device 'cuda' was asked for but CUDA is not available on this "
                                             r"machine .*; set device: cpu or auto"):
        check_run(valid_config(device="cuda"))
    # a cluster's submit host need not have the GPU its jobs get
    assert check_run(valid_config(device="cuda"), jobs_run_here=False)["n_items"] == 4


def test_triton_options_for_jobs_on_the_cpu_are_refused_by_the_preflight(monkeypatch):
    """decode_attention: triton and decode_kernels: fused run Triton kernels on a GPU: where the jobs run here on
    the CPU (device cpu, or auto without a GPU) the preflight refuses them before any job; a cluster's submit host
    need not have the GPU."""
    from stagereplay.decode.protocol import RegimeError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, name, value, default in (("cpu", "decode_attention", "triton", "masked"),
                                         ("auto", "decode_kernels", "fused", "library")):
        with pytest.raises(RegimeError, match=f"{name} '{value}' runs Triton kernels on a CUDA device and the model "
                                              f"is on the CPU: use {name} {default} there"):
            check_run(valid_config(device=device, decode_regime="static", **{name: value}))
    assert check_run(valid_config(device="cuda", decode_regime="static", decode_kernels="fused"), jobs_run_here=False)


def truncate(path: Path, n_bytes: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - n_bytes])


def test_truncated_weights_are_refused_by_the_preflight_from_the_header_alone(tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(REPO / "data/toy/primary", folder)
    size = (folder / "model.safetensors").stat().st_size
    truncate(folder / "model.safetensors", 1000)
    with pytest.raises(ModelLoadError, match=rf"model.safetensors is truncated: it has {size - 1000} bytes, its "
                                             rf"header describes {size} \(\d+ tensors\); copy or download it again"):
        check_model(ModelSource("local", str(folder)))
    truncate(folder / "model.safetensors", size - 1000 - 100)  # cut inside the header
    with pytest.raises(ModelLoadError, match="is truncated or not a safetensors file: its header claims"):
        check_model(ModelSource("local", str(folder)))


def test_a_sharded_checkpoint_missing_a_shard_is_refused(tmp_path, four_layers):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(four_layers).save_pretrained(folder, max_shard_size="100KB")
    shutil.copy(four_layers / "tokenizer.json", folder)
    shutil.copy(four_layers / "tokenizer_config.json", folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    check_model(ModelSource("local", str(folder)))  # whole: accepted, every shard's header read
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=rf"names weight files that are not in .*\['{shards[-1].name}'\]"):
        check_model(ModelSource("local", str(folder)))


def test_the_weights_check_reads_headers_only(tmp_path, monkeypatch):
    """A 2 GB file whose header describes 2 GB of data is accepted in a few reads of its first bytes."""
    from stagereplay.models.sources import check_safetensors_file

    header = json.dumps({"w": {"dtype": "F32", "shape": [2**29], "data_offsets": [0, 2**31]}}).encode()
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2**31)  # sparse: no data written
    start = time.perf_counter()
    check_safetensors_file(path)
    assert time.perf_counter() - start < 1.0


def test_prefix_precision_outside_precisions_is_refused():
    from stagereplay.stages.preflight import check_prefix_precision

    check_prefix_precision(None, ["bf16"])
    check_prefix_precision("fp32", ["bf16", "fp32"])
    with pytest.raises(ValueError, match=r"cache_differences.prefix_precision: 'fp16' is not one of precisions "
                                         r"\['bf16', 'fp32'\]"):
        check_prefix_precision("fp16", ["bf16", "fp32"])
    with pytest.raises(ValueError, match="prefix_precision: 'fp32'"):
        check_run(valid_config(precisions=["bf16"], cache_differences={"prefix_precision": "fp32"}))


def test_the_workflow_refuses_a_prefix_precision_outside_precisions_when_parsed(tmp_path):
    tiny_config(tmp_path, precisions=["bf16"], cache_differences={"n_items": 2, "prefix_precision": "fp32"})
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert "cache_differences.prefix_precision: 'fp32' is not one of precisions ['bf16']" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


# --- the workflow: what Snakemake itself would get wrong -----------------------------------------------------

def test_a_results_folder_that_is_a_file_is_named_before_any_work(tmp_path):
    from stagereplay.stages.preflight import check_output_folders

    (tmp_path / "results").mkdir()
    (tmp_path / "results/tiny").write_text("not a folder")
    with pytest.raises(ValueError, match=r"results/tiny is a file, but the run writes its outputs into the folder "
                                         r".*results/tiny/: move or delete"):
        check_output_folders(tmp_path / "results/tiny")
    check_output_folders(tmp_path / "results/other", tmp_path / "logs/tiny")  # absent folders are fine

    tiny_config(tmp_path)
    proc = snakemake(tmp_path, "-n", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NotADirectoryError" not in output
    assert "results/tiny is a file, but the run writes its outputs into the folder results/tiny/" in output
    assert (tmp_path / "results/tiny").read_text() == "not a folder"


def test_a_dry_run_runs_the_preflight_and_says_so(tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(REPO / "data/toy/primary" / name, folder / name)
    tiny_config(tmp_path, model=str(folder), revisions=["local"])
    proc = snakemake(tmp_path, "-n", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Dry run: checking the inputs as a run does before its first job" in output
    assert "has no usable tokenizer" in output
    assert not (tmp_path / "results").exists()


def counted_checks(tmp_path, monkeypatch):
    """(list growing by one per check made, a record of passed checks, the config, its model's fingerprints)."""
    from stagereplay.io.file_hashes import HashCache
    from stagereplay.stages import preflight
    from stagereplay.stages.input_fingerprints import model_fingerprint

    made = []
    check_run_itself = preflight.check_run
    monkeypatch.setattr(preflight, "check_run", lambda *a, **k: made.append(1) or check_run_itself(*a, **k))
    cfg = valid_config(n_items=3)
    fingerprints = {"primary": model_fingerprint(cfg["model"], "primary", cache=HashCache(None))}
    return made, preflight.PassedChecks(tmp_path / "preflight.json"), cfg, fingerprints


def test_a_passed_preflight_is_remembered_by_its_inputs_and_the_device_checked_every_time(tmp_path, monkeypatch):
    """The same inputs (by content) are not checked again; another config value, other model files or a model not
    fingerprinted are; a failed check is not remembered; the device is the machine's, checked every time."""
    from stagereplay.io.file_hashes import HashCache
    from stagereplay.stages import preflight
    from stagereplay.stages.input_fingerprints import model_fingerprint

    made, passed, cfg, fingerprints = counted_checks(tmp_path, monkeypatch)

    def check(config, prints=fingerprints, jobs_run_here=False):
        return preflight.check_run_once(config, jobs_run_here=jobs_run_here, fingerprints=prints, passed=passed)

    first = check(cfg)
    again = check({**cfg, "run": "another"})  # the run's name names folders only
    assert len(made) == 1 and "passed_at" not in first and again == {**first, "passed_at": again["passed_at"]}
    assert preflight.PassedChecks(tmp_path / "preflight.json").entries  # kept on disk for the next run
    check({**cfg, "n_items": 2})
    check(cfg, {"primary": {**fingerprints["primary"], "sha256": "0" * 64}})
    check(cfg, {"primary": None})
    check(cfg, {"primary": None})
    assert len(made) == 5
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(REPO / "data/toy/primary" / name, folder / name)
    bad = valid_config(n_items=3, model=str(folder), revisions=["local"])
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="has no usable tokenizer"):
            check(bad, {"local": model_fingerprint(str(folder), "local", cache=HashCache(None))})
    assert len(made) == 7
    check({**cfg, "device": "cuda"})  # passed and remembered where the jobs run elsewhere (a cluster's submit host)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="device 'cuda' was asked for but CUDA is not available"):
        check({**cfg, "device": "cuda"}, jobs_run_here=True)
    assert len(made) == 8


def test_a_passed_preflight_holds_after_the_store_got_a_snapshot_of_the_model(tmp_path, monkeypatch):
    """A run after the model store was filled (its second run name) reuses the first run's check: a snapshot stands
    in for its source only where preparing proved it the source's, so it cannot change the verdict."""
    from stagereplay.stages import preflight

    made, passed, cfg, fingerprints = counted_checks(tmp_path, monkeypatch)
    entry = tmp_path / "store" / "bf16-entry"
    preflight.check_run_once(cfg, jobs_run_here=False, fingerprints=fingerprints, prepared={"primary": [entry]},
                             passed=passed)
    entry.mkdir(parents=True)
    (entry / "stagereplay_snapshot.json").write_text('{"format": 1}')
    again = preflight.check_run_once(cfg, jobs_run_here=False, fingerprints=fingerprints,
                                     prepared={"primary": [entry]}, passed=passed)
    assert len(made) == 1 and "passed_at" in again


def test_a_remembered_preflight_leaves_the_jobs_the_environment_of_a_check_made_again(tmp_path, monkeypatch):
    """An offline run's jobs inherit HF_HUB_OFFLINE and the like from Snakemake's process, which the check sets: a
    remembered check must set them too; and what the check's imports set (torch's inductor its cache folder) must
    not reach them. Else a run's jobs get another environment than the run before's (and another job server key:
    the second run's jobs found no server)."""
    from stagereplay.io.file_hashes import HashCache
    from stagereplay.stages import preflight
    from stagereplay.stages.input_fingerprints import model_fingerprint

    offline = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    passed = preflight.PassedChecks(tmp_path / "preflight.json")
    cfg = valid_config(n_items=3)
    fingerprints = {"primary": model_fingerprint(cfg["model"], "primary", cache=HashCache(None))}
    environments = []
    check_run_itself = preflight.check_run

    def check_importing_a_library_that_sets_a_variable(*args, **kwargs):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # as torch._inductor's import does
        return check_run_itself(*args, **kwargs)

    monkeypatch.setattr(preflight, "check_run", check_importing_a_library_that_sets_a_variable)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    names = (*offline, "TORCHINDUCTOR_CACHE_DIR")
    for _ in range(2):
        for name in offline:
            monkeypatch.delenv(name, raising=False)
        summary = preflight.check_run_once(cfg, jobs_run_here=False, fingerprints=fingerprints, passed=passed)
        environments.append({name: os.environ.get(name) for name in names})
    assert "passed_at" in summary and environments[1] == environments[0]
    assert environments[0] == {**dict.fromkeys(offline, "1"), "TORCHINDUCTOR_CACHE_DIR": None}


def test_a_second_dry_run_on_the_same_inputs_reads_none_of_them_again(tmp_path):
    tiny_config(tmp_path)
    first = snakemake(tmp_path, "-n")
    second = snakemake(tmp_path, "-n")
    output = second.stdout + second.stderr
    assert "Inputs checked" in first.stdout + first.stderr and "not read again" not in first.stdout + first.stderr
    assert "Inputs checked: 6 items, revisions ['primary'] (these same inputs passed the check at" in output
    assert "not read again" in output
