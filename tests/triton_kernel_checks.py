"""Checks of stagereplay.models.invariant_triton, run as a script so that TRITON_INTERPRET can be set before Triton
compiles anything: ``python tests/triton_kernel_checks.py DEVICE`` prints one JSON object.

On a CPU (Triton's interpreter) the kernels are checked for what they compute: each against a float64 version of
the same formula, with partial tiles, partial key blocks, bias, GQA packing and several rows per tile. The
interpreter multiplies tiles with numpy, whose BLAS is not row-invariant, so the byte-level invariance checks run
on CUDA only (``invariant`` below is None on a CPU).
"""

import json
import os
import sys

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from stagereplay.models.invariant_triton import CONFIGS, TritonKernels  # noqa: E402
from stagereplay.io.fingerprints import tensor_bytes  # noqa: E402

K = TritonKernels()
if len(sys.argv) > 2:  # a JSON object of fp32 settings to check instead of the module's (a candidate configuration)
    CONFIGS["fp32"] = {**CONFIGS["fp32"], **json.loads(sys.argv[2])}
FP32 = dict(CONFIGS["fp32"])
torch.manual_seed(0)
results = {"device": DEVICE, "errors": {}, "invariant": {} if DEVICE != "cpu" else None}


def same(a, b):
    return tensor_bytes(a.cpu()) == tensor_bytes(b.cpu())


def record(name, got, want, dtype):
    scale = want.abs().max().item() or 1.0
    results["errors"][f"{name}/{dtype}"] = (got.double().cpu() - want.cpu()).abs().max().item() / scale


def check_invariant(name, op, n, windows=((0, 1), (3, 4), (5, 12), (0, 7))):
    """op(lo, hi) computes rows lo..hi-1 together; each window's rows must equal those of the whole call."""
    if results["invariant"] is None:
        return
    full = op(0, n)
    results["invariant"][name] = all(same(op(lo, hi), full[lo:hi]) for lo, hi in windows if hi <= n)


def attention_checks(r, tag):
    """attention: 6 query heads on 2 K/V heads (groups of 3), 70 positions (a partial last 16-key block), d=32"""
    L, heads, kv, d, block = 70, 6, 2, 32, 16
    qa, ka, va = r(L, heads, d), r(kv, L, d), r(kv, L, d)
    scale = d ** -0.5
    want = torch.nn.functional.scaled_dot_product_attention(
        qa.double().transpose(0, 1), ka.double().repeat_interleave(3, 0), va.double().repeat_interleave(3, 0),
        is_causal=True, scale=scale).transpose(0, 1)
    record("attention_prefill", K.attention(qa, ka, va, list(range(L)), scale, block), want, tag)
    # decode steps and a chunk: the rows at positions p..p+n-1 over the cache 0..p+n-1
    for p in (0, 15, 16, 69):
        record(f"attention_decode_{p}", K.attention(qa[p:p + 1], ka[:, :p + 1], va[:, :p + 1], [p], scale, block),
               want[p:p + 1], tag)
    record("attention_chunk", K.attention(qa[30:50], ka[:, :50], va[:, :50], list(range(30, 50)), scale, block),
           want[30:50], tag)
    if results["invariant"] is not None:
        full = K.attention(qa, ka, va, list(range(L)), scale, block)
        steps = all(same(K.attention(qa[p:p + 1], ka[:, :p + 1], va[:, :p + 1], [p], scale, block), full[p:p + 1])
                    for p in range(L))
        chunks = all(same(K.attention(qa[a:a + c], ka[:, :a + c], va[:, :a + c], list(range(a, a + c)), scale, block),
                          full[a:a + c]) for a, c in ((0, 5), (5, 20), (25, 33), (58, 12)))
        results["invariant"][f"attention/{tag}"] = steps and chunks


def programs_check(r) -> dict:
    """The fp32 attention's per-K/V-head program against its reference, one program per query head: the same bytes
    for rows at their own positions and padding, one token and several (5 query heads on 2 K/V heads: a partial
    group tile); and the control, chunks of one block instead of the configured size, which must differ."""
    rows, L, heads, kv, d, block = 3, 150, 10, 2, 32, 16
    q, keys, values = r(rows, 2, heads, d), r(rows, kv, L, d), r(rows, kv, L, d)
    pads = torch.tensor([0, 5, 17], device=DEVICE)
    index = torch.tensor([[140, 141], [100, 101], [60, 61]], device=DEVICE)
    out = {}
    for name, config in (("per_query_head", {"attention_programs": "per_query_head"}),
                         ("per_kv_head", {"attention_programs": "per_kv_head"}),
                         ("control", {"attention_programs": "per_query_head", "attention_chunk_blocks": 1})):
        CONFIGS["fp32"] = {**FP32, "attention_chunk_blocks": 4, **config}
        out[name] = tensor_bytes(K.attention_rows(q, keys, values, pads, index, d ** -0.5, block).cpu())
    CONFIGS["fp32"] = FP32
    return {"equal": out["per_kv_head"] == out["per_query_head"],
            "control_differs": out["control"] != out["per_query_head"]}


for dtype in (torch.float32, torch.bfloat16):
    tag = str(dtype).split(".")[1]
    r = lambda *s: torch.randn(*s, device=DEVICE).to(dtype)  # noqa: E731
    # linear: 20 rows (a partial 16- or 64-row tile), k=80 (partial k block), n=72 (partial n block), with bias
    x, w, b = r(20, 80), r(72, 80) * 0.1, r(72)
    record("linear", K.linear(x, w, b), x.double() @ w.double().T + b.double(), tag)
    record("linear_nobias", K.linear(x, w, None), x.double() @ w.double().T, tag)
    check_invariant(f"linear/{tag}", lambda lo, hi: K.linear(x[lo:hi], w, b), 20)
    # rms_norm over rows of 96 (a padded power-of-two block)
    h, g = r(9, 96) * 3, r(96)
    hd = h.double()
    record("rms_norm", K.rms_norm(h, g, 1e-6), g.double() * hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6),
           tag)
    check_invariant(f"rms_norm/{tag}", lambda lo, hi: K.rms_norm(h[lo:hi], g, 1e-6), 9)
    # gated activation, 1100 elements per row (over one 1024-element block)
    gate, up = r(3, 1100) * 4, r(3, 1100)
    record("gated_act", K.gated_act(torch.nn.SiLU(), gate, up), torch.nn.functional.silu(gate.double()) * up.double(),
           tag)
    check_invariant(f"gated_act/{tag}", lambda lo, hi: K.gated_act(torch.nn.SiLU(), gate[lo:hi], up[lo:hi]), 3,
                    ((0, 1), (1, 3)))
    # rotary: (rows, heads, d) with per-row cos/sin
    q, cos, sin = r(5, 3, 32), r(5, 32), r(5, 32)
    rot = torch.cat((-q[..., 16:], q[..., :16]), dim=-1)
    record("rotary", K.rotary(q, cos, sin), q.double() * cos.double()[:, None] + rot.double() * sin.double()[:, None],
           tag)
    check_invariant(f"rotary/{tag}", lambda lo, hi: K.rotary(q[lo:hi], cos[lo:hi], sin[lo:hi]), 5)
    attention_checks(r, tag)
    if dtype == torch.float32 and FP32["attention"] == "per_head":  # chunks of one 16-key block: five combined
        CONFIGS["fp32"] = {**FP32, "attention_chunk_blocks": 1}
        attention_checks(r, f"{tag}_chunks")
        CONFIGS["fp32"] = FP32
        results["programs"] = programs_check(r)


print(json.dumps(results))
