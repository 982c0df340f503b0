"""Packed decodes (stagereplay.experiments.packing): a row's continuation is the same, byte for byte, whichever
row slot of a decode it occupies, given the layout it keeps (its pad and position, its recorded batch's row count,
the decoder's buffer). Witnessed by the suffix ids, every margin's float32 bytes, the cache fingerprints (whole and
per layer), the layout and the stop reason. Two controls show the comparison can fail: one slot's cache nudged by
one step of its dtype, and rows decoded in batches of another row count (a layout that is not kept)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.packing import Task, decodes, packing_refusal, run_packed
from stagereplay.experiments.recipe import DecodeSettings, run
from stagereplay.experiments.transplant import transplant_batch
from stagereplay.experiments.transplant_specs import enumerate_sweeps

ROWS = 5
FILLER = {2}  # a row that reached no boundary: filler in the recorded batch


def recorded(loaded, regime: str, construction: str, seed: int = 3):
    tok = loaded.tokenizer
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 24))] for _ in range(ROWS)]
    stages = [None if r in FILLER else [rng.randrange(3, len(tok)) for _ in range(rng.randrange(2, 12))]
              for r in range(ROWS)]
    decoder = make_decoder(loaded.model, (), regime, max_len=80, max_rows=ROWS)
    settings = DecodeSettings(None, 12)
    rows = {r for r, s in enumerate(stages) if s is not None}
    own = run(decoder, construction, prompts, settings, stages=stages, keep=rows)
    return decoder, prompts, stages, settings, own, sorted(rows)


def witness(res) -> tuple:
    return (list(res.suffix_ids), np.asarray(res.margins, "<f4").tobytes(), res.fingerprints, res.pad,
            res.position, res.stop_reason)


def tasks_for(order, prompts, stages, own, rows=ROWS, edits=None):
    edits = edits or {}
    return [Task((j, r), rows, own[r].pad, prompts[r], stages[r], own[r].layers, edits.get(j))
            for j, r in enumerate(order)]


def differing(packed, own) -> set:
    return {key for key, p in packed.items() if witness(p.result) != witness(own[key[1]])}


@pytest.fixture(scope="module", params=[("static", "prefill"), ("static", "incremental"), ("eager", "prefill")],
                ids=lambda p: "-".join(p))
def batch(request, loaded_fp32):
    return recorded(loaded_fp32, *request.param)


def test_a_row_continues_alike_in_every_slot(batch):
    decoder, prompts, stages, settings, own, rows = batch
    # every row twice (two specs of one item, say), in an order that moves each out of its recorded slot; the
    # decodes are full (ROWS slots) but for the last one, and one decode holds the same row twice
    order = rows[::-1] + rows[1:] + rows[:1]
    packed = run_packed(decoder, tasks_for(order, prompts, stages, own), settings)
    assert [len(chunk) for chunk in decodes(tasks_for(order, prompts, stages, own))] == [ROWS, len(order) - ROWS]
    assert any(j % ROWS != r for j, r in packed)  # rows did move
    assert differing(packed, own) == set()


def test_control_a_nudged_slot_is_caught(batch):
    """The comparison can fail: one slot's cache nudged (its first K element moved by one step of its dtype) is
    told apart by its witness, and only that slot."""
    decoder, prompts, stages, settings, own, rows = batch

    def nudge(layers):
        k = layers[0][0]
        k[0, 0, 0, 0] = torch.nextafter(k[0, 0, 0, 0], torch.tensor(float("inf"), dtype=k.dtype))

    order = rows[::-1]
    packed = run_packed(decoder, tasks_for(order, prompts, stages, own, edits={1: nudge}), settings)
    assert differing(packed, own) == {(1, order[1])}


def test_control_another_row_count_changes_the_bits(loaded_fp32):
    """The layout a packed row keeps matters: the same rows continued in decodes of one row (not their recorded
    batch's) give other bits on this CPU in fp32 (one row takes another matrix kernel than several), which the
    comparison catches; in their recorded row count they do not."""
    decoder, prompts, stages, settings, own, rows = recorded(loaded_fp32, "static", "prefill")
    kept = run_packed(decoder, tasks_for(rows, prompts, stages, own), settings)
    alone = run_packed(decoder, tasks_for(rows, prompts, stages, own, rows=1), settings)
    assert differing(kept, own) == set()
    assert differing(alone, own)


def test_packed_transplants_equal_the_unpacked_path(loaded_fp32):
    """Every column of every transplant row (donor, placebo, sham) as the unpacked path writes it, but
    rows_transplanted, which says how many transplants shared the decode."""
    decoder, prompts, stages, settings, _, rows = recorded(loaded_fp32, "static", "prefill")
    own = {name: run(decoder, name, prompts, settings, stages=stages, keep=set(rows))
           for name in ("incremental", "prefill")}
    specs = enumerate_sweeps(["all", "halves", "k_only", "stage_positions"], decoder.n_layers)
    packed = transplant_batch(decoder, prompts, stages, settings, own, rows, specs, pack=True)
    unpacked = transplant_batch(decoder, prompts, stages, settings, own, rows, specs, pack=False)
    for r in rows:
        assert len(packed[r]) == len(unpacked[r]) == 2 * len(specs)
        for a, b in zip(packed[r], unpacked[r]):
            assert b["rows_transplanted"] == len(rows)
            assert a["rows_transplanted"] in (ROWS, (2 * len(rows) + 4 * len(specs) * len(rows)) % ROWS)
            a, b = dict(a, rows_transplanted=None), dict(b, rows_transplanted=None)
            a["margins"], b["margins"] = (np.asarray(x["margins"], "<f4").tobytes() for x in (a, b))
            assert a == b


def test_packing_is_refused_where_rows_do_not_continue_from_their_boundaries(loaded_fp32):
    decoder = make_decoder(loaded_fp32.model, (), "static", max_len=40, max_rows=3)
    decoder.suffix_schedule = False  # the regime's switch: built rows then run the lockstep schedule
    assert "does not continue rows" in packing_refusal(decoder, 3)
    assert packing_refusal(decoder, 1) is None  # one row is its own batch: independent
    with pytest.raises(ValueError, match="does not continue rows"):
        run_packed(decoder, [Task(0, 3, 0, [5, 6], [7, 8], [])], DecodeSettings(None, 4))
