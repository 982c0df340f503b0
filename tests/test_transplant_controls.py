"""The transplants' controls: the placebo beside every transplant, the sham that checks the edit path, no-ops, the
paired test, and the minimal search's verdicts. Each control is shown to catch what it exists to catch."""

import dataclasses

import pandas as pd
import pytest
import torch

from stagereplay.analysis import placebo as placebo_stats
from stagereplay.analysis.tables import transplant_matrix
from stagereplay.analysis.transplant_report import localisation_lines
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments import transplant as transplant_module
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.experiments.transplant import (
    PlaceboError,
    Transplant,
    placebo_bytes,
    run_transplants,
    transplant_batch,
    transplant_edit,
    transplant_rows,
    transplanted_bytes_equal,
)
from stagereplay.experiments.transplant_specs import TransplantSpec, enumerate_sweeps

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:]]
STAGES = [[8, 15, 4, 19, 11, 6], [3, 5, 7], [12, 13, 14, 20, 9]]
N_LAYERS = 3  # conftest's tiny model


def test_placebo_moves_the_difference_within_its_span():
    gen = torch.Generator().manual_seed(0)
    recipient = torch.randn(1, 2, 6, 4, generator=gen).to(torch.bfloat16)
    donor = recipient.clone()
    donor[:, :, 4:] += 1.0  # the difference sits on the last two positions (as a stage's would)
    moved, kind = placebo_bytes(donor, recipient)
    assert kind == "shifted" and moved.dtype == recipient.dtype
    assert torch.equal(moved[:, :, 4:], recipient[:, :, 4:])  # the positions the donor changed are left as they were
    assert not torch.equal(moved[:, :, 1:3], recipient[:, :, 1:3])  # ... and the same push lands three places on
    assert not torch.equal(moved, donor)
    # a span of one position has nowhere to move it to: the difference is negated
    negated, kind = placebo_bytes(donor[:, :, 5:], recipient[:, :, 5:])
    assert kind == "negated" and not torch.equal(negated, donor[:, :, 5:])
    # a difference the shift leaves in place (here: the same at every position) is negated too, never the donor
    zeros = torch.zeros_like(recipient)
    flat = zeros + 1.0
    same, kind = placebo_bytes(flat, zeros)
    assert kind == "negated" and not torch.equal(same, flat)


def test_noop_is_told_from_the_bytes():
    layers = [(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2)) for _ in range(2)]
    other = [(k.clone(), v.clone()) for k, v in layers]
    other[1][1][:, :, 3] = 1.0  # layer 1, V, a stage position
    assert transplanted_bytes_equal(TransplantSpec("p", (0, 1), "kv", "prompt"), other, layers, prompt_len=3)
    assert transplanted_bytes_equal(TransplantSpec("k", (0, 1), "k"), other, layers, prompt_len=3)
    assert not transplanted_bytes_equal(TransplantSpec("s", (1,), "kv", "stage"), other, layers, prompt_len=3)


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    from stagereplay.models.loading import load_model
    from stagereplay.models.sources import ModelSource

    loaded = load_model(ModelSource("local", str(tiny_model_dir)), "bf16", "cpu")
    decoder = make_decoder(loaded.model, (), "eager", max_len=40, max_rows=3)
    s = RunSettings("tiny", "bf16", None, 12, decode_regime="eager")
    own = {name: run(decoder, name, PROMPTS, s, stages=STAGES, keep={0, 1, 2}) for name in ("incremental", "prefill")}
    return decoder, s, own


def test_every_transplant_row_carries_its_placebo_and_sham(batch):
    decoder, s, own = batch
    specs = enumerate_sweeps(["all", "halves", "prompt_positions"], N_LAYERS)
    rows = transplant_batch(decoder, PROMPTS, STAGES, s, own, [0, 1, 2], specs)
    for r, records in rows.items():
        assert len(records) == 2 * len(specs)
        for rec in records:
            recipient = own[rec["recipient"]][r]
            assert rec["sham_cache_fingerprint"] == recipient.fingerprints[0]  # the sham reproduced its recipient
            assert rec["placebo_outcome"] in ("donor", "recipient", "neither")
            assert rec["placebo_kind"] in ("shifted", "negated", "negated+shifted")
            if rec["positions"] == "prompt":  # both constructions prefill the prompt alike: nothing is handed over
                assert rec["noop"] and rec["suffix_ids"] == recipient.suffix_ids
                assert rec["placebo_suffix_fingerprint"] == rec["suffix_fingerprint"]
            if not rec["noop"]:
                assert rec["placebo_cache_fingerprint"] != rec["cache_fingerprint"]


@pytest.mark.parametrize("pack", [True, False])
def test_a_placebo_that_is_the_real_donor_is_caught(batch, monkeypatch, pack):
    decoder, s, own = batch
    # a donor whose bytes differ from the recipient's (the tiny model's two constructions may agree byte for byte,
    # which would make every transplant a no-op); the shams are left out, since they check the recipients' own
    pushed = {name: [dataclasses.replace(res, layers=[(k + push, v + push) for k, v in res.layers])
                     for res in results] for push, (name, results) in zip((1, 2), own.items())}
    monkeypatch.setattr(transplant_module, "run_shams", lambda *a: {name: {0: None} for name in own})
    monkeypatch.setattr(transplant_module, "check_sham", lambda *a: None)
    spec = TransplantSpec("all", tuple(range(N_LAYERS)))
    rows = transplant_batch(decoder, PROMPTS, STAGES, s, pushed, [0], [spec], pack=pack)  # the real placebo passes
    assert [r["noop"] for r in rows[0]] == [False, False]
    monkeypatch.setattr(transplant_module, "placebo_bytes", lambda donor, recipient: (donor, "shifted"))
    with pytest.raises(PlaceboError, match="placebo that is the real donor"):
        transplant_batch(decoder, PROMPTS, STAGES, s, pushed, [0], [spec], pack=pack)


def test_a_sham_that_does_not_copy_is_caught(batch, monkeypatch):
    """The sham writes the recipient's own bytes back through the transplant's edit; an edit path that writes
    anything else (here: its own bytes plus one) must stop the stage."""
    decoder, s, own = batch
    real = transplant_module.transplant_edit

    def broken(row, spec, donor, prompt_len, arm="donor"):
        source = [(k + 1, v + 1) for k, v in donor] if arm == "sham" else donor
        return real(row, spec, source, prompt_len, "donor" if arm == "sham" else arm)

    monkeypatch.setattr(transplant_module, "transplant_edit", broken)
    with pytest.raises(PlaceboError, match="sham transplant"):
        transplant_rows(decoder, PROMPTS, STAGES, s, own, "prefill", "prefill",
                        {1: TransplantSpec("sham", tuple(range(N_LAYERS)))}, arm="sham")
    sham = Transplant(1, "prefill", "prefill", TransplantSpec("sham", tuple(range(N_LAYERS))), "sham")
    with pytest.raises(PlaceboError, match="sham .* packed decode"):  # the same check in a packed decode
        run_transplants(decoder, PROMPTS, STAGES, s, own, [sham], pack=True)


def test_transplant_edit_refuses_an_unknown_arm():
    with pytest.raises(ValueError, match="arm must be one of"):
        transplant_edit(0, TransplantSpec("all", (0,)), [], 3, arm="real")


def test_paired_counts_and_mcnemar_by_hand():
    cell = placebo_stats.paired_counts([1, 1, 1, 1, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 1, 1])
    assert (cell["both"], cell["only_donor"], cell["only_placebo"], cell["neither"]) == (1, 6, 1, 0)
    assert cell["p_value"] == pytest.approx(2 * (1 + 7) / 2 ** 7)  # exact two-sided binomial on 6 of 7
    assert placebo_stats.reading(cell) == "not separable from its placebo"  # p 0.125
    strong = placebo_stats.paired_counts([1] * 8, [0] * 8)
    assert strong["p_value"] == pytest.approx(2 / 2 ** 8) and placebo_stats.reading(strong) == "carries beyond its placebo"
    tie = placebo_stats.paired_counts([1, 1, 0], [1, 1, 0])  # no discordant pair: nothing tells them apart
    assert tie["p_value"] == 1.0 and placebo_stats.reading(tie) == "not separable from its placebo"
    with pytest.raises(ValueError, match="as many placebo runs"):
        placebo_stats.paired_counts([1, 0], [1])


def _rows(outcomes, placebos, noops, positions="stage"):
    return pd.DataFrame([{"item_index": i, "item_id": f"i{i}", "revision": "primary", "precision": "bf16",
                          "direction": "live->prefill", "sweep": "x", "layer_set": "all", "component": "kv",
                          "positions": positions, "divergent": True, "outcome": o, "placebo_outcome": p, "noop": n}
                         for i, (o, p, n) in enumerate(zip(outcomes, placebos, noops))])


def test_report_reads_localisation_net_of_placebo_and_counts_noops_apart():
    near_tie = _rows(["donor"] * 5 + ["recipient"], ["donor"] * 4 + ["recipient"] * 2, [False] * 6)
    matrix = transplant_matrix(near_tie)
    out = {"sweep": []}
    text = "\n".join(localisation_lines(matrix, out))
    assert "5 / 6" in text and "4 / 6" in text and "not separable from its placebo" in text
    assert "carries beyond" not in text  # 5/6 against a placebo's 4/6 is no evidence of localisation
    carried = transplant_matrix(_rows(["donor"] * 9, ["recipient"] * 9, [False] * 9))
    assert "carries beyond its placebo" in "\n".join(localisation_lines(carried, {"sweep": []}))
    noop = transplant_matrix(_rows(["recipient"] * 3, ["recipient"] * 3, [True] * 3, positions="prompt"))
    assert int(noop["noop"].iloc[0]) == 3 and int(noop["n"].iloc[0]) == 0
    assert "no-op" in "\n".join(localisation_lines(noop, {"sweep": []}))
    # a file from before the controls says so instead of inventing a placebo
    old = transplant_matrix(near_tie.drop(columns=["placebo_outcome", "noop"]))
    assert "predates the placebo control" in "\n".join(localisation_lines(old, {"sweep": []}))


def test_minimal_search_verdicts():
    from stagereplay.analysis.divergence_location import VERDICT_NOT_SEPARABLE
    from stagereplay.stages.minimal_transplant import VERDICTS, verdict

    assert VERDICT_NOT_SEPARABLE == VERDICTS[1]
    assert verdict({"donor": ["donor", "recipient"], "placebo": ["recipient", "recipient"]}) == "localised"
    assert verdict({"donor": ["donor"], "placebo": ["donor"]}) == "not separable from its placebo"
    assert verdict({"donor": ["neither"], "placebo": ["recipient"]}) == "whole cache does not carry"
