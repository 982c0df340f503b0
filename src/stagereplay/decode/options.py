"""The decode settings a config gives (regime, attention, kernels) and the checks of which go together.

No torch: the workflow checks these when it parses the config, before anything imports a model stack; the decoders
(:mod:`stagereplay.decode.regimes`, :mod:`stagereplay.decode.static`) check them again when they are built.
"""

from __future__ import annotations

import os

from stagereplay.decode.protocol import RegimeError

REGIMES = ("eager", "static", "cuda_graph")
ATTENTIONS = ("masked", "triton")  # the static forward's attention; another regime parameter
KERNELS = ("library", "fused")  # how the forward's small operations run; another regime parameter


def check_static_options(regime: str, attention: str = "masked", prefill_group: int | None = None,
                         kernels: str = "library") -> None:
    """The one check of the decode options' values and of which go together: each a known value, and no
    static-buffer option for the eager regime, which has no static buffer. The workflow's parse-time check
    (:func:`stagereplay.stages.preflight.check_decode_settings`), the decoder factory and the static decoder all call
    this, so each setting is checked in one place."""
    if regime not in REGIMES:
        raise RegimeError(f"decode_regime {regime!r} is not one of {list(REGIMES)}")
    if attention not in ATTENTIONS:
        raise RegimeError(f"decode_attention {attention!r} is not one of {list(ATTENTIONS)}")
    if kernels not in KERNELS:
        raise RegimeError(f"decode_kernels {kernels!r} is not one of {list(KERNELS)}")
    if prefill_group is not None and (isinstance(prefill_group, bool) or int(prefill_group) < 1):
        raise RegimeError(f"decode_prefill_group {prefill_group!r}: a positive number of rows, or null for all rows")
    if regime == "eager" and (attention != "masked" or prefill_group is not None or kernels != "library"):
        raise RegimeError(
            f"decode_attention: {attention}, decode_prefill_group: {prefill_group} and decode_kernels: {kernels} set "
            "the forward over the static K/V buffer, which decode_regime: eager does not have: they need "
            "decode_regime static or cuda_graph; set decode_regime: static or cuda_graph, or leave them at their "
            "defaults (masked, null, library)")


def uses_triton(attention: str = "masked", kernels: str = "library") -> bool:
    return attention == "triton" or kernels == "fused"


def check_device_options(device_type: str, attention: str = "masked", kernels: str = "library") -> None:
    """Refuse Triton options (``decode_attention: triton``, ``decode_kernels: fused``) for a model on another device
    than CUDA, unless Triton's interpreter is on (the decoder and the preflight both call this)."""
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    for option, value, default in (("decode_attention", attention, ATTENTIONS[0]),
                                   ("decode_kernels", kernels, KERNELS[0])):
        if value in ("triton", "fused"):
            raise RegimeError(f"{option} {value!r} runs Triton kernels on a CUDA device and the model is on the "
                              f"{device_type.upper()}: use {option} {default} there (TRITON_INTERPRET=1 runs the "
                              "kernels in Triton's slow interpreter, for tests)")
