"""The library API: stage replay on a Hugging Face model and tokenizer one already has, outside Snakemake.

:func:`replay` continues one prefix's boundary state from each of several constructions and gives, per
construction, its continuation, margins and boundary-cache fingerprints, and whether its replicas were bit-identical;
:func:`transplant` continues a recipient construction's boundary cache with a donor's K/V written over some of its
layers and says whose continuation it follows; :func:`generate_stage` is the stage the model generates itself (the
live construction's own), for a prompt that has none yet. Each is the one recipe of the pipeline's experiments and
audit (:mod:`stagereplay.experiments.recipe`, :func:`stagereplay.experiments.transplant.transplant_rows`) on a batch
of one row with the eager decoder, under the pipeline's determinism flags for the call only.

Knows nothing of items, gold answers, the ledger or Snakemake; results are plain dataclasses. The model runs as it
is: its dtype is the precision, and it is never cast or moved.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from stagereplay.decode.greedy import BoundaryMatcher, RowResult
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments import constructions as registry
from stagereplay.experiments.recipe import DecodeSettings, replica_difference, run, run_replicas
from stagereplay.experiments.transplant import COMPONENTS, POSITIONS, TransplantSpec, rebuilt_as, transplant_rows
from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.io.ids import first_divergence
from stagereplay.io.provenance import software_versions
from stagereplay.models.loading import PRECISIONS, determinism, device_name, eos_ids_of, unsupported


class StageNotGeneratedError(ValueError):
    """The model's greedy generation from the prompt does not reach the stage boundary asked for."""


@dataclass(frozen=True)
class Continuation:
    """One construction's continuation from the boundary state (the cache over the prefix but its last token)."""

    construction: str
    suffix_ids: list[int]
    suffix_text: str
    margins: list[float]  # top-2 logit margin (fp32 logits) at every suffix step
    stop_reason: str  # eos | max_new_tokens | nonfinite
    cache_fingerprint: str  # sha256 of the boundary cache exactly as the continuation read it
    cache_k_fingerprints: list[str]  # one per layer
    cache_v_fingerprints: list[str]
    suffix_fingerprint: str
    replicas: int = 1  # runs from scratch
    replicas_exact: bool | None = None  # None: one replica
    replica_difference: str | None = None  # what a replica differs from replica 1 in (ledger column names)


@dataclass(frozen=True)
class Replay:
    prompt_ids: list[int]
    stage_ids: list[int]  # the boundary token last
    precision: str
    continuations: dict[str, Continuation]  # by construction, in the order asked
    provenance: dict  # versions, git commit, dtype, device, decode regime, determinism flags

    @property
    def prefix_fingerprint(self) -> str:
        return fingerprint_ids(self.prompt_ids + self.stage_ids)

    def first_divergence(self, a: str = "live", b: str = "prefill") -> int | None:
        """The first suffix step at which constructions ``a`` and ``b`` differ in token ids; None: they agree."""
        return first_divergence(self.continuations[a].suffix_ids, self.continuations[b].suffix_ids)


@dataclass(frozen=True)
class Transplant:
    donor: str  # a rebuilt live cache that is not bit-exact with the live one is named incremental
    recipient: str
    layers: list[int]
    component: str  # kv | k | v
    positions: str | tuple[int, int]  # all | prompt | stage | a span [lo, hi) of cache positions
    outcome: str  # donor | recipient | neither: whose own continuation the transplanted one equals
    divergent: bool  # the donor's and the recipient's own continuations differ
    first_divergence_donor: int | None
    first_divergence_recipient: int | None
    continuation: Continuation  # construction "<donor>-><recipient>"; its cache fingerprint is the transplanted one
    donor_continuation: Continuation
    recipient_continuation: Continuation
    live_fingerprint_match: bool | None  # the rebuilt live cache is the live cache, byte for byte (None: no live)
    precision: str
    provenance: dict


def replay(model, tokenizer, prompt, stage, constructions=("live", "prefill"), precision: str | None = None, *,
           max_new_tokens: int = 32, replicas: int = 1, chunk_size: int = 16) -> Replay:
    """Continue the boundary state of ``prompt`` + ``stage`` from each of ``constructions``, greedily.

    ``prompt`` is text (tokenized as ``tokenizer(prompt)`` does, special tokens included: apply a chat template
    first) or token ids; ``stage`` the reasoning stage's text (tokenized alone, without special tokens) or ids, its
    last token the boundary token. Give ids where they matter: text tokenized in two parts need not be the ids the
    model generated. ``live`` generates the stage from the prompt and continues its own cache, so the stage must be
    the one the model generates greedily at this precision (:func:`generate_stage`); else
    :class:`StageNotGeneratedError` says where the model leaves it. ``precision`` None is the model's dtype; a name
    (bf16, fp32, fp16) must be that dtype. Each construction runs ``replicas`` times from scratch, and whether the
    runs were bit-identical is reported, not raised as the pipeline does.
    """
    names = tuple(constructions)
    for name in names:
        registry.get(name)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"constructions {list(names)}: name each construction once, at least one")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas is {replicas!r}; it must be a whole number, at least 1")
    call = _Call(model, tokenizer, prompt, stage, precision, max_new_tokens, chunk_size)
    out = {}
    with determinism() as flags:
        for name in names:
            runs = [res[0] for res in run_replicas(call.decoder, name, [call.prompt], call.settings,
                                                   replicas=tuple(range(1, replicas + 1)), **call.source(name))]
            if name == "live":
                call.check_live(runs[0])
            differs = next((d for d in (replica_difference(runs[0], other) for other in runs[1:]) if d), None)
            out[name] = call.continuation(name, runs[0], replicas, None if replicas == 1 else differs is None,
                                          differs)
    return Replay(call.prompt, call.stage, call.precision, out, call.provenance(flags))


def transplant(model, tokenizer, prompt, stage, donor: str = "prefill", recipient: str = "live",
               precision: str | None = None, *, layers=None, component: str = "kv",
               positions: str | tuple[int, int] = "all", max_new_tokens: int = 32,
               chunk_size: int = 16) -> Transplant:
    """Continue ``recipient``'s boundary cache with ``donor``'s K and/or V (``component``) written over ``layers``
    (None: every layer) at ``positions``, and compare with both constructions' own continuations.

    ``prompt``, ``stage`` and ``precision`` are as for :func:`replay`. Both caches are built from the prefix ids,
    ``live`` by its own schedule (``incremental``), as the pipeline's transplant stage does; where ``live`` is one of
    them the live generation runs too, and the rebuilt cache is named ``live`` only when it is the live cache byte for
    byte. With every layer and position the recipient holds the donor's whole boundary state: its continuation must
    then be the donor's.
    """
    for name in (donor, recipient):
        registry.get(name)
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {list(COMPONENTS)}, got {component!r}")
    if not (positions in POSITIONS or (isinstance(positions, tuple) and len(positions) == 2)):
        raise ValueError(f"positions must be one of {list(POSITIONS)} or a span (lo, hi), got {positions!r}")
    call = _Call(model, tokenizer, prompt, stage, precision, max_new_tokens, chunk_size)
    n_layers = call.decoder.n_layers
    chosen = tuple(range(n_layers)) if layers is None else tuple(sorted({operator.index(i) for i in layers}))
    if not chosen or not all(0 <= i < n_layers for i in chosen):
        raise ValueError(f"layers {list(chosen)}: give at least one layer, each of the model's 0..{n_layers - 1}")
    spec = TransplantSpec("custom", chosen, component, positions)
    with determinism() as flags:
        live = None
        if "live" in (donor, recipient):
            [live] = run(call.decoder, "live", [call.prompt], call.settings, **call.source("live"))
            call.check_live(live)
        own = {name: run(call.decoder, rebuilt_as(name), [call.prompt], call.settings, stages=[call.stage],
                         keep={0}) for name in dict.fromkeys((donor, recipient))}
        label, match = {name: name for name in own}, None
        if live is not None:
            match = live.fingerprints[0] == own["live"][0].fingerprints[0]
            label["live"] = "live" if match else "incremental"
        [(res, outcome)] = transplant_rows(call.decoder, [call.prompt], [call.stage], call.settings, own, donor,
                                           recipient, {0: spec}).values()
    mine, theirs = own[donor][0], own[recipient][0]
    return Transplant(
        label[donor], label[recipient], list(chosen), component, positions, outcome.outcome,
        first_divergence(mine.suffix_ids, theirs.suffix_ids) is not None, outcome.first_divergence_donor,
        outcome.first_divergence_recipient, call.continuation(f"{label[donor]}->{label[recipient]}", res),
        call.continuation(label[donor], mine), call.continuation(label[recipient], theirs), match, call.precision,
        call.provenance(flags))


def generate_stage(model, tokenizer, prompt, marker, *, occurrence: int = 1, max_stage_tokens: int = 256,
                   precision: str | None = None) -> list[int]:
    """The stage ids the model generates greedily from ``prompt`` (the live construction's own, as the pipeline's
    ``reconstruct_prefixes`` generates them), up to and including the boundary token: the one that completes the
    ``occurrence``-th appearance of ``marker`` (text, matched on the decoded ids, or token ids) within
    ``max_stage_tokens``. :class:`StageNotGeneratedError` when the boundary does not come."""
    if isinstance(marker, str):
        matcher = BoundaryMatcher(occurrence, text=marker, decode=tokenizer.decode)
    else:
        matcher = BoundaryMatcher(occurrence, token_ids=[operator.index(i) for i in (
            [marker] if isinstance(marker, int) else marker)])
    call = _Call(model, tokenizer, prompt, None, precision, max_stage_tokens=max_stage_tokens)
    with determinism():
        [res] = run(call.decoder, "live", [call.prompt], call.settings, matcher=matcher, max_new_tokens=0)
    if not res.stage_ids:
        why = "its logits turned non-finite" if res.stop_reason == "nonfinite" else (
            f"it generated {len(res.suffix_ids)} tokens ({tokenizer.decode(res.suffix_ids)[-80:]!r} at the end) "
            f"without completing appearance {occurrence} of {marker!r}")
        raise StageNotGeneratedError(f"the model found no stage boundary from this prompt at {call.precision}: "
                                     f"{why}; raise max_stage_tokens or choose another marker")
    return list(res.stage_ids)


class _Call:
    """One API call's model, ids, decoder and settings, checked. Without a stage (:func:`generate_stage`) the
    budget is ``max_stage_tokens`` of stage and no suffix."""

    def __init__(self, model, tokenizer, prompt, stage, precision, max_new_tokens=1, chunk_size=16,
                 max_stage_tokens=None):
        reason = unsupported(model.config)
        if reason is not None:
            raise ValueError(f"the model ({type(model).__name__}) {reason}")
        if model.training:
            raise ValueError("the model is in training mode (dropout would make every run differ): call model.eval()")
        self.model, self.tokenizer = model, tokenizer
        self.precision = _precision(model, precision)
        vocab = int(model.config.vocab_size)
        self.prompt = _ids(prompt, tokenizer, "prompt", True, vocab)
        self.stage = None if stage is None else _ids(stage, tokenizer, "stage", False, vocab)
        stage_budget = max_stage_tokens if stage is None else len(self.stage)
        self.settings = DecodeSettings(stage_budget, max_new_tokens, chunk_size)
        limit = getattr(model.config, "max_position_embeddings", None)
        total = len(self.prompt) + stage_budget + (0 if stage is None else max_new_tokens)
        if limit is not None and total > limit:
            raise ValueError(f"the prompt, the stage and the suffix budget take {total} positions; the model has "
                             f"{limit}")
        self.decoder = make_decoder(model, tuple(eos_ids_of(model, tokenizer)))

    def source(self, construction: str) -> dict:
        """How the recipe gets this call's prefix: generated to the stage (``live``) or rebuilt from its ids."""
        if registry.get(construction).rebuildable:
            return {"stages": [self.stage]}
        # within a budget of the stage's length, the boundary is reached only if the generation is the stage
        return {"matcher": BoundaryMatcher(1, token_ids=self.stage)}

    def check_live(self, res: RowResult) -> None:
        if res.stage_ids:
            return
        if res.stop_reason == "nonfinite":
            raise StageNotGeneratedError(f"the model's logits turned non-finite while it generated the stage at "
                                         f"{self.precision}")
        generated, stage, decode = res.suffix_ids, self.stage, self.tokenizer.decode
        at = first_divergence(generated, stage)
        chose = f"id {generated[at]} ({decode(generated[at:at + 1])!r})" if at < len(generated) else "nothing"
        raise StageNotGeneratedError(
            f"the live construction continues the model's own greedy generation, which leaves the given stage at its "
            f"token {at} of {len(stage)} at {self.precision}: it chooses {chose} where the stage has id {stage[at]} "
            f"({decode(stage[at:at + 1])!r}). Give the stage the model generates (stagereplay.generate_stage), or "
            "replay this one with constructions that rebuild it from its ids (incremental, the stage fed token by "
            "token, stands in for live; prefill; chunked; prefix_cached)")

    def continuation(self, name: str, res: RowResult, replicas: int = 1, exact: bool | None = None,
                     differs: str | None = None) -> Continuation:
        whole, ks, vs = res.fingerprints
        return Continuation(name, list(res.suffix_ids), self.tokenizer.decode(res.suffix_ids), list(res.margins),
                            res.stop_reason, whole, list(ks), list(vs), fingerprint_ids(res.suffix_ids), replicas,
                            exact, differs)

    def provenance(self, flags: dict) -> dict:
        parameter = next(self.model.parameters())
        return {**software_versions(), "model_type": self.model.config.model_type,
                "num_layers": self.decoder.n_layers,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "dtype": str(parameter.dtype).replace("torch.", ""), "device": device_name(parameter.device),
                **self.decoder.record(), "numerics_regime": self.decoder.numerics, "numerics": flags}


def _precision(model, precision: str | None) -> str:
    """The precision name of the model's dtype, checked against the one asked for."""
    dtypes = {p.dtype for p in model.parameters()}
    names = {dtype: name for name, dtype in PRECISIONS.items()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in names:
        raise ValueError(f"the model's parameters are {sorted(map(str, dtypes))}: it must be in one of "
                         f"{sorted(PRECISIONS)} throughout")
    dtype = next(iter(dtypes))
    if precision is None:
        return names[dtype]
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {sorted(PRECISIONS)}")
    if PRECISIONS[precision] != dtype:
        raise ValueError(f"precision {precision!r} was asked for, but the model's weights are {dtype} (the model is "
                         f"never cast here): load it at that precision (dtype={PRECISIONS[precision]}) or leave "
                         "precision at None")
    return precision


def _ids(value, tokenizer, what: str, special_tokens: bool, vocab_size: int) -> list[int]:
    """Token ids of text (through ``tokenizer``) or of ids given as a list, tuple or 1-D tensor."""
    if isinstance(value, str):
        ids = list(tokenizer(value, add_special_tokens=special_tokens)["input_ids"])
    else:
        if hasattr(value, "tolist"):
            value = value.tolist()
        try:
            ids = [operator.index(i) for i in value]
        except TypeError:
            raise TypeError(f"{what} must be text or a flat sequence of token ids, got {type(value).__name__} "
                            f"{str(value)[:60]}") from None
    if not ids:
        raise ValueError(f"{what} has no tokens")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"{what} holds ids outside the model's vocabulary of {vocab_size}: {outside[:5]}")
    return ids
