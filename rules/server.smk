# The generation server. server.ready is temp(): it is rebuilt (the server started or found again)
# whenever a consumer must run, and removed once the last consumer is done.


localrules:
    server_ready,
    stop_server,


rule server_ready:
    input:
        target_files(),
    output:
        temp("server.ready"),
    params:
        settings=SERVER.fingerprint(),
        log_dir=SERVER_LOG_DIR,
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/server_ready.log",
    script:
        "../scripts/server_ready.py"


rule stop_server:
    """Stops a local server once every trace shard is done: downstream GPU work waits on this edge."""
    input:
        expand("traces/shard_{i}.jsonl", i=SHARDS),
        stats=expand("traces/shard_{i}.stats.json", i=SHARDS),
    output:
        "server.stopped",
        # Every shard's statistics in one table; written here, the one rule that waits for all shards.
        table="traces/stats.csv",
    params:
        settings=SERVER.fingerprint(),
        log_dir=SERVER_LOG_DIR,
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/stop_server.log",
    script:
        "../scripts/stop_server.py"
