rule select_items:
    input:
        preflight_in_dry_run,  # no file: runs the preflight in a dry run (workflow/rules/common/preflight.smk)
    output:
        selection=f"{RESULTS}/selection/items.parquet",
    log:
        f"{LOGS}/select_items.log",
    benchmark:
        f"{BENCH}/select_items.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    params:
        dataset=dataset_config(),
        dataset_file=dataset_file(),
        n_items=config["n_items"],
        seed=config["seed"],
        answer_format=config["answer_format"],
        offline=config["offline"],
        version=CODE_VERSION,
    script:
        "../scripts/select_items.py"
