rule save_target_head:
    """What training needs of the target's head (embeddings, final norm, lm_head), saved once."""
    input:
        target_files(),
    output:
        "hidden/target_head.safetensors",
    params:
        settings=HIDDEN.head_fingerprint(),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/save_target_head.log",
    script:
        "../scripts/save_target_head.py"


if VLLM_HIDDEN:

    localrules:
        hidden_server_ready,
        stop_hidden_server,

    rule hidden_server_ready:
        """The extraction server: the trace server's model and settings in vLLM's extraction mode.
        It starts once the trace server has released the GPUs (server.stopped)."""
        input:
            server_stopped="server.stopped",
            head="hidden/target_head.safetensors",
        output:
            temp("hidden_server.ready"),
        params:
            # the extraction server: the generation server's settings and the extraction's (a change restarts it)
            settings={"server": SERVER.fingerprint(), "hidden": HIDDEN.server_fingerprint()},
            log_dir=HIDDEN_SERVER_LOG_DIR,
            states_dir=HIDDEN_STATES_DIR,
        conda:
            "../envs/eaglenest.yaml"
        log:
            "logs/hidden_server_ready.log",
        script:
            "../scripts/hidden_server_ready.py"

    rule extract_hidden_vllm:
        """One shard's hidden states from the extraction server (its client needs no GPU, hence its
        own rule name: the SLURM profile gives it no GPU partition)."""
        input:
            traces="traces/shard_{i}.jsonl",
            ready="hidden_server.ready",
            head="hidden/target_head.safetensors",
        output:
            hidden_output("hidden/shard_{i}.safetensors"),
        params:
            # what changes the states vLLM computes: a change re-extracts every shard
            settings=HIDDEN.fingerprint(),
        resources:
            # One shard at a time against the server, each with hidden.vllm.concurrency requests in flight.
            generation_slots=1,
        conda:
            "../envs/eaglenest.yaml"
        log:
            "logs/extract_hidden/shard_{i}.log",
        benchmark:
            "logs/benchmarks/extract_hidden/shard_{i}.tsv"
        script:
            "../scripts/extract_hidden_vllm.py"

    rule stop_hidden_server:
        """Stops the extraction server once the last shard is extracted (training waits on this edge),
        or in stream mode once training, which reads from it, is done (export waits on it)."""
        input:
            "draft/checkpoint.safetensors" if STREAM else expand("hidden/shard_{i}.safetensors", i=SHARDS),
        output:
            "hidden_server.stopped",
        params:
            settings=SERVER.fingerprint(),
            log_dir=HIDDEN_SERVER_LOG_DIR,
        conda:
            "../envs/eaglenest.yaml"
        log:
            "logs/stop_hidden_server.log",
        script:
            "../scripts/stop_server.py"

else:

    rule extract_hidden:
        input:
            traces="traces/shard_{i}.jsonl",
            # The generation server has released the GPUs before the target is loaded here.
            server_stopped="server.stopped",
            target=target_files(),
        output:
            hidden_output("hidden/shard_{i}.safetensors"),
        params:
            settings=HIDDEN.fingerprint(),
        resources:
            **gpu_resources("hidden"),
        conda:
            "../envs/eaglenest.yaml"
        log:
            "logs/extract_hidden/shard_{i}.log",
        benchmark:
            "logs/benchmarks/extract_hidden/shard_{i}.tsv"
        script:
            "../scripts/extract_hidden.py"
