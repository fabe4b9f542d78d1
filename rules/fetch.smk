# What the jobs read from the Hugging Face hub, fetched where Snakemake runs (a login node under the SLURM
# profile) before them, so compute nodes without internet read it from the caches (eaglenest.fetch).


localrules:
    fetch_inputs,


rule fetch_inputs:
    """The hub evaluation sets (into dataset.cache_dir) and the target's config and tokenizer (into $HF_HOME);
    offline, each checked in its cache, and what is missing named with the command that fetches it."""
    output:
        "data/fetched.json",
    params:
        settings=FETCH.fingerprint(),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/fetch_inputs.log",
    script:
        "../scripts/fetch_inputs.py"
