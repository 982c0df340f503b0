"""What produced the run, from the provenance its results files record (their own and their parts'): model and
revisions, dataset, budgets, boundary, seed, regimes, hardware, code and software; "not recorded" where the files
record nothing. :func:`identity` gives the report's table and its ``stats.json`` record."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.analysis.report_format import NOT_RECORDED, table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.io.parquet import CONTENT_KEY, read_provenance

# The dataset keys each source reads (the schema fills every key's default, whatever the source): only these are shown.
DATASET_KEYS = {"synthetic": ("source", "size", "seed"),
                "jsonl": ("source", "path", "fields"), "csv": ("source", "path", "fields"),
                "parquet": ("source", "path", "fields"),
                "hf": ("source", "name", "subset", "split", "revision", "fields")}
# Determinism flags that act on CUDA alone: shown for a run with a CUDA device only.
CUDA_ONLY_FLAGS = ("cublas_workspace_config", "tf32_cudnn", "tf32_matmul")
# Regime settings that act only in the static / cuda_graph regimes (the eager decoder has no static buffer).
STATIC_ONLY_SETTINGS = ("decode_attention", "decode_prefill_group", "decode_kernels")


def _records(provenance: dict) -> list[dict]:
    """A file's provenance records: its own and, for a gathered file, each part's."""
    if not provenance:
        return []
    return [provenance, *provenance.get("parts", [])]


def _values(records: list[dict], *path: str) -> list:
    """Distinct values at ``path`` (keys into nested dicts) over ``records``, in first-seen order. A key recorded
    with the value null counts (as None); a key no record holds gives nothing."""
    found = []
    for record in records:
        node, present = record, True
        for key in path:
            if not isinstance(node, dict) or key not in node:
                present = False
                break
            node = node[key]
        if present and node not in found:
            found.append(node)
    return found


def show_values(values: list, empty: str = NOT_RECORDED) -> str:
    if not values:
        return empty

    def one(v):
        if v is None:
            return "none"
        if isinstance(v, dict):  # what a thing is (its source, path, name) before its settings
            keys = sorted((k for k in v if v[k] is not None),  # an unset option says nothing
                          key=lambda k: (k not in ("source", "path", "name", "marker"), list(v).index(k)))
            return ", ".join(f"{k} {one(v[k])}" for k in keys) or "none set"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(map(one, v)) + "]"
        return f"`{v}`" if isinstance(v, str) else str(v)

    return "; ".join(one(v) for v in values)


def applicable_dataset(dataset: dict) -> dict:
    """The keys of a recorded dataset config that its source reads (an unknown source keeps them all)."""
    keys = DATASET_KEYS.get(dataset.get("source"))
    if keys is None:
        return dict(dataset)
    return {"source": dataset["source"], **{k: v for k, v in dataset.items() if k in keys and k != "source"}}


def applicable_flags(flags: dict, devices: list) -> dict:
    """Determinism flags without the CUDA-only ones when every recorded device is a CPU (a GPU is recorded by its
    name, a CPU as ``cpu:...``)."""
    cpu_only = bool(devices) and all(str(d).startswith("cpu") for d in devices)
    return {k: v for k, v in flags.items() if k not in CUDA_ONLY_FLAGS} if cpu_only and isinstance(flags, dict) \
        else flags


def transplant_text(records: list[dict]) -> str | None:
    """How a revision's transplants were chosen and swept, from its transplant file's provenance; None without."""
    selections = _values(records, "selection")
    sweeps = _values(records, "config", "sweeps")
    if not selections and not sweeps:
        return None
    chosen = []
    for sel in selections:
        if isinstance(sel, dict):
            blind = " (outcome-blind)" if "never correctness" in str(sel.get("decided_from")) else ""
            chosen.append(f"rule `{sel.get('rule')}` (seed {sel.get('seed')}): {sel.get('n_selected')} items drawn "
                          f"from the {sel.get('n_divergent')} divergent of {sel.get('n_candidates')} candidates{blind}")
    return "; ".join(chosen or [NOT_RECORDED]) + f"; sweeps {show_values(sweeps)}"


def identity(revision_data: list[RevisionData], selection: str | None, run: str, seed: int) -> tuple[list[str], dict]:
    """What produced the run, from the provenance its files record: a Markdown table and its dict."""
    per_revision = {}
    everything: list[dict] = []
    for data in revision_data:
        records = []
        for kind in ("ledger", "transplant", "bridge", "audit", "cache_differences", "batch_invariance"):
            records += _records(data.provenance(kind))
        per_revision[data.revision] = records
        everything += records
    sel_prov = read_provenance(selection) if selection and Path(selection).is_file() else {}
    rows: list[tuple[str, str]] = []
    record: dict = {}

    def add(label: str, key: str, text: str, value) -> None:
        rows.append((label, text))
        record[key] = value

    add("run", "run", f"`{run}`", run)
    _model_rows(add, revision_data, per_revision, everything)
    _dataset_rows(add, revision_data, selection, sel_prov)
    _settings_rows(add, everything, sel_prov, seed)
    _regime_rows(add, everything)
    for data in revision_data:
        text = transplant_text(_records(data.provenance("transplant")))
        if text is not None:
            add(f"transplants `{data.revision}`", f"transplant:{data.revision}", text, text)
    _software_rows(add, everything)
    lines = ["## What produced this run", "",
             "From the provenance the results files record (their own and their parts'); several values are listed "
             "where the files differ.", "", *table_head("", "recorded")]
    lines += [table_row(label, text) for label, text in rows]
    return lines + [""], record


def _model_rows(add, revision_data: list[RevisionData], per_revision: dict, everything: list[dict]) -> None:
    """The model, each revision as requested and as resolved, its type and layers."""
    model = _values(everything, "config", "model") or _values(everything, "model_source")
    add("model", "model", show_values(model), model)
    for data in revision_data:
        records = per_revision[data.revision]
        requested = _values(records, "config", "revision")
        source = _values(records, "model_source")
        commit = _values(records, "model_commit")
        sha = _values(records, "model_sha256")
        resolved = "; ".join(([f"hub commit {show_values(commit)}"] if commit else [])
                             + ([f"model files sha256 {show_values(sha)}"] if sha else [])) or \
            f"{NOT_RECORDED} (no hub commit or model files sha256 in the provenance)"
        text = (f"requested {show_values(requested)}; source {show_values(source)}; resolved: {resolved}"
                if records else f"{NOT_RECORDED} (no provenance)")
        add(f"revision `{data.revision}`", f"revision:{data.revision}", text,
            {"requested": requested, "source": source, "model_commit": commit, "sha256": sha})
    add("model type, layers", "model_type", f"{show_values(_values(everything, 'model_type'))}, "
        f"{show_values(_values(everything, 'num_layers'))} layers",
        {"model_type": _values(everything, "model_type"), "num_layers": _values(everything, "num_layers")})


def _dataset_rows(add, revision_data: list[RevisionData], selection: str | None, sel_prov: dict) -> None:
    """The dataset as configured, its content's fingerprints, and the items selected and decoded."""
    dataset = [applicable_dataset(d) if isinstance(d, dict) else d
               for d in (_values([sel_prov], "config", "dataset") if sel_prov else [])]
    add("dataset", "dataset", show_values(dataset, f"{NOT_RECORDED} (no selection/items.parquet)"), dataset)
    fingerprint = _values([sel_prov], "dataset_fingerprint")
    file_sha = _values([sel_prov], "dataset_sha256")
    n_rows = _values([sel_prov], "dataset_rows")
    content = None
    if selection and Path(selection).is_file():
        raw = (pq.read_schema(selection).metadata or {}).get(CONTENT_KEY)
        content = raw.decode() if raw else None
    add("dataset content fingerprint", "dataset_fingerprint",
        f"rows as read: {show_values(fingerprint)}" + (f" ({show_values(n_rows)} rows)" if n_rows else "")
        + (f"; dataset file sha256 {show_values(file_sha)}" if file_sha else "")
        + f"; selected items (items.parquet content sha256): {'`' + content + '`' if content else NOT_RECORDED}",
        {"source": fingerprint, "file": file_sha, "rows": n_rows, "selection": content})
    n_items = _values([sel_prov], "config", "n_items") if sel_prov else []
    in_ledgers = sorted({int(i) for d in revision_data if d.has("ledger") for i in d.ledger["item_index"].unique()})
    add("items", "items", f"{show_values(n_items)} selected (config n_items); {len(in_ledgers)} in the ledger(s)",
        {"n_items": n_items, "in_ledgers": len(in_ledgers)})


def _settings_rows(add, everything: list[dict], sel_prov: dict, seed: int) -> None:
    """The token budgets, boundary, seeds and precisions."""
    add("token budgets", "budgets", f"max_stage_tokens {show_values(_values(everything, 'config', 'max_stage_tokens'))}; "
        f"max_new_tokens {show_values(_values(everything, 'config', 'max_new_tokens'))}",
        {"max_stage_tokens": _values(everything, "config", "max_stage_tokens"),
         "max_new_tokens": _values(everything, "config", "max_new_tokens")})
    add("boundary", "boundary", show_values(_values(everything, "config", "boundary")),
        _values(everything, "config", "boundary"))
    seeds = _values(everything, "config", "seed") + [s for s in _values([sel_prov], "seed")
                                                     if s not in _values(everything, "config", "seed")]
    add("seed", "seed", f"{show_values(seeds)} (recorded); report's bootstrap seed {seed}",
        {"recorded": seeds, "report": seed})
    precisions = _values(everything, "config", "precision")
    add("precisions", "precisions", show_values(precisions), precisions)


def _regime_rows(add, everything: list[dict]) -> None:
    """The numerics and decode regime (the settings that act in it) and the determinism flags (those that act on the
    devices recorded)."""
    # numerics: the regime the model was loaded in (its record holds the invariant kernels' settings too), else the
    # configured name
    regime = {name: _values(everything, *path) for name, path in (
        ("numerics", ("numerics_regime",)), ("decode_regime", ("config", "decode_regime")),
        ("decode_attention", ("config", "decode_attention")),
        ("decode_prefill_group", ("config", "decode_prefill_group")),
        ("decode_kernels", ("config", "decode_kernels")), ("batch_size", ("config", "batch_size")),
        ("batch_seed", ("config", "batch_seed")))}
    regime["numerics"] = [v.get("numerics") if isinstance(v, dict) and list(v) == ["numerics"] else v
                          for v in regime["numerics"]] or _values(everything, "config", "numerics")
    static = any(v in ("static", "cuda_graph") for v in regime["decode_regime"])
    shown = {k: v for k, v in regime.items() if v and v != [None]  # an unset option says nothing
             and (static or k not in STATIC_ONLY_SETTINGS)}
    add("numerics and decode regime", "regime", "; ".join(f"{k} {show_values(v)}" for k, v in shown.items()), shown)
    devices = _values(everything, "device")
    flags = [applicable_flags(f, devices) for f in _values(everything, "numerics")]
    add("determinism flags", "flags", show_values(flags), flags)


def _software_rows(add, everything: list[dict]) -> None:
    """The device, attention, threads and dtype; the answer format and prompt; the package and software versions."""
    hardware = {name: _values(everything, *path) for name, path in (
        ("device", ("device",)), ("attn_implementation", ("attn_implementation",)), ("threads", ("config", "threads")),
        ("dtype", ("dtype",)))}
    add("device, attention, threads, dtype", "hardware", "; ".join(f"{k} {show_values(v)}" for k, v in hardware.items()),
        hardware)
    add("answers, prompt", "answers", f"answer_format {show_values(_values(everything, 'config', 'answer_format'))}; "
        f"prompt {show_values(_values(everything, 'config', 'prompt'))}",
        {"answer_format": _values(everything, "config", "answer_format"),
         "prompt": _values(everything, "config", "prompt")})
    package = {"stagereplay": _values(everything, "stagereplay"), "git_commit": _values(everything, "git_commit")}
    add("package", "package", f"stagereplay {show_values(package['stagereplay'])}, commit {show_values(package['git_commit'])}",
        package)
    software = {name: _values(everything, name) for name in ("torch", "transformers", "cache_fingerprint_scheme")}
    add("software", "software", "; ".join(f"{k} {show_values(v)}" for k, v in software.items()), software)
