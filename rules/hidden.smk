rule save_target_head:
    """What training needs of the target's head (embeddings, final norm, lm_head), saved once."""
    output:
        "hidden/target_head.safetensors",
    params:
        target=target_model(),
        aux_layers=config["draft"]["aux_layers"],
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/save_target_head.log",
    script:
        "../scripts/save_target_head.py"


rule extract_hidden:
    input:
        traces="traces/shard_{i}.jsonl",
        # The generation server has released the GPUs before the target is loaded here.
        server_stopped="server.stopped",
    output:
        hidden_output("hidden/shard_{i}.safetensors"),
    params:
        target=target_model(),
        aux_layers=config["draft"]["aux_layers"],
        hidden={k: v for k, v in config["hidden"].items() if k not in ("temporary", "device", "batch_tokens", "gpus")},
    resources:
        gpu=gpus("hidden"),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/extract_hidden/shard_{i}.log",
    benchmark:
        "logs/benchmarks/extract_hidden/shard_{i}.tsv"
    script:
        "../scripts/extract_hidden.py"
