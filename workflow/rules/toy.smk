# Not part of the default target: retrains the embedded toy revisions from their seeds and checks the weights'
# fingerprints against the shipped ones; the job fails when they differ (they are bit-identical only for the same
# torch build, CPU kernel set and thread count).
rule train_toy_model:
    output:
        weights="results/toy_training/{toy_revision}/model.safetensors",
        check="results/toy_training/{toy_revision}/fingerprint_check.json",
    log:
        "logs/toy_training/{toy_revision}.log",
    benchmark:
        "benchmarks/toy_training/{toy_revision}.tsv"
    wildcard_constraints:
        toy_revision="primary|later",
    conda:
        "../../envs/stagereplay.yaml"
    threads: 2
    params:
        shipped=str(REPO / "data/toy"),
        version=CODE_VERSION,
    script:
        "../scripts/train_toy_model.py"
