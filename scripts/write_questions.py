"""dataset.generate: the target writes its own training questions on the trace server (eaglenest.data.questions)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from transformers import AutoTokenizer

from eaglenest.data.questions import write_questions
from eaglenest.serving.client import RetryPolicy
from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.validation.evalsets import load_set, resolve_sets

config = snakemake.config
api_key = ServerConfig.from_dict(config["server"]).api_key()
ready = check_sentinel(snakemake.input.ready, api_key)
# The evaluation sets' questions are never training questions (the held-out split is made from these).
exclude = [m["content"] for s in resolve_sets(snakemake.params.evalsets, None)[1:]
           for row in load_set(s, cache_dir=config["dataset"]["cache_dir"]) for m in row["messages"] if m["role"] == "user"]
gen = config["generation"]
write_questions(snakemake.output[0], url=ready["urls"][0], model=ready["model"],
                tokenizer=AutoTokenizer.from_pretrained(config["server"]["model"]), exclude=exclude,
                concurrency=gen["concurrency"], request_timeout=gen["request_timeout"],
                retry=RetryPolicy.from_settings(gen), api_key=api_key, **snakemake.params.generate)
