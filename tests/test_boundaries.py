"""Stage boundaries on a Qwen2-style byte-level tokenizer (``</think>`` as R1-style models have it, any string,
any token id, with an occurrence), and the report's count of items that never reach their boundary."""

import json

import pandas as pd
import pytest
import torch

from gguf_fixture import write_tiny_gguf
from stagereplay.data.prompts import Prompter
from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows, matcher_from_config
from stagereplay.decode.plans import Batch
from stagereplay.experiments.matched import matched as run_matched
from stagereplay.experiments.rows import LEDGER_SCHEMA, RunSettings
from stagereplay.io.parquet import write_parquet
from stagereplay.models.loading import load_model
from stagereplay.models.sources import ModelSource
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
    assert first_reached(matcher_from_config({"marker": "</think>"}, tok), ids) == first
    assert first_reached(matcher_from_config({"marker": "</think>", "occurrence": 2}, tok), ids) == second
    assert first_reached(matcher_from_config({"marker": "</think>", "occurrence": 3}, tok), ids) is None
    assert first_reached(matcher_from_config({"token_id": think, "occurrence": 2}, tok), ids) == second


def test_string_marker_spelled_over_several_tokens(qwen_tokenizer):
    tok = qwen_tokenizer
    # "</think>" written out character by character (not the added token): still found on the decoded text
    pieces = [tok.convert_tokens_to_ids(c) for c in "x</think>"]
    assert tok.convert_tokens_to_ids("</think>") not in pieces
    assert first_reached(matcher_from_config({"marker": "</think>"}, tok), pieces) == len(pieces) - 1
    ids = tok("7 #### 8 #### 9", add_special_tokens=False)["input_ids"]
    hit = first_reached(matcher_from_config({"marker": "####", "occurrence": 2}, tok), ids)
    assert tok.decode(ids[: hit + 1]) == "7 #### 8 ####"


class ScriptedDecoder:
    """A decoder whose greedy choice at each step is the next id of a script (one per row): the greedy loop and
    the matcher run on real tokenizer ids without depending on what a random model happens to generate."""

    n_layers = 1

    def __init__(self, scripts, vocab, eos_ids=()):
        self.scripts, self.vocab, self.eos_ids = scripts, vocab, tuple(eos_ids)

    def record(self):
        return {"decode_regime": "scripted"}

    def independent_rows(self, rows):
        return True

    def _logits(self, batch):
        logits = torch.zeros(len(batch), self.vocab)
        for r, fed in enumerate(batch):
            script = self.scripts[r]
            logits[r, script[min(fed[1], len(script) - 1)]] = 1.0
        return logits

    def open(self, prompts):
        batch = [[len(p), 0] for p in prompts]  # per row: positions written, script ids chosen so far
        return batch, self._logits(batch)

    def step(self, batch, tokens):
        for fed, token in zip(batch, tokens):
            if token is not None:
                fed[0] += 1
                fed[1] += 1
        return self._logits(batch)

    def row_layers(self, batch, row, end):
        assert batch[row][0] == end
        return [(torch.zeros(1, 1, end, 2), torch.zeros(1, 1, end, 2))]

    def pad(self, batch, row):
        return 0


def test_live_loop_stops_at_the_marker_on_tokenizer_ids(qwen_tokenizer):
    """decode_rows with string and token-id matchers: the stage ends at the token that completes the marker's
    occurrence, on every row of a batch, and a row whose marker never comes runs out of its stage budget."""
    tok = qwen_tokenizer
    think = tok.convert_tokens_to_ids("</think>")
    one = tok("ab</think>c</think>d e f g", add_special_tokens=False)["input_ids"]
    spelled = [tok.convert_tokens_to_ids(c) for c in "xy</think>"] + tok("1 2 3 4", add_special_tokens=False)[
        "input_ids"]
    none = tok("no marker in here at all", add_special_tokens=False)["input_ids"]
    decoder = ScriptedDecoder([one, spelled, none], len(tok))
    prompts = [[3, 4], [5], [6, 7, 8]]
    first_spelled = len("xy</think>") - 1
    for boundary, occurrence in ({"marker": "</think>"}, 1), ({"marker": "</think>", "occurrence": 2}, 2), (
            {"token_id": think, "occurrence": 2}, 2):
        res = decode_rows(decoder, prompts, matcher=matcher_from_config(boundary, tok), max_stage_tokens=len(none) - 1,
                          max_new_tokens=3)
        end = [i for i, t in enumerate(one) if t == think][occurrence - 1]
        assert res[0].stage_ids == one[:end + 1] and res[0].suffix_ids == one[end + 1:end + 4]
        assert res[0].position == len(prompts[0]) + end and res[0].stop_reason == "max_new_tokens"
        if "marker" in boundary and occurrence == 1:
            assert res[1].stage_ids == spelled[:first_spelled + 1]
            assert tok.decode(res[1].stage_ids).endswith("</think>")
        else:  # the spelled-out marker holds no </think> token and no second occurrence
            assert res[1].stage_ids == [] and res[1].stop_reason == "boundary_missing"
        assert res[2].stage_ids == [] and res[2].stop_reason == "boundary_missing"
        assert res[2].suffix_ids == none[:len(none) - 1]


def test_boundary_needs_a_marker_or_token_id(qwen_tokenizer):
    with pytest.raises(ValueError, match="marker .* or token_id"):
        matcher_from_config({"marker": None, "occurrence": 1}, qwen_tokenizer)


def test_report_counts_and_names_items_that_never_reach_the_boundary(tiny_model_dir, tmp_path):
    loaded = load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu")
    decoder = EagerDecoder(loaded.model, ())
    prompter = Prompter(loaded.tokenizer)
    item = {"item_index": 0, "item_id": "reaches", "question": "12+34-5=", "gold_answer": "41"}
    free = decode_rows(decoder, [prompter(item["question"])], matcher=BoundaryMatcher(1, token_ids=[10**6]),
                       max_stage_tokens=6, max_new_tokens=1)[0].suffix_ids
    assert len(free) == 6
    marker, occurrence = free[3], free[:4].count(free[3])  # completed by the 4th generated token
    boundary = {"token_id": marker, "occurrence": occurrence}
    rows = []
    for it, budget in ((item, 16), ({**item, "item_index": 1, "item_id": "runs-out"}, 3)):
        settings = RunSettings("primary", "fp32", max_stage_tokens=budget, max_new_tokens=4)
        result = run_matched(decoder, Batch(None, (it,)), [prompter(it["question"])], settings, loaded.tokenizer,
                             matcher_from_config(boundary, loaded.tokenizer))
        assert [p["status"] for p in result.prefix_rows] == ["ok" if budget == 16 else "boundary_missing"]
        rows += result.rows
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
