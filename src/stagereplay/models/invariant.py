"""The ``invariant`` numerics regime: a token's numbers do not depend on how many tokens a forward pass holds.

Why it exists: a one-shot prefill and the live cache of the same token ids differ only because the kernels of
the default regime pick their reduction order and tiling from the shape of the whole call (a prefill is one
GEMM of M = n rows, a decode step an M = 1 GEMV; softmax, norms and even transcendental element-wise functions
take vectorised or scalar paths depending on how many elements they see). Under this regime every operation
of the Qwen2 forward computes each token (a row) in a way fixed by that row alone, so ``prefill``,
``incremental``, ``live`` and every ``chunked:C`` construction give byte-identical boundary caches and hence
identical suffixes, in bf16 as in fp32.

The contract a kernel set keeps (rows in, rows out; row ``i``'s result depends only on row ``i``'s inputs and
is computed with a reduction order that does not depend on the number of rows):

- ``linear(x (m, k), weight (n, k), bias (n,) | None) -> (m, n)``: q/k/v/o projections, gate/up/down, lm_head;
- ``rms_norm(x (m, h), weight (h,), eps) -> (m, h)``;
- ``gated_act(act_fn, gate (m, i), up (m, i)) -> (m, i)``: ``act_fn(gate) * up``, the MLP's middle;
- ``rotary(x (m, heads, d), cos (m, d), sin (m, d)) -> (m, heads, d)``;
- ``attention(q (m, heads, d), keys (kv, L, d), values (kv, L, d), positions, scaling, block_size)
  -> (m, heads, d)``: the row at cache position ``p`` attends keys ``0..p`` in blocks of ``block_size`` keys
  taken in ascending order, with an online softmax in fp32 (running max, running sum, rescaled accumulator).
  A decode step is the one-row case of the same code: same blocks, same order, same partial last block.
- ``attention_rows(q (rows, T, heads, d), keys (rows, kv, L, d), values, pads (rows,), index (T,), scaling,
  block_size) -> (rows, T, heads, d)``: the same over the static decoder's left-padded K/V buffer, a row's
  key blocks aligned at its first real key, so that its bits depend neither on its padding nor on the other
  rows of the batch (batch invariance).

What needs no kernel: embeddings (a gather) and residual additions (element-wise additions, exactly rounded
per element whatever the vector width) are invariant already. Rotary cos/sin come from a table computed in
fixed chunks of ``ROTARY_CHUNK`` positions, one identical call per chunk, and gathered: an entry never depends
on how many positions a forward pass asks for.

:class:`ReferenceKernels` is the reference, correct on any device and written for the CPU: each row goes
through the same calls, with the same shapes, on a fresh contiguous copy of the row, so identical inputs give
identical bytes whatever the batch. It is slow by design (a Python loop over rows, and over key blocks per
row). A GPU kernel set (Triton, with fixed tiles and no split-K) implements the same five methods and slots in
through ``apply(model, kernels=...)``; it is not written yet.

Limits: Qwen2 models (``model_type`` ``qwen2``), full attention, no padding (an ``attention_mask`` holding a
zero is refused), RoPE types whose frequencies do not change with the sequence length. This module knows
nothing of constructions, the ledger or Snakemake: it only changes how the model computes.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

NUMERICS = ("default", "invariant")
BLOCK_SIZE = 64  # keys per attention block: a multiple of every SIMD width, the tile a GPU kernel would use
ROTARY_CHUNK = 256  # positions per rotary-table chunk
SUPPORTED_MODEL_TYPES = ("qwen2",)
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # frequencies fixed, whatever the sequence length


class InvariantRegimeError(ValueError):
    """A model, input or option the invariant regime cannot serve, with what to do about it."""


def _fresh(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A newly allocated contiguous copy: same bytes, same alignment, same strides for every row."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    out.copy_(t)
    return out


class ReferenceKernels:
    """The reference kernel set: every row computed by identical calls on a fresh copy of that row."""

    name = "reference"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x (m, k) -> (m, n): m identical M=1 products, never one M=m product (whose order depends on m)
        if x.shape[0] == 1:
            return F.linear(_fresh(x), weight, bias)
        return torch.cat([F.linear(_fresh(x[i:i + 1]), weight, bias) for i in range(x.shape[0])])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x (m, h) -> (m, h), the Qwen2RMSNorm formula row by row
        rows = []
        for i in range(x.shape[0]):
            h = _fresh(x[i:i + 1], torch.float32)
            variance = h.pow(2).mean(-1, keepdim=True)
            rows.append(weight * (h * torch.rsqrt(variance + eps)).to(x.dtype))
        return torch.cat(rows)

    def gated_act(self, act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # (m, i) -> (m, i); element-wise, but transcendental functions take a vector or a scalar path
        # depending on the element count, so rows go one by one here too
        return torch.cat([act_fn(_fresh(gate[i:i + 1])) * _fresh(up[i:i + 1]) for i in range(gate.shape[0])])

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x (m, heads, d), cos/sin (m, d) -> (m, heads, d), as transformers' apply_rotary_pos_emb
        rows = []
        half = x.shape[-1] // 2
        for i in range(x.shape[0]):
            r, c, s = _fresh(x[i]), _fresh(cos[i]), _fresh(sin[i])
            rotated = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
            rows.append(r * c + rotated * s)
        return torch.stack(rows)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
                  scaling: float, block_size: int) -> torch.Tensor:
        # q (m, heads, d); keys/values (kv, L, d); row i attends cache positions 0..positions[i]
        rows = [self._attention_row(q[i], keys, values, int(p), scaling, block_size) for i, p in enumerate(positions)]
        return torch.stack(rows).to(q.dtype)

    def attention_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pads: torch.Tensor,
                       index: torch.Tensor, scaling: float, block_size: int) -> torch.Tensor:
        """Left-padded rows over a K/V buffer (the static decoder's layout): q (rows, T, heads, d) at buffer
        positions ``index[0]``.. (``index`` (T,), or (rows, T) for rows at their own positions); keys/values
        (rows, kv, L, d); row r's keys start at ``pads[r]``, its blocks aligned there. A padding query (before
        its row's first key) gets zeros."""
        rows, T, heads, d = q.shape
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        for r in range(rows):
            first = int(index[0] if index.dim() == 1 else index[r, 0])
            pad = int(pads[r])
            real = [t for t in range(T) if first + t >= pad]
            if real:
                out[r, real[0]:] = self.attention(q[r, real[0]:], keys[r, :, pad:], values[r, :, pad:],
                                                  [first + t - pad for t in real], scaling, block_size)
        return out

    @staticmethod
    def _attention_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, scaling: float,
                       block: int) -> torch.Tensor:
        heads, d = q.shape
        kv = keys.shape[0]
        groups = heads // kv  # query head h reads key head h // groups, as transformers' repeat_kv
        dev = q.device
        qf = _fresh(q.reshape(kv, groups, d), torch.float32)  # (kv, groups, d)
        running_max = torch.full((kv, groups, 1), float("-inf"), dtype=torch.float32, device=dev)
        running_sum = torch.zeros((kv, groups, 1), dtype=torch.float32, device=dev)
        acc = torch.zeros((kv, groups, d), dtype=torch.float32, device=dev)
        for start in range(0, position + 1, block):
            width = min(block, position + 1 - start)
            # the block is always `block` keys wide: a partial last block is zero-padded and masked, whether the
            # keys after it exist (a prefill row) or not (a decode step); `width` depends on the position alone
            make = torch.empty if width == block else torch.zeros
            kb = make((kv, block, d), dtype=torch.float32, device=dev)
            vb = make((kv, block, d), dtype=torch.float32, device=dev)
            kb[:, :width].copy_(keys[:, start:start + width])
            vb[:, :width].copy_(values[:, start:start + width])
            scores = torch.matmul(qf, kb.transpose(1, 2)) * scaling  # (kv, groups, block)
            if width < block:
                scores[..., width:] = float("-inf")
            new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
            p = torch.exp(scores - new_max)
            rescale = torch.exp(running_max - new_max)
            running_sum = running_sum * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p, vb)  # (kv, groups, d)
            running_max = new_max
        return (acc / running_sum).reshape(heads, d)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _linear_forward(kernels):
    def forward(self, x):
        out = kernels.linear(_rows(x), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return forward


def _rms_norm_forward(kernels):
    def forward(self, x):
        return kernels.rms_norm(_rows(x), self.weight, self.variance_epsilon).reshape(x.shape)
    return forward


def _mlp_forward(kernels):
    def forward(self, x):
        rows = _rows(x)
        hidden = kernels.gated_act(self.act_fn, self.gate_proj(rows), self.up_proj(rows))
        out = self.down_proj(hidden)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return forward


def _rotary_forward(original):
    """Cos/sin gathered from a table built chunk by chunk with the module's own (fp32) computation."""
    tables: dict[str, list[torch.Tensor]] = {"cos": [], "sin": []}

    def forward(self, x, position_ids):
        needed = int(position_ids.max()) + 1
        while len(tables["cos"]) * ROTARY_CHUNK < needed:
            start = len(tables["cos"]) * ROTARY_CHUNK
            ids = torch.arange(start, start + ROTARY_CHUNK, device=x.device)[None]
            probe = torch.empty(0, dtype=torch.float32, device=x.device)
            cos, sin = original(probe, ids)  # (1, ROTARY_CHUNK, d), fp32
            tables["cos"].append(cos[0])
            tables["sin"].append(sin[0])
        cos_table, sin_table = torch.cat(tables["cos"]), torch.cat(tables["sin"])
        return cos_table[position_ids].to(x.dtype), sin_table[position_ids].to(x.dtype)  # (b, n, d)
    return forward


def _attention_forward(kernels, block_size: int):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        b, n, _ = hidden_states.shape
        d = self.head_dim
        rows = _rows(hidden_states)
        q = self.q_proj(rows).reshape(b * n, -1, d)  # (b*n, heads, d)
        k = self.k_proj(rows).reshape(b * n, -1, d)  # (b*n, kv_heads, d)
        v = self.v_proj(rows).reshape(b, n, -1, d)
        cos, sin = position_embeddings  # (b or 1, n, d)
        cos, sin = cos.expand(b, n, d).reshape(b * n, d), sin.expand(b, n, d).reshape(b * n, d)
        q = kernels.rotary(q, cos, sin).reshape(b, n, -1, d)
        k = kernels.rotary(k, cos, sin).reshape(b, n, -1, d)
        key_states, value_states = k.transpose(1, 2), v.transpose(1, 2)  # (b, kv_heads, n, d)
        past = 0
        if cache is not None:
            past = int(cache.get_seq_length(self.layer_idx))
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        positions = list(range(past, past + n))  # cache position of each new row
        out = torch.stack([kernels.attention(q[i], key_states[i], value_states[i], positions, self.scaling,
                                             block_size) for i in range(b)])  # (b, n, heads, d)
        out = self.o_proj(out.reshape(b * n, -1))
        return out.reshape(b, n, -1), None
    return forward


def _refuse_padding(original):
    @functools.wraps(original)  # keeps the signature, which compat.cache_keyword reads
    def forward(*args, **kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            raise InvariantRegimeError(
                "numerics: invariant serves unpadded batches only (its attention reads cache positions, not a "
                "mask); feed rows of equal length or use numerics: default"
            )
        return original(*args, **kwargs)
    return forward


def is_invariant(model) -> bool:
    return getattr(model, "_stagereplay_numerics", None) is not None


def describe(model) -> dict:
    """What the regime of ``model`` is, for provenance: ``{"numerics": "default"}`` or the invariant details."""
    return dict(getattr(model, "_stagereplay_numerics", None) or {"numerics": "default"})


def default_kernels(device: torch.device):
    """The kernel set for ``device``: Triton's on CUDA when it is installed, else the reference kernels.

    The choice is recorded (``kernels`` in the regime's description): the two sets are different regimes,
    each invariant in itself, and they need not agree with each other bit for bit."""
    if torch.device(device).type == "cuda":
        try:
            from stagereplay.models.invariant_triton import TritonKernels
        except ImportError:
            import logging

            logging.getLogger(__name__).warning(
                "numerics: invariant on CUDA without Triton: the reference kernels run instead (correct but slow, "
                "a Python loop over rows); pip install triton for the GPU kernels")
        else:
            return TritonKernels()
    return ReferenceKernels()


def apply(model, kernels=None, block_size: int = BLOCK_SIZE) -> dict:
    """Switch ``model`` (a loaded Qwen2 causal LM, in place) to the invariant regime; return its description.

    Every ``nn.Linear``, RMSNorm, MLP, rotary embedding and attention module gets a forward routed through
    ``kernels`` (``default_kernels`` for the model's device unless given). The weights are untouched and shared.
    """
    if is_invariant(model):
        raise InvariantRegimeError("the model is already in the invariant regime; load it afresh to apply it again")
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvariantRegimeError(
            f"numerics: invariant supports {list(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}; "
            "use numerics: default for this model"
        )
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise InvariantRegimeError(
            f"numerics: invariant needs RoPE frequencies that do not change with the sequence length; rope_type "
            f"{rope_type!r} does. Use numerics: default for this model"
        )
    if block_size < 1:
        raise InvariantRegimeError(f"attention block size must be positive, not {block_size}")
    kernels = kernels or default_kernels(next(model.parameters()).device)
    counts = {"linear": 0, "rms_norm": 0, "mlp": 0, "rotary": 0, "attention": 0}
    for module in model.modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_forward(kernels), module)
            counts["linear"] += 1
        elif kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_forward(kernels), module)
            counts["rms_norm"] += 1
        elif kind.endswith("MLP"):
            module.forward = types.MethodType(_mlp_forward(kernels), module)
            counts["mlp"] += 1
        elif kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rotary_forward(module.forward), module)
            counts["rotary"] += 1
        elif kind.endswith("Attention"):
            module.forward = types.MethodType(_attention_forward(kernels, block_size), module)
            counts["attention"] += 1
    layers = int(config.num_hidden_layers)
    expected = {"linear": 7 * layers + 1, "rms_norm": 2 * layers + 1, "mlp": layers, "rotary": 1, "attention": layers}
    if counts != expected:
        raise InvariantRegimeError(
            f"numerics: invariant expected the Qwen2 layout {expected} but found modules {counts}; this model "
            "has a layout the regime does not know, use numerics: default"
        )
    model.forward = _refuse_padding(model.forward)
    info = {"numerics": "invariant", "kernels": kernels.name, "attention_block_size": int(block_size),
            "rotary_chunk": ROTARY_CHUNK}
    if hasattr(kernels, "describe"):
        info["kernel_config"] = kernels.describe()
    model._stagereplay_numerics = info
    model._stagereplay_kernels = kernels  # the static decoder computes through the same kernels
    return dict(info)
