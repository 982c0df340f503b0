"""What every model-loading stage does first and last: claim a GPU, open the model on it
(:func:`stagereplay.models.opening.open_model`), build its decoder, record provenance (the per-shard parts are
joined by :mod:`stagereplay.stages.gather`, which loads no model)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from stagereplay.decode.protocol import Decoder
from stagereplay.decode.regimes import decoder_from_record
from stagereplay.experiments.recipe import DecodeSettings
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.provenance import recorded_numerics, recorded_regime, software_versions
from stagereplay.models.gpus import claim_gpu, start_device
from stagereplay.models.loading import eos_token_ids, set_determinism
from stagereplay.models.opening import open_model
from stagereplay.runtime.hand_over import process_start
from stagereplay.stages.settings import ModelSettings

log = logging.getLogger("stagereplay")


@dataclass
class Job:
    loaded: object  # stagereplay.models.loading.LoadedModel
    decoder: Decoder
    flags: dict  # the determinism flags in force
    settings: ModelSettings  # the stage's, as the job was loaded with them
    precision: str

    def provenance(self, stage: str, config: dict, **extra) -> dict:
        return {**software_versions(), **self.loaded.info, **self.decoder.record(), "numerics": self.flags,
                "stage": stage, "config": config, **extra}

    @property
    def numerics(self) -> str:
        return self.decoder.numerics

    def run_settings(self) -> RunSettings:
        """The settings of an experiment that makes ledger rows: the stage's budgets and answer format, this job's
        precision, decode and numerics regime (stages that replay fixed prefixes have no stage budget)."""
        s = self.settings
        return RunSettings(s.revision, self.precision, getattr(s, "max_stage_tokens", None), s.max_new_tokens,
                           getattr(s, "answer_format", "last_number"), getattr(s, "stage_end", None),
                           self.decoder.record()["decode_regime"], self.numerics, s.chunk_size)

    def decode_settings(self) -> DecodeSettings:
        """The recipe's settings alone, for a stage whose rows carry no answers (caches, transplants)."""
        s = self.settings
        return DecodeSettings(getattr(s, "max_stage_tokens", None), s.max_new_tokens, s.chunk_size)


def load(settings: ModelSettings, precision: str, *, numerics: str, make_decoder) -> Job:
    """Model at ``precision`` on a GPU of this job's own (when several are visible) and its decoder
    (``make_decoder(loaded)``); from the revision's prepared snapshot in the model store where the workflow made
    one. The job's log says what each part of the start took."""
    log.info("job started %s: loading the model", process_start())
    took = StartTimes()
    flags = set_determinism(settings.threads)
    took("numerics flags")
    gpu = claim_gpu(settings.device)  # held until the job ends
    device_start = start_device(gpu.device)
    took("GPU claim")
    loaded = open_model(settings.planned_source, precision, settings.prepared_models, device=gpu.device,
                        attn_implementation=settings.attn_implementation, numerics=numerics, took=took)
    took("weights and tokenizer")
    if device_start is not None:
        device_start.join()
        took("device start (the rest of it)")
    loaded.info["gpu_slot"] = gpu.record()
    job = Job(loaded, make_decoder(loaded), flags, settings, precision)
    took("decoder")
    log.info("model and decoder ready: %s (%s)", process_start(), took)
    return job


class StartTimes:
    """Wall seconds of each part of a job's start, in order: ``took(name)`` ends the part named."""

    def __init__(self):
        self.parts: list[tuple[str, float]] = []
        self.since = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.parts.append((name, now - self.since))
        self.since = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.parts)


def load_as_recorded(settings: ModelSettings, precision: str, regime_from: str) -> Job:
    """Model and decoder in the numerics and decode regime recorded in ``regime_from`` (the generation's own)."""
    record = recorded_regime(regime_from)
    return load(settings, precision, numerics=recorded_numerics(regime_from),
                make_decoder=lambda loaded: decoder_from_record(loaded.model, eos_token_ids(loaded), record))


# Settings that say where inputs are or how to show progress, not what was computed: provenance records the model
# files' fingerprints and the snapshot loaded in the model's info instead.
NOT_CONFIG = ("progress", "base_dir", "model_fingerprint", "prepared_models", "model_store")


def config_of(settings) -> dict:
    """The settings as provenance records them."""
    return {k: v for k, v in asdict(settings).items() if k not in NOT_CONFIG}
