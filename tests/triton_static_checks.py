"""The static decoder with ``attention="triton"`` (default numerics), run as a script so that TRITON_INTERPRET can
be set before Triton compiles anything: ``python tests/triton_static_checks.py MODEL_DIR DEVICE`` prints JSON.

Checks, per precision: replicas bit-exact, the bridge (incremental rebuild == live, every layer's bytes), the
same greedy tokens and logits within rounding of the masked attention, and batched left-padded rows within
rounding of the same rows alone.
"""

import json
import os
import sys

MODEL, DEVICE = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


from stagereplay.models import compat  # noqa: E402
from stagereplay import fastdecode as fd  # noqa: E402
from stagereplay.engine import BoundaryMatcher, build_cache, continue_greedy, generate_to_boundary  # noqa: E402
from stagereplay.io.fingerprints import fingerprint_layers  # noqa: E402
from stagereplay.models.loading import ModelSource, load_model, set_determinism  # noqa: E402

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:] + [3, 4]]
set_determinism(1)
out = {}
for precision in ("fp32", "bf16"):
    model = load_model(ModelSource("local", MODEL), precision, DEVICE).model
    fast = fd.StaticDecoder(model, (), max_len=96, max_rows=3, attention="triton")
    masked = fd.StaticDecoder(model, (), max_len=96, max_rows=3)
    free = generate_to_boundary(fast, PROMPT, BoundaryMatcher(10_000, token_ids=[10_000]), 70).generated_ids
    marker = free[67]  # the boundary: the 68th generated token (the cache crosses a 64-key block)
    stop = BoundaryMatcher(free[:68].count(marker), token_ids=[marker])
    runs = [generate_to_boundary(fast, PROMPT, stop, 70) for _ in range(2)]
    reference = generate_to_boundary(masked, PROMPT, stop, 70)
    live = runs[0]
    fp = lambda cache: fingerprint_layers(compat.cache_layers(cache))[0]  # noqa: E731
    incremental = build_cache(fast, "incremental", PROMPT, live.stage_ids)
    suffixes = [continue_greedy(fast, cache, live.stage_ids[-1], 8).suffix_ids for cache in (live.cache, incremental)]
    a, b = fast.new_cache(), masked.new_cache()
    la, lb = fast.forward(PROMPT, a), masked.forward(PROMPT, b)
    batched = fast.new_cache(3)
    rows = fast.prefill_rows(PROMPTS, batched)
    alone = [fast.forward(p, fast.new_cache()) for p in PROMPTS]
    out[precision] = {
        "replicas_equal": runs[0].generated_ids == runs[1].generated_ids and fp(runs[0].cache) == fp(runs[1].cache),
        "bridge_bit_exact": fp(incremental) == fp(live.cache) and suffixes[0] == suffixes[1],
        "status": live.status, "stage_tokens": len(live.stage_ids),
        "tokens_equal_masked": live.stage_ids == reference.stage_ids,
        "prefill_logits_vs_masked": (la - lb).abs().max().item(),
        "batched_vs_alone": max((rows[i] - alone[i]).abs().max().item() for i in range(3)),
        "describe": fast.describe()["decode_attention"],
    }
print(json.dumps(out))
