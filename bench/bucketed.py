"""The static decoder with its attention span bucketed: a benchmark knob, not a regime of the package.

The package's :class:`~stagereplay.decode.static.StaticDecoder` attends over the whole K/V buffer at every step, so
every step has the same shapes. Its ``span(end)`` is a hook: :class:`BucketedDecoder` attends over the next
multiple of ``bucket`` positions instead, a function of the position alone (live and incremental steps at one
position still share every kernel shape), so that short contexts do not pay for reading the whole buffer. The
projection's rates (``bench/stage_rates.py``) use it to time steps by attended span; results made with it are not
comparable with the package's static regime (``record()`` says ``decode_bucket``).
"""

from __future__ import annotations

from stagereplay.decode.protocol import RegimeError
from stagereplay.decode.static import StaticDecoder


class BucketedDecoder(StaticDecoder):
    """``StaticDecoder`` whose forwards attend over ``min(max_len, ceil(end / bucket) * bucket)`` positions
    (``bucket`` None: the whole buffer, as the package's decoder)."""

    def __init__(self, model, eos_ids=(), *, bucket: int | None = None, **kwargs):
        if bucket is not None and int(bucket) < 1:
            raise RegimeError("decode_bucket must be a positive number of positions")
        if bucket is not None and kwargs.get("attention", "masked") == "triton":
            raise RegimeError("decode_bucket has no effect with decode_attention 'triton' (it reads each row's keys "
                              "up to its position); drop one of them")
        self.bucket = int(bucket) if bucket else None
        super().__init__(model, eos_ids, **kwargs)

    def record(self) -> dict:
        return {**super().record(), "decode_bucket": self.bucket}

    def span(self, end: int) -> int:
        if self.bucket is None:
            return self.max_len
        return min(self.max_len, -(-end // self.bucket) * self.bucket)
