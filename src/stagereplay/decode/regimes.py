"""The decoder of a regime, from the config or from what a results file recorded.

Every stage after generation rebuilds its caches in the regime, buffer length and row count the ledger was made
in, so constructions stay comparable bit for bit.
"""

from __future__ import annotations

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.options import check_static_options
from stagereplay.decode.protocol import Decoder, RegimeError
from stagereplay.decode.static import StaticDecoder

def make_decoder(model, eos_ids=(), regime: str = "eager", max_len: int | None = None, max_rows: int = 1,
                 attention: str = "masked", prefill_group: int | None = None, kernels: str = "library") -> Decoder:
    """The eager decoder, or a static one for ``static``/``cuda_graph`` (a buffer of ``max_len`` positions for
    ``max_rows`` rows)."""
    check_static_options(regime, attention, prefill_group, kernels)
    if regime == "eager":
        return EagerDecoder(model, tuple(eos_ids))
    if max_len is None:
        raise RegimeError(f"decode_regime {regime!r} needs max_len (prompt + stage + suffix budget)")
    return StaticDecoder(model, tuple(eos_ids), max_len=max_len, max_rows=max_rows, regime=regime,
                         attention=attention, prefill_group=prefill_group, kernels=kernels)


def decoder_from_record(model, eos_ids, record: dict) -> Decoder:
    """A decoder in the regime ``record`` (:func:`stagereplay.io.provenance.recorded_regime`) describes."""
    return make_decoder(model, tuple(eos_ids), record.get("decode_regime") or "eager",
                        max_len=record.get("decode_max_len"), max_rows=int(record.get("decode_max_rows") or 1),
                        attention=record.get("decode_attention") or "masked",
                        prefill_group=record.get("decode_prefill_group"),
                        kernels=record.get("decode_kernels") or "library")
