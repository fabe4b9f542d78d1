"""Extract one trace shard's hidden states through the extraction server (hidden.backend: vllm)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.states.extract import extract_hidden_vllm

h = snakemake.config["hidden"]
api_key = ServerConfig.from_dict(snakemake.config["server"]).api_key()
ready = check_sentinel(snakemake.input.ready, api_key)
extract_hidden_vllm([snakemake.input.traces], snakemake.output[0], url=ready["urls"], model=ready["model"],
                    head_path=snakemake.input.head, storage=ready["states_dir"], max_length=h["max_length"],
                    use_truncated=h["use_truncated"], concurrency=h["concurrency"],
                    request_timeout=h["request_timeout"], max_retries=h["max_retries"],
                    backoff_base=h["backoff_base"], backoff_max=h["backoff_max"], api_key=api_key)
