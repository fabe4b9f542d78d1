rule prepare_prompts:
    input:
        dataset_files,
    output:
        shards=expand("data/prompts/shard_{i}.jsonl", i=SHARDS),
        heldout="data/prompts/heldout.jsonl",
        stats="data/prompts/stats.json",
    params:
        dataset=config["dataset"],
        shards=config["shards"],
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/prepare_prompts.log",
    script:
        "../scripts/prepare_prompts.py"
