rule prepare_prompts:
    input:
        dataset_files,
    output:
        shards=expand("data/prompts/shard_{i}.jsonl", i=SHARDS),
        heldout="data/prompts/heldout.jsonl",
        stats="data/prompts/stats.json",
    params:
        # dataset.generate makes data/questions.jsonl, this rule's input (write_questions below reruns on its changes).
        settings=PROMPTS.fingerprint(),
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/prepare_prompts.log",
    script:
        "../scripts/prepare_prompts.py"


rule write_questions:
    """dataset.generate: the target writes its own training questions (eaglenest.data.questions), on the trace
    server; none of them is a question of the evaluation sets."""
    input:
        ready="server.ready",
        evalsets=evalset_files(),
        fetched="data/fetched.json",
    output:
        QUESTIONS_FILE,
    params:
        # the served model, the sampling and the evaluation sets: a change writes the questions again
        settings=QUESTIONS.fingerprint(),
    resources:
        generation_slots=1,
    conda:
        "../envs/eaglenest.yaml"
    log:
        "logs/write_questions.log",
    script:
        "../scripts/write_questions.py"
