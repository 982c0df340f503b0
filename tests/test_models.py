"""Model sources on models built in code: GGUF files written with gguf-py, hub ids from a local cache offline,
and greedy decoding that no generation_config can change."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from gguf_fixture import write_tiny_gguf
from stagereplay.data.prompts import Prompter
from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import decode_rows, matcher_from_config
from stagereplay.experiments import constructions
from stagereplay.models.loading import eos_token_ids, load_model
from stagereplay.models.sources import ModelLoadError, ModelSource, resolve_source


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(folder / "tiny-qwen2.gguf")
    return folder, model


def test_gguf_file_loads_through_the_pipeline_path(gguf_dir):
    folder, reference = gguf_dir
    # model: the .gguf file itself, and model: its folder with revisions: [x.gguf] name the same source
    by_file = resolve_source(str(folder / "tiny-qwen2.gguf"), "primary")
    by_revision = resolve_source(str(folder), "tiny-qwen2.gguf")
    assert by_file == by_revision and by_file.kind == "gguf"
    loaded = load_model(by_file, "fp32", "cpu")
    assert loaded.info["model_type"] == "qwen2" and loaded.info["dtype"] == "float32"
    ours, theirs = loaded.model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in theirs:  # F32 tensors round-trip exactly: compare bytes
        assert ours[name].numpy().tobytes() == theirs[name].numpy().tobytes(), name
    # the tokenizer comes from the GGUF metadata, chat template and </think> included
    tok = loaded.tokenizer
    assert tok.convert_tokens_to_ids("</think>") == tok("</think>", add_special_tokens=False)["input_ids"][0]
    prompt = Prompter(tok, instruction="Solve.")("1+2")
    assert tok.decode(prompt).startswith("<|im_start|>user\nSolve.\n\n1+2<|im_end|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos_token_ids(loaded)
    bf16 = load_model(by_revision, "bf16", "cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "other.gguf", architecture="gpt2")
    with pytest.raises(ModelLoadError, match=r"holds a 'gpt2' model; the cache code supports \['qwen2'"):
        load_model(resolve_source(str(tmp_path / "other.gguf"), None), "fp32", "cpu")


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        resolve_source(str(tmp_path / "nope.gguf"), None)
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        resolve_source(str(tmp_path), "nope.gguf")


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache, model_dir, repo="tiny-org/tiny-qwen2", branch="main"):
    """The layout huggingface_hub keeps: models--org--name/snapshots/<commit>/ and refs/<branch>."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model_dir, root / "snapshots" / COMMIT)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / branch).write_text(COMMIT)
    return repo


def test_hub_id_loads_from_the_local_cache_offline(tmp_path, tiny_model_dir, monkeypatch):
    repo = fake_hub_cache(tmp_path / "hub", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_source(repo, "main", base_dir=tmp_path)
    assert source.kind == "hub" and source.describe() == f"{repo}@main"
    for revision in ("main", COMMIT):
        loaded = load_model(ModelSource("hub", repo, revision=revision), "fp32", "cpu", offline=True)
        assert loaded.info["model_source"] == f"{repo}@{revision}"
        assert loaded.info["model_commit"] == COMMIT
    reference = load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu")
    for name, t in reference.model.state_dict().items():
        assert loaded.model.state_dict()[name].numpy().tobytes() == t.numpy().tobytes(), name


def test_hub_id_falls_back_to_the_cache_when_the_hub_is_unreachable(tmp_path, tiny_model_dir, monkeypatch):
    import huggingface_hub.constants

    repo = fake_hub_cache(tmp_path / "hub", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    loaded = load_model(ModelSource("hub", repo, revision="main"), "fp32", "cpu", offline=False)
    assert loaded.info["model_commit"] == COMMIT
    with pytest.raises(ModelLoadError, match="cannot fetch other-org/absent@main from the hub or find it in"):
        load_model(ModelSource("hub", "other-org/absent", revision="main"), "fp32", "cpu", offline=False)


def test_hub_id_missing_from_the_cache_gives_a_clear_offline_error(tmp_path, tiny_model_dir, monkeypatch):
    repo = fake_hub_cache(tmp_path / "hub", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match=r"not in the local Hugging Face cache .*offline: true"):
        load_model(ModelSource("hub", "other-org/absent", revision="main"), "fp32", "cpu", offline=True)
    with pytest.raises(ModelLoadError, match="tiny-org/tiny-qwen2@v2.*huggingface-cli download"):
        load_model(ModelSource("hub", repo, revision="v2"), "fp32", "cpu", offline=True)


def test_generation_config_sampling_defaults_do_not_leak(tmp_path, tiny_model_dir):
    """The engine steps the model by hand (never ``generate``): a checkpoint asking for sampling decodes the
    same greedy ids as one that does not."""
    sampling = tmp_path / "sampling"
    shutil.copytree(tiny_model_dir, sampling)
    gen = json.loads((sampling / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.5)
    (sampling / "generation_config.json").write_text(json.dumps(gen))
    runs = []
    for folder in (tiny_model_dir, sampling, sampling):
        loaded = load_model(ModelSource("local", str(folder)), "fp32", "cpu")
        decoder = EagerDecoder(loaded.model, tuple(eos_token_ids(loaded)))
        matcher = matcher_from_config({"token_id": 10**6}, loaded.tokenizer)  # never reached: the whole budget
        prompt = Prompter(loaded.tokenizer)("12+34-5=")
        stage = decode_rows(decoder, [prompt], matcher=matcher, max_stage_tokens=24, max_new_tokens=1)[0]
        assert stage.stop_reason == "boundary_missing"
        # and a continuation from a rebuilt cache: the prompt but its last id, which is pending
        cont = decode_rows(decoder, [prompt[:-1]], stages=[prompt[-1:]], max_new_tokens=24,
                           build=constructions.get("prefill").cache_build())[0]
        runs.append((stage.suffix_ids, cont.suffix_ids, cont.margins))
    assert runs[0] == runs[1] == runs[2]
    # the settings are live for ``generate``, which would have followed them (sampling, repetition penalty)
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=24)[0, len(prompt):].tolist()
    assert loaded.model.generation_config.do_sample is True
    assert sampled != runs[0][0][:len(sampled)]


def test_gguf_runs_through_the_reconstruct_stage(gguf_dir, tmp_path):
    from stagereplay.io.parquet import read_provenance
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.select import select_items
    from stagereplay.stages.settings import ReconstructSettings

    folder, _ = gguf_dir
    select_items({"source": "synthetic", "size": 20, "seed": 0}, 2, 0, str(tmp_path / "items.parquet"))
    reconstruct_prefixes(str(tmp_path / "items.parquet"), str(tmp_path / "ledger.parquet"),
                         str(tmp_path / "prefixes.parquet"), str(tmp_path / "bridge.parquet"),
                         ReconstructSettings(model=str(folder), revision="tiny-qwen2.gguf", precision="bf16",
                                             boundary={"marker": "</think>", "occurrence": 1}, max_stage_tokens=4,
                                             max_new_tokens=4, device="cpu", progress=False,
                                             bridge={"n_rows": 0, "seed": 0}))
    import pandas as pd

    ledger = pd.read_parquet(tmp_path / "ledger.parquet")
    assert sorted(ledger["item_index"].unique()) == [0, 1] and set(ledger["revision"]) == {"tiny-qwen2.gguf"}
    prov = read_provenance(tmp_path / "ledger.parquet")
    assert prov["model_source"].endswith("tiny-qwen2.gguf") and prov["model_type"] == "qwen2"
    assert prov["gpu_slot"] == {**prov["gpu_slot"], "device": "cpu", "claimed": False}


def test_the_cpu_device_name_names_the_kernels_and_bf16_features():
    """The toy's bf16 split depends on the CPU's bf16 kernels, so provenance names them (README, the quickstart)."""
    import platform

    from stagereplay.models.loading import BF16_CPU_FLAGS, device_name

    name = device_name(torch.device("cpu"))
    assert name.startswith(f"cpu:{platform.machine()} {torch.backends.cpu.get_cpu_capability()}")
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    for flag in BF16_CPU_FLAGS:
        assert (flag in name) == (flag in flags)
