"""The static regime's forward: the model's layers written over the decoder's preallocated K/V buffer.

:class:`StaticForward` feeds ids (rows, T) at buffer positions into buffer rows, writes their K and V there and
returns the last position's fp32 logits; every query attends over the first ``span`` buffer positions, so that a
decode step has the same shapes at every position. Written for few kernels per layer (a CUDA graph replays them
all, but each still costs a launch on the device), in three variants:

- ``decode_kernels: library``: torch's own ops; the attention masked over the whole span in batched GEMMs
  (``decode_attention: masked``) or over each row's own keys in Triton (``triton``).
- ``decode_kernels: fused``: three one-launch Triton kernels per layer (:mod:`stagereplay.decode.fused_kernels`:
  residual add with RMSNorm, RoPE with the K/V write, the SiLU gate), which leave a decode step fewer kernels to
  launch. Another regime parameter: the two give different bits.
- ``numerics: invariant`` (a model switched by :func:`stagereplay.models.invariant.apply`): every operation through
  the regime's row-invariant kernels (Triton on CUDA), the attention over each row's own keys only, in blocks
  aligned at its first real key: a row's bits then depend neither on its padding nor on the other rows.

K/V writes go to distinct positions, so the non-sorting ``index_copy_``/``scatter_`` are deterministic.

This module holds no state and makes none: :class:`StaticForward` is the base class of the static regime's decoder
(:class:`stagereplay.decode.static.StaticDecoder`), whose constructor makes the buffers, kernels and rotary table
the forwards read. It knows nothing of batches, of which batch is resident, of CUDA graphs or of the decoder
protocol.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

TRITON_ATTENTION_BLOCK = 64


@contextmanager
def _unique_index_writes():
    """K/V writes go to distinct positions, so the non-sorting ``index_copy_`` is deterministic; the sorting
    variant that deterministic mode would pick is not capturable in a CUDA graph on every build."""
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if was:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if was:
            torch.use_deterministic_algorithms(True, warn_only=warn)


def _by_row(index: torch.Tensor) -> torch.Tensor:
    """A forward's buffer positions as (rows or 1, T): ``index`` is (T,) shared by every row, or (rows, T)."""
    return index[None, :] if index.dim() == 1 else index


def _write(buffer: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
    """``x`` (rows, kv_heads, T, D) into ``buffer`` (rows, kv_heads, max_len, D) at positions ``index`` ((T,) or
    (rows, T)): copies to distinct positions, so deterministic without the sorting variants."""
    with _unique_index_writes():
        if index.dim() == 1:
            buffer.index_copy_(2, index, x)
        else:
            buffer.scatter_(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]), x)


class StaticForward:
    """The static regime's forwards over the decoder's K/V buffer, as a base class of the decoder that owns it.

    Reads, and never sets, the decoder's ``model``, ``n_heads``, ``n_kv``, ``head_dim``, ``max_len``, ``dtype``,
    ``device``, ``attention``, ``decode_kernels``, ``kernels`` (numerics: invariant) and ``block_size``, ``fused``
    (each layer's fused weights), ``positions``, ``pads`` (the resident batch's left pads), ``k`` and ``v`` (per
    layer, (max_rows, kv_heads, max_len, head_dim)), ``cos_table`` and ``sin_table``, ``_triton`` and ``_fused_ops``.
    ``_forward`` writes ``k`` and ``v`` at the positions it feeds, nothing else.
    """

    def _forward(self, ids: torch.Tensor, index: torch.Tensor, rows: int, span: int, row0: int = 0) -> torch.Tensor:
        """Feed ``ids`` (rows, T) at buffer positions ``index`` ((T,), or (rows, T) for rows at their own
        positions) into buffer rows ``row0``..``row0 + rows``; return fp32 logits of the last position.

        Every query attends over the first ``span`` buffer positions under an additive mask: keys at or after the row's padding
        and at or before the query's own position (a padding query sees itself only, so it stays finite).
        Written for few kernels per layer (a graph replays them all, but each still costs a launch on the
        device): fused RMSNorm, one RoPE over q and k together, scale and mask folded into one batched GEMM.
        """
        if self.kernels is not None:
            return self._forward_invariant(ids, index, rows, row0)
        if self.decode_kernels == "fused":
            return self._forward_fused(ids, index, rows, span, row0)
        inner = self.model.model
        T = ids.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        group = H // KV
        pads = self.pads[row0:row0 + rows]
        position_ids = (_by_row(index) - pads[:, None]).clamp_min(0)  # (rows, T)
        h = inner.embed_tokens(ids)  # (rows, T, hidden)
        cos, sin = inner.rotary_emb(h, position_ids)  # (rows, T, D)
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated)
        half = D // 2
        cos = cos[:, None]
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]  # (rows, 1, T, D)
        bias = self._mask(pads, index, span) if self.attention == "masked" else None
        hidden = h.shape[-1]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            norm = layer.input_layernorm
            x = torch.nn.functional.rms_norm(h, (hidden,), norm.weight, norm.variance_epsilon)
            qkv_w, qkv_b, gate_up_w = self.fused[i]
            qkv = torch.nn.functional.linear(x, qkv_w, qkv_b)  # (rows, T, (H + 2 KV) D)
            qk = qkv[..., : (H + KV) * D].view(rows, T, H + KV, D).transpose(1, 2)
            qk = torch.addcmul(qk * cos, torch.roll(qk, half, dims=-1), sin)  # RoPE: (rows, H+KV, T, D)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[..., (H + KV) * D:].view(rows, T, KV, D).transpose(1, 2)
            kb, vb = self.k[i][row0:row0 + rows], self.v[i][row0:row0 + rows]  # (rows, KV, max_len, D)
            _write(kb, index, k)
            _write(vb, index, v)
            if self.attention == "triton":
                out = self._triton.attention_rows(q.transpose(1, 2), kb, vb, pads, index, attn.scaling,
                                                  TRITON_ATTENTION_BLOCK).reshape(rows, T, H * D)
            else:
                out = self._masked_attention(q.reshape(rows * KV, group * T, D), kb, vb, bias, span,
                                             attn.scaling).reshape(rows, T, H * D)
            h = h + attn.o_proj(out)
            norm = layer.post_attention_layernorm
            x = torch.nn.functional.rms_norm(h, (hidden,), norm.weight, norm.variance_epsilon)
            gate, up = torch.nn.functional.linear(x, gate_up_w).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        norm = inner.norm
        h = torch.nn.functional.rms_norm(h[:, -1:], (hidden,), norm.weight, norm.variance_epsilon)
        return self.model.lm_head(h)[:, 0].float()  # (rows, vocab)

    def _mask(self, pads: torch.Tensor, index: torch.Tensor, span: int) -> torch.Tensor:
        """The masked attention's additive mask, (rows*KV, group*T, span): keys at or after the row's padding and
        at or before the query's position (a padding query sees itself only); the query heads sharing a K/V head
        side by side, T innermost."""
        rows, T = pads.shape[0], index.shape[-1]
        group = self.n_heads // self.n_kv
        keys = self.positions[None, None, :span]  # (1, 1, span)
        at = _by_row(index)[:, :, None]  # (rows or 1, T, 1)
        allowed = ((keys >= pads[:, None, None]) & (keys <= at)) | (keys == at)
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        return bias[:, None, None].expand(rows, self.n_kv, group, T, span).reshape(rows * self.n_kv, group * T, span)

    def _masked_attention(self, qg: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias: torch.Tensor,
                          span: int, scaling: float) -> torch.Tensor:
        """Queries ``qg`` (rows*KV, group*T, D) over the first ``span`` buffer positions of ``kb``/``vb`` under
        ``bias``: one batched GEMM with the scale and mask folded in, an fp32 softmax, one batched GEMM.
        Returns (rows, T, H, D)."""
        rows, D = kb.shape[0], self.head_dim
        T = qg.shape[1] // (self.n_heads // self.n_kv)
        kspan = kb.view(rows * self.n_kv, self.max_len, D)[:, :span]  # (rows*KV, span, D), strided
        scores = torch.baddbmm(bias, qg, kspan.transpose(1, 2), alpha=scaling)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        out = torch.bmm(probs, vb.view(rows * self.n_kv, self.max_len, D)[:, :span])  # (rows*KV, group*T, D)
        return out.view(rows, self.n_heads, T, D).transpose(1, 2)

    def _rotary_table_rows(self, index: torch.Tensor, rows: int, row0: int) -> tuple:
        """The rows' left pads, and the rotary table's cos and sin at each token's position ((rows * T, D) each),
        gathered on the device (no host sync)."""
        pads = self.pads[row0:row0 + rows]
        position_ids = (_by_row(index) - pads[:, None]).clamp_min(0)  # (rows, T)
        flat = position_ids.reshape(-1)
        return pads, self.cos_table[flat], self.sin_table[flat]

    def _forward_fused(self, ids: torch.Tensor, index: torch.Tensor, rows: int, span: int,
                       row0: int = 0) -> torch.Tensor:
        """``_forward`` under ``decode_kernels: fused``: the same GEMMs and attention, the small operations through
        :class:`~stagereplay.decode.fused_kernels.FusedKernels` (token rows flattened to (rows * T, features))."""
        ops, inner = self._fused_ops, self.model.model
        T = ids.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        pads, cos, sin = self._rotary_table_rows(index, rows, row0)
        masked = self.attention == "masked"
        bias = self._mask(pads, index, span) if masked else None
        layers = inner.layers
        norm = layers[0].input_layernorm
        h, x = ops.add_rms_norm(inner.embed_tokens(ids).reshape(rows * T, -1), None, norm.weight,
                                norm.variance_epsilon)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            qkv_w, qkv_b, gate_up_w = self.fused[i]
            kb, vb = self.k[i][row0:row0 + rows], self.v[i][row0:row0 + rows]  # (rows, KV, max_len, D)
            q = ops.rope_write(torch.nn.functional.linear(x, qkv_w, qkv_b), cos, sin, kb, vb, index, rows, H, KV,
                               heads_first=masked)
            if masked:
                out = self._masked_attention(q.view(rows * KV, (H // KV) * T, D), kb, vb, bias, span, attn.scaling)
            else:
                out = self._triton.attention_rows(q, kb, vb, pads, index, attn.scaling, TRITON_ATTENTION_BLOCK)
            norm = layer.post_attention_layernorm
            h, x = ops.add_rms_norm(h, attn.o_proj(out.reshape(rows * T, H * D)), norm.weight, norm.variance_epsilon)
            delta = layer.mlp.down_proj(ops.silu_mul(torch.nn.functional.linear(x, gate_up_w)))
            if i + 1 < len(layers):
                norm = layers[i + 1].input_layernorm
                h, x = ops.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        norm = inner.norm  # the last position of each row only
        _, x = ops.add_rms_norm(h.view(rows, T, -1)[:, -1], delta.view(rows, T, -1)[:, -1], norm.weight,
                                norm.variance_epsilon)
        return self.model.lm_head(x).float()  # (rows, vocab)

    def _forward_invariant(self, ids: torch.Tensor, index: torch.Tensor, rows: int, row0: int = 0) -> torch.Tensor:
        """``_forward`` under ``numerics: invariant``: the same layer, every operation through the regime's
        row-invariant kernels (token rows flattened to (rows * T, features)), attention over each row's own keys."""
        ops = self.kernels
        inner = self.model.model
        T = ids.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        pads, cos, sin = self._rotary_table_rows(index, rows, row0)
        h = inner.embed_tokens(ids).reshape(rows * T, -1)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b, gate_up_w = self.fused[i]
            norm = layer.input_layernorm
            qkv = ops.linear(ops.rms_norm(h, norm.weight, norm.variance_epsilon), qkv_w, qkv_b)
            q = ops.rotary(qkv[:, : H * D].reshape(rows * T, H, D), cos, sin)
            k = ops.rotary(qkv[:, H * D: (H + KV) * D].reshape(rows * T, KV, D), cos, sin)
            v = qkv[:, (H + KV) * D:].reshape(rows, T, KV, D).transpose(1, 2)
            kb, vb = self.k[i][row0:row0 + rows], self.v[i][row0:row0 + rows]  # (rows, KV, max_len, D)
            _write(kb, index, k.view(rows, T, KV, D).transpose(1, 2))
            _write(vb, index, v)
            out = ops.attention_rows(q.view(rows, T, H, D), kb, vb, pads, index, attn.scaling, self.block_size)
            h = h + ops.linear(out.reshape(rows * T, H * D), attn.o_proj.weight, attn.o_proj.bias)
            norm = layer.post_attention_layernorm
            gate_up = ops.linear(ops.rms_norm(h, norm.weight, norm.variance_epsilon), gate_up_w, None)
            width = gate_up.shape[1] // 2
            hidden = ops.gated_act(mlp.act_fn, gate_up[:, :width], gate_up[:, width:])
            h = h + ops.linear(hidden, mlp.down_proj.weight, mlp.down_proj.bias)
        last = h.view(rows, T, -1)[:, -1]
        norm = inner.norm
        return ops.linear(ops.rms_norm(last, norm.weight, norm.variance_epsilon), self.model.lm_head.weight,
                          self.model.lm_head.bias).float()  # (rows, vocab)
