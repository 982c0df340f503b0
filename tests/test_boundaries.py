"""Stage boundaries on a Qwen2-style byte-level tokenizer (``</think>`` as R1-style models have it, any string,
any token id, with an occurrence), and the report's count of items that never reach their boundary."""

import json

import pandas as pd
import pytest

from gguf_fixture import write_tiny_gguf
from stagereplay.engine import BoundaryMatcher, Decoder, generate_to_boundary
from stagereplay.experiment import LEDGER_SCHEMA, Prompter, Settings, make_matcher, matched_item
from stagereplay.io.parquet import write_parquet
from stagereplay.models.loading import ModelSource, load_model
from stagereplay.analysis.report import build_report


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("gguf_tok")
    write_tiny_gguf(folder / "t.gguf", layers=1)
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="t.gguf")


def first_reached(matcher, ids):
    """Index of the token that completes the boundary, or None."""
    return next((i for i in range(len(ids)) if matcher.reached(ids[: i + 1])), None)


def test_think_marker_as_one_token_and_its_occurrences(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = tok("ab</think>c</think>d", add_special_tokens=False)["input_ids"]
    think = tok.convert_tokens_to_ids("</think>")
    assert ids.count(think) == 2  # one token each, as in R1-style vocabularies
    first, second = [i for i, t in enumerate(ids) if t == think]
    assert first_reached(make_matcher({"marker": "</think>"}, tok), ids) == first
    assert first_reached(make_matcher({"marker": "</think>", "occurrence": 2}, tok), ids) == second
    assert first_reached(make_matcher({"marker": "</think>", "occurrence": 3}, tok), ids) is None
    assert first_reached(make_matcher({"token_id": think, "occurrence": 2}, tok), ids) == second


def test_string_marker_spelled_over_several_tokens(qwen_tokenizer):
    tok = qwen_tokenizer
    # "</think>" written out character by character (not the added token): still found on the decoded text
    pieces = [tok.convert_tokens_to_ids(c) for c in "x</think>"]
    assert tok.convert_tokens_to_ids("</think>") not in pieces
    assert first_reached(make_matcher({"marker": "</think>"}, tok), pieces) == len(pieces) - 1
    ids = tok("7 #### 8 #### 9", add_special_tokens=False)["input_ids"]
    hit = first_reached(make_matcher({"marker": "####", "occurrence": 2}, tok), ids)
    assert tok.decode(ids[: hit + 1]) == "7 #### 8 ####"


def test_boundary_needs_a_marker_or_token_id(qwen_tokenizer):
    with pytest.raises(ValueError, match="marker .* or token_id"):
        make_matcher({"marker": None, "occurrence": 1}, qwen_tokenizer)


def test_report_counts_and_names_items_that_never_reach_the_boundary(tiny_model_dir, tmp_path):
    loaded = load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu")
    decoder = Decoder(loaded.model, ())
    prompter = Prompter(loaded.tokenizer)
    item = {"item_index": 0, "item_id": "reaches", "question": "12+34-5=", "gold_answer": "41"}
    free = generate_to_boundary(decoder, prompter(item["question"]), BoundaryMatcher(1, token_ids=[10**6]),
                                6).generated_ids
    marker, occurrence = free[3], free[:4].count(free[3])  # completed by the 4th generated token
    boundary = {"token_id": marker, "occurrence": occurrence}
    rows = []
    for it, budget in ((item, 16), ({**item, "item_index": 1, "item_id": "runs-out"}, 3)):
        settings = Settings("primary", "fp32", max_stage_tokens=budget, max_new_tokens=4)
        item_rows, prefix = matched_item(decoder, loaded.tokenizer, prompter, make_matcher(boundary, loaded.tokenizer),
                                         it, settings)
        rows += item_rows
    ledger = pd.DataFrame(rows, columns=LEDGER_SCHEMA.names)
    assert ledger.groupby("item_id")["status"].agg(set).to_dict() == {"reaches": {"ok"},
                                                                      "runs-out": {"boundary_missing"}}
    write_parquet(ledger, tmp_path / "ledger.parquet", {"stage": "test"}, LEDGER_SCHEMA)
    build_report({"primary": str(tmp_path / "ledger.parquet")}, tmp_path / "report.md", tmp_path / "stats.json",
                 "t")
    matched = json.loads((tmp_path / "stats.json").read_text())["revisions"]["primary"]["matched"]["fp32"]
    assert (matched["n_items"], matched["boundary_missing"], matched["n_compared"]) == (2, 1, 1)
    report = (tmp_path / "report.md").read_text()
    assert "| `runs-out` | matched | fp32 | boundary_missing (live): never reached the stage boundary" in report
