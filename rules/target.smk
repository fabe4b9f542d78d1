# A target that arrives as a GGUF file (server.model or hidden.target: a path, or pkg:<module>/<file>) is
# converted once into the Hugging Face directory vLLM and transformers load (eaglenest.gguf).


rule convert_target:
    input:
        gguf=lambda wc: GGUF_SOURCES[f"models/{wc.name}"],
    output:
        directory("models/{name}"),
    params:
        dtype="bfloat16",  # the checkpoint's storage; server.dtype and hidden.dtype choose the compute dtype
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/convert_target/{name}.log",
    script:
        "../scripts/convert_target.py"
