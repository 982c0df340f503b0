rule build_report:
    input:
        ledgers=ledgers(),
        transplants=transplants(),
        bridges=expand(f"{RESULTS}/{{revision}}/bridge.parquet", revision=REVISIONS),
        audits=expand(f"{RESULTS}/{{revision}}/audit.parquet", revision=REVISIONS),
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
        revisions=list(REVISIONS),
        transplant_revisions=list(TRANSPLANT_REVISIONS),
        run=RUN,
        seed=config["seed"],
        reference_precision=config["reference_precision"],
        version=CODE_VERSION,
    script:
        "../scripts/build_report.py"
