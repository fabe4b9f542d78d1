rule generate_traces:
    input:
        prompts="data/prompts/shard_{i}.jsonl",
        ready="server.ready",
    output:
        traces="traces/shard_{i}.jsonl",
        stats="traces/shard_{i}.stats.json",
    params:
        # Only what changes the answers: concurrency or timeouts do not make traces stale.
        settings=GENERATION.fingerprint(),
    resources:
        # Shards go one at a time, each with generation.concurrency requests in flight.
        generation_slots=1,
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/generate_traces/shard_{i}.log",
    benchmark:
        "logs/benchmarks/generate_traces/shard_{i}.tsv"
    script:
        "../scripts/generate_traces.py"
