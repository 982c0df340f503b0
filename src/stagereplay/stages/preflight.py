"""Checks of a run's inputs before any job starts, so that a bad input never costs a result already computed.

Snakemake deletes a job's old outputs as the job starts; an input that a job would only discover to be bad
(a dataset row, a model path, a prompt too long for the model) would then cost the results of the last good
run. The workflow calls :func:`check_run_once` when it has work to do, before the first job: every problem found
here raises an error naming the item, row or key and saying what to do, and nothing has been touched. A check
that passed is remembered by its inputs' content (:func:`inputs_key`) and not made again on the same inputs.

Reads the dataset, the model configs and tokenizers; never loads weights. Imports the model stack (torch,
transformers) only where a check reads a model, so that the workflow parses without it. Knows nothing of Snakemake.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from stagereplay.config import check_boundary_set
from stagereplay.data import datasets
from stagereplay.data.prompts import Prompter, check_characters, check_context, check_marker
from stagereplay.decode.options import check_device_options, check_static_options, uses_triton
from stagereplay.io.parquet import write_text_atomic
from stagereplay.models.gguf_files import gguf_read_once
from stagereplay.models.sources import ModelLoadError, ModelSource, go_offline, resolve_source
from stagereplay.models.store import ModelStore, StoreError

# What a passed check of the inputs is remembered by, beside the workflow's file digests (io.file_hashes).
PASSED_CHECKS = Path(".snakemake") / "stagereplay" / "preflight.json"
KEPT_CHECKS = 16


def check_model(source: ModelSource, trust_remote_code: bool = False, allow_pickle: bool = False,
                offline: bool = True):
    """The checks :func:`stagereplay.models.load_model` makes, without the weights: (model config, tokenizer).

    A GGUF source's config and tokenizer are what transformers builds from the file's metadata, as loading it
    does; gguf-py parses that metadata once for the whole check (:func:`~stagereplay.models.gguf_files.gguf_read_once`)
    instead of three or four times, which took the better part of a minute for a Qwen2 vocabulary."""
    from stagereplay.models.loading import check_gguf_tensors_used, checked_config, checked_tokenizer, meta_model

    with gguf_read_once() if source.kind == "gguf" else nullcontext():
        resolved, _, config, common = checked_config(source, trust_remote_code, allow_pickle, offline)
        if resolved.kind == "gguf":  # every tensor must give a parameter (the parameter names, not the weights)
            check_gguf_tensors_used(meta_model(config), resolved, source)
        return config, checked_tokenizer(resolved, source, common, getattr(config, "vocab_size", None))


def check_batching(batch_size: int, decode_regime: str) -> None:
    """Refuse a batch size that the decode regime cannot run (the workflow checks this at parse time too)."""
    if batch_size > 1 and decode_regime == "eager":
        raise ValueError(
            f"batch_size: {batch_size} decodes items together over a static, left-padded K/V buffer, which "
            "decode_regime: eager does not have; set decode_regime: static (any device) or cuda_graph (CUDA), or "
            "batch_size: 1")


def check_decode_settings(batch_size: int, decode_regime: str, decode_attention: str = "masked",
                          decode_prefill_group: int | None = None, decode_kernels: str = "library") -> None:
    """Refuse decode settings that the decode regime cannot run (the workflow checks them at parse time too)."""
    check_batching(batch_size, decode_regime)
    check_static_options(decode_regime, decode_attention, decode_prefill_group, decode_kernels)


def check_transplant_select(select, item_ids: list[str]) -> None:
    """Refuse a ``transplant.select`` that cannot be met by the selected items (ids that are not among them,
    ``sample:N`` above their count) before its job deletes the last selection and fails."""
    if isinstance(select, (list, tuple)):
        known = set(item_ids)
        unknown = [i for i in select if i not in known]
        if unknown:
            raise ValueError(
                f"transplant.select: item ids {unknown} are not among the {len(item_ids)} selected items (e.g. "
                f"{item_ids[:3]}); name ids from results/<run>/selection/items.parquet, or select 'divergent' or "
                "'sample:N'")
    elif isinstance(select, str) and select.startswith("sample:") and int(select[7:]) > len(item_ids):
        raise ValueError(f"transplant.select: {select} asks for more items than the {len(item_ids)} selected; "
                         "lower N or raise n_items")


def check_prefix_precision(prefix_precision: str | None, precisions: list[str]) -> None:
    """Refuse a ``cache_differences.prefix_precision`` no generation runs at: its prefixes would never exist
    (the workflow checks this at parse time, before any job)."""
    if prefix_precision is not None and prefix_precision not in precisions:
        raise ValueError(
            f"cache_differences.prefix_precision: {prefix_precision!r} is not one of precisions {precisions}; the "
            "cache differences take their prefix ids from that precision's generation: name one of those, or "
            "null for the first"
        )


def check_output_folders(*folders: str | Path) -> None:
    """Refuse output folders (``results/<run>`` and the like) of which the folder or a parent is a file."""
    for folder in folders:
        for path in (Path(folder), *Path(folder).parents):
            if path.exists() and not path.is_dir():
                raise ValueError(
                    f"{path} is a file, but the run writes its outputs into the folder {folder}/: move or delete "
                    f"{path}, or choose another run name (run: in the config)"
                )


def check_model_store(store: ModelStore, keys: list[str | None]) -> None:
    """Refuse a ``model_store`` that is a file (or under one), and one the run cannot write where it must prepare
    a snapshot into it (``keys``: the store entries the run loads, None for one not known before its job); a store
    whose entries are all whole is only read, so a read-only one serves them."""
    root = store.root
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise StoreError(
            f"model_store: {existing} is a file, but the run keeps its prepared snapshots in the folder {root}: point "
            "model_store (config) at a folder (it is created where missing), or move the file away")
    unprepared = [k or "(a hub model not yet downloaded)" for k in keys if k is None or store.problems(k)]
    if unprepared and not os.access(existing, os.W_OK | os.X_OK):
        what = "the store" if existing == root else f"{existing}, where the store {root} would be created,"
        raise StoreError(
            f"model_store: {what} is not writable (read-only, or another user's), but {len(unprepared)} snapshot(s) "
            f"this run loads are not prepared there yet ({', '.join(unprepared[:3])}) and prepare_model writes them "
            "into it: make it writable, point model_store (config) at a writable folder, or prepare them once where "
            "the store is writable")


def check_run(config: dict, base_dir: str | Path = ".", jobs_run_here: bool = True,
              prepared: dict | None = None, fingerprints: dict | None = None, cache=None) -> dict:
    """Every check that needs no weights, over the whole validated config; returns a short summary.

    ``config`` is the workflow's config after schema validation (defaults filled), with paths already resolved.
    ``jobs_run_here``: the jobs run on this machine, so the device they ask for must be here (a cluster's
    submit host need not have the GPU its jobs get). ``prepared`` maps a revision to the folders its prepared
    snapshots go to and ``fingerprints`` to its model files' fingerprint: a GGUF source with a current snapshot
    there is checked through the snapshot's config and tokenizer
    (:func:`stagereplay.models.snapshot.checked_stand_in`), a little faster than reading the GGUF's metadata.
    """
    check_decode_settings(config.get("batch_size", 1), config.get("decode_regime", "eager"),
                          config.get("decode_attention", "masked"), config.get("decode_prefill_group"),
                          config.get("decode_kernels", "library"))
    check_prefix_precision((config.get("cache_differences") or {}).get("prefix_precision"), config["precisions"])
    check_boundary_set(config.get("boundary") or {})
    if jobs_run_here:
        check_device(config)
    numeric = config["answer_format"] != "boxed"
    if config["offline"]:
        go_offline()
    rows = datasets.load_source(config["dataset"], base_dir, numeric=numeric, offline=config["offline"])
    selected = datasets.choose_items(rows, config["n_items"], config["seed"])
    check_transplant_select((config.get("transplant") or {}).get("select", "divergent"), list(selected["item_id"]))
    summary = {"n_items": len(selected), "revisions": {}}
    for revision in config["revisions"]:
        source = resolve_source(config["model"], revision, base_dir)
        stand_in = None
        if source.kind == "gguf" and prepared:
            from stagereplay.models.snapshot import checked_stand_in

            stand_in = checked_stand_in(prepared.get(revision, ()), source, (fingerprints or {}).get(revision), cache)
        if stand_in is not None:
            checked_from, model_config, tokenizer = stand_in
        else:
            checked_from = "source"
            model_config, tokenizer = check_model(source, config["trust_remote_code"], config["allow_pickle"],
                                                  config["offline"])
        token_id = (config.get("boundary") or {}).get("token_id")
        vocab = getattr(model_config, "vocab_size", None)
        if token_id is not None and vocab is not None and token_id >= vocab:
            raise ModelLoadError(
                f"boundary.token_id {token_id} is outside the vocabulary of {source.describe()} ({vocab} ids): the "
                "boundary could never appear; give an id the model can produce, or a marker string"
            )
        if token_id is None:
            check_marker((config.get("boundary") or {}).get("marker"), tokenizer, source.describe())
        prompter = Prompter(tokenizer, **(config.get("prompt") or {}))
        from stagereplay.models.loading import context_positions

        context = context_positions(model_config)  # a sliding window shorter than the context limits it
        longest, alone = 0, {}
        for item_id, question in zip(selected["item_id"], selected["question"]):
            check_characters(item_id, question, tokenizer, source.describe(), alone, prompter)
            n_prompt = len(prompter(question))
            check_context(item_id, n_prompt, config["max_stage_tokens"], config["max_new_tokens"], context)
            longest = max(longest, n_prompt)
        summary["revisions"][revision] = {"source": source.describe(), "context": context,
                                          "longest_prompt": longest,
                                          "checked_from": str(checked_from)}
    return summary


def check_device(config: dict) -> None:
    """The device the jobs ask for is on this machine, and runs the Triton options where they are set (the GPU the
    jobs will get). torch only where the answer depends on this machine: ``auto`` without Triton options runs
    anywhere, and ``cpu`` is known without asking."""
    device = config.get("device", "auto")
    attention, kernels = config.get("decode_attention", "masked"), config.get("decode_kernels", "library")
    if device == "cpu":
        check_device_options("cpu", attention, kernels)
    elif device != "auto" or uses_triton(attention, kernels):
        from stagereplay.models.loading import resolve_device

        check_device_options(resolve_device(device).type, attention, kernels)


# ---- A passed check, remembered by its inputs -------------------------------------------------------------------------
# The check reads the dataset, the model files and prompts through tokenizers; with every one of those the same (by
# content) and the same code and packages, it gives the same verdict, so a check that passed is not made again: a
# GGUF source's metadata alone takes seconds to read. The device is checked every time (check_device): it is the
# machine's, not the inputs'.
NOT_CHECKED = ("run",)  # config keys the check does not read: the run's name only names its folders


def package_digest() -> str:
    """sha256 over this package's files (its code: a change to any check makes it again)."""
    root = Path(__file__).resolve().parents[1]  # the package
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(f"{path.relative_to(root)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def installed_distributions() -> list[str]:
    """The installed distributions with their versions, as the import path's metadata folders name them
    (``transformers-5.24.0.dist-info``): one listing per folder, no package imported or read."""
    names = set()
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as found:
                names.update(e.name for e in found if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue
    return sorted(names)


def inputs_key(config: dict, fingerprints: dict, dataset_fingerprint: dict | None,
               base_dir: str | Path = ".") -> str | None:
    """A digest of everything :func:`check_run`'s verdict depends on, or None where an input is not known by its
    content (a Hugging Face dataset, a model not fingerprinted, a hub model the check may resolve online): then the
    check is always made. The model store's snapshots do not count: one stands in for its source only where it was
    made from the source's current files, and preparing it proved its config and tokenizer the source's, so the
    verdict through it is the verdict through the source (a run after the store was filled reuses the first run's
    check)."""
    if config["dataset"].get("source") == "hf":
        return None
    if config["dataset"].get("source") != "synthetic" and not (dataset_fingerprint or {}).get("sha256"):
        return None
    models = {}
    for revision in config["revisions"]:
        fingerprint = (fingerprints or {}).get(revision) or {}
        if not fingerprint.get("sha256"):
            return None
        try:
            kind = resolve_source(config["model"], revision, base_dir).kind
        except ModelLoadError:
            return None
        if kind == "hub" and not config["offline"]:
            return None
        models[revision] = fingerprint["sha256"]
    ident = {"config": {k: v for k, v in config.items() if k not in NOT_CHECKED}, "models": models,
             "dataset": (dataset_fingerprint or {}).get("sha256"),
             "base_dir": str(Path(base_dir).resolve()), "python": sys.version, "package": package_digest(),
             "installed": installed_distributions()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


class PassedChecks:
    """The summaries of checks that passed, by :func:`inputs_key` (the last ``KEPT_CHECKS``), in a small JSON file."""

    def __init__(self, path: str | Path | None = PASSED_CHECKS):
        self.path = None if path is None else Path(path)
        self.entries: dict[str, dict] = {}
        if self.path is not None and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.entries = {}  # a damaged record only costs checking again

    def get(self, key: str | None) -> dict | None:
        return self.entries.get(key) if key else None

    def add(self, key: str | None, summary: dict) -> None:
        if not key or self.path is None:
            return
        self.entries.pop(key, None)
        self.entries[key] = {**summary, "passed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.entries = dict(list(self.entries.items())[-KEPT_CHECKS:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(self.entries, indent=1))
        except OSError:
            pass  # a read-only working directory: the check is made again next time


@contextmanager
def environment_kept():
    """This process's environment as it was, after what the block imports: a library may set a variable as it is
    imported (torch's inductor sets ``TORCHINDUCTOR_CACHE_DIR``), and the jobs inherit this process's environment,
    so a check made again must leave the jobs the environment of a remembered one (and the job server's key)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        os.environ.update(before)


def check_run_once(config: dict, base_dir: str | Path = ".", jobs_run_here: bool = True,
                   prepared: dict | None = None, fingerprints: dict | None = None,
                   dataset_fingerprint: dict | None = None, passed: PassedChecks | None = None) -> dict:
    """:func:`check_run`, unless the same inputs passed it before (``passed``, by :func:`inputs_key`): then its
    summary, with ``passed_at``. The device is checked either way, and an offline run goes offline either way: the
    jobs inherit this process's environment (and the job server's key holds it), so a remembered check must leave
    it as a check made again would."""
    if config["offline"]:
        go_offline()
    if jobs_run_here:
        check_device(config)
    key = inputs_key(config, fingerprints, dataset_fingerprint, base_dir) if passed is not None else None
    remembered = passed.get(key) if passed is not None else None
    if remembered is not None:
        return remembered
    with environment_kept():
        summary = check_run(config, base_dir, jobs_run_here=False, prepared=prepared, fingerprints=fingerprints)
    if passed is not None:
        passed.add(key, summary)
    return summary
