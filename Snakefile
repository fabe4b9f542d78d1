# eaglenest: a served target LLM -> an EAGLE-3 draft that vLLM loads. See README.md and docs/dag.md.
import os

from snakemake.utils import min_version

min_version("9.0")

# The embedded default (config.yaml) is the config of a plain run: the working directory's config.yaml, else
# this workflow's own (a run in another directory, --directory). A run given --configfile uses those files
# alone (plus --config and the schema's defaults): a preset is what it says, never the toy's values
# underneath. Jobs Snakemake re-runs this file for get the same --configfile, so they resolve alike.
if not workflow.overwrite_configfiles:

    configfile: "config.yaml" if os.path.exists("config.yaml") else os.path.join(workflow.basedir, "config.yaml")


include: "rules/common.smk"
include: "rules/fetch.smk"
include: "rules/target.smk"
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
