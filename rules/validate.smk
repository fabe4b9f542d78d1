rule validate_draft:
    """The draft in real vLLM (target alone, EAGLE-3 in each exported format, n-gram; one server at a time) vs the
    offline prediction; the acceptance figures go into the drafts' model cards."""
    input:
        **draft_dirs(),
        checkpoint="draft/checkpoint.safetensors",
        heldout="data/prompts/heldout.jsonl",
        evalsets=evalset_files(),
        metrics="draft/train_metrics.csv",
        target=target_files(),
    output:
        json=report("reports/validation.json", caption="../report/validation.rst", category="Validation"),
        csv="reports/validation.csv",
        html=report("reports/validation.html", caption="../report/validation.rst", category="Validation"),
    params:
        server=config["server"],
        generation={k: config["generation"][k] for k in ("max_tokens", "temperature", "top_p", "chat_template_kwargs",
                                                         "extra_body", "request_timeout")},
        validate=config["validate"],
        target=target_model(),
        hidden_dtype=config["hidden"]["dtype"],
        log_dir="logs/validate",
        cache_dir=config["dataset"]["cache_dir"],
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
