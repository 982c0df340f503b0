"""GPU kernels for the ``invariant`` numerics regime, in Triton: the contract of :mod:`stagereplay.invariant`.

Every kernel here computes a row (a token) in a way fixed by that row alone:

- ``linear``: one tiled GEMM whose launch configuration never depends on the number of rows ``m``
  (``BLOCK_M`` x ``BLOCK_N`` output tiles, ``BLOCK_N`` set by the weight's output features alone, ``BLOCK_K``
  reduction steps in ascending order, no split-K, no autotuning). Row ``i`` of the output is the same sequence
  of tile products whatever ``m`` is; the other rows of its tile only ride along.
- ``rms_norm``: one program per row, the whole row in one block, one fixed reduction tree.
- ``gated_act`` and ``rotary``: element-wise, one formula per element.
- ``attention`` / ``attention_rows``: a flash-attention loop over keys in blocks of ``block_size`` keys in
  ascending order with an online softmax in fp32. The query heads that share a K/V head are packed into the
  tile's rows next to the query positions, so a decode step (one position, ``groups`` heads) and a prefill
  (``m`` positions) run the same code: a row at cache position ``p`` sees the same key blocks, the same partial
  last block and the same order in both. In a left-padded batch a row's blocks start at its first real key,
  so its padding changes nothing either. Blocks wholly after ``p`` (reached only because another row of the tile is further on) are
  masked out entirely, which leaves the running max, sum and accumulator exactly as they were.
  That packed tile is the bf16/fp16 kernel (tensor cores); a head_dim below 16 (the smallest reduction a
  ``tl.dot`` takes) or not a power of two is padded with zeros in the tile, which add exact zero products. In fp32 a decode step would fill 16-row FMA tiles
  with a group's few heads, so fp32 runs each query head on its own: the same blocks aligned at the row's first
  real key, an online softmax over each chunk's blocks, and the chunks (``attention_chunk_blocks`` blocks each,
  counted from that first key) combined in ascending order. A decode step and a prefill row at the same position
  cut their keys into the same chunks, so they agree bit for bit. One program per (row, K/V head, token, chunk)
  runs the group's query heads one after another over each key block, which it then reads from the SM's cache;
  its bytes are those of one program per query head (``attention_programs: per_query_head``, the reference kept
  for that proof: bench/fp32_attention.py).

fp32 inputs use ``input_precision="ieee"`` for every ``tl.dot``: TF32 would change the precision the study
crosses. The kernels run on CUDA; with ``TRITON_INTERPRET=1`` they also run on the CPU (slowly), which is how
the test suite checks them on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# One launch configuration per dtype for every number of rows: changing any of these changes the regime's bits
# (they are recorded). bf16/fp16 tiles feed the tensor cores; fp32 runs ``ieee`` products on the FMA units, where
# a tall tile would only multiply the work of a decode step's single row, so its tiles are 16 rows high. The
# tile width depends on the weight alone (its output features N), never on the rows: a narrow weight gets
# narrow tiles so that a one-row decode step still spreads its weight over many programs (there is no split-K).
CONFIGS = {
    "half": {"linear": (64, 64, 64), "linear_warps": 4, "linear_stages": 3, "attention": "packed_tile",
             "attention_rows": 64, "attention_warps": 4},
    "fp32": {"linear": (16, 64, 32), "linear_warps": 4, "linear_stages": 2, "attention": "per_head",
             "attention_chunk_blocks": 16, "attention_warps": 2},
}
LINEAR_WIDTHS = ((16384, 64), (4096, 32), (0, 16))  # (at least N output features, tile width)


def _tile_width(n: int, widest: int) -> int:
    return min(widest, next(width for at_least, width in LINEAR_WIDTHS if n >= at_least))


# Triton's CPU interpreter multiplies bf16 tiles as raw 16-bit integers; under it, tiles go to fp32 first (the
# interpreter checks indexing, masking and the online softmax, not the GPU's bits)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None],
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)  # (BLOCK_K, BLOCK_N)
        if INTERPRET:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE or INTERPRET:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu, rounded like act_fn(gate)
    tl.store(out_ptr + offs, (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, D: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0)  # one (token, head) pair per program
    token = row // heads
    i = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + row * D + i).to(tl.float32)
    x2 = tl.load(x_ptr + row * D + HALF + i).to(tl.float32)
    c1 = tl.load(cos_ptr + token * D + i).to(tl.float32)
    c2 = tl.load(cos_ptr + token * D + HALF + i).to(tl.float32)
    s1 = tl.load(sin_ptr + token * D + i).to(tl.float32)
    s2 = tl.load(sin_ptr + token * D + HALF + i).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    tl.store(out_ptr + row * D + i, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + row * D + HALF + i, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty))


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, index_ptr, stride_ir, pads_ptr, T, heads, kv_heads, groups,
                      stride_kr, stride_kh, stride_kl, scaling, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                      D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0) // kv_heads
    kv_head = tl.program_id(0) % kv_heads
    pid = tl.program_id(1)
    first = tl.load(index_ptr + row * stride_ir)  # buffer position of the row's first token in this call
    pad = tl.load(pads_ptr + row)  # the row's first real key: key blocks are aligned there
    # packed rows: r -> (token r // groups, query head kv_head * groups + r % groups)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    token = r // groups
    head = kv_head * groups + r % groups
    valid = token < T
    position = first + token  # the query's buffer position: it attends keys pad..position
    d = tl.arange(0, DP)  # head_dim padded to a power of two of at least 16 (a tl.dot's smallest K); pads are 0
    dm = d < D
    q_rows = (row * T + token) * heads + head
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DP), dtype=tl.float32)
    last = first + tl.minimum((pid * BLOCK_M + BLOCK_M - 1) // groups, T - 1)  # furthest query of this tile
    keys = tl.arange(0, BLOCK_N)
    k_base = k_ptr + row * stride_kr + kv_head * stride_kh
    v_base = v_ptr + row * stride_kr + kv_head * stride_kh
    for start in range(pad, last + 1, BLOCK_N):
        kpos = start + keys
        in_cache = kpos <= last
        k = tl.load(k_base + kpos[None, :] * stride_kl + d[:, None], mask=in_cache[None, :] & dm[:, None], other=0.0)  # (DP, N)
        if INTERPRET:
            k = k.to(tl.float32)
        if IEEE or INTERPRET:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scaling
        seen = (kpos[None, :] <= position[:, None]) & valid[:, None]
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # padding queries: nothing seen yet
        p = tl.exp(scores - safe_max[:, None])
        rescale = tl.exp(running_max - safe_max)
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        v = tl.load(v_base + kpos[:, None] * stride_kl + d[None, :], mask=in_cache[:, None] & dm[None, :],
                    other=0.0)  # (N, DP)
        if INTERPRET:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                  input_precision="ieee")
        elif IEEE:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(out_ptr + q_rows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & dm[None, :])


@triton.jit
def _attention_head_kernel(q_ptr, k_ptr, v_ptr, part_ptr, index_ptr, stride_ir, pads_ptr, T, heads, groups,
                           chunks, stride_kr, stride_kh, stride_kl, scaling, D: tl.constexpr, BLOCK_N: tl.constexpr,
                           CHUNK: tl.constexpr):
    """fp32 attention, one (row, query head, token, key chunk) per program, on the FMA units without ``tl.dot``.
    The row's keys from its first real key on are cut into chunks of ``CHUNK`` keys (whole blocks); a program runs
    the online softmax over its chunk's blocks in ascending order (a query reads its own head's keys only, up to
    its own position: no tile rows of other heads or tokens to pad) and writes the chunk's (max, sum, weighted
    values) for ``_attention_combine_kernel``. Products and sums in fp32, each sum one fixed reduction tree."""
    row = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    token = tl.program_id(1)
    chunk = tl.program_id(2)
    kv_head = head // groups
    pad = tl.load(pads_ptr + row)
    position = tl.load(index_ptr + row * stride_ir) + token
    d = tl.arange(0, D)
    q_row = (row * T + token) * heads + head
    q = tl.load(q_ptr + q_row * D + d)
    running_max = tl.full((1,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((1,), dtype=tl.float32)
    acc = tl.zeros((D,), dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)
    k_base = k_ptr + row * stride_kr + kv_head * stride_kh
    v_base = v_ptr + row * stride_kr + kv_head * stride_kh
    first = pad + chunk * CHUNK
    for start in range(first, tl.minimum(position + 1, first + CHUNK), BLOCK_N):
        kpos = start + keys
        seen = kpos <= position
        k = tl.load(k_base + kpos[:, None] * stride_kl + d[None, :], mask=seen[:, None], other=0.0)  # (N, D)
        scores = tl.sum(k * q[None, :], axis=1) * scaling
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        p = tl.exp(scores - new_max)
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(p, axis=0)
        v = tl.load(v_base + kpos[:, None] * stride_kl + d[None, :], mask=seen[:, None], other=0.0)  # (N, D)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        running_max = new_max
    # a chunk wholly after the position (or a padding query's) writes (-inf, 0, 0): it adds nothing when combined
    part = part_ptr + (q_row * chunks + chunk) * (D + 2)
    tl.store(part + d, acc)
    tl.store(part + D + tl.arange(0, 1), running_max)
    tl.store(part + D + 1 + tl.arange(0, 1), running_sum)


@triton.jit
def _attention_head_block(q_ptr, q_row, d, g, h, k_base, v_base, kpos, seen, stride_kl, scaling, running_max,
                          running_sum, acc, D: tl.constexpr):
    """One query head's online-softmax step over one key block: ``_attention_head_kernel``'s statements on the same
    tiles, the head's (max, sum, weighted values) read from and written to element ``h`` of the group's tiles."""
    q = tl.load(q_ptr + q_row * D + d)
    k = tl.load(k_base + kpos[:, None] * stride_kl + d[None, :], mask=seen[:, None], other=0.0)  # (N, D)
    scores = tl.sum(k * q[None, :], axis=1) * scaling
    scores = tl.where(seen, scores, float("-inf"))
    mine = g == h
    head_max = tl.max(tl.where(mine, running_max, float("-inf")), axis=0)  # exact: one element
    new_max = tl.maximum(head_max, tl.max(scores, axis=0))
    p = tl.exp(scores - new_max)
    rescale = tl.exp(head_max - new_max)
    running_sum = tl.where(mine, running_sum * rescale + tl.sum(p, axis=0), running_sum)
    v = tl.load(v_base + kpos[:, None] * stride_kl + d[None, :], mask=seen[:, None], other=0.0)  # (N, D)
    acc = tl.where(mine[:, None], acc * rescale + tl.sum(p[:, None] * v, axis=0)[None, :], acc)
    running_max = tl.where(mine, new_max, running_max)
    return running_max, running_sum, acc


@triton.jit
def _attention_group_kernel(q_ptr, k_ptr, v_ptr, part_ptr, index_ptr, stride_ir, pads_ptr, T, heads, chunks,
                            stride_kr, stride_kh, stride_kl, scaling, D: tl.constexpr, BLOCK_N: tl.constexpr,
                            CHUNK: tl.constexpr, GROUPS: tl.constexpr, GP: tl.constexpr):
    """``_attention_head_kernel``'s arithmetic for the ``GROUPS`` query heads of one K/V head in one program: a key
    block is fetched for the group's first head and read again from the SM's cache by the others, where one program
    per query head fetched it ``GROUPS`` times through L2. Every head runs that kernel's statements on the same tiles
    (``_attention_head_block``), so each head's sums keep their reduction trees; the heads' running (max, sum,
    weighted values) sit in (``GP``,) and (``GP``, D) tiles, each element updated by its head's formula and left as
    it is by the others."""
    row = tl.program_id(0) // (heads // GROUPS)
    kv_head = tl.program_id(0) % (heads // GROUPS)
    token = tl.program_id(1)
    chunk = tl.program_id(2)
    pad = tl.load(pads_ptr + row)
    position = tl.load(index_ptr + row * stride_ir) + token
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    q_row0 = (row * T + token) * heads + kv_head * GROUPS  # the group's first query head
    running_max = tl.full((GP,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, D), dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)
    k_base = k_ptr + row * stride_kr + kv_head * stride_kh
    v_base = v_ptr + row * stride_kr + kv_head * stride_kh
    first = pad + chunk * CHUNK
    for start in range(first, tl.minimum(position + 1, first + CHUNK), BLOCK_N):
        kpos = start + keys
        seen = kpos <= position
        for h in range(GROUPS):  # not unrolled: unrolled, the heads' tiles spill (bench/fp32_attention.py)
            running_max, running_sum, acc = _attention_head_block(
                q_ptr, q_row0 + h, d, g, h, k_base, v_base, kpos, seen, stride_kl, scaling, running_max, running_sum,
                acc, D)
    # a chunk wholly after the position (or a padding query's) writes (-inf, 0, 0): it adds nothing when combined
    part = part_ptr + ((q_row0 + g) * chunks + chunk) * (D + 2)  # (GP,)
    used = g < GROUPS
    tl.store(part[:, None] + d[None, :], acc, mask=used[:, None])
    tl.store(part + D, running_max, mask=used)
    tl.store(part + D + 1, running_sum, mask=used)


@triton.jit
def _attention_combine_kernel(part_ptr, out_ptr, chunks, D: tl.constexpr):
    """One query's chunk results combined in ascending chunk order (the same chunks for a decode step and a
    prefill row at the same position, so the same bits)."""
    q_row = tl.program_id(0)
    d = tl.arange(0, D)
    running_max = tl.full((1,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((1,), dtype=tl.float32)
    acc = tl.zeros((D,), dtype=tl.float32)
    for c in range(0, chunks):
        part = part_ptr + (q_row * chunks + c) * (D + 2)
        part_max = tl.load(part + D + tl.arange(0, 1))
        new_max = tl.maximum(running_max, part_max)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet
        mine = tl.exp(running_max - safe_max)
        theirs = tl.exp(part_max - safe_max)
        running_sum = running_sum * mine + tl.load(part + D + 1 + tl.arange(0, 1)) * theirs
        acc = acc * mine + tl.load(part + d) * theirs
        running_max = new_max
    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)
    tl.store(out_ptr + q_row * D + d, out.to(out_ptr.dtype.element_ty))


def _config(dtype: torch.dtype) -> dict:
    return CONFIGS["fp32" if dtype == torch.float32 else "half"]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


class TritonKernels:
    """The invariant regime's kernel set on a GPU (see the module docstring)."""

    name = "triton"

    def describe(self) -> dict:
        return {"configs": {k: {n: list(v) if isinstance(v, tuple) else v for n, v in c.items()}
                            for k, c in CONFIGS.items()},
                "linear_tile_width_by_n": [list(w) for w in LINEAR_WIDTHS], "triton": triton.__version__}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x, weight = _contiguous(x), _contiguous(weight)
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        config = _config(x.dtype)
        block_m, widest, block_k = config["linear"]
        block_n = _tile_width(n, widest)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        _linear_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0),
                             weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32, INTERPRET=_INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_K=block_k, num_warps=config["linear_warps"], num_stages=config["linear_stages"])
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _contiguous(x)
        m, h = x.shape
        out = torch.empty_like(x)
        _rms_norm_kernel[(m,)](x, weight, out, h, x.stride(0), out.stride(0), float(eps),
                               BLOCK=triton.next_power_of_2(h), num_warps=8 if h >= 4096 else 4)
        return out

    def gated_act(self, act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if "silu" not in type(act_fn).__name__.lower():
            raise ValueError(f"the Triton kernels implement the SiLU-gated MLP only, not "
                                       f"{type(act_fn).__name__}; use numerics: default for this model")
        gate, up = _contiguous(gate), _contiguous(up)
        out = torch.empty_like(gate)
        n = gate.numel()
        _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x, cos, sin = _contiguous(x), _contiguous(cos), _contiguous(sin)
        m, heads, d = x.shape
        out = torch.empty_like(x)
        _rotary_kernel[(m * heads,)](x, cos, sin, out, heads, D=d, HALF=d // 2)
        return out

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
                  scaling: float, block_size: int) -> torch.Tensor:
        # q (m, heads, d) at cache positions positions[0].. (consecutive); keys/values (kv, L, d)
        first = int(positions[0])
        if list(positions) != list(range(first, first + q.shape[0])):
            raise ValueError("the Triton attention takes consecutive cache positions")
        index = torch.full((1,), first, dtype=torch.long, device=q.device)
        return self.attention_rows(q[None], keys[None], values[None], self._no_padding(q.device), index, scaling,
                                   block_size)[0]

    @functools.cache  # noqa: B019  (one zero per device, made once: this runs per layer and per token)
    def _no_padding(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.long, device=device)

    def attention_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pads: torch.Tensor,
                       index: torch.Tensor, scaling: float, block_size: int) -> torch.Tensor:
        """Left-padded rows over a K/V buffer: q (rows, T, heads, d) at buffer positions ``index[0]``.. (``index``
        (T,), or (rows, T) for rows at their own positions); keys and values (rows, kv, L, d); row r's real keys
        start at ``pads[r]`` and its key blocks are aligned there, so a row computes the same bits whatever its
        padding and whatever the other rows hold. Reads ``index`` and ``pads`` on the device (no host sync: a
        CUDA graph can hold it)."""
        q = _contiguous(q)
        stride_ir = 0 if index.dim() == 1 else index.stride(0)
        rows, T, heads, d = q.shape
        kv = keys.shape[1]
        if keys.stride(-1) != 1 or values.stride() != keys.stride():
            keys, values = keys.contiguous(), values.contiguous()
        groups = heads // kv
        out = torch.empty_like(q)
        config = _config(q.dtype)
        if config["attention"] == "per_head":
            chunk = config["attention_chunk_blocks"] * block_size
            chunks = triton.cdiv(keys.shape[2], chunk)  # the buffer's length: a fixed grid for a CUDA graph
            parts = torch.empty((rows * T * heads, chunks, d + 2), dtype=torch.float32, device=q.device)
            if config.get("attention_programs", "per_kv_head") == "per_kv_head":
                _attention_group_kernel[(rows * kv, T, chunks)](
                    q, keys, values, parts, index, stride_ir, pads, T, heads, chunks, keys.stride(0),
                    keys.stride(1), keys.stride(2), float(scaling), D=d, BLOCK_N=block_size, CHUNK=chunk,
                    GROUPS=groups, GP=triton.next_power_of_2(groups), num_warps=config["attention_warps"],
                    num_stages=config.get("attention_stages", 3))
            else:  # the reference: one program per query head
                _attention_head_kernel[(rows * heads, T, chunks)](
                    q, keys, values, parts, index, stride_ir, pads, T, heads, groups, chunks, keys.stride(0),
                    keys.stride(1), keys.stride(2), float(scaling), D=d, BLOCK_N=block_size, CHUNK=chunk,
                    num_warps=config["attention_warps"], num_stages=config.get("attention_stages", 3))
            _attention_combine_kernel[(rows * T * heads,)](parts, out, chunks, D=d, num_warps=1)
            return out
        grid = (rows * kv, triton.cdiv(T * groups, config["attention_rows"]))
        _attention_kernel[grid](q, keys, values, out, index, stride_ir, pads, T, heads, kv, groups, keys.stride(0),
                                keys.stride(1), keys.stride(2), float(scaling), IEEE=q.dtype == torch.float32,
                                INTERPRET=_INTERPRET, D=d, DP=max(16, triton.next_power_of_2(d)),
                                BLOCK_M=config["attention_rows"], BLOCK_N=block_size,
                                num_warps=config["attention_warps"])
        return out
