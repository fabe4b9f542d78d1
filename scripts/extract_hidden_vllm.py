"""Extract one trace shard's hidden states through the extraction server (hidden.backend: vllm)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import HiddenSettings
from eaglenest.states.extract import extract_hidden_vllm

api_key = ServerConfig.from_config(snakemake.config).api_key()
ready = check_sentinel(snakemake.input.ready, api_key)
extract_hidden_vllm([snakemake.input.traces], snakemake.output[0], HiddenSettings.from_config(snakemake.config),
                    url=ready["urls"], model=ready["model"], head_path=snakemake.input.head,
                    storage=ready["states_dir"], api_key=api_key)
