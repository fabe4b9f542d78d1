# The settings of the run, the plan and checks before any job, and the helpers the rule files share
# (the Snakefile includes this first). What runs while this is parsed is eaglenest.workflow's.
import os
import shutil
import sys

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

sys.path.insert(0, workflow.basedir)  # the eaglenest package of this checkout; jobs get it by PYTHONPATH

from eaglenest.config import ConfigError
from eaglenest.data.prompts import QUESTIONS_FILE
from eaglenest.plan import RunSettings, stage_gpus
from eaglenest.serving.lifecycle import stop_server
from eaglenest.serving.settings import forget_run_key
from eaglenest.serving.slurm_cluster import gpu_partition
from eaglenest.settings import FetchSettings
from eaglenest.workflow import (cluster_executor, config_sources, convert_gguf_targets, job_environment, preflight,
                                profile_runtime_minutes, read_config)


def log(message):
    logger.info(f"eaglenest: {message}")


# --- the settings: the config validated once, a GGUF target pointed at its converted directory -----------------
job_environment(workflow.basedir)
CONFIG_SOURCES = config_sources(workflow.configfiles)
try:
    read_config(config, CONFIG_SOURCES, workflow.basedir, main=workflow.is_main_process, log=log)
except ConfigError as e:
    raise WorkflowError(str(e)) from None
GGUF_SOURCES = convert_gguf_targets(config)  # the GGUF file of each directory convert_target writes
if GGUF_SOURCES and workflow.is_main_process:
    log("; ".join(f"{src} is converted to {d} (rule convert_target)" for d, src in GGUF_SOURCES.items()))

# One settings object per stage (eaglenest.settings), built once from the validated config; each rule
# passes its stage's fingerprint() as its one settings param, so a change reruns exactly that stage.
RUN = RunSettings.from_config(config)
SERVER, SLURM, PROMPTS, QUESTIONS = RUN.server, RUN.slurm, RUN.prompts, RUN.questions
GENERATION, HIDDEN, DRAFT, TRAIN = RUN.generation, RUN.hidden, RUN.draft, RUN.train
VALIDATE, EXPORT = RUN.validate, RUN.export
FETCH = FetchSettings.from_config(config)
SHARDS = list(range(PROMPTS.shards))
HAS_GPU = bool(shutil.which("nvidia-smi"))

# --- preflight and plan: before any job (dry-runs too), what the run will cost and every check of the config ------
if workflow.is_main_process:
    try:
        preflight(config, GGUF_SOURCES, CONFIG_SOURCES, has_gpu=HAS_GPU, executor=cluster_executor(),
                  validate_minutes=profile_runtime_minutes(workflow, "validate_draft"), log=log)
    except ConfigError as e:
        raise WorkflowError(str(e)) from None

# --- where the servers keep their records, and the modes the rules follow -------------------------------------
SERVER_LOG_DIR = "logs/server"  # pidfile or SLURM job record, and the server's own log
# hidden.backend vllm: the extraction server (a second server, same lifecycle, own log dir and
# pidfile or job record) and the mode-0700 directory it writes per-request hidden-state files into.
VLLM_HIDDEN = HIDDEN.backend == "vllm"
HIDDEN_SERVER_LOG_DIR = "logs/hidden_server"
HIDDEN_STATES_DIR = HIDDEN.states_dir
# hidden.mode stream: no shards; train_draft reads the states from the running extraction server.
STREAM = HIDDEN.mode == "stream"


# --- input functions and the helpers the rule files share ----------------------------------------------------
def all_cores():
    """Every core given with --cores; 1 under an executor without --cores (the profile sizes the job)."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def gpus(section):
    """GPUs for the jobs of one config section (hidden, train, validate): eaglenest.plan.stage_gpus."""
    return stage_gpus(RUN, section, HAS_GPU)


def gpu_resources(section):
    """A GPU rule's resources: its GPUs and, for the SLURM profile, the GPU partition (server.slurm.partition,
    else $EAGLENEST_GPU_PARTITION), so GPU jobs never land in $SBATCH_PARTITION's CPU partition."""
    n, partition = gpus(section), gpu_partition(SLURM)
    return {"gpu": n, "slurm_partition": partition} if n and partition else {"gpu": n}


# The draft directory of each export format (export.format: vllm, speculators or both).
DRAFT_DIRS = {"vllm": "draft/checkpoint", "speculators": "draft/speculators"}


def draft_dirs():
    """``{format: directory}`` of the formats export.format asks for."""
    fmt = EXPORT.format
    return {f: d for f, d in DRAFT_DIRS.items() if fmt in (f, "both")}


def extra_draft_dirs():
    """The directories of validate.drafts, measured beside this run's draft: a change in one reruns validate_draft."""
    return [d["path"] for d in VALIDATE.other_drafts]


def snapshot_files():
    """The drafts train_draft keeps along training (train.snapshots), each measured by rule curve_point."""
    return expand("draft/curve/point_{i}.safetensors", i=range(1, TRAIN.snapshots + 1))


def curve_files():
    """The learning curve's points: vLLM's acceptance of each draft kept along training (rule curve_point)."""
    return expand("reports/curve/point_{i}.json", i=range(1, TRAIN.snapshots + 1))


def all_targets(wildcards):
    return [*draft_dirs().values(), "reports/validation.json", "reports/validation.html"]


def train_processes():
    """torchrun processes for training: train.nproc, else one per GPU the rule asks for."""
    return TRAIN.nproc or max(1, gpus("train"))


def hidden_output(path):
    """Hidden shards are hundreds of GB at real scale: hidden.temporary deletes them after training."""
    return temp(path) if HIDDEN.temporary else path


def dataset_files(wildcards):
    """A local dataset is an input, so editing it reruns prepare_prompts; a hub name is not a file. With
    dataset.generate, the questions the target writes (rule write_questions)."""
    path = PROMPTS.path
    return [path] if path == QUESTIONS_FILE or os.path.exists(path) else []


def target_files():
    """The converted target's directory (rule convert_target) where server.model or hidden.target is a GGUF
    file: an input of every rule that serves or reads the target."""
    return sorted(GGUF_SOURCES)


def evalset_files():
    """validate.datasets' local files are inputs of validate_draft, so editing one reruns it."""
    return [d["path"] for d in VALIDATE.datasets if os.path.exists(d["path"])]


def hidden_server_stopped():
    """GPU work after extraction waits until the extraction server has released the GPUs (in stream
    mode training needs the server: the work after training waits instead)."""
    return ["hidden_server.stopped"] if VLLM_HIDDEN and not STREAM else []


def train_inputs():
    """What train_draft reads besides the vocabulary and the head: the shards, or (stream) the traces
    and the running extraction server."""
    if STREAM:
        return {"traces": expand("traces/shard_{i}.jsonl", i=SHARDS), "ready": "hidden_server.ready"}
    return {"hidden": expand("hidden/shard_{i}.safetensors", i=SHARDS), "hidden_server_stopped": hidden_server_stopped()}


def after_training():
    """Stream mode: the work after training (export, then validation on the GPUs) waits until the
    extraction server training used has stopped."""
    return ["hidden_server.stopped"] if STREAM else []


def stop_server_on_exit(why):
    """The servers never outlive the workflow by accident (unless server.keep_server is set)."""
    for log_dir in (SERVER_LOG_DIR, HIDDEN_SERVER_LOG_DIR):
        stop_server(SERVER, log_dir, log=lambda m: logger.info(f"eaglenest: {m} ({why})"))
    if not SERVER.keep_server:
        forget_run_key()  # no server of this run is left: the next run makes a new key
