"""The library API: stage replay on a Hugging Face model and tokenizer one already has, outside Snakemake.

:func:`replay` continues the boundary state of one prompt, or of a list of prompts, from each of several
constructions and gives, per prompt and construction, its continuation, margins and boundary-cache fingerprints
(per-step logits and the cache tensors on request), and whether its replicas were bit-identical; the result keeps
its boundary caches, so that ``result.transplant(...)`` continues a recipient's cache with a donor's K/V written over
some of its layers without building either again. :func:`transplant` does one such transplant from scratch;
:func:`generate_stage` is the stage the model generates itself (the live construction's own).

Each call is the pipeline's recipe (:mod:`stagereplay.experiments.recipe`,
:func:`stagereplay.experiments.transplant.transplant_rows`) with the eager decoder, under the pipeline's
determinism flags for the call only, over a recorded batch plan (:mod:`stagereplay.decode.plans`; by default every
prompt in one batch): one decode per construction, replica and batch. Every argument is checked before the model
runs (:mod:`stagereplay.api.arguments`). A call that runs for more than two seconds shows a progress bar
(``progress=False``: none).

Knows nothing of items, gold answers, the ledger or Snakemake; results are plain dataclasses
(:mod:`stagereplay.api.results`). The model runs as it is: its dtype is the precision, and it is never cast or moved.
"""

from __future__ import annotations

from stagereplay.api import arguments
from stagereplay.api.progress import Progress
from stagereplay.api.results import Continuation, Replay, ReplayBatch, StageNotGeneratedError, Transplant
from stagereplay.api.session import Session
from stagereplay.models.loading import context_positions, eos_ids_of

__all__ = ["replay", "transplant", "generate_stage", "Replay", "ReplayBatch", "Continuation", "Transplant",
           "StageNotGeneratedError"]

# generate_stage's stage budget when none is given (less where the model's context leaves less)
DEFAULT_STAGE_TOKENS = 256


def replay(model, tokenizer, prompt, stage, constructions=("live", "prefill"), precision: str | None = None, *,
           max_new_tokens: int = 32, replicas: int = 1, chunk_size: int = 16, logits: bool = False,
           caches: bool = False, batch_size: int | None = None, seed: int = 0,
           progress: bool = True) -> Replay | ReplayBatch:
    """Continue the boundary state of ``prompt`` + ``stage`` from each of ``constructions`` (a name or several),
    greedily; a :class:`Replay`, or for a list of prompts a :class:`ReplayBatch` of them.

    ``prompt`` is text (tokenized as ``tokenizer(prompt)`` does, special tokens included: apply a chat template
    first) or token ids, or a list of such prompts (a 2-D tensor's rows are prompts of one length) with a list of
    stages; ``stage`` the reasoning stage's text (tokenized alone, without special tokens) or ids, its last token
    the boundary token. Give ids where they matter: text tokenized in two parts need not be the ids the model
    generated. ``live`` generates the stage from the prompt and continues its own cache, so the stage must be the
    one the model generates greedily at this precision (:func:`generate_stage`); else
    :class:`StageNotGeneratedError` says where the model leaves it. ``precision`` None is the model's dtype; a name
    (bf16, fp32, fp16) must be that dtype. Each construction runs ``replicas`` times from scratch, and whether the
    runs were bit-identical is reported, not raised as the pipeline does. ``logits`` keeps every suffix step's fp32
    logits (:meth:`Replay.kl` compares two constructions'), ``caches`` the boundary caches' tensors, in each
    :class:`Continuation`. ``batch_size`` (None: every prompt in one batch) and ``seed`` make the batch plan, which
    the provenance records.
    """
    arguments.check_model(model)
    arguments.check_tokenizer(tokenizer)
    names = arguments.construction_names(constructions)
    replicas = arguments.whole(replicas, "replicas")
    for flag, value in (("logits", logits), ("caches", caches), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} is {value!r}; it is True or False")
    session = _session(model, tokenizer, prompt, stage, precision, max_new_tokens, chunk_size, batch_size, seed,
                       progress, live="live" in names)
    return session.replay(names, replicas, logits, caches)


def transplant(model, tokenizer, prompt, stage, donor: str = "prefill", recipient: str = "live",
               precision: str | None = None, *, layers=None, component: str = "kv", positions="all",
               max_new_tokens: int = 32, chunk_size: int = 16, batch_size: int | None = None, seed: int = 0,
               progress: bool = True) -> Transplant | list[Transplant]:
    """Continue ``recipient``'s boundary cache with ``donor``'s K and/or V (``component``: kv, k or v) written over
    ``layers`` (None: every layer; a layer index or a list) at ``positions`` (all, prompt, stage, or a span
    ``(lo, hi)`` of cache positions), and compare with both constructions' own continuations.

    ``prompt``, ``stage`` and ``precision`` are as for :func:`replay` (a list of prompts gives a list of
    transplants, one decode per batch). Both caches are built from the prefix ids, ``live`` by its own schedule
    (``incremental``), as the pipeline's transplant stage does; where ``live`` is one of them the live generation
    runs too, and the rebuilt cache is named ``live`` only when it is the live cache byte for byte. With every layer
    and position the recipient holds the donor's whole boundary state: its continuation must then be the donor's.
    For a series of transplants, replay once and call :meth:`Replay.transplant`: the caches are built once.
    """
    arguments.check_model(model)
    arguments.check_tokenizer(tokenizer)
    for name in (donor, recipient):
        arguments.construction_names(name)
    session = _session(model, tokenizer, prompt, stage, precision, max_new_tokens, chunk_size, batch_size, seed,
                       progress, live="live" in (donor, recipient))
    out = session.transplant(donor, recipient, layers, component, positions)
    return out if session.batched else out[0]


def generate_stage(model, tokenizer, prompt, marker, *, occurrence: int = 1, max_stage_tokens: int | None = None,
                   precision: str | None = None, batch_size: int | None = None, seed: int = 0,
                   progress: bool = True) -> list[int] | list[list[int]]:
    """The stage ids the model generates greedily from ``prompt`` (the live construction's own, as the pipeline's
    ``reconstruct_prefixes`` generates them), up to and including the boundary token: the one that completes the
    ``occurrence``-th appearance of ``marker`` (text, matched on the decoded ids, or token ids) within
    ``max_stage_tokens`` (None: 256, or what the model's context leaves after the prompt where that is less). A list
    of prompts gives a list of stages, from one decode per batch. :class:`StageNotGeneratedError` when the boundary
    does not come, saying whether the model ended its generation (EOS) or ran out of budget."""
    arguments.check_model(model)
    arguments.check_tokenizer(tokenizer)
    matcher = arguments.marker_matcher(marker, occurrence, tokenizer)
    precision = arguments.precision_of(model, precision)
    prompts, _, batched = arguments.rows_of(prompt, None, tokenizer, int(model.config.vocab_size))
    limit = context_positions(model.config)
    if max_stage_tokens is None:
        room = DEFAULT_STAGE_TOKENS if limit is None else limit - max(len(p) for p in prompts)
        max_stage_tokens = min(DEFAULT_STAGE_TOKENS, room)
        if max_stage_tokens < 1:
            arguments.check_context(model.config, prompts, [1] * len(prompts), 0, "one stage token")
    budget = arguments.whole(max_stage_tokens, "max_stage_tokens")
    arguments.check_context(model.config, prompts, [budget] * len(prompts), 0, "max_stage_tokens")
    session = _new_session(model, tokenizer, prompts, None, precision, 1, 16, batch_size, seed, progress, budget)
    bar = Progress(f"generate_stage of {len(prompts)} prompt(s)", session.progress)
    bar.add(len(session.batches))
    try:
        results = {i: res for b, rows in enumerate(session.batches)
                   for i, res in zip(rows, session.decode("live", b, bar, "live", keep=False, max_new_tokens=0,
                                                          matcher=matcher))}
    finally:
        bar.close()
    missing = [i for i in range(len(prompts)) if not results[i].stage_ids]
    if missing:
        raise StageNotGeneratedError(_no_boundary(missing, results, tokenizer, eos_ids_of(model, tokenizer),
                                                  marker, occurrence, budget, precision, batched))
    stages = [list(results[i].stage_ids) for i in range(len(prompts))]
    return stages if batched else stages[0]


def _no_boundary(missing, results, tokenizer, eos_ids, marker, occurrence, budget, precision, batched) -> str:
    """Why the first of ``missing`` found no boundary, and what to change."""
    i = missing[0]
    res = results[i]
    name = f"prompt {i}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") if batched else "this prompt"
    tail = tokenizer.decode(res.suffix_ids)[-80:]
    if res.stop_reason == "nonfinite":
        why, fix = "its logits turned non-finite", "load the model at another precision"
    elif res.suffix_ids and res.suffix_ids[-1] in eos_ids:
        why = (f"it ended its generation (EOS id {res.suffix_ids[-1]}) after {len(res.suffix_ids)} tokens "
               f"({tail!r} at the end) without completing appearance {occurrence} of {marker!r}")
        fix = "choose another marker or occurrence, or another prompt (a larger budget would not help)"
    else:
        why = (f"it generated all {len(res.suffix_ids)} tokens of max_stage_tokens {budget} ({tail!r} at the end) "
               f"without completing appearance {occurrence} of {marker!r}")
        fix = "raise max_stage_tokens or choose another marker"
    return f"the model found no stage boundary from {name} at {precision}: {why}; {fix}"


def _session(model, tokenizer, prompt, stage, precision, max_new_tokens, chunk_size, batch_size, seed, progress,
             live: bool) -> Session:
    """A checked session for ``replay`` and ``transplant``: every argument that can be checked before the model
    runs, checked."""
    precision = arguments.precision_of(model, precision)
    if stage is None:
        raise ValueError("stage is None: give the stage's text or ids, its boundary token last "
                         "(stagereplay.generate_stage gives the model's own)")
    prompts, stages, batched = arguments.rows_of(prompt, stage, tokenizer, int(model.config.vocab_size))
    max_new_tokens = arguments.whole(max_new_tokens, "max_new_tokens")
    if live:
        for a in range(len(stages)):
            for b in range(len(stages)):
                if len(stages[a]) < len(stages[b]) and stages[b][:len(stages[a])] == stages[a]:
                    raise ValueError(
                        f"stage {a} is the start of stage {b}: the live construction finds every row's boundary "
                        f"with one matcher, and prompt {b}'s generation would stop at stage {a}'s boundary; replay "
                        "these prompts in separate calls, or without live (incremental stands in for it)")
    longest = max(len(s) for s in stages)  # live generates up to the longest stage on every row
    arguments.check_context(model.config, prompts, [longest] * len(stages) if live else [len(s) for s in stages],
                            max_new_tokens, "the longest stage" if live and batched else "the stage")
    session = _new_session(model, tokenizer, prompts, stages, precision, max_new_tokens, chunk_size, batch_size,
                           seed, progress)
    session.batched = batched
    return session


def _new_session(model, tokenizer, prompts, stages, precision, max_new_tokens, chunk_size, batch_size, seed,
                 progress, max_stage_tokens=None) -> Session:
    chunk_size = arguments.whole(chunk_size, "chunk_size")
    if batch_size is not None:
        batch_size = arguments.whole(batch_size, "batch_size")
    seed = arguments.whole(seed, "seed", 0)
    if not isinstance(progress, bool):
        raise TypeError(f"progress is {progress!r}; it is True or False")
    return Session(model, tokenizer, prompts, stages, precision, max_new_tokens, chunk_size, batch_size, seed,
                   progress, max_stage_tokens)
