rule plot_figures:
    input:
        unpack(report_inputs),
    output:
        **{
            f"{name}_{fmt}": report(
                f"{RESULTS}/report/figures/{name}.{fmt}",
                caption=f"../report/{name}.rst",
                category="Figures",
                subcategory=name.split("_", 1)[0],
                labels={"figure": name, "format": fmt.upper()},
            )
            for name in FIGURE_NAMES
            for fmt in ("pdf", "png")
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
        # The report is gated by the audit: check_audit writes audit_check.json only when every ledger row reproduced.
        audit_check=expand(f"{RESULTS}/{{revision}}/audit_check.json", revision=report_revisions().get("audit", [])),
        figures=figure_files("png"),
    output:
        report=f"{RESULTS}/report/report.md",
        stats=f"{RESULTS}/report/stats.json",
    log:
        f"{LOGS}/build_report.log",
    benchmark:
        f"{BENCH}/build_report.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    params:
        figure_names=FIGURE_NAMES,
        run=RUN,
        seed=config["seed"],
        version=CODE_VERSION,
    script:
        "../scripts/build_report.py"
