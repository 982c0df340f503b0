"""The static decoder with Triton kernels in default numerics (``attention="triton"``, ``kernels="fused"`` or
both), run as a script so that TRITON_INTERPRET can be set before Triton compiles anything:
``python tests/triton_static_checks.py MODEL_DIR DEVICE [OPTIONS_JSON [STAGE]]`` prints JSON. OPTIONS_JSON holds
the decoder's options under test (default ``{"attention": "triton"}``); STAGE the boundary's token (default 68, so
that the cache crosses a 64-key attention block).

Checks, per precision: replicas bit-exact, the bridge (incremental rebuild == live, every layer's bytes), the
same greedy tokens and logits within rounding of the library forward with the masked attention, and batched
left-padded rows within rounding of the same rows alone.
"""

import json
import os
import sys

MODEL, DEVICE = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
OPTIONS = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {"attention": "triton"}
STAGE = int(sys.argv[4]) if len(sys.argv) > 4 else 68
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


from stagereplay.decode.greedy import decode_rows  # noqa: E402
from stagereplay.decode.static import StaticDecoder  # noqa: E402
from stagereplay.experiments import constructions  # noqa: E402
from stagereplay.io.fingerprints import fingerprint_layers  # noqa: E402
from stagereplay.models.loading import load_model, set_determinism  # noqa: E402
from stagereplay.models.sources import ModelSource

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:] + [3, 4]]


class AtLength:
    """A boundary matcher (the greedy loop only calls ``reached``) whose boundary is the n-th generated token."""

    def __init__(self, n):
        self.n = n

    def reached(self, generated):
        return len(generated) == self.n


set_determinism(1)
out = {}
# the interpreter checks indexing, masking and the online softmax (as fp32 arithmetic whatever the dtype), which
# one precision covers; on CUDA both precisions run the compiled kernels
for precision in (("fp32", "bf16") if DEVICE == "cuda" else ("fp32",)):
    model = load_model(ModelSource("local", MODEL), precision, DEVICE).model
    fast = StaticDecoder(model, (), max_len=96, max_rows=3, **OPTIONS)
    masked = StaticDecoder(model, (), max_len=96, max_rows=3)
    stop = AtLength(STAGE)  # the boundary: the STAGE-th generated token
    runs = [decode_rows(fast, [PROMPT], matcher=stop, max_stage_tokens=STAGE + 2, max_new_tokens=8, keep={0})[0]
            for _ in range(2)]
    reference = decode_rows(masked, [PROMPT], matcher=stop, max_stage_tokens=STAGE + 2, max_new_tokens=8)[0]
    live = runs[0]
    incremental = decode_rows(fast, [PROMPT], stages=[live.stage_ids], max_new_tokens=8, keep={0},
                              build=constructions.get("incremental").cache_build())[0]
    _, la = fast.open([PROMPT])
    _, lb = masked.open([PROMPT])
    _, rows = fast.open(PROMPTS)
    alone = [fast.open([p])[1][0] for p in PROMPTS]
    out[precision] = {
        "replicas_equal": runs[0].stage_ids + runs[0].suffix_ids == runs[1].stage_ids + runs[1].suffix_ids
        and runs[0].fingerprints == runs[1].fingerprints
        and fingerprint_layers(runs[0].layers) == fingerprint_layers(runs[1].layers),
        "bridge_bit_exact": incremental.fingerprints == live.fingerprints
        and fingerprint_layers(incremental.layers) == fingerprint_layers(live.layers)
        and incremental.suffix_ids == live.suffix_ids and incremental.margins == live.margins,
        "status": "ok" if live.stage_ids else live.stop_reason, "stage_tokens": len(live.stage_ids),
        "tokens_equal_masked": live.stage_ids == reference.stage_ids,
        "prefill_logits_vs_masked": (la - lb).abs().max().item(),
        "logit_scale": lb.abs().max().item(),
        "batched_vs_alone": max((rows[i] - alone[i]).abs().max().item() for i in range(3)),
        "attention": fast.record()["decode_attention"],
        "kernels": fast.record()["decode_kernels"],
    }
print(json.dumps(out))
