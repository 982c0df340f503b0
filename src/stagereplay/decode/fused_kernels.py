"""The Triton kernels of ``decode_kernels: fused``: the static forward's small operations, one launch each.

At batch 1 a decode step reads the weights in a few large GEMMs and spends the rest of its device time in about
twenty small kernels per layer, each bound by its launch and latency rather than its bytes. ``fused`` keeps the
GEMMs and the attention of the ``library`` forward and replaces the small operations around them with three kernels
per layer:

- ``add_rms_norm``: the residual add and the next RMSNorm in one pass over a token's row (it writes both the new
  residual stream and the normed input of the next GEMM);
- ``rope_write``: RoPE over q and k, q written in the attention's layout, k and v written into the K/V buffer at
  the forward's positions (no separate rotation, copies and index writes);
- ``silu_mul``: the SiLU-gated product of the fused gate/up GEMM's two halves.

Each output element is computed from its own token's row alone (one program per token, or per token and head), in
fp32, so a token gets the same bits in a prefill, a chunk or a one-token step, eagerly or replayed in a CUDA graph.
The residual add and the RMSNorm round where torch's add and Qwen2's RMSNorm round (the sum; the normed row, then
its product with the weight); RoPE and the SiLU gate round once, where the ``library`` forward rounds after each
element-wise operation. So the bits differ from the ``library`` forward's: the kernels are a regime parameter,
recorded with the regime. They run on CUDA; with ``TRITON_INTERPRET=1`` also on the CPU (slowly), which
is how the test suite checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, stride_h, stride_d, stride_s, stride_o, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the stream's dtype as torch's add rounds it
        delta = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(out_ptr.dtype.element_ty)  # as Qwen2RMSNorm: round, then
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)                 # times the weight
    tl.store(out_ptr + row * stride_o + cols, (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, index_ptr, stride_ir, T, H, KV,
                       stride_qkv, stride_qr, stride_qh, stride_qt, stride_kr, stride_kh, stride_kl,
                       D: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0)  # row * T + t
    head = tl.program_id(1)  # q heads, then k heads, then v heads: the fused GEMM's column order
    row = token // T
    t = token % T
    i = tl.arange(0, HALF)
    at = tl.load(index_ptr + row * stride_ir + t)  # the token's buffer position (K and V)
    src = qkv_ptr + token * stride_qkv + head * D
    x1 = tl.load(src + i)
    x2 = tl.load(src + HALF + i)
    if head < H + KV:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        c1 = tl.load(cos_ptr + token * D + i).to(tl.float32)
        c2 = tl.load(cos_ptr + token * D + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + token * D + i).to(tl.float32)
        s2 = tl.load(sin_ptr + token * D + HALF + i).to(tl.float32)
        y1 = (a * c1 - b * s1).to(q_ptr.dtype.element_ty)  # x * cos + rotate_half(x) * sin,
        y2 = (b * c2 + a * s2).to(q_ptr.dtype.element_ty)  # rotate_half(x) = (-x2, x1)
        if head < H:
            dst = q_ptr + row * stride_qr + head * stride_qh + t * stride_qt
        else:
            dst = k_ptr + row * stride_kr + (head - H) * stride_kh + at * stride_kl
        tl.store(dst + i, y1)
        tl.store(dst + HALF + i, y2)
    else:
        dst = v_ptr + row * stride_kr + (head - H - KV) * stride_kh + at * stride_kl
        tl.store(dst + i, x1)
        tl.store(dst + HALF + i, x2)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, W, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (tokens, features) with unit stride along the features (a copy only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class FusedKernels:
    """The kernel set of ``decode_kernels: fused`` (see the module docstring)."""

    name = "fused"

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, rms_norm(h + delta))`` for (tokens, hidden) inputs; without ``delta``, ``(h, rms_norm(h))``."""
        h = _rows(h)
        m, width = h.shape
        out = torch.empty((m, width), dtype=h.dtype, device=h.device)
        if delta is None:
            total, delta = h, h
        else:
            delta = _rows(delta)
            total = torch.empty((m, width), dtype=h.dtype, device=h.device)
        _add_rms_norm_kernel[(m,)](h, delta, weight, total, out, width, h.stride(0), delta.stride(0),
                                   total.stride(0), out.stride(0), float(eps), HAS_DELTA=total is not h,
                                   BLOCK=triton.next_power_of_2(width), num_warps=8 if width >= 4096 else 4)
        return total, out

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, index: torch.Tensor, rows: int, heads: int, kv_heads: int,
                   heads_first: bool) -> torch.Tensor:
        """RoPE over the q and k heads of ``qkv`` (rows * T, (heads + 2 kv_heads) * D) with ``cos``/``sin``
        (rows * T, D); k and v written into ``keys``/``values`` (rows, kv_heads, L, D) at positions ``index`` ((T,),
        or (rows, T) for rows at their own positions).
        Returns q as (rows, heads, T, D) when ``heads_first`` (the masked attention's layout), else (rows, T,
        heads, D)."""
        qkv = _rows(qkv)
        tokens = qkv.shape[0]
        T = tokens // rows
        D = keys.shape[-1]
        if keys.stride() != values.stride() or keys.stride(-1) != 1:
            raise ValueError("rope_write writes K and V buffers of one layout, unit stride along head_dim")
        if heads_first:
            q = torch.empty((rows, heads, T, D), dtype=qkv.dtype, device=qkv.device)
            strides = (q.stride(0), q.stride(1), q.stride(2))
        else:
            q = torch.empty((rows, T, heads, D), dtype=qkv.dtype, device=qkv.device)
            strides = (q.stride(0), q.stride(2), q.stride(1))
        _rope_write_kernel[(tokens, heads + 2 * kv_heads)](
            qkv, cos, sin, q, keys, values, index, 0 if index.dim() == 1 else index.stride(0), T, heads, kv_heads,
            qkv.stride(0), *strides, keys.stride(0),
            keys.stride(1), keys.stride(2), D=D, HALF=D // 2, num_warps=1)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a (tokens, 2 W) gate/up GEMM output (gate first): (tokens, W)."""
        gate_up = _rows(gate_up)
        m, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((m, width), dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        _silu_mul_kernel[(m, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=4)
        return out
