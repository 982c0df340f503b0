"""The greedy loop's lookahead (decode.greedy): the next step launched from device-side ids before the host has
read the choice, taken back where the host changes a cache first.

The ``cuda_graph`` regime turns it on. On the CPU the ``static`` regime runs the same forward, so these tests turn
the lookahead on there and compare every result with the plain loop's: token ids, fp32 margins, boundary-cache
fingerprints and layout, byte for byte.
"""

import pytest
import torch

from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.static import StaticDecoder
from stagereplay.experiments import constructions
from stagereplay.experiments.transplant import transplant_edit
from stagereplay.experiments.transplant_specs import TransplantSpec
from stagereplay.io.fingerprints import fingerprint_layers

PROMPTS = [[19, 18, 7, 11, 14, 8, 9, 16, 2], [19, 18, 7, 11, 14], [7, 11, 14, 8, 9, 16, 2, 3, 4]]


class Uneven:
    """A boundary that rows reach after different numbers of tokens (set by their first id), or never."""

    @staticmethod
    def reached(ids):
        return ids[0] % 4 != 0 and len(ids) == 2 + ids[0] % 4


class Counted:
    """A decoder as the loop sees it, counting steps fed from device ids (launched ahead) and steps taken back."""

    def __init__(self, decoder, lookahead):
        self.inner, self.lookahead = decoder, lookahead
        self.eos_ids, self.n_layers = decoder.eos_ids, decoder.n_layers
        self.ahead = self.rewound = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, batch, tokens):
        self.ahead += isinstance(tokens, torch.Tensor)
        return self.inner.step(batch, tokens)

    def rewind(self, batch):
        self.rewound += 1
        self.inner.rewind(batch)


@pytest.fixture(scope="module", params=["static", "cuda_graph"])
def decoder(tiny_model_dir, request):
    """The static regime on the CPU, and the cuda_graph regime (its device copies and graph replays) where there
    is a GPU."""
    from stagereplay.models.loading import load_model, set_determinism
    from stagereplay.models.sources import ModelSource

    if request.param == "cuda_graph" and not torch.cuda.is_available():
        pytest.skip("the cuda_graph regime needs a CUDA device")
    set_determinism(1)
    device = "cuda" if request.param == "cuda_graph" else "cpu"
    model = load_model(ModelSource("local", str(tiny_model_dir)), "bf16", device).model
    return StaticDecoder(model, (), max_len=48, max_rows=4, regime=request.param)


def both(decoder, **kw):
    """The plain loop's rows and the lookahead loop's, and the lookahead decoder's counts."""
    rows = set(range(len(kw["prompts"])))
    plain = decode_rows(Counted(decoder, False), keep=rows, **kw)
    ahead = Counted(decoder, True)
    return plain, decode_rows(ahead, keep=rows, **kw), ahead


def assert_same(plain, ahead):
    for a, b in zip(plain, ahead, strict=True):
        assert (a.stage_ids, a.suffix_ids, a.margins, a.stop_reason, a.fingerprints, a.pad, a.position) == (
            b.stage_ids, b.suffix_ids, b.margins, b.stop_reason, b.fingerprints, b.pad, b.position)
        assert (a.layers is None) == (b.layers is None)
        if a.layers is not None:
            assert fingerprint_layers(a.layers) == fingerprint_layers(b.layers)


def test_the_static_regimes_turn_it_on_only_with_a_cuda_graph(decoder):
    assert decoder.lookahead is (decoder.regime == "cuda_graph")  # static on the CPU: nothing to overlap


def test_live_rows_with_uneven_boundaries(decoder):
    """Live rows find their boundaries on the host (no swap, no edit): every step after the first is launched ahead
    and none is taken back; rows that finish early are fed their choice, which changes no other row."""
    plain, ahead, counts = both(decoder, prompts=PROMPTS, matcher=Uneven(), max_stage_tokens=7, max_new_tokens=6)
    assert_same(plain, ahead)
    assert {r.stop_reason for r in plain} >= {"max_new_tokens"}
    assert counts.ahead > 5 and counts.rewound == 0


@pytest.mark.parametrize("name", ["incremental", "prefill", "chunked", "prefix_cached"])
def test_constructions_of_a_batch(decoder, name):
    """Teacher-forced rows of uneven stages (one row without a prefix): the guess is the forced id in the stage and
    the choice after it; a row whose built cache is swapped in at its boundary is never launched ahead of the
    swap, so nothing is taken back."""
    stages = [[3, 4, 5], None, [6, 7, 8, 9, 10]]
    build = constructions.get(name).cache_build(2)
    plain, ahead, counts = both(decoder, prompts=PROMPTS, stages=stages, build=build, max_new_tokens=5)
    assert_same(plain, ahead)
    assert plain[1].stop_reason == "no_prefix"
    assert counts.ahead > 3 and counts.rewound == 0


def test_a_live_row_edited_at_its_boundary_is_taken_back_and_fed_again(decoder):
    """A live row's boundary is found on the host after the next step was launched; an edit there changes the
    cache that step read, so the step is taken back and fed again: the rows equal the plain loop's."""
    base = decode_rows(decoder, PROMPTS, matcher=Uneven(), max_stage_tokens=7, max_new_tokens=4, keep={0, 2})
    donor = decode_rows(decoder, PROMPTS, stages=[r.stage_ids or None for r in base],
                        build=constructions.get("prefill").cache_build(), max_new_tokens=4, keep={0, 2})
    reached = [r for r in (0, 2) if base[r].stage_ids]
    assert reached, "no row reached its boundary: pick other prompts"
    r = reached[0]
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    edit = transplant_edit(r, every, donor[r].layers, len(PROMPTS[r]))
    plain, ahead, counts = both(decoder, prompts=PROMPTS, matcher=Uneven(), max_stage_tokens=7, max_new_tokens=4,
                                edit=edit)
    assert_same(plain, ahead)
    assert plain[r].fingerprints == donor[r].fingerprints  # the edit took effect in both loops
    assert counts.rewound >= 1


def test_zero_new_tokens_and_eos(decoder):
    """The boundary cache alone (no suffix), and rows stopped by an end-of-sequence id."""
    plain, ahead, _ = both(decoder, prompts=PROMPTS, matcher=Uneven(), max_stage_tokens=7, max_new_tokens=0)
    assert_same(plain, ahead)
    # a built construction's boundary cache alone, one row (its own batch: it starts at its boundary, no step)
    plain, ahead, _ = both(decoder, prompts=PROMPTS[:1], stages=[[3, 4, 5]],
                           build=constructions.get("prefill").cache_build(), max_new_tokens=0)
    assert_same(plain, ahead)
    assert plain[0].stop_reason == "max_new_tokens"
    free = decode_rows(decoder, PROMPTS[:1], matcher=BoundaryMatcher(1, token_ids=[10_000]), max_stage_tokens=9,
                       max_new_tokens=1)[0].suffix_ids
    eos = StaticDecoder(decoder.model, (free[6],), max_len=48, max_rows=4, regime=decoder.regime)
    plain, ahead, _ = both(eos, prompts=PROMPTS, stages=[free[:3], [5], free[:2]],
                           build=constructions.get("prefill").cache_build(), max_new_tokens=8)
    assert_same(plain, ahead)
    assert plain[0].stop_reason == "eos"
