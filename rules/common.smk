# Config validation, paths and helpers shared by the rule files (the Snakefile includes this first).
import os
import shutil
import sys

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

# Rule scripts (and the processes they start: watchdogs, torchrun) import the eaglenest package from
# this checkout, also inside conda environments. This sets PYTHONPATH for them; it requires nothing of
# the caller's environment, so there is no `envvars:` to declare.
sys.path.insert(0, workflow.basedir)
os.environ.update(PYTHONPATH=os.pathsep.join(p for p in (workflow.basedir, os.environ.get("PYTHONPATH")) if p))
# The process that owns the local server: its watchdog stops the server when this process dies.
# setdefault keeps the main process's pid when a job re-reads the Snakefile in a subprocess.
os.environ.setdefault("EAGLENEST_WORKFLOW_PID", str(os.getpid()))

from eaglenest.config import ConfigError, resolve_shipped_paths, validate_config, write_resolved_config
from eaglenest.serving.settings import ServerConfig, forget_run_key
from eaglenest.serving.lifecycle import stop_server
from eaglenest.serving.slurm import SlurmSettings, gpu_partition
from eaglenest.plan import format_plan, make_plan, stage_gpus
from eaglenest.checks import review_config
from eaglenest.gguf import converted_dir, is_gguf
from eaglenest.data.prompts import QUESTIONS_FILE
from eaglenest.settings import (DraftSettings, ExportSettings, FetchSettings, GenerationSettings, HiddenSettings,
                                PromptSettings, QuestionSettings, TrainSettings, ValidateSettings)

# What the config was read from: the --configfile files, else the embedded default (see the Snakefile).
CONFIG_SOURCES = [str(f) for f in workflow.configfiles] or ["config.yaml"]
try:
    config.update(validate_config(config, source=f"the workflow config ({', '.join(CONFIG_SOURCES)}, --config)"))
except ConfigError as e:
    raise WorkflowError(str(e)) from None
# A relative path is the working directory's; one found only in the workflow's own directory (toy/..., the
# files the embedded default names) is that file, so a run in another directory (--directory) finds them.
SHIPPED_PATHS = resolve_shipped_paths(config, ".", workflow.basedir)
RESOLVED_CONFIG = "logs/config.resolved.yaml"
if workflow.is_main_process:  # not in the jobs Snakemake re-runs this file for (SLURM, --sdm conda)
    # Written on every run, dry-runs included: what the run uses, schema defaults filled in.
    write_resolved_config(config, RESOLVED_CONFIG, CONFIG_SOURCES, notes=SHIPPED_PATHS)
    logger.info(f"eaglenest: config from {' + '.join(CONFIG_SOURCES)} + schema defaults; resolved in {RESOLVED_CONFIG}")
    for note in SHIPPED_PATHS:
        logger.info(f"eaglenest: {note}")

# server.model (or hidden.target) a GGUF file: rule convert_target writes its Hugging Face directory under
# models/, and everything that serves or reads the target uses that directory from here on.
GGUF_SOURCES = {}
for _section, _key in (("server", "model"), ("hidden", "target")):
    if is_gguf(config[_section][_key]):
        GGUF_SOURCES[converted_dir(config[_section][_key])] = config[_section][_key]
        config[_section][_key] = converted_dir(config[_section][_key])
if GGUF_SOURCES and workflow.is_main_process:
    logger.info("eaglenest: " + "; ".join(f"{src} is converted to {d} (rule convert_target)" for d, src in GGUF_SOURCES.items()))


def facts_config():
    """The config the checks and the plan read the target's facts through: a GGUF target's file (its
    metadata) until rule convert_target has written the directory's config.json."""
    view = {**config, "server": dict(config["server"]), "hidden": dict(config["hidden"])}
    for section, key in (("server", "model"), ("hidden", "target")):
        d = view[section][key]
        if d in GGUF_SOURCES and not os.path.isfile(os.path.join(d, "config.json")):
            view[section][key] = GGUF_SOURCES[d]
    return view


SHARDS = list(range(config["shards"]))
# One settings object per stage (eaglenest.settings), built once from the validated config; each rule
# passes its stage's fingerprint() as its one settings param, so a change reruns exactly that stage.
SERVER = ServerConfig.from_config(config)
PROMPTS = PromptSettings.from_config(config)
QUESTIONS = QuestionSettings.from_config(config)
GENERATION = GenerationSettings.from_config(config)
HIDDEN = HiddenSettings.from_config(config)
DRAFT = DraftSettings.from_config(config)
TRAIN = TrainSettings.from_config(config)
VALIDATE = ValidateSettings.from_config(config)
EXPORT = ExportSettings.from_config(config)
FETCH = FetchSettings.from_config(config)
SLURM = SlurmSettings.from_dict(config["server"]["slurm"])
SERVER_LOG_DIR = "logs/server"  # pidfile or SLURM job record, and the server's own log
# hidden.backend vllm: the extraction server (a second server, same lifecycle, own log dir and
# pidfile or job record) and the mode-0700 directory it writes per-request hidden-state files into.
VLLM_HIDDEN = HIDDEN.backend == "vllm"
HIDDEN_SERVER_LOG_DIR = "logs/hidden_server"
HIDDEN_STATES_DIR = HIDDEN.states_dir
# hidden.mode stream: no shards; train_draft reads the states from the running extraction server.
STREAM = HIDDEN.mode == "stream"


HAS_GPU = bool(shutil.which("nvidia-smi"))


def all_cores():
    """Every core given with --cores; 1 under an executor without --cores (the profile sizes the job)."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def gpus(section):
    """GPUs for the jobs of one config section (hidden, train, validate): eaglenest.plan.stage_gpus."""
    return stage_gpus(config, section, HAS_GPU)


def gpu_resources(section):
    """A GPU rule's resources: its GPUs and, for the SLURM profile, the GPU partition (server.slurm.partition,
    else $EAGLENEST_GPU_PARTITION), so GPU jobs never land in $SBATCH_PARTITION's CPU partition."""
    n, partition = gpus(section), gpu_partition(SLURM)
    return {"gpu": n, "slurm_partition": partition} if n and partition else {"gpu": n}


def profile_runtime_minutes(rule):
    """The runtime (minutes) the profile's set-resources gives ``rule`` (e.g. profiles/slurm: validate_draft
    8h), else None: what a SLURM job of that rule may take."""
    from snakemake.resources import Resource

    value = (workflow.resource_settings.overwrite_resources.get(rule) or {}).get("runtime")
    value = getattr(value, "value", value)
    try:
        return int(Resource.parse_human_friendly("runtime", value)) if value is not None else None
    except (WorkflowError, TypeError, ValueError):
        return None


def cluster_executor():
    """The executor the jobs go to where it is not this machine (the SLURM profile's slurm), else None; dry-runs
    included. Snakemake parses this file before it hands the run its executor, and -n swaps in a dryrun one: the
    executor the command line and its profiles name is the args of snakemake's CLI (cli.args_to_api). Called
    through Snakemake's Python API instead, nothing names it here: None."""
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

    frame = sys._getframe()
    while frame and not (frame.f_code.co_name == "args_to_api" and hasattr(frame.f_locals.get("args"), "executor")):
        frame = frame.f_back
    name = frame.f_locals["args"].executor if frame else None
    if not isinstance(name, str) or name in ("local", "dryrun", "touch"):
        return None
    return None if ExecutorPluginRegistry().get_plugin(name).common_settings.local_exec else name


if workflow.is_main_process:
    # Before any job (dry-runs too): what the run will cost, from the config and the dataset's size, and every
    # check of the config against the target's config.json, the disk, the GPUs, the cluster and the profile
    # (eaglenest.checks), all of them: every failure is reported at once.
    PLAN = make_plan(facts_config(), has_gpu=HAS_GPU)
    REVIEW = review_config(facts_config(), PLAN, has_gpu=HAS_GPU, executor=cluster_executor(),
                           validate_minutes=profile_runtime_minutes("validate_draft"), sources=CONFIG_SOURCES)
    PLAN.skipped = REVIEW.skipped
    logger.info(f"eaglenest: {format_plan(PLAN)}")
    for note in REVIEW.notes:
        logger.info(f"eaglenest: {note}")
    if REVIEW.errors:
        where = f"the workflow config ({', '.join(CONFIG_SOURCES)}, --config)"
        raise WorkflowError(f"{where}: {REVIEW.errors[0]}" if len(REVIEW.errors) == 1 else
                            f"{where}: {len(REVIEW.errors)} settings to fix before any job:\n" +
                            "\n".join(f"  - {e}" for e in REVIEW.errors))


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
