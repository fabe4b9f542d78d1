rule generate_traces:
    input:
        prompts="data/prompts/shard_{i}.jsonl",
        ready="server.ready",
    output:
        traces="traces/shard_{i}.jsonl",
        stats="traces/shard_{i}.stats.json",
    params:
        generation=config["generation"],
        # The answers depend on the served model: a new model means new traces.
        model=SERVER.model_id,
        api_key_env=config["server"]["api_key_env"],
    resources:
        # Shards go one at a time, each with generation.concurrency requests in flight.
        generation_slots=1,
    log:
        "logs/generate_traces/shard_{i}.log",
    benchmark:
        "logs/benchmarks/generate_traces/shard_{i}.tsv"
    script:
        "../scripts/generate_traces.py"
