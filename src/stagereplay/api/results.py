"""What the library's calls return: plain dataclasses with short reprs, every field documented in the class
docstring (``help(stagereplay.Replay)`` shows it). A :class:`Replay` keeps the call's session (the model, the rows
and the boundary caches it built), so that :meth:`Replay.transplant` reuses them instead of building them again.

Knows nothing of decoding: the session (:mod:`stagereplay.api.session`) fills these in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.io.ids import first_divergence


class StageNotGeneratedError(ValueError):
    """The model's greedy generation from the prompt does not reach the stage boundary asked for."""


@dataclass(frozen=True, repr=False)
class Continuation:
    """One construction's greedy continuation from one prompt's boundary state (the cache over the prefix but its
    last token, that token pending).

    Attributes:
        construction: the construction's name (``"<donor>-><recipient>"`` for a transplanted cache).
        suffix_ids: the suffix's token ids, the first one chosen from the boundary cache.
        suffix_text: the suffix decoded by the tokenizer.
        margins: the top-2 logit margin (fp32 logits) at every suffix step.
        stop_reason: ``eos``, ``max_new_tokens`` or ``nonfinite`` (the logits turned non-finite).
        cache_fingerprint: sha256 of the boundary cache exactly as the continuation read it.
        cache_k_fingerprints: sha256 of each layer's K at the boundary, one per layer.
        cache_v_fingerprints: sha256 of each layer's V at the boundary, one per layer.
        suffix_fingerprint: sha256 of the suffix ids (little-endian int32).
        replicas: how many times the construction ran from scratch.
        replicas_exact: whether every replica was bit-identical to the first (None: one replica).
        replica_difference: what a replica differed from the first in (ledger column names); None when none did.
        logits: with ``logits=True``, the fp32 logits of every suffix step, a CPU tensor (steps, vocab); else None.
        cache: with ``caches=True``, the boundary cache's (K, V) per layer, CPU tensors
            (1, kv_heads, positions, head_dim), exactly the bytes fingerprinted; else None.
    """

    construction: str
    suffix_ids: list[int]
    suffix_text: str
    margins: list[float]
    stop_reason: str
    cache_fingerprint: str
    cache_k_fingerprints: list[str]
    cache_v_fingerprints: list[str]
    suffix_fingerprint: str
    replicas: int = 1
    replicas_exact: bool | None = None
    replica_difference: str | None = None
    logits: Any = field(default=None, compare=False)
    cache: Any = field(default=None, compare=False)

    def __repr__(self) -> str:
        exact = "" if self.replicas_exact is None else f", {self.replicas} replicas " + (
            "exact" if self.replicas_exact else f"DIFFER: {self.replica_difference}")
        text = self.suffix_text if len(self.suffix_text) <= 40 else self.suffix_text[:37] + "..."
        return (f"Continuation({self.construction!r}, {len(self.suffix_ids)} tokens {text!r}, {self.stop_reason}, "
                f"cache {self.cache_fingerprint[:12]}{exact})")


@dataclass(frozen=True, repr=False)
class Replay:
    """One prompt's boundary state continued from each construction asked for.

    Attributes:
        prompt_ids: the prompt's token ids.
        stage_ids: the stage's token ids, the boundary token last.
        precision: ``bf16``, ``fp32`` or ``fp16``: the model's dtype.
        continuations: by construction name, in the order asked: its :class:`Continuation`.
        provenance: versions, git commit, dtype, device, decode regime, determinism flags and the batch plan.
        prompt_index: the prompt's place in the call's list of prompts (0 for one prompt).
        session: the call's model, rows and kept boundary caches, which :meth:`transplant` reuses (they live as
            long as the result does).
    """

    prompt_ids: list[int]
    stage_ids: list[int]
    precision: str
    continuations: dict[str, Continuation]
    provenance: dict
    prompt_index: int = 0
    session: Any = field(default=None, compare=False)

    @property
    def prefix_fingerprint(self) -> str:
        return fingerprint_ids(self.prompt_ids + self.stage_ids)

    def first_divergence(self, a: str = "live", b: str = "prefill") -> int | None:
        """The first suffix step at which constructions ``a`` and ``b`` differ in token ids; None: they agree."""
        return first_divergence(self.continuations[a].suffix_ids, self.continuations[b].suffix_ids)

    def step_measures(self, a: str = "live", b: str = "prefill") -> dict:
        """Per suffix step, how the logits of ``a`` and ``b`` compare, as the pipeline's fidelity stage measures
        them (:func:`stagereplay.experiments.fidelity.step_measures`: ``kl_forward`` = KL(P_a || P_b) and
        ``kl_reverse`` in nats, ``max_abs_logit_diff``, both margins and argmaxes, ``logits_equal``), numpy arrays
        over the steps at which both had read the same ids: up to and including the first divergence."""
        from stagereplay.experiments.fidelity import step_measures

        x, y = (self.continuations[name].logits for name in (a, b))
        if x is None or y is None:
            raise ValueError("no logits were kept: call replay(..., logits=True)")
        split = self.first_divergence(a, b)
        steps = min(len(x), len(y)) if split is None else split + 1
        return step_measures(x[:steps], y[:steps])

    def kl(self, a: str = "live", b: str = "prefill") -> list[float]:
        """KL(P_a || P_b) in nats at every suffix step both read the same ids (:meth:`step_measures`)."""
        return [float(v) for v in self.step_measures(a, b)["kl_forward"]]

    def transplant(self, donor: str = "prefill", recipient: str = "live", *, layers=None, component: str = "kv",
                   positions="all") -> "Transplant":
        """:func:`stagereplay.transplant` on this prompt, reusing the boundary caches this replay built (a
        construction it did not run is built once, then kept). One decode of the recipient's batch."""
        [result] = self.session.transplant(donor, recipient, layers, component, positions, rows=[self.prompt_index])
        return result

    def __repr__(self) -> str:
        names = list(self.continuations)
        split = ""
        if len(names) >= 2:
            step = self.first_divergence(names[0], names[1])
            split = f", {names[0]}/{names[1]} " + ("agree" if step is None else f"diverge at step {step}")
        return (f"Replay(prompt {self.prompt_index}: {len(self.prompt_ids)} prompt + {len(self.stage_ids)} stage "
                f"tokens, {self.precision}, {names}{split})")


@dataclass(frozen=True, repr=False)
class ReplayBatch:
    """A list of prompts replayed in one call (one decode per construction and replica over each batch of the
    plan): a sequence of :class:`Replay`, one per prompt in the order given.

    Attributes:
        replays: one :class:`Replay` per prompt.
        precision: the model's dtype name.
        provenance: as :attr:`Replay.provenance`, with the batch plan.
        session: the call's session, shared with its replays.
    """

    replays: list[Replay]
    precision: str
    provenance: dict
    session: Any = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.replays)

    def __getitem__(self, i):
        return self.replays[i]

    def __iter__(self):
        return iter(self.replays)

    def transplant(self, donor: str = "prefill", recipient: str = "live", *, layers=None, component: str = "kv",
                   positions="all") -> list["Transplant"]:
        """:meth:`Replay.transplant` on every prompt, in one decode of each batch; one :class:`Transplant` each."""
        return self.session.transplant(donor, recipient, layers, component, positions)

    def __repr__(self) -> str:
        names = list(self.replays[0].continuations)
        split = ""
        if len(names) >= 2:
            n = sum(r.first_divergence(names[0], names[1]) is not None for r in self.replays)
            split = f", {names[0]}/{names[1]} diverge on {n}"
        return f"ReplayBatch({len(self.replays)} prompts, {names}, {self.precision}{split})"


@dataclass(frozen=True, repr=False)
class Transplant:
    """A recipient construction's boundary cache continued with a donor's K and/or V written over some layers.

    Attributes:
        donor: the donor construction (a rebuilt live cache that is not bit-exact with the live one is named
            ``incremental``).
        recipient: the recipient construction, named as the donor is.
        layers: the layers written.
        component: ``kv``, ``k`` or ``v``: what was written.
        positions: ``all``, ``prompt``, ``stage`` or a span (lo, hi) of cache positions.
        outcome: ``agree`` (donor and recipient continue alike, and so does the transplant), ``donor`` or
            ``recipient`` (the transplanted continuation equals that side's own, the sides differing), ``neither``.
        divergent: the donor's and the recipient's own continuations differ.
        first_divergence_donor: the first step the transplanted continuation differs from the donor's (None: never).
        first_divergence_recipient: the same against the recipient's own continuation.
        continuation: the transplanted continuation (construction ``"<donor>-><recipient>"``, its cache fingerprint
            the transplanted cache's).
        donor_continuation: the donor's own continuation.
        recipient_continuation: the recipient's own continuation.
        live_fingerprint_match: the rebuilt live cache is the live cache byte for byte (None: live not involved).
        precision: the model's dtype name.
        provenance: as :attr:`Replay.provenance`.
        prompt_index: the prompt's place in the call's list of prompts.
    """

    donor: str
    recipient: str
    layers: list[int]
    component: str
    positions: str | tuple[int, int]
    outcome: str
    divergent: bool
    first_divergence_donor: int | None
    first_divergence_recipient: int | None
    continuation: Continuation
    donor_continuation: Continuation
    recipient_continuation: Continuation
    live_fingerprint_match: bool | None
    precision: str
    provenance: dict
    prompt_index: int = 0

    def __repr__(self) -> str:
        every = self.layers == list(range(self.provenance.get("num_layers", 0)))
        layers = "all layers" if every else f"layers {self.layers}"
        return (f"Transplant(prompt {self.prompt_index}: {self.donor}->{self.recipient}, {layers}, "
                f"{self.component}, positions {self.positions}: {self.outcome})")
