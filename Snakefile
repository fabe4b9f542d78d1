# eaglenest: a served target LLM -> an EAGLE-3 draft that vLLM loads. See README.md and docs/dag.md.
import os

from snakemake.utils import min_version

min_version("9.0")

configfile: "config.yaml"

include: "rules/common.smk"
include: "rules/prompts.smk"
include: "rules/server.smk"
include: "rules/traces.smk"
include: "rules/hidden.smk"
include: "rules/draft.smk"
include: "rules/validate.smk"


rule all:
    input:
        all_targets,
    default_target: True


onsuccess:
    stop_server_on_exit("the workflow finished")


onerror:
    stop_server_on_exit("the workflow failed or was interrupted")
