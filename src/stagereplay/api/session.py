"""A library call's session: the model's decoder, the rows (prompts and stages) cut into a recorded batch plan, and
the boundary caches each construction built, kept so that later transplants reuse them.

Every decode is the pipeline's recipe (:func:`stagereplay.experiments.recipe.run`) over one batch of the plan, as
the pipeline's stages decode theirs; every transplant is :func:`stagereplay.experiments.transplant.transplant_rows`
over one batch, the recipient decoded again with the donor's K/V written in. Arguments are checked by the callers
(:mod:`stagereplay.api`) before a session decodes anything.
"""

from __future__ import annotations

from stagereplay.api import arguments
from stagereplay.api.progress import Progress
from stagereplay.api.results import Continuation, Replay, ReplayBatch, StageNotGeneratedError, Transplant
from stagereplay.decode.greedy import RowResult
from stagereplay.decode.plans import batch_plan
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments import constructions as registry
from stagereplay.experiments.recipe import DecodeSettings, replica_difference, run
from stagereplay.experiments.transplant import transplant_rows
from stagereplay.experiments.transplant_specs import TransplantSpec, rebuilt_as
from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.io.ids import first_divergence
from stagereplay.io.provenance import software_versions
from stagereplay.models.loading import determinism, device_name, eos_ids_of


class GivenStages:
    """The live construction's boundary for rows whose stages are given: a row's generation reaches its boundary
    when it is one of the stages (the callers refuse stages of which one is a strict prefix of another, where a
    row could stop at another row's boundary)."""

    def __init__(self, stages: list[list[int]]):
        self.stages = {tuple(s) for s in stages}

    def reached(self, generated: list[int]) -> bool:
        return tuple(generated) in self.stages


class Session:
    """One call's model, rows, batch plan and kept boundary caches (:attr:`kept`: construction -> per batch, its
    replica-1 results, every row's cache kept)."""

    def __init__(self, model, tokenizer, prompts: list[list[int]], stages: list[list[int]] | None, precision: str,
                 max_new_tokens: int, chunk_size: int, batch_size: int | None, seed: int, progress: bool,
                 max_stage_tokens: int | None = None):
        self.model, self.tokenizer, self.precision = model, tokenizer, precision
        self.prompts, self.stages = prompts, stages
        budget = max(len(s) for s in stages) if stages else max_stage_tokens
        self.settings = DecodeSettings(budget, max_new_tokens, chunk_size)
        self.plan = batch_plan([str(i) for i in range(len(prompts))], batch_size or len(prompts), seed)
        self.batches = ([[i] for i in range(len(prompts))] if self.plan is None
                        else [[int(i) for i in b] for b in self.plan.batches])
        self.decoder = make_decoder(model, tuple(eos_ids_of(model, tokenizer)))
        self.progress = progress
        self.batched = False  # a list of prompts was given: a batch result, even of one prompt
        self.kept: dict[str, list[list[RowResult]]] = {}
        self.logits: dict[str, dict[int, object]] = {}
        self.flags: dict = {}

    # decoding

    def decode(self, construction: str, b: int, bar: Progress, label: str, keep: bool = True, observe=None,
               max_new_tokens: int | None = None, matcher=None) -> list[RowResult]:
        """One construction over batch ``b`` (the recipe), every row's boundary cache kept when ``keep``."""
        rows = self.batches[b]
        prompts = [self.prompts[i] for i in rows]
        if registry.get(construction).rebuildable:
            source = {"stages": [self.stages[i] for i in rows]}
        else:
            source = {"matcher": matcher or GivenStages([self.stages[i] for i in rows])}
        with bar.decode(label), determinism() as flags:
            self.flags = flags
            return run(self.decoder, construction, prompts, self.settings, keep=set(range(len(rows))) if keep else
                       frozenset(), observe=observe, max_new_tokens=max_new_tokens, **source)

    def check_live(self, b: int, results: list[RowResult]) -> None:
        """Every row of batch ``b`` generated its given stage; else where the model leaves it."""
        for i, res in zip(self.batches[b], results):
            stage = self.stages[i]
            if res.stage_ids == stage:
                continue
            name = f"prompt {i}: " if len(self.prompts) > 1 else ""
            if res.stop_reason == "nonfinite":
                raise StageNotGeneratedError(f"{name}the model's logits turned non-finite while it generated the "
                                             f"stage at {self.precision}")
            generated, decode = list(res.stage_ids) + list(res.suffix_ids), self.tokenizer.decode
            at = first_divergence(generated, stage)
            chose = f"id {generated[at]} ({decode(generated[at:at + 1])!r})" if at < len(generated) else "nothing"
            raise StageNotGeneratedError(
                f"{name}the live construction continues the model's own greedy generation, which leaves the given "
                f"stage at its token {at} of {len(stage)} at {self.precision}: it chooses {chose} where the stage "
                f"has id {stage[at]} ({decode(stage[at:at + 1])!r}). Give the stage the model generates "
                "(stagereplay.generate_stage), or replay this one with constructions that rebuild it from its ids "
                "(incremental, the stage fed token by token, stands in for live; prefill; chunked; prefix_cached)")

    def replay(self, names: tuple[str, ...], replicas: int, logits: bool, caches: bool) -> Replay | ReplayBatch:
        """Each construction (live first, where asked) over every batch, ``replicas`` times from scratch."""
        bar = Progress(f"replay of {len(self.prompts)} prompt(s)", self.progress)
        bar.add(len(names) * replicas * len(self.batches))
        exact: dict[str, list[tuple[bool | None, str | None]]] = {}
        try:
            for name in sorted(names, key=lambda n: n != "live"):
                kept, seen, exact[name] = [], {}, [None] * len(self.prompts)
                for b, rows in enumerate(self.batches):
                    observe = self.observer(rows, seen) if logits else None
                    runs = [self.decode(name, b, bar, f"{name} replica {k + 1}", keep=k == 0,
                                        observe=observe if k == 0 else None) for k in range(replicas)]
                    if name == "live":
                        self.check_live(b, runs[0])
                    kept.append(runs[0])
                    for r, i in enumerate(rows):
                        differs = next((d for d in (replica_difference(runs[0][r], o[r]) for o in runs[1:]) if d),
                                       None)
                        exact[name][i] = (None if replicas == 1 else differs is None, differs)
                self.kept[name] = kept
                self.logits[name] = seen
        finally:
            bar.close()
        out, provenance = [], self.provenance()  # once a call: it asks git for the commit
        for i in range(len(self.prompts)):
            conts = {name: self.continuation(name, self.result(name, i), replicas, *exact[name][i],
                                             logits=self.stacked(name, i) if logits else None, cache=caches)
                     for name in names}
            out.append(Replay(self.prompts[i], self.stages[i], self.precision, conts, provenance, i, self))
        if not self.batched:
            return out[0]
        return ReplayBatch(out, self.precision, provenance, self)

    @staticmethod
    def observer(rows: list[int], seen: dict):
        """An ``observe`` for the recipe that keeps each row's fp32 logits per suffix step, on the CPU."""
        def observe(r: int, step: int, logits) -> None:
            seen.setdefault(rows[r], []).append(logits.detach().float().cpu().clone())
        return observe

    def stacked(self, name: str, i: int):
        import torch

        steps = self.logits.get(name, {}).get(i, [])
        return torch.stack(steps) if steps else torch.empty((0, int(self.model.config.vocab_size)))

    def result(self, name: str, i: int) -> RowResult:
        for b, rows in enumerate(self.batches):
            if i in rows:
                return self.kept[name][b][rows.index(i)]
        raise KeyError(i)

    def continuation(self, name: str, res: RowResult, replicas: int = 1, exact: bool | None = None,
                     differs: str | None = None, logits=None, cache: bool = False) -> Continuation:
        whole, ks, vs = res.fingerprints
        layers = None
        if cache and res.layers is not None:
            layers = [(k.detach().cpu(), v.detach().cpu()) for k, v in res.layers]
        return Continuation(name, list(res.suffix_ids), self.tokenizer.decode(res.suffix_ids), list(res.margins),
                            res.stop_reason, whole, list(ks), list(vs), fingerprint_ids(res.suffix_ids), replicas,
                            exact, differs, logits, layers)

    def provenance(self) -> dict:
        parameter = next(self.model.parameters())
        return {**software_versions(), "model_type": self.model.config.model_type,
                "num_layers": self.decoder.n_layers,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "dtype": str(parameter.dtype).replace("torch.", ""), "device": device_name(parameter.device),
                **self.decoder.record(), "numerics_regime": self.decoder.numerics, "numerics": self.flags,
                "batch_plan": None if self.plan is None else self.plan.record(), "prompts": len(self.prompts)}

    # transplants

    def ensure(self, name: str, bar: Progress) -> None:
        """``name``'s results on every batch, decoded once (the first time a transplant needs them) and kept."""
        if name in self.kept:
            return
        bar.add(len(self.batches))
        kept = []
        for b in range(len(self.batches)):
            kept.append(self.decode(name, b, bar, f"{name} (kept for transplants)"))
            if name == "live":
                self.check_live(b, kept[-1])
        self.kept[name] = kept

    def label(self, name: str, i: int) -> tuple[str, bool | None]:
        """How construction ``name`` is named for prompt ``i``, and whether its rebuilt live cache is the live one."""
        if name != "live":
            return name, None
        match = self.result("live", i).fingerprints[0] == self.result("incremental", i).fingerprints[0]
        return ("live" if match else "incremental"), match

    def transplant(self, donor: str, recipient: str, layers, component: str, positions,
                   rows: list[int] | None = None) -> list[Transplant]:
        """Donor's K/V over ``layers`` of the recipient's boundary cache, for ``rows`` (None: every prompt), one
        decode per batch that holds one of them; donor and recipient are built once per session."""
        if donor == recipient:
            raise ValueError(f"donor and recipient are both {donor!r}: a transplant between a construction and "
                             "itself writes its own bytes back (a no-op); name two constructions")
        for name in (donor, recipient):
            registry.get(name)
        chosen = arguments.layers_of(layers, self.decoder.n_layers)
        component = arguments.component_of(component)
        wanted = list(range(len(self.prompts))) if rows is None else rows
        span = arguments.positions_of(positions, [len(self.prompts[i]) + len(self.stages[i]) - 1 for i in wanted])
        spec = TransplantSpec("custom", chosen, component, span)
        bar = Progress(f"transplant {donor}->{recipient}", self.progress)
        out: dict[int, Transplant] = {}
        try:
            needed = [rebuilt_as(n) for n in (donor, recipient)] + (["live"] if "live" in (donor, recipient) else [])
            for name in dict.fromkeys(sorted(needed, key=lambda n: n != "live")):  # live first: its stage check
                self.ensure(name, bar)
            for b, batch in enumerate(self.batches):
                mine = [r for r, i in enumerate(batch) if i in wanted]
                if mine:
                    out.update(self.transplant_batch(b, donor, recipient, {r: spec for r in mine}, bar))
        finally:
            bar.close()
        return [out[i] for i in wanted]

    def transplant_batch(self, b: int, donor: str, recipient: str, specs: dict, bar: Progress) -> dict:
        batch = self.batches[b]
        own = {name: self.kept[rebuilt_as(name)][b] for name in (donor, recipient)}
        prompts, stages = [self.prompts[i] for i in batch], [self.stages[i] for i in batch]
        bar.add(1)
        with bar.decode(f"{donor}->{recipient}"), determinism() as flags:
            self.flags = flags
            done = transplant_rows(self.decoder, prompts, stages, self.settings, own, donor, recipient, specs)
        out, provenance = {}, self.provenance()
        for r, (res, outcome) in done.items():
            i, spec = batch[r], specs[r]
            (d, match_d), (c, match_c) = self.label(donor, i), self.label(recipient, i)
            mine, theirs = own[donor][r], own[recipient][r]
            divergent = first_divergence(mine.suffix_ids, theirs.suffix_ids) is not None
            verdict = "agree" if not divergent and outcome.outcome == "donor" else outcome.outcome
            out[i] = Transplant(d, c, list(spec.layers), spec.component, spec.positions, verdict, divergent,
                                outcome.first_divergence_donor, outcome.first_divergence_recipient,
                                self.continuation(f"{d}->{c}", res), self.continuation(d, mine),
                                self.continuation(c, theirs), match_d if match_c is None else match_c,
                                self.precision, provenance, i)
        return out
