"""The controls on small models: the fixed-prefix 2x2, the bridge, the saved-ledger audit and their report sections."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from stagereplay.analysis.report import RevisionData, audit_section, bridge_section, fixed_prefix_section
from stagereplay.data.prompts import Prompter
from stagereplay.data.toy import synthetic_items
from stagereplay.decode.greedy import matcher_from_config
from stagereplay.decode.plans import Batch
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.audit import (
    AUDIT_SCHEMA,
    AuditFailedError,
    audit_batch,
    compare_row,
    layout_parity,
)
from stagereplay.experiments.bridge import BRIDGE_SCHEMA, bridge, bridge_rows_of, choose_bridge_items
from stagereplay.experiments.cache_differences import compare_layers
from stagereplay.experiments.matched import fixed_prefix, matched
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import LEDGER_SCHEMA, RunSettings
from stagereplay.io.fingerprints import fingerprint_layers
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.models.loading import eos_token_ids, load_model, set_determinism
from stagereplay.models.sources import ModelSource
from stagereplay.stages.gather import check_audit

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "data/toy/primary"
BOUNDARY = {"marker": ";", "occurrence": 1}
MAX_STAGE, MAX_NEW = 32, 12


class Setup:
    """The embedded toy model at one precision, with what the experiments need (eager, or static batches)."""

    def __init__(self, precision, folder=TOY, regime="eager", max_rows=1):
        set_determinism(1)
        self.loaded = load_model(ModelSource("local", str(folder)), precision, "cpu")
        self.tokenizer = self.loaded.tokenizer
        self.decoder = make_decoder(self.loaded.model, tuple(eos_token_ids(self.loaded)), regime,
                                    max_len=None if regime == "eager" else 64 + MAX_STAGE + MAX_NEW,
                                    max_rows=max_rows)
        self.prompter = Prompter(self.tokenizer)
        self.matcher = matcher_from_config(BOUNDARY, self.tokenizer)
        self.settings = RunSettings("primary", precision, MAX_STAGE, MAX_NEW, decode_regime=regime)

    def prompts(self, batch):
        return [self.prompter(item["question"]) for item in batch.items]

    def matched(self, batch, **kwargs):
        return matched(self.decoder, batch, self.prompts(batch), self.settings, self.tokenizer, self.matcher,
                       **kwargs)

    def fixed(self, batch, stages, **kwargs):
        return fixed_prefix(self.decoder, batch, self.prompts(batch), stages, self.settings, self.tokenizer,
                            **kwargs)

    def recompute(self, batch, reference_stages):
        """What the audit stage recomputes for one batch: both experiments with one replica (or the exception)."""
        try:
            return (self.matched(batch, replicas=(1,)).rows
                    + self.fixed(batch, reference_stages, replicas=(1,)))
        except Exception as exc:  # noqa: BLE001 - as audit_ledger does: a finding about every row
            return exc

    def audit(self, batch, stored, reference_stages):
        return audit_batch(stored, self.recompute(batch, reference_stages))


def toy_items(n):
    return [{"item_index": i, "item_id": t.item_id, "question": t.question, "gold_answer": t.gold_answer}
            for i, t in enumerate(synthetic_items(n, 0))]


def alone(item):
    return Batch(None, (item,))  # batch_size 1: each item a batch of one row


@pytest.fixture(scope="module")
def bf16():
    return Setup("bf16")


@pytest.fixture(scope="module")
def fp32():
    return Setup("fp32")


@pytest.fixture(scope="module")
def static_bf16():
    return Setup("bf16", regime="static", max_rows=3)


@pytest.fixture(scope="module")
def item_rows(bf16, fp32):
    """Matched and fixed-prefix rows of two items at bf16 (the reference) and fp32, as the pipeline makes them:
    each item alone, the fixed-prefix 2x2 of both precisions over bf16's live prefix."""
    rows = {}
    for item in toy_items(2):
        batch = alone(item)
        reference = bf16.matched(batch)
        stage = reference.prefix_rows[0]["stage_ids"]
        assert stage, "the toy model reaches its ';' boundary on these items"
        rows[item["item_index"]] = {
            "item": item, "batch": batch, "prefix": reference.prefix_rows[0], "stage": stage,
            "bf16": reference.rows + bf16.fixed(batch, [stage]),
            "fp32": fp32.matched(batch).rows + fp32.fixed(batch, [stage])}
    return rows


@pytest.fixture(scope="module")
def batched_rows(static_bf16):
    """Matched and fixed-prefix rows of three items decoded together in one static batch (left-padded rows)."""
    batch = Batch(0, tuple(toy_items(3)))
    result = static_bf16.matched(batch)
    stages = result.stages()
    assert all(stages), "the toy model reaches its ';' boundary on these items"
    return {"batch": batch, "stages": stages, "rows": result.rows + static_bf16.fixed(batch, stages)}


def boundary_cache(setup, prompt, stage, construction="incremental"):
    """One row's boundary cache built by ``construction`` (a copy, kept out of the decoder's buffers)."""
    return run(setup.decoder, construction, [prompt], setup.settings, stages=[stage], keep={0}, max_new_tokens=0)[0]


def test_bridge_items_depend_on_selection_and_seed_only():
    pool = list(range(200))
    chosen = choose_bridge_items(pool, 12, 0)
    assert chosen == choose_bridge_items(reversed(pool), 12, 0) == sorted(chosen)
    assert len(set(chosen)) == 12 and set(chosen) <= set(pool)
    assert chosen != choose_bridge_items(pool, 12, 1)
    assert choose_bridge_items([5, 3], 12, 0) == [3, 5]
    batch = Batch(4, tuple({"item_index": i} for i in (7, 3, 5)))
    assert bridge_rows_of(batch, {3, 5, 11}) == {1, 2}


def test_compare_layers_names_first_layer_component_and_position(fp32):
    stage = [int(i) for i in fp32.tokenizer("37+45=82;", add_special_tokens=False)["input_ids"]]
    prompt = fp32.prompter("37+45-12")
    a = boundary_cache(fp32, prompt, stage).layers
    b = boundary_cache(fp32, prompt, stage).layers
    assert compare_layers(a, b) == {"bit_exact": True, "n_layers_differ": 0, "first_layer_differs": None,
                                    "component_differs": None, "first_position_differs": None}
    assert fingerprint_layers(a) == fingerprint_layers(b)
    # one bit of one element: the smallest difference there is
    b[1][1].view(torch.int32)[0, 1, 5, 3] ^= 1
    b[3][0][0, 0, 2, 0] += 1.0
    assert compare_layers(a, b) == {"bit_exact": False, "n_layers_differ": 2, "first_layer_differs": 1,
                                    "component_differs": "V", "first_position_differs": 5}
    # a cache of another length differs in shape
    shorter = boundary_cache(fp32, prompt, stage[:-1]).layers
    assert compare_layers(a, shorter)["component_differs"] == "shape"


@pytest.mark.parametrize("setup_name", ["bf16", "fp32", "static_bf16"])
def test_bridge_incremental_is_live_byte_for_byte(setup_name, request):
    setup = request.getfixturevalue(setup_name)
    items = toy_items(3)
    chosen = {0, 2}
    batches = [Batch(0, tuple(items))] if setup.settings.decode_regime == "static" else [alone(i) for i in items]
    records = []
    for batch in batches:
        wanted = bridge_rows_of(batch, chosen)
        result = setup.matched(batch, keep=wanted)
        records += bridge(setup.decoder, batch, setup.prompts(batch), setup.settings, result, wanted)
    assert sorted(r["item_index"] for r in records) == [0, 2]
    for r in records:
        assert r["status"] == "ok" and r["bit_exact"] is True and r["suffix_equal"] is True
        assert r["live_cache_fingerprint"] == r["incremental_cache_fingerprint"]
        assert r["live_suffix_fingerprint"] == r["incremental_suffix_fingerprint"]
        assert r["first_layer_differs"] is None and r["first_position_differs"] is None
        # the contrast's verdict agrees with the bytes, whichever it is
        assert r["prefill_bit_exact"] == (r["prefill_first_layer_differs"] is None)


def test_prefill_contrast_agrees_with_fingerprints(fp32):
    batch = alone(toy_items(1)[0])
    result = fp32.matched(batch, keep={0})
    live, prefill = result.live[0], result.prefill[0]
    assert live.layers is not None and prefill.layers is not None  # kept for the bridge row
    same = fingerprint_layers(live.layers) == fingerprint_layers(prefill.layers)
    assert compare_layers(live.layers, prefill.layers)["bit_exact"] == same
    assert (live.fingerprints[0] == prefill.fingerprints[0]) == same  # the ledger's fingerprints, of the same bytes
    [record] = bridge(fp32.decoder, batch, fp32.prompts(batch), fp32.settings, result, {0})
    assert record["prefill_bit_exact"] == same


def test_fixed_prefix_rows_and_replicas(item_rows):
    for entry in item_rows.values():
        for precision in ("bf16", "fp32"):
            fixed = [r for r in entry[precision] if r["experiment"] == "fixed_prefix"]
            assert [(r["construction"], r["replica"]) for r in fixed] == [
                ("incremental", 1), ("incremental", 2), ("prefill", 1), ("prefill", 2)]
            assert all(r["stage_ids"] == entry["stage"] and r["precision"] == precision for r in fixed)
            assert all(r["prompt_ids"] == entry["prefix"]["prompt_ids"] for r in fixed)
        # at the reference precision, incremental is live (the bridge's claim) and matched prefill is prefill
        by = {(r["experiment"], r["construction"], r["replica"]): r for r in entry["bf16"]}
        for a, b in ((("matched", "live", 1), ("fixed_prefix", "incremental", 1)),
                     (("matched", "prefill", 1), ("fixed_prefix", "prefill", 1))):
            assert by[a]["cache_fingerprint"] == by[b]["cache_fingerprint"]
            assert by[a]["cache_k_fingerprints"] == by[b]["cache_k_fingerprints"]
            assert by[a]["suffix_ids"] == by[b]["suffix_ids"]


def test_no_reference_prefix_means_no_rows(fp32, item_rows):
    items = toy_items(2)
    assert fp32.fixed(alone(items[0]), [None]) == []
    # in a batch, a row without a prefix gets no rows; the other rows of its batch still do
    rows = fp32.fixed(Batch(None, tuple(items)), [None, item_rows[1]["stage"]])
    assert {r["item_index"] for r in rows} == {1} and len(rows) == 4
    with pytest.raises(ValueError, match="empty"):
        fp32.fixed(alone(items[0]), [[]])
    with pytest.raises(ValueError, match="2 stages for 1 prompts"):
        fp32.fixed(alone(items[0]), [None, None])


def test_audit_reproduces_every_row(item_rows, bf16, fp32):
    for entry in item_rows.values():
        for setup, rows in ((bf16, entry["bf16"]), (fp32, entry["fp32"])):
            records = setup.audit(entry["batch"], rows, [entry["stage"]])
            assert len(records) == len(rows) == 8
            assert all(r["reproduced"] and r["differed"] == [] for r in records), records


def test_audit_reproduces_a_batched_ledger(batched_rows, static_bf16):
    rows = batched_rows["rows"]
    pads = {r["item_index"]: r["layout_pad"] for r in rows}
    assert len(set(pads.values())) > 1, "the items' prompts differ in length: their rows are padded differently"
    assert {(r["batch_index"], r["batch_rows"]) for r in rows} == {(0, 3)}
    records = static_bf16.audit(batched_rows["batch"], rows, batched_rows["stages"])
    assert len(records) == len(rows) == 3 * 8
    assert all(r["reproduced"] and r["differed"] == [] for r in records), records
    assert layout_parity(rows) == {}  # rows of different items may sit at different pads


def test_audit_names_corrupted_rows(item_rows, bf16):
    entry = item_rows[0]
    rows = [dict(r) for r in entry["bf16"]]
    flipped = next(r for r in rows if r["experiment"] == "fixed_prefix" and r["construction"] == "prefill")
    flipped["suffix_ids"] = list(flipped["suffix_ids"])
    flipped["suffix_ids"][2] = (flipped["suffix_ids"][2] + 1) % 21
    wrong_fp = next(r for r in rows if r["experiment"] == "matched" and r["construction"] == "live"
                    and r["replica"] == 2)
    wrong_fp["cache_fingerprint"] = "0" * 64
    dropped = next(r for r in rows if r["experiment"] == "matched" and r["construction"] == "prefill"
                   and r["replica"] == 2)
    rows.remove(dropped)
    records = bf16.audit(entry["batch"], rows, [entry["stage"]])
    failed = {(r["experiment"], r["construction"], r["replica"]): r for r in records if not r["reproduced"]}
    assert set(failed) == {("fixed_prefix", "prefill", flipped["replica"]), ("matched", "live", 2),
                           ("matched", "prefill", 2)}
    assert failed[("fixed_prefix", "prefill", flipped["replica"])]["differed"] == ["suffix_ids"]
    assert "suffix_ids differ at index 2" in failed[("fixed_prefix", "prefill", flipped["replica"])]["detail"]
    assert failed[("matched", "live", 2)]["differed"] == ["cache_fingerprint"]
    assert failed[("matched", "prefill", 2)]["differed"] == ["missing_row"]
    assert all(r["item_id"] == entry["item"]["item_id"] for r in failed.values())
    assert sum(r["reproduced"] for r in records) == len(rows) - 2


def test_audit_checks_fixed_prefix_against_the_reference(item_rows, fp32):
    entry = item_rows[1]
    other_stage = item_rows[0]["stage"]
    assert other_stage != entry["stage"]
    records = fp32.audit(entry["batch"], entry["fp32"], [other_stage])
    fixed = [r for r in records if r["experiment"] == "fixed_prefix"]
    assert len(fixed) == 4 and not any(r["reproduced"] for r in fixed)
    assert all("stage_ids" in r["differed"] for r in fixed)
    assert all(r["reproduced"] for r in records if r["experiment"] == "matched")


def test_audit_records_a_failed_recomputation_against_every_row(item_rows):
    rows = item_rows[0]["bf16"]
    records = audit_batch(rows, RuntimeError("out of memory"))
    assert len(records) == len(rows)
    assert all(not r["reproduced"] and r["differed"] == ["error"] and "out of memory" in r["detail"]
               for r in records)


def test_compare_row_reads_margins_as_float32_bytes(item_rows):
    row = item_rows[0]["bf16"][0]
    assert compare_row(row, dict(row)) == ([], "")
    nudged = dict(row, margins=[m + 1e-3 for m in row["margins"]])
    differed, detail = compare_row(nudged, row)
    assert differed == ["margins"] and "step 0" in detail
    # the same float32 bytes are equal whatever their Python type; different bytes differ even where == holds
    assert compare_row(dict(row, margins=np.asarray(row["margins"], dtype=np.float32)), row) == ([], "")
    zero, negative_zero = dict(row, margins=[0.0, 1.0]), dict(row, margins=[-0.0, 1.0])
    assert compare_row(zero, negative_zero)[0] == ["margins"]
    assert compare_row(dict(row, margins=[float("nan")]), dict(row, margins=[float("nan")])) == ([], "")


def _write_frames(tmp_path, audit_records, ledger_rows):
    audit, ledger = tmp_path / "audit.parquet", tmp_path / "ledger.parquet"
    write_parquet(pd.DataFrame(audit_records, columns=AUDIT_SCHEMA.names), audit, {}, AUDIT_SCHEMA)
    write_parquet(pd.DataFrame(ledger_rows, columns=LEDGER_SCHEMA.names), ledger, {}, LEDGER_SCHEMA)
    return audit, ledger


def test_check_audit_passes_fails_and_names_rows(item_rows, bf16, tmp_path):
    entry = item_rows[0]
    rows = entry["bf16"]
    records = bf16.audit(entry["batch"], rows, [entry["stage"]])
    audit, ledger = _write_frames(tmp_path, records, rows)
    summary = check_audit(str(audit), str(ledger), str(tmp_path / "ok.json"))
    assert summary["reproduced"] == len(rows) == summary["ledger_rows"]
    assert (tmp_path / "ok.json").is_file()
    # a failed record, and a ledger row the audit never saw
    records[3] = dict(records[3], reproduced=False, differed=["suffix_fingerprint"], detail="x")
    audit, ledger = _write_frames(tmp_path, records[:-1], rows)
    with pytest.raises(AuditFailedError) as err:
        check_audit(str(audit), str(ledger), str(tmp_path / "bad.json"))
    message = str(err.value)
    assert "2 ledger row(s) did not reproduce" in message and entry["item"]["item_id"] in message
    assert "suffix_fingerprint" in message and "not_audited" in message
    assert not (tmp_path / "bad.json").exists()


def _live_replica(rows, replica):
    return next(r for r in rows if r["experiment"] == "matched" and r["construction"] == "live"
                and r["replica"] == replica)


def test_audit_refuses_a_duplicated_row_and_a_made_up_replica(item_rows, bf16, tmp_path):
    """A re-hashed copy of a live replica-1 row, and a row claiming replica 7, in a ledger file whose integrity
    fingerprint was recomputed after the edit (so only the audit can catch them)."""
    entry = item_rows[0]
    rows = [dict(r) for r in entry["bf16"]]
    copy_of_live = dict(_live_replica(rows, 1))
    made_up = dict(_live_replica(rows, 2), replica=7)
    tampered = rows + [copy_of_live, made_up]
    audit, ledger = _write_frames(tmp_path, [], tampered)
    stored = read_parquet(ledger).to_dict("records")  # the file passes its own integrity check
    assert len(stored) == len(rows) + 2
    records = bf16.audit(entry["batch"], stored, [entry["stage"]])
    assert len(records) == len(stored)
    failed = [r for r in records if not r["reproduced"]]
    duplicates = [r for r in failed if r["differed"] == ["duplicate_row"]]
    unexpected = [r for r in failed if r["differed"] == ["unexpected_row"]]
    assert len(duplicates) == 2 and len(unexpected) == 1 and len(failed) == 3  # both copies: neither is vouched for
    assert {(r["experiment"], r["construction"], r["replica"]) for r in duplicates} == {("matched", "live", 1)}
    assert (unexpected[0]["construction"], unexpected[0]["replica"]) == ("live", 7)
    assert "replica 7" in unexpected[0]["detail"]
    assert all(r["reproduced"] for r in records if r not in failed)
    # the pipeline stops, naming them
    audit, ledger = _write_frames(tmp_path, records, tampered)
    with pytest.raises(AuditFailedError) as err:
        check_audit(str(audit), str(ledger), str(tmp_path / "summary.json"))
    message = str(err.value)
    assert "duplicate_row" in message and "unexpected_row" in message
    assert "live replica 7" in message and "live replica 1" in message and entry["item"]["item_id"] in message
    assert not (tmp_path / "summary.json").exists()
    # an audit file that claims every row reproduced does not hide the duplicate from check_audit
    forged = [dict(r, reproduced=True, differed=[], detail="") for r in records]
    audit, ledger = _write_frames(tmp_path, forged, tampered)
    with pytest.raises(AuditFailedError, match="duplicate_row"):
        check_audit(str(audit), str(ledger), str(tmp_path / "summary.json"))
    # without the copy and the made-up replica the same ledger passes
    audit, ledger = _write_frames(tmp_path, bf16.audit(entry["batch"], rows, [entry["stage"]]), rows)
    check_audit(str(audit), str(ledger), str(tmp_path / "summary.json"))


def _shift_pad(row):
    return dict(row, layout_pad=int(row["layout_pad"]) + 1)


def test_layout_parity_flags_a_construction_decoded_in_another_layout(batched_rows, static_bf16):
    rows = [dict(r) for r in batched_rows["rows"]]
    item = rows[0]["item_index"]
    key = lambda r: (r["item_index"], r["experiment"], r["construction"], r["replica"])  # noqa: E731
    target = next(i for i, r in enumerate(rows)
                  if key(r) == (item, "matched", "prefill", 1))
    rows[target] = _shift_pad(rows[target])
    found = layout_parity(rows)
    assert list(found) == [target]
    assert "layout_pad" in found[target] and "another layout" in found[target]
    records = static_bf16.audit(batched_rows["batch"], rows, batched_rows["stages"])
    failed = [r for r in records if not r["reproduced"]]
    assert [key(r) for r in failed] == [(item, "matched", "prefill", 1)]
    assert "layout_parity" in failed[0]["differed"] and "layout_pad" in failed[0]["differed"]
    assert "another layout" in failed[0]["detail"]
    # the whole construction (both replicas) in another layout than the item's live rows: one side is flagged,
    # all of its rows and nothing of other items or experiments
    rows = [dict(r) for r in batched_rows["rows"]]
    rows = [_shift_pad(r) if key(r)[:3] == (item, "matched", "prefill") else r for r in rows]
    flagged = {key(rows[i])[:3] for i in layout_parity(rows)}
    assert flagged in ({(item, "matched", "prefill")}, {(item, "matched", "live")})
    assert len(layout_parity(rows)) == 2
    records = static_bf16.audit(batched_rows["batch"], rows, batched_rows["stages"])
    assert {key(r)[:3] for r in records if "layout_parity" in r["differed"]} == flagged


def test_layout_parity_compares_every_layout_column(batched_rows):
    rows = [dict(r) for r in batched_rows["rows"]]
    item = rows[0]["item_index"]
    for column, value in (("layout_position", lambda v: int(v) + 1), ("batch_row", lambda v: int(v) + 1),
                          ("decode_regime", lambda v: "eager")):
        edited = [dict(r) for r in rows]
        i = next(j for j, r in enumerate(edited) if (r["item_index"], r["experiment"], r["construction"],
                                                     r["replica"]) == (item, "fixed_prefix", "prefill", 2))
        edited[i][column] = value(edited[i][column])
        found = layout_parity(edited)
        assert list(found) == [i] and column in found[i], column


def _overflowing_copy(tmp_path) -> Path:
    """The toy model with its final norm's weights scaled so fp16 logits overflow (fp32 stays finite).

    The toy ties its output layer to the embeddings, so the final norm's scale alone carries the overflow."""
    import shutil

    folder = tmp_path / "overflow"
    shutil.copytree(TOY, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 3e4  # max 1.43 -> 4.3e4, still finite in fp16
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_fp16_overflow_rows_are_marked_counted_and_reproduced(tmp_path):
    folder = _overflowing_copy(tmp_path)
    fp16, fp32 = Setup("fp16", folder), Setup("fp32", folder)
    item = toy_items(1)[0]
    batch = alone(item)
    stage = [int(i) for i in fp32.tokenizer("37+4", add_special_tokens=False)["input_ids"]]
    finite = fp32.fixed(batch, [stage])
    assert all(r["status"] == "ok" and len(r["suffix_ids"]) == MAX_NEW for r in finite)
    rows = fp16.fixed(batch, [stage])
    assert len(rows) == 4
    assert all(r["status"] == "nonfinite" and r["stop_reason"] == "nonfinite" and r["correct"] is None
               for r in rows)
    ledger = pd.DataFrame(rows + finite)
    lines, numbers = fixed_prefix_section(RevisionData("primary", {}, _frames={"ledger": ledger}))
    assert numbers["fp16"]["nonfinite_rows"] == 4 and numbers["fp16"]["n_compared"] == 0
    assert numbers["fp32"]["nonfinite_rows"] == 0 and numbers["fp32"]["n_compared"] == 1
    assert "fp16: 4 rows of 1 items" in "\n".join(lines)
    # generating at fp16 overflows within the stage: live rows marked, no prefix, nothing built on it
    result = fp16.matched(batch)
    assert [(r["construction"], r["status"]) for r in result.rows] == [("live", "nonfinite")] * 2
    assert result.prefix_rows[0]["status"] == "nonfinite" and result.prefix_rows[0]["stage_ids"] == []
    assert fp16.fixed(batch, result.stages()) == []
    # the audit reproduces the marked rows: the matched ones, and the fixed-prefix ones over the given prefix
    records = fp16.audit(batch, result.rows + rows, [stage])
    assert len(records) == 6 and all(r["reproduced"] for r in records), records


def test_report_sections_from_frames():
    bridge = pd.DataFrame([
        {"item_index": 1, "item_id": "a", "precision": "bf16", "status": "ok", "bit_exact": True,
         "suffix_equal": True, "prefill_bit_exact": False, "first_layer_differs": None,
         "component_differs": None, "first_position_differs": None},
        {"item_index": 2, "item_id": "b", "precision": "bf16", "status": "ok", "bit_exact": False,
         "suffix_equal": False, "prefill_bit_exact": False, "first_layer_differs": 3,
         "component_differs": "V", "first_position_differs": 17},
        {"item_index": 3, "item_id": "c", "precision": "bf16", "status": "boundary_missing", "bit_exact": None,
         "suffix_equal": None, "prefill_bit_exact": None, "first_layer_differs": None,
         "component_differs": None, "first_position_differs": None},
    ])
    lines, numbers = bridge_section(RevisionData("primary", {}, _frames={"bridge": bridge}))
    assert (numbers["bit_exact"]["k"], numbers["bit_exact"]["n"]) == (1, 2)  # the missing boundary is not counted
    assert numbers["not_bit_exact_items"] == ["b"]
    text = "\n".join(lines)
    assert "| `b` | bf16 | 3 | V | 17 |" in text
    assert "| | reference study | bf16 |" in text and "| rows bit-exact (every layer's K and V bytes) |" in text
    assert "| 1 / 2 |" in text and (numbers["bit_exact_by_precision"]["bf16"]["k"], 1) == (1, 1)
    # a second precision gets its own column, not a sum
    fp32 = bridge.assign(precision="fp32", bit_exact=[True, True, None])
    lines, numbers = bridge_section(RevisionData("primary", {}, _frames={"bridge": pd.concat([bridge, fp32])}))
    text = "\n".join(lines)
    assert "| | reference study | bf16 | fp32 |" in text and "| 1 / 2 | 2 / 2 |" in text
    assert (numbers["bit_exact"]["k"], numbers["bit_exact"]["n"]) == (3, 4)
    assert "same chunks" in text and "not counted" in text
    audit = pd.DataFrame([
        {"item_id": "a", "experiment": "matched", "precision": "bf16", "construction": "live", "replica": 1,
         "reproduced": True, "differed": []},
        {"item_id": "b", "experiment": "fixed_prefix", "precision": "fp32", "construction": "prefill", "replica": 2,
         "reproduced": False, "differed": ["suffix_ids"]},
    ])
    lines, numbers = audit_section(RevisionData("primary", {}, _frames={"audit": audit}))
    assert (numbers["reproduced"]["k"], numbers["reproduced"]["n"]) == (1, 2)
    assert "1 / 2" in "\n".join(lines) and "b fixed_prefix fp32 prefill 2" in "\n".join(lines)


def test_a_bridge_of_no_rows_says_whether_none_was_asked_for_or_none_reached_the_boundary(tmp_path):
    """bridge.n_rows: 0 made the report say that no bridge row reached the boundary, which is not what happened."""
    path = tmp_path / "bridge.parquet"
    for n_rows, says in ((0, "No bridge row was asked for (bridge.n_rows: 0), so the incremental cache was not "
                             "compared with the live one; set bridge.n_rows above 0 to compare them."),
                         (3, "No bridge row reached the boundary: there is no cache to compare.")):
        write_parquet(pd.DataFrame(columns=BRIDGE_SCHEMA.names), path,
                      {"stage": "gather", "parts": [{"config": {"bridge": {"n_rows": n_rows, "seed": 0}}}]},
                      BRIDGE_SCHEMA)
        lines, _ = bridge_section(RevisionData("primary", {"bridge": str(path)}))
        assert says in lines and len([line for line in lines if line.startswith("No bridge row")]) == 1
