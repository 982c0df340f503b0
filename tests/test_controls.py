"""The controls on small models: the fixed-prefix 2x2, the bridge, the saved-ledger audit and their report sections."""

from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from stagereplay.models import compat
from stagereplay.audit import AuditFailedError, ItemRecomputer, audit_item, compare_row
from stagereplay.bridge import BridgeRecorder, choose_bridge_items, compare_caches
from stagereplay.control_stages import check_audit
from stagereplay.engine import Decoder, build_cache
from stagereplay.experiment import LEDGER_SCHEMA, Prompter, Settings, make_matcher, matched_item
from stagereplay.fixed_prefix import fixed_prefix_item
from stagereplay.io.fingerprints import fingerprint_layers
from stagereplay.io.parquet import write_parquet
from stagereplay.models.loading import ModelSource, eos_token_ids, load_model, set_determinism
from stagereplay.analysis.report import RevisionData, audit_section, bridge_section, fixed_prefix_section
from stagereplay.data.toy import synthetic_items

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "data/toy/primary"
BOUNDARY = {"marker": ";", "occurrence": 1}
EXPERIMENTS = {"matched", "fixed_prefix"}


class Setup:
    """The embedded toy model at one precision, with what the experiments need."""

    def __init__(self, precision, folder=TOY):
        set_determinism(1)
        self.loaded = load_model(ModelSource("local", str(folder)), precision, "cpu")
        self.tokenizer = self.loaded.tokenizer
        self.decoder = Decoder(self.loaded.model, tuple(eos_token_ids(self.loaded)))
        self.prompter = Prompter(self.tokenizer)
        self.matcher = make_matcher(BOUNDARY, self.tokenizer)
        self.settings = Settings("primary", precision, 32, 12)

    def recomputer(self, item, reference_stage_ids):
        return ItemRecomputer(self.decoder, self.tokenizer, self.prompter, self.matcher, self.settings, item,
                              reference_stage_ids)


def toy_items(n):
    return [{"item_index": i, "item_id": t.item_id, "question": t.question, "gold_answer": t.gold_answer}
            for i, t in enumerate(synthetic_items(n, 0))]


@pytest.fixture(scope="module")
def bf16():
    return Setup("bf16")


@pytest.fixture(scope="module")
def fp32():
    return Setup("fp32")


@pytest.fixture(scope="module")
def item_rows(bf16, fp32):
    """Matched and fixed-prefix rows of two items at bf16 (the reference) and fp32, as the pipeline makes them."""
    items = toy_items(2)
    rows = {}
    for item in items:
        matched, prefix = matched_item(bf16.decoder, bf16.tokenizer, bf16.prompter, bf16.matcher, item, bf16.settings)
        assert prefix["stage_ids"], "the toy model reaches its ';' boundary on these items"
        fixed_bf16 = fixed_prefix_item(bf16.decoder, bf16.tokenizer, item, prefix, bf16.settings)
        fixed_fp32 = fixed_prefix_item(fp32.decoder, fp32.tokenizer, item, prefix, fp32.settings)
        rows[item["item_index"]] = {"item": item, "prefix": prefix, "bf16": matched + fixed_bf16,
                                    "fp32": fixed_fp32}
    return rows


def test_bridge_items_depend_on_selection_and_seed_only():
    pool = list(range(200))
    chosen = choose_bridge_items(pool, 12, 0)
    assert chosen == choose_bridge_items(reversed(pool), 12, 0) == sorted(chosen)
    assert len(set(chosen)) == 12 and set(chosen) <= set(pool)
    assert chosen != choose_bridge_items(pool, 12, 1)
    assert choose_bridge_items([5, 3], 12, 0) == [3, 5]


def test_compare_caches_names_first_layer_component_and_position(fp32):
    stage = [int(i) for i in fp32.tokenizer("37+45=82;", add_special_tokens=False)["input_ids"]]
    prompt = fp32.prompter("37+45-12")
    a = build_cache(fp32.decoder, "incremental", prompt, stage)
    b = build_cache(fp32.decoder, "incremental", prompt, stage)
    assert compare_caches(a, b) == {"bit_exact": True, "n_layers_differ": 0, "first_layer_differs": None,
                                    "component_differs": None, "first_position_differs": None}
    (k1, v1) = compat.cache_layers(b)[1]
    v1 = v1.clone()
    # one bit of one element: the smallest difference there is
    v1.view(torch.int32)[0, 1, 5, 3] ^= 1
    compat.set_cache_layer(b, 1, values=v1)
    (k3, _) = compat.cache_layers(b)[3]
    k3 = k3.clone()
    k3[0, 0, 2, 0] += 1.0
    compat.set_cache_layer(b, 3, keys=k3)
    result = compare_caches(a, b)
    assert result == {"bit_exact": False, "n_layers_differ": 2, "first_layer_differs": 1, "component_differs": "V",
                      "first_position_differs": 5}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_bridge_incremental_is_live_byte_for_byte(precision, request):
    setup = request.getfixturevalue(precision)
    items = toy_items(3)
    recorder = BridgeRecorder(setup.decoder, [0, 2], "primary", precision, setup.settings.max_new_tokens)
    for item in items:
        rows, _ = matched_item(setup.decoder, setup.tokenizer, setup.prompter, setup.matcher, item, setup.settings,
                               on_live_boundary=recorder.observe)
        recorder.complete(item, rows[0])
    records = recorder.records()
    assert [r["item_index"] for r in records] == [0, 2]
    for r in records:
        assert r["status"] == "ok" and r["bit_exact"] is True and r["suffix_equal"] is True
        assert r["live_cache_fingerprint"] == r["incremental_cache_fingerprint"]
        assert r["first_layer_differs"] is None and r["first_position_differs"] is None
        # the contrast's verdict agrees with the bytes, whichever it is
        assert r["prefill_bit_exact"] == (r["prefill_first_layer_differs"] is None)


def test_prefill_contrast_agrees_with_fingerprints(fp32):
    item = toy_items(1)[0]
    prompt = fp32.prompter(item["question"])
    seen = {}
    rows, _ = matched_item(fp32.decoder, fp32.tokenizer, fp32.prompter, fp32.matcher, item, fp32.settings,
                           on_live_boundary=lambda it, p, boundary: seen.setdefault("b", boundary))
    live = seen["b"].cache
    prefill = build_cache(fp32.decoder, "prefill", prompt, seen["b"].stage_ids)
    same = fingerprint_layers(compat.cache_layers(live)) == fingerprint_layers(compat.cache_layers(prefill))
    assert compare_caches(live, prefill)["bit_exact"] == same


def test_fixed_prefix_rows_and_replicas(item_rows):
    for entry in item_rows.values():
        for precision in ("bf16", "fp32"):
            fixed = [r for r in entry[precision] if r["experiment"] == "fixed_prefix"]
            assert [(r["construction"], r["replica"]) for r in fixed] == [
                ("incremental", 1), ("incremental", 2), ("prefill", 1), ("prefill", 2)]
            assert all(r["stage_ids"] == entry["prefix"]["stage_ids"] and r["precision"] == precision for r in fixed)
        # at the reference precision, incremental is live (the bridge's claim) and matched prefill is prefill
        by = {(r["experiment"], r["construction"], r["replica"]): r for r in entry["bf16"]}
        for a, b in ((("matched", "live", 1), ("fixed_prefix", "incremental", 1)),
                     (("matched", "prefill", 1), ("fixed_prefix", "prefill", 1))):
            assert by[a]["cache_fingerprint"] == by[b]["cache_fingerprint"]
            assert by[a]["suffix_ids"] == by[b]["suffix_ids"]


def test_no_reference_prefix_means_no_rows(fp32):
    item = toy_items(1)[0]
    prefix = {"item_index": 0, "prompt_ids": [2], "stage_ids": [], "status": "boundary_missing"}
    assert fixed_prefix_item(fp32.decoder, fp32.tokenizer, item, prefix, fp32.settings) == []
    with pytest.raises(ValueError, match="item_index 7"):
        fixed_prefix_item(fp32.decoder, fp32.tokenizer, item, {**prefix, "item_index": 7}, fp32.settings)


def test_audit_reproduces_every_row(item_rows, bf16, fp32):
    for entry in item_rows.values():
        stage = entry["prefix"]["stage_ids"]
        for setup, rows in ((bf16, entry["bf16"]), (fp32, entry["fp32"])):
            experiments = EXPERIMENTS if setup is bf16 else {"fixed_prefix"}
            records = audit_item(setup.recomputer(entry["item"], stage), rows, experiments)
            assert len(records) == len(rows)
            assert all(r["reproduced"] and r["differed"] == [] for r in records), records


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
    records = audit_item(bf16.recomputer(entry["item"], entry["prefix"]["stage_ids"]), rows, EXPERIMENTS)
    failed = {(r["experiment"], r["construction"], r["replica"]): r for r in records if not r["reproduced"]}
    assert set(failed) == {("fixed_prefix", "prefill", flipped["replica"]), ("matched", "live", 2),
                           ("matched", "prefill", 2)}
    assert "suffix_ids" in failed[("fixed_prefix", "prefill", flipped["replica"])]["differed"]
    assert "suffix_ids differ at index 2" in failed[("fixed_prefix", "prefill", flipped["replica"])]["detail"]
    assert failed[("matched", "live", 2)]["differed"] == ["cache_fingerprint"]
    assert failed[("matched", "prefill", 2)]["differed"] == ["missing_row"]
    assert all(r["item_id"] == entry["item"]["item_id"] for r in failed.values())


def test_audit_checks_fixed_prefix_against_the_reference(item_rows, fp32):
    entry = item_rows[1]
    other_stage = item_rows[0]["prefix"]["stage_ids"]
    records = audit_item(fp32.recomputer(entry["item"], other_stage), entry["fp32"], {"fixed_prefix"})
    assert not any(r["reproduced"] for r in records)
    assert all("stage_ids" in r["differed"] for r in records)


def test_compare_row_reads_margins_as_float32_bytes(item_rows):
    row = item_rows[0]["bf16"][0]
    nudged = dict(row, margins=[m + 1e-3 for m in row["margins"]])
    assert compare_row(row, dict(row)) == ([], "")
    differed, detail = compare_row(nudged, row)
    assert differed == ["margins"] and "step 0" in detail


def _write_frames(tmp_path, audit_records, ledger_rows):
    from stagereplay.audit import AUDIT_SCHEMA

    audit, ledger = tmp_path / "audit.parquet", tmp_path / "ledger.parquet"
    write_parquet(pd.DataFrame(audit_records, columns=AUDIT_SCHEMA.names), audit, {}, AUDIT_SCHEMA)
    write_parquet(pd.DataFrame(ledger_rows, columns=LEDGER_SCHEMA.names), ledger, {}, LEDGER_SCHEMA)
    return audit, ledger


def test_check_audit_passes_fails_and_names_rows(item_rows, bf16, tmp_path):
    entry = item_rows[0]
    rows = entry["bf16"]
    records = audit_item(bf16.recomputer(entry["item"], entry["prefix"]["stage_ids"]), rows, EXPERIMENTS)
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
    prompt = fp32.prompter(item["question"])
    stage = [int(i) for i in fp32.tokenizer("37+4", add_special_tokens=False)["input_ids"]]
    prefix = {"item_index": 0, "prompt_ids": prompt, "stage_ids": stage}
    finite = fixed_prefix_item(fp32.decoder, fp32.tokenizer, item, prefix, fp32.settings)
    assert all(r["status"] == "ok" and len(r["suffix_ids"]) == 12 for r in finite)
    rows = fixed_prefix_item(fp16.decoder, fp16.tokenizer, item, prefix, fp16.settings)
    assert len(rows) == 4
    assert all(r["status"] == "nonfinite" and r["stop_reason"] == "nonfinite" and r["correct"] is None
               for r in rows)
    ledger = pd.DataFrame(rows + finite)
    lines, numbers = fixed_prefix_section(RevisionData("primary", {}, _frames={"ledger": ledger}))
    assert numbers["fp16"]["nonfinite_rows"] == 4 and numbers["fp16"]["n_compared"] == 0
    assert numbers["fp32"]["nonfinite_rows"] == 0 and numbers["fp32"]["n_compared"] == 1
    assert "fp16: 4 rows of 1 items" in "\n".join(lines)
    records = audit_item(fp16.recomputer(item, stage), rows, {"fixed_prefix"})
    assert all(r["reproduced"] for r in records)
    # generating at fp16 overflows within the stage: live rows marked, no prefix, nothing built on it
    matched, prefix = matched_item(fp16.decoder, fp16.tokenizer, fp16.prompter, fp16.matcher, item, fp16.settings)
    assert [(r["construction"], r["status"]) for r in matched] == [("live", "nonfinite")] * 2
    assert prefix["status"] == "nonfinite" and prefix["stage_ids"] == []
    assert fixed_prefix_item(fp16.decoder, fp16.tokenizer, item, prefix, fp16.settings) == []
    records = audit_item(fp16.recomputer(item, None), matched, {"matched", "fixed_prefix"})
    assert len(records) == 2 and all(r["reproduced"] for r in records)


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
