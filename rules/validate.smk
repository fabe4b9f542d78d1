rule validate_draft:
    """The draft in real vLLM (target alone, EAGLE-3 in each exported format, n-gram, validate.drafts; one server
    at a time) vs the offline prediction; the acceptance figures go into the drafts' model cards."""
    input:
        **draft_dirs(),
        extra_drafts=extra_draft_dirs(),
        checkpoint="draft/checkpoint.safetensors",
        heldout="data/prompts/heldout.jsonl",
        evalsets=evalset_files(),
        fetched="data/fetched.json",  # hub evaluation sets and the target's tokenizer, in the caches (rule fetch_inputs)
        metrics="draft/train_metrics.csv",
        curve=curve_files(),
        target=target_files(),
    output:
        json=report("reports/validation.json", caption="../report/validation.rst", category="Validation"),
        csv="reports/validation.csv",
        html=report("reports/validation.html", caption="../report/validation.rst", category="Validation"),
    params:
        settings=VALIDATE.fingerprint(),
        drafts=VALIDATE.other_drafts,
        log_dir="logs/validate",
    threads: all_cores()
    resources:
        **gpu_resources("validate"),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/validate_draft.log",
    benchmark:
        "logs/benchmarks/validate_draft.tsv"
    script:
        "../scripts/validate_draft.py"


rule curve_point:
    """A draft kept along training (train.snapshots) in real vLLM: its acceptance on the held-out prompts at T=0,
    a point of the report's learning curve (one server start)."""
    input:
        checkpoint="draft/curve/point_{i}.safetensors",
        heldout="data/prompts/heldout.jsonl",
        target=target_files(),
        after_training=after_training(),
    output:
        "reports/curve/point_{i}.json",
    params:
        settings=VALIDATE.fingerprint(),
        log_dir="logs/validate",
    wildcard_constraints:
        i=r"\d+",
    threads: all_cores()  # one server at a time on a machine without GPUs: never beside validate_draft's
    resources:
        **gpu_resources("validate"),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/curve_point_{i}.log",
    script:
        "../scripts/curve_point.py"
