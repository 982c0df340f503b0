"""One test per row of docs/BAD_INPUTS.md: each bad input gets an error naming the item, row or key and saying
what to do, or (boundary missing, fp16 overflow) a marked row; and a failing run never touches earlier results.

Config and workflow failures go through snakemake on a tiny config in a temp directory; the rest through the
package functions the rules call.
"""

import hashlib
import json
import socket
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from conftest import make_tiny_model
from gguf_fixture import write_tiny_gguf
from stagereplay.analysis.report import build_report
from stagereplay.config import schema_file
from stagereplay.data.datasets import DatasetError
from stagereplay.data.prompts import PromptTooLongError
from stagereplay.experiments.rows import RunSettings
from stagereplay.models.loading import load_model
from stagereplay.models.sources import ModelLoadError, ModelSource, resolve_source
from stagereplay.stages.gather import gather_ledger
from stagereplay.stages.preflight import check_model, check_run
from stagereplay.stages.reconstruct import reconstruct_prefixes
from stagereplay.stages.select import select_items
from stagereplay.stages.settings import ReconstructSettings, from_params
from workflow_runner import snakemake

REPO = Path(__file__).resolve().parents[1]
SCHEMA = schema_file()  # the schema the workflow validates with (the catalogue's enums filled in)


def default_config(**overrides):
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(overrides)
    return cfg


def valid_config(**overrides):
    cfg = default_config(**overrides)
    validate(cfg, SCHEMA, set_default=True)
    cfg["model"] = str(REPO / cfg["model"]) if cfg["model"] == "data/toy" else cfg["model"]
    return cfg


def write_config(workdir, **overrides):
    cfg = default_config(run="tiny", n_items=4, max_new_tokens=8, device="cpu", precisions=["bf16"],
                         dataset={"source": "synthetic", "size": 50, "seed": 0})
    cfg.update(overrides)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))


def reconstruct(items, ledger, prefixes, **params):
    """The reconstruct_prefixes stage as its rule calls it (its bridge rows beside the ledger)."""
    bridge = Path(ledger).with_name(Path(ledger).stem + "_bridge.parquet")
    params = {"bridge": {"n_rows": 0, "seed": 0}, **params}  # no bridge rows unless asked
    reconstruct_prefixes(str(items), str(ledger), str(prefixes), str(bridge), from_params(ReconstructSettings, params))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- config keys and values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change,named", [
    ({"n_itmes": 5}, "n_itmes"),
    ({"boundary": {"markr": ";"}}, "markr"),
    ({"precisions": ["bf17"]}, "bf17"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -4}, "max_new_tokens"),
    ({"max_stage_tokens": 0}, "max_stage_tokens"),
    ({"run": "../../escape"}, "../../escape"),
    ({"run": "/tmp/escape"}, "/tmp/escape"),
    ({"revisions": ["../../outside"]}, "../../outside"),
    ({"revisions": ["primary/../../../outside"]}, "primary/../../../outside"),
    ({"trust_remote_code": "yes"}, "yes"),
])
def test_bad_config_key_or_value_is_named(change, named):
    cfg = default_config(**change)
    with pytest.raises(WorkflowError) as err:
        validate(cfg, SCHEMA, set_default=True)
    assert named in str(err.value)


def test_workflow_refuses_mistyped_key_and_escaping_run_before_any_work(tmp_path):
    write_config(tmp_path / "w", dataset={"source": "synthetic", "sise": 50})
    proc = snakemake(tmp_path / "w", "--cores", "1", check=False)
    rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc != 0 and "sise" in out and "Additional properties are not allowed" in out
    write_config(tmp_path / "w", run="../../escape")
    proc = snakemake(tmp_path / "w", "--cores", "1", check=False)
    rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc != 0 and "../../escape" in out
    assert not (tmp_path / "escape").exists() and not (tmp_path / "w/results").exists()


def test_a_block_given_without_its_null_defaults(tmp_path):
    """A block in the config file, or `--config 'transplant={revisions: [...]}'` as the README shows, lacks the keys
    whose default is null (the validator fills none). The workflow plans; a bad revision there is named."""
    write_config(tmp_path / "w", transplant={"revisions": ["primary", "later"]}, cache_differences={"n_items": 2})
    proc = snakemake(tmp_path / "w", "-n", check=False)
    rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc == 0, out[-3000:]
    write_config(tmp_path / "w")
    proc = snakemake(tmp_path / "w", "--cores", "1", "--config", "transplant={revisions: [primary, nope]}", check=False)
    rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc != 0 and "revisions: 'nope' is neither a subfolder" in out
    assert not (tmp_path / "w/results").exists()


def test_budgets_below_one_are_refused_by_the_package_too():
    for key in ("max_new_tokens", "max_stage_tokens", "chunk_size"):
        for value in (0, -3):
            kwargs = {"max_stage_tokens": 8, "max_new_tokens": 8, key: value}
            with pytest.raises(ValueError, match=f"{key} is {value}"):
                RunSettings("primary", "bf16", **kwargs)
    RunSettings("primary", "bf16", None, 8)  # a stage that replays fixed prefixes has no stage budget


# --- datasets ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,match", [
    ([], "has no items; point dataset.path at a file"),
    ([{"id": "a", "question": "q", "answer": "1"}, {"id": "a", "question": "r", "answer": "2"}],
     "row 2 repeats item id 'a' .*item ids must be unique"),
    ([{"id": "a", "question": "", "answer": "1"}], "line 1 has no question .*fix or remove it"),
    ([{"id": "a", "question": "q"}], "line 1 has no gold answer .*fix or remove it"),
    ([{"id": "a", "question": "q", "answer": "#### seven"}],
     "line 1 has a non-numeric gold answer 'seven'.*choose answer_format: boxed"),
])
def test_bad_dataset_rows_are_named_by_selection_and_preflight(tmp_path, rows, match):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = {"source": "jsonl", "path": str(path), "fields": {"id": "id"}}
    with pytest.raises(DatasetError, match=match):
        select_items(dataset, 1, 0, str(tmp_path / "items.parquet"))
    assert not (tmp_path / "items.parquet").exists()
    with pytest.raises(DatasetError, match=match):
        check_run(valid_config(dataset=dataset, n_items=1))


def test_missing_dataset_file_and_too_few_items(tmp_path):
    missing = {"source": "jsonl", "path": str(tmp_path / "missing.jsonl")}
    with pytest.raises(DatasetError, match="missing.jsonl' does not exist"):
        check_run(valid_config(dataset=missing))
    with pytest.raises(DatasetError, match="n_items is 6000 but the dataset has only 5000 items; lower n_items"):
        check_run(valid_config(n_items=6000))


def test_non_numeric_gold_is_fine_where_no_number_is_needed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### seven"}])
    selected = select_items({"source": "jsonl", "path": str(path)}, 1, 0, str(tmp_path / "i.parquet"),
                                   answer_format="boxed")
    assert selected["gold_answer"].tolist() == ["seven"]


# --- models -----------------------------------------------------------------------------------------------

def test_model_path_that_does_not_exist(tmp_path):
    for model, match in [(str(tmp_path / "nowhere"), "is not an existing folder or GGUF file.*check the path"),
                         (str(tmp_path / "nowhere.gguf"), "GGUF file .* does not exist; check the path")]:
        with pytest.raises(ModelLoadError, match=match):
            resolve_source(model, "primary")
        with pytest.raises(ModelLoadError, match=match):
            check_run(valid_config(model=model, n_items=2))
    with pytest.raises(ModelLoadError, match="'nope' is neither a subfolder.*name one of: \\['later', 'primary'\\]"):
        check_run(valid_config(revisions=["nope"], n_items=2))


def test_boundary_token_id_outside_the_vocabulary():
    with pytest.raises(ModelLoadError, match="boundary.token_id 5000 is outside the vocabulary of .*primary "
                                             "\\(2[0-9] ids\\): the boundary could never appear"):
        check_run(valid_config(boundary={"token_id": 5000}, n_items=2))


@pytest.mark.parametrize("architecture", ["gpt2", "bert"])
def test_gguf_of_an_unsupported_architecture(tmp_path, architecture):
    path = tmp_path / f"tiny-{architecture}.gguf"
    write_tiny_gguf(path, architecture=architecture, layers=1)
    match = (f"GGUF file .*tiny-{architecture}.gguf holds a '{architecture}' model; the cache code supports "
             ".*point model at one of those")
    source = resolve_source(str(path), None)
    with pytest.raises(ModelLoadError, match=match):
        check_model(source)
    with pytest.raises(ModelLoadError, match=match):
        load_model(source, "fp32", "cpu")


def test_tokenizer_that_does_not_match_the_model(tmp_path):
    folder = make_tiny_model(tmp_path / "m", vocab_extra=-4, layers=1)
    with pytest.raises(ModelLoadError, match="has 2[0-9] tokens but the model's vocabulary has 1[0-9]: they do not "
                                             "belong together"):
        check_model(ModelSource("local", str(folder)))
    with pytest.raises(ModelLoadError, match="do not belong together"):
        load_model(ModelSource("local", str(folder)), "fp32", "cpu")


def test_pickled_weights_are_refused_unless_allowed(tmp_path):
    folder = make_tiny_model(tmp_path / "m", layers=1)
    state = load_file(folder / "model.safetensors")
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    source = ModelSource("local", str(folder))
    with pytest.raises(ModelLoadError, match="only pickled weights.*set allow_pickle: true"):
        load_model(source, "fp32", "cpu")
    with pytest.raises(ModelLoadError, match="only pickled weights"):
        check_model(source)
    loaded = load_model(source, "fp32", "cpu", allow_pickle=True)
    assert torch.equal(loaded.model.lm_head.weight, state["lm_head.weight"])


def test_trust_remote_code_is_off_unless_the_config_turns_it_on(tmp_path, monkeypatch):
    import transformers

    seen = []
    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code")))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    assert valid_config()["trust_remote_code"] is False
    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 20, "seed": 0}, 1, 0, str(items))
    kwargs = dict(model=str(REPO / "data/toy"), revision="primary", precision="bf16", boundary={"marker": ";"},
                  max_stage_tokens=4, max_new_tokens=2, device="cpu", progress=False)
    reconstruct(items, tmp_path / "l.parquet", tmp_path / "p.parquet", **kwargs)
    assert {name for name, _ in seen} == {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"}
    assert all(flag is False for _, flag in seen)
    seen.clear()
    reconstruct(items, tmp_path / "l.parquet", tmp_path / "p.parquet", **kwargs, trust_remote_code=True)
    assert seen and all(flag is True for _, flag in seen)


def test_offline_reaches_no_network_even_after_huggingface_hub_was_imported(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # The state of a process that imported huggingface_hub before the config said offline.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    not_cached = "some-org/some-model@main is not in the local Hugging Face cache .* and offline: true forbids"
    with pytest.raises(ModelLoadError, match=not_cached):
        load_model(ModelSource("hub", "some-org/some-model", revision="main"), "fp32", "cpu", offline=True)
    # whatever reaches the hub later in this process (a tokenizer's files, a dataset) is offline too
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ModelLoadError, match=not_cached):
        check_run(valid_config(model="some-org/some-model", revisions=["main"], n_items=2))
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert attempts == []


# --- the pipeline's own runs ------------------------------------------------------------------------------

def test_prompt_longer_than_the_context_names_the_item(tmp_path, tiny_model_dir):
    long_question = "12+34-" * 40 + "5"  # 241 characters against a context of 256
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "short", "question": "1+2", "answer": "3"},
                                              {"id": "too-long", "question": long_question, "answer": "1"}])
    items = tmp_path / "items.parquet"
    select_items({"source": "jsonl", "path": str(path), "fields": {"id": "id"}}, 2, 0, str(items))
    kwargs = dict(model=str(tiny_model_dir), revision="local", precision="fp32", boundary={"marker": ";"},
                  max_stage_tokens=8, max_new_tokens=8, device="cpu", progress=False)
    match = "item 'too-long': prompt of 2[0-9][0-9] tokens .* exceeds the model's context of 256; lower the budgets"
    with pytest.raises(PromptTooLongError, match=match):
        reconstruct(items, tmp_path / "l.parquet", tmp_path / "p.parquet", **kwargs)
    assert not (tmp_path / "l.parquet").exists() and not (tmp_path / "p.parquet").exists()
    assert not (tmp_path / "l_bridge.parquet").exists()
    cfg = valid_config(model=str(tiny_model_dir), revisions=["local"], n_items=2, max_stage_tokens=8,
                       max_new_tokens=8, dataset={"source": "jsonl", "path": str(path), "fields": {"id": "id"}})
    with pytest.raises(PromptTooLongError, match=match):
        check_run(cfg)


def run_stage(tmp_path, model, revision, precision, boundary, n_items=3):
    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, n_items, 0, str(items))
    ledger, prefixes = tmp_path / "parts/l.parquet", tmp_path / "parts/p.parquet"
    reconstruct(items, ledger, prefixes, model=str(model), revision=revision, precision=precision,
                boundary=boundary, max_stage_tokens=8, max_new_tokens=6, device="cpu", progress=False)
    gather_ledger([str(ledger)], str(tmp_path / "ledger.parquet"))
    build_report({revision: str(tmp_path / "ledger.parquet")}, str(tmp_path / "report.md"),
                 str(tmp_path / "stats.json"), "t")
    stats = json.loads((tmp_path / "stats.json").read_text())["revisions"][revision]["matched"][precision]
    return pd.read_parquet(tmp_path / "ledger.parquet"), stats, (tmp_path / "report.md").read_text()


def test_boundary_that_never_appears_is_marked_and_counted(tmp_path):
    ledger, stats, report = run_stage(tmp_path, REPO / "data/toy", "primary", "bf16", {"marker": "@@"})
    assert set(ledger["status"]) == {"boundary_missing"}
    assert len(ledger) == 2 * 3 and set(ledger["construction"]) == {"live"}
    assert all(len(ids) == 8 for ids in ledger["suffix_ids"])  # everything generated within the budget
    assert stats["boundary_missing"] == 3 and stats["n_compared"] == 0
    reason = "boundary_missing (live): never reached the stage boundary"
    excluded = [line for line in report.splitlines() if reason in line]
    assert len(excluded) == 3 and all(any(item in line for line in excluded) for item in set(ledger["item_id"]))


def test_fp16_overflow_marks_rows_nonfinite(tmp_path):
    folder = make_tiny_model(tmp_path / "m", layers=1)
    state = load_file(folder / "model.safetensors")
    # Logits of about 1.5e5: beyond fp16's 65504, well within bf16 and fp32.
    state["lm_head.weight"] = state["lm_head.weight"] * 3e5
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    ledger, stats, report = run_stage(tmp_path / "fp16", folder, "local", "fp16", {"marker": ";"})
    assert set(ledger["status"]) == {"nonfinite"} and set(ledger["stop_reason"]) == {"nonfinite"}
    assert stats["nonfinite_items"] == 3 and stats["n_compared"] == 0
    excluded = [line for line in report.splitlines() if line.startswith("| `") and "nonfinite" in line]
    assert all(any(item in line for line in excluded) for item in set(ledger["item_id"]))
    ledger, _, _ = run_stage(tmp_path / "fp32", folder, "local", "fp32", {"marker": ";"})
    assert "nonfinite" not in set(ledger["status"])


# --- a failing run never touches results already computed -------------------------------------------------

def snapshot(root):
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_failing_rerun_leaves_earlier_results_byte_for_byte(tmp_path):
    work = tmp_path / "w"
    write_config(work)
    target = "results/tiny/primary/ledger.parquet"  # the generation stages: enough to lose, and quick
    proc = snakemake(work, "--cores", "2", target, check=False)
    rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc == 0, out[-3000:]
    before = snapshot(work / "results")
    assert {"tiny/selection/items.parquet", "tiny/primary/parts/matched_bf16_0.parquet",
            "tiny/primary/parts/fixed_prefix_bf16_0.parquet", "tiny/primary/ledger.parquet"} <= set(before)
    bad_jsonl = write_jsonl(tmp_path / "dup.jsonl", [{"id": "x", "question": "1+1", "answer": "2"},
                                                     {"id": "x", "question": "2+2", "answer": "4"}])
    for change, named in [
        ({"max_new_tokens": 400}, "exceeds the model's context of"),
        ({"dataset": {"source": "jsonl", "path": str(bad_jsonl), "fields": {"id": "id"}}, "n_items": 1},
         "row 2 repeats item id 'x'"),
        ({"model": str(tmp_path / "no-such-model")}, "is not an existing folder or GGUF file"),
    ]:
        write_config(work, **change)
        proc = snakemake(work, "--cores", "2", target, check=False)
        rc, out = proc.returncode, proc.stdout + proc.stderr
        assert rc != 0 and named in out, out[-3000:]
        assert snapshot(work / "results") == before, change
