rule plot_figures:
    input:
        unpack(report_inputs),
    output:
        **{
            f"{name}_{fmt}": report(
                f"{RESULTS}/report/figures/{name}.{fmt}",
                caption=f"../report/{name}.rst",
                category="Figures",
                labels={"figure": figure_title(name), "format": fmt.upper()},
            )
            for name in FIGURE_NAMES
            for fmt in ("png", "pdf")
        },
    log:
        f"{LOGS}/plot_figures.log",
    benchmark:
        f"{BENCH}/plot_figures.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    params:
        seed=config["seed"],
        version=CODE_VERSION,
    script:
        "../scripts/plot_figures.py"


rule build_report:
    input:
        unpack(report_inputs),
        unpack(engine_report_inputs),
        # The report is gated by the audit: check_audit writes audit_check.json only when every ledger row reproduced.
        audit_check=expand(f"{RESULTS}/{{revision}}/audit_check.json", revision=report_revisions().get("audit", [])),
        figures=figure_files("png"),
        item_browser=f"{RESULTS}/report/items.html",
    output:
        report=f"{RESULTS}/report/report.md",
        report_html=report(
            f"{RESULTS}/report/report.html",
            caption="../report/report.rst",
            category="Report",
            labels={"page": "findings, claims and tables (report.md)"},
        ),
        stats=f"{RESULTS}/report/stats.json",
    log:
        f"{LOGS}/build_report.log",
    benchmark:
        f"{BENCH}/build_report.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    params:
        figure_names=FIGURE_NAMES,
        not_run=controls_not_run(),
        run=RUN,
        seed=config["seed"],
        equivalence_margin=config["accuracy_equivalence_margin"],
        version=CODE_VERSION,
    script:
        "../scripts/build_report.py"


# The item browser: one self-contained HTML page (data embedded as JSON) to look at each item's suffixes, margins
# and transplants; the ledger's token ids decoded with each revision's tokenizer, read from its prepared snapshot in
# the model store (no weights loaded, no GGUF metadata parsed).
rule build_item_browser:
    input:
        selection=f"{RESULTS}/selection/items.parquet",
        ledger=expand(f"{RESULTS}/{{revision}}/ledger.parquet", revision=REVISIONS),
        transplant=expand(f"{RESULTS}/{{revision}}/transplant.parquet", revision=TRANSPLANT_REVISIONS),
        models=[prepared_folder(slug) for slug in REVISIONS],
    output:
        html=report(
            f"{RESULTS}/report/items.html",
            caption="../report/items.rst",
            category="Items",
            labels={"page": "item browser"},
        ),
    log:
        f"{LOGS}/build_item_browser.log",
    benchmark:
        f"{BENCH}/build_item_browser.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    params:
        tokenizers={
            slug: dict(
                model=resolve_path(config["model"]),
                revision=name,
                trust_remote_code=config["trust_remote_code"],
                allow_pickle=config["allow_pickle"],
                offline=config["offline"],
                prepared_models=prepared_folder(slug),
            )
            for slug, name in REVISIONS.items()
        },
        run=RUN,
        version=CODE_VERSION,
    script:
        "../scripts/build_item_browser.py"
