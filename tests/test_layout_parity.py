"""Layout parity: compared constructions are decoded in one layout, so a transplant carries exactly the donor's
state, batched as at batch 1.

The engine before the rebuild decoded a batch's ``prefill`` rows apart from its ``live`` rows: only the rows with a
prefix, left-padded so that their prefixes ended together. On the CPU in fp32 a row's bits depend on that layout
(one row alone takes another matrix kernel than several; the control below shows it), so the layout was mixed into
the construction. Here every construction of a batch shares the live run's layout, and
an all-layer transplant's continuation equals the donor's own byte for byte: token ids and the float32 bytes of
every margin (a far finer witness than the token ids).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.recipe import DecodeSettings, run
from stagereplay.experiments.transplant import transplant_batch, transplant_edit
from stagereplay.experiments.transplant_specs import TransplantSpec

ROWS = 6


def make_batch(loaded, rows: int, without_prefix: set[int], seed: int = 1):
    tok = loaded.tokenizer
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 30))] for _ in range(rows)]
    stages = [None if r in without_prefix else [rng.randrange(3, len(tok)) for _ in range(rng.randrange(2, 14))]
              for r in range(rows)]
    decoder = make_decoder(loaded.model, (), "static", max_len=96, max_rows=rows)
    return decoder, prompts, stages, DecodeSettings(None, 16)


@pytest.fixture(scope="module")
def batch(loaded_fp32):
    return make_batch(loaded_fp32, ROWS, {1, 4})  # rows 1 and 4 reached no boundary: filler in every construction


@pytest.fixture(scope="module")
def pair(loaded_fp32):
    return make_batch(loaded_fp32, 2, {1})


def margin_bytes(res) -> bytes:
    return np.asarray(res.margins, dtype="<f4").tobytes()


def old_layout_prefill(decoder, prompts, stages, settings, **kw):
    """The pre-rebuild batched prefill: only the rows with a prefix, left-padded so that their boundary caches end
    together (each row's cut prefix as one prompt forward, then its pending token), continued together."""
    mine = [r for r, s in enumerate(stages) if s is not None]
    cuts = [prompts[r] + stages[r][:-1] for r in mine]
    out = run(decoder, "incremental", cuts, settings, stages=[[stages[r][-1]] for r in mine], **kw)
    return dict(zip(mine, out))


def test_the_old_layout_changes_bits_here(pair):
    """The control: the same row's prefill, continued in the old layout (without its prefix-less neighbour) gives
    other float32 margins than in the live run's layout: the layout, not only the cache, sets the bits."""
    decoder, prompts, stages, settings = pair
    new = run(decoder, "prefill", prompts, settings, stages=stages)[0]
    old = old_layout_prefill(decoder, prompts, stages, settings)[0]
    assert margin_bytes(new) != margin_bytes(old)


def test_constructions_share_the_layout(batch):
    decoder, prompts, stages, settings = batch
    layouts = {name: [(r.pad, r.position) for r in run(decoder, name, prompts, settings, stages=stages)]
               for name in ("incremental", "prefill", "chunked", "prefix_cached")}
    assert layouts["incremental"] == layouts["prefill"] == layouts["chunked"] == layouts["prefix_cached"]
    width = max(len(p) for p in prompts)
    assert layouts["prefill"] == [(None, None) if s is None else (width - len(p), width + len(s) - 1)
                                  for p, s in zip(prompts, stages)]


@pytest.mark.parametrize("fixture", ["batch", "pair"])
def test_all_layer_transplant_follows_the_donor_byte_for_byte_in_a_batch(fixture, request):
    decoder, prompts, stages, settings = request.getfixturevalue(fixture)
    rows = {r for r, s in enumerate(stages) if s is not None}
    own = {name: run(decoder, name, prompts, settings, stages=stages, keep=rows) for name in ("incremental", "prefill")}
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    done = transplant_batch(decoder, prompts, stages, settings, own, sorted(rows), [every])  # every row in one decode
    for r in sorted(rows):
        out = done[r]
        assert len(out) == 2  # both directions
        for row in out:
            donor = own[row["donor"]][r]
            assert row["outcome"] == "donor"
            assert row["suffix_ids"] == donor.suffix_ids
            assert np.asarray(row["margins"], "<f4").tobytes() == margin_bytes(donor)
            assert row["cache_fingerprint"] == donor.fingerprints[0]  # taken from the buffer the continuation read


def test_the_old_layout_would_not_follow_its_donor(pair):
    """What the engine before the rebuild did with a prefill recipient: the live cache written into the row of the
    prefill batch (the rows with a prefix only) and continued there. Its continuation is not the donor's own, byte
    for byte: the batch layout, not the cache, decided it."""
    decoder, prompts, stages, settings = pair
    live = run(decoder, "incremental", prompts, settings, stages=stages, keep={0})[0]
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    old_recipient = old_layout_prefill(decoder, prompts, stages, settings,
                                       edit=transplant_edit(0, every, live.layers, len(prompts[0])))[0]
    assert margin_bytes(old_recipient) != margin_bytes(live)
