rule prepare_prompts:
    input:
        dataset_files,
    output:
        shards=expand("data/prompts/shard_{i}.jsonl", i=SHARDS),
        heldout="data/prompts/heldout.jsonl",
        stats="data/prompts/stats.json",
    params:
        # cache_dir changes where datasets caches, not the prompts: it is no reason to rerun.
        dataset={k: v for k, v in config["dataset"].items() if k != "cache_dir"},
        shards=config["shards"],
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/prepare_prompts.log",
    script:
        "../scripts/prepare_prompts.py"
