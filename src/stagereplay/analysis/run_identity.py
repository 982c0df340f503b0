"""What produced the run, from the provenance its results files record (their own and their parts'): model and
revisions, dataset, budgets, boundary, seed, regimes, hardware, code and software; "not recorded" where the files
record nothing. :func:`identity` gives the report's table and its ``stats.json`` record."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.analysis.report_format import NOT_RECORDED
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.io.parquet import CONTENT_KEY, read_provenance


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


def _show(values: list, empty: str = NOT_RECORDED) -> str:
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
    model = _values(everything, "config", "model") or _values(everything, "model_source")
    add("model", "model", _show(model), model)
    for data in revision_data:
        records = per_revision[data.revision]
        requested = _values(records, "config", "revision")
        source = _values(records, "model_source")
        commit = _values(records, "model_commit")
        sha = _values(records, "model_sha256")
        resolved = "; ".join(([f"hub commit {_show(commit)}"] if commit else [])
                             + ([f"model files sha256 {_show(sha)}"] if sha else [])) or \
            f"{NOT_RECORDED} (no hub commit or model files sha256 in the provenance)"
        text = (f"requested {_show(requested)}; source {_show(source)}; resolved: {resolved}"
                if records else f"{NOT_RECORDED} (no provenance)")
        add(f"revision `{data.revision}`", f"revision:{data.revision}", text,
            {"requested": requested, "source": source, "model_commit": commit, "sha256": sha})
    add("model type, layers", "model_type", f"{_show(_values(everything, 'model_type'))}, "
        f"{_show(_values(everything, 'num_layers'))} layers",
        {"model_type": _values(everything, "model_type"), "num_layers": _values(everything, "num_layers")})
    dataset = _values([sel_prov], "config", "dataset") if sel_prov else []
    add("dataset", "dataset", _show(dataset, f"{NOT_RECORDED} (no selection/items.parquet)"), dataset)
    fingerprint = _values([sel_prov], "dataset_fingerprint")
    file_sha = _values([sel_prov], "dataset_sha256")
    n_rows = _values([sel_prov], "dataset_rows")
    content = None
    if selection and Path(selection).is_file():
        raw = (pq.read_schema(selection).metadata or {}).get(CONTENT_KEY)
        content = raw.decode() if raw else None
    add("dataset content fingerprint", "dataset_fingerprint",
        f"rows as read: {_show(fingerprint)}" + (f" ({_show(n_rows)} rows)" if n_rows else "")
        + (f"; dataset file sha256 {_show(file_sha)}" if file_sha else "")
        + f"; selected items (items.parquet content sha256): {'`' + content + '`' if content else NOT_RECORDED}",
        {"source": fingerprint, "file": file_sha, "rows": n_rows, "selection": content})
    n_items = _values([sel_prov], "config", "n_items") if sel_prov else []
    in_ledgers = sorted({int(i) for d in revision_data if d.has("ledger") for i in d.ledger["item_index"].unique()})
    add("items", "items", f"{_show(n_items)} selected (config n_items); {len(in_ledgers)} in the ledger(s)",
        {"n_items": n_items, "in_ledgers": len(in_ledgers)})
    add("token budgets", "budgets", f"max_stage_tokens {_show(_values(everything, 'config', 'max_stage_tokens'))}; "
        f"max_new_tokens {_show(_values(everything, 'config', 'max_new_tokens'))}",
        {"max_stage_tokens": _values(everything, "config", "max_stage_tokens"),
         "max_new_tokens": _values(everything, "config", "max_new_tokens")})
    add("boundary", "boundary", _show(_values(everything, "config", "boundary")),
        _values(everything, "config", "boundary"))
    seeds = _values(everything, "config", "seed") + [s for s in _values([sel_prov], "seed")
                                                     if s not in _values(everything, "config", "seed")]
    add("seed", "seed", f"{_show(seeds)} (recorded); report's bootstrap seed {seed}",
        {"recorded": seeds, "report": seed})
    precisions = _values(everything, "config", "precision")
    add("precisions", "precisions", _show(precisions), precisions)
    regime = {name: _values(everything, *path) for name, path in (
        ("numerics", ("config", "numerics")), ("numerics_regime", ("numerics_regime",)),
        ("decode_regime", ("config", "decode_regime")), ("decode_attention", ("config", "decode_attention")),
        ("decode_prefill_group", ("config", "decode_prefill_group")),
        ("decode_kernels", ("config", "decode_kernels")), ("batch_size", ("config", "batch_size")),
        ("batch_seed", ("config", "batch_seed")))}
    add("numerics and decode regime", "regime", "; ".join(f"{k} {_show(v)}" for k, v in regime.items()), regime)
    flags = _values(everything, "numerics")
    add("determinism flags", "flags", _show(flags), flags)
    hardware = {name: _values(everything, *path) for name, path in (
        ("device", ("device",)), ("attn_implementation", ("attn_implementation",)), ("threads", ("config", "threads")),
        ("dtype", ("dtype",)))}
    add("device, attention, threads, dtype", "hardware", "; ".join(f"{k} {_show(v)}" for k, v in hardware.items()),
        hardware)
    add("answers, prompt", "answers", f"answer_format {_show(_values(everything, 'config', 'answer_format'))}; "
        f"prompt {_show(_values(everything, 'config', 'prompt'))}",
        {"answer_format": _values(everything, "config", "answer_format"),
         "prompt": _values(everything, "config", "prompt")})
    package = {"stagereplay": _values(everything, "stagereplay"), "git_commit": _values(everything, "git_commit")}
    add("package", "package", f"stagereplay {_show(package['stagereplay'])}, commit {_show(package['git_commit'])}",
        package)
    software = {name: _values(everything, name) for name in ("torch", "transformers", "cache_fingerprint_scheme")}
    add("software", "software", "; ".join(f"{k} {_show(v)}" for k, v in software.items()), software)
    lines = ["## What produced this run", "",
             "From the provenance the results files record (their own and their parts'); several values are listed "
             "where the files differ.", "", "| | recorded |", "| --- | --- |"]
    lines += [f"| {label} | {text} |" for label, text in rows]
    return lines + [""], record
