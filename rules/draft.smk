rule build_vocab:
    input:
        traces=expand("traces/shard_{i}.jsonl", i=SHARDS),
        head="hidden/target_head.safetensors",
    output:
        "draft/vocab.safetensors",
    params:
        settings=DRAFT.vocab_fingerprint(),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/build_vocab.log",
    script:
        "../scripts/build_vocab.py"


rule train_draft:
    input:
        **train_inputs(),
        vocab="draft/vocab.safetensors",
        head="hidden/target_head.safetensors",
    output:
        checkpoint="draft/checkpoint.safetensors",
        metrics="draft/train_metrics.csv",
        snapshots=snapshot_files(),
    params:
        settings=TRAIN.fingerprint(),
        nproc=train_processes(),
        state_dir="draft/.train_state",
    threads: all_cores()
    resources:
        **gpu_resources("train"),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/train_draft.log",
    benchmark:
        "logs/benchmarks/train_draft.tsv"
    script:
        "../scripts/train_draft.py"


rule export_draft:
    """The trained draft in each format export.format asks for, from the same weights."""
    input:
        "draft/checkpoint.safetensors",
        after_training(),
    output:
        **{f: directory(d) for f, d in draft_dirs().items()},
    params:
        settings=EXPORT.fingerprint(),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/export_draft.log",
    script:
        "../scripts/export_draft.py"
