"""One frozen settings object per stage, built once from the validated config (config.validate_config).

Each class holds what one stage reads of the config: its own section, and the few keys of other
sections it depends on, each field declared once with the config key it comes from (``setting``).
A field's default is the schema's, so library code called without Snakemake takes ``Stage.defaults()``
(or ``Stage.defaults().replace(...)``), never a default of its own.

``fingerprint()`` is the part of a stage's settings that changes its outputs: its rule passes that plain
dict as its one settings param, so a change reruns exactly that stage (and, through the files it
rewrites, what follows). A field declared ``reruns=False`` (where a job runs, timeouts, concurrency)
is read by the stage but never reruns it.

Adding a setting takes two places: the schema (type, default, description) and one field here.
The generation server's settings are ``serving.settings.ServerConfig`` and ``SlurmSettings`` (Stages too); this
module sits on the ground of the import graph and imports no stage package.
docs/settings.md says which stage reads which section."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .config import defaults as config_defaults

# dataset.generate writes the target's own questions here; prepare_prompts then reads them
# (eaglenest.data.prompts re-exports it for the rules and the plan).
QUESTIONS_FILE = "data/questions.jsonl"


def lookup(config: dict, key: str):
    """``config``'s value at a dotted key, e.g. ``lookup(config, "server.model")``."""
    value = config
    for part in key.split("."):
        value = value[part]
    return value


def setting(key: str | Callable[[dict], Any], *, reruns: bool = True, reads: tuple[str, ...] = ()):
    """A stage field read from the config at ``key`` ("section.key"; or a function of the whole config for
    a value made of several keys, ``reads`` naming them), its default the schema's; ``reruns``: whether it
    is in the stage's fingerprint."""
    read = key if callable(key) else (lambda config: lookup(config, key))
    default = read(config_defaults())
    return field(default_factory=lambda: copy.deepcopy(default),
                 metadata={"read": read, "keys": (key,) if isinstance(key, str) else reads, "reruns": reruns})


class Stage:
    """What every stage's settings share: built from a config, the schema's defaults, a fingerprint."""

    @classmethod
    def from_config(cls, config: dict):
        """The stage's settings from a validated config (every key present: defaults filled in); a copy, so
        a later change to ``config`` does not reach them."""
        return cls(**{f.name: copy.deepcopy(f.metadata["read"](config)) for f in fields(cls)})

    @classmethod
    def defaults(cls):
        """The stage's settings from the schema's defaults alone."""
        return cls.from_config(config_defaults())

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> dict:
        """The settings that change this stage's outputs (a plain dict: its rule's settings param)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.metadata.get("reruns", True)}


def _plain(value):
    return value.fingerprint() if isinstance(value, Stage) else copy.deepcopy(value)


def served_model_id(config: dict) -> str:
    """The model name requests to the generation server carry (server.served_model_name, else server.model)."""
    return config["server"]["served_model_name"] or config["server"]["model"]


def target_model(config: dict) -> str:
    """The target as transformers loads it: hidden.target, else the served model."""
    return config["hidden"]["target"] or config["server"]["model"]


def dataset_path(config: dict) -> str:
    """The dataset prepare_prompts reads: the target's own questions when dataset.generate asks for them."""
    return QUESTIONS_FILE if config["dataset"]["generate"]["questions"] else config["dataset"]["path"]


@dataclass(frozen=True)
class PromptSettings(Stage):
    """prepare_prompts: the dataset, its shuffle and split into training shards and the held-out set."""

    # the dataset read: data/questions.jsonl where dataset.generate writes the questions
    path: str = setting(dataset_path, reads=("dataset.path", "dataset.generate.questions"))
    split: str = setting("dataset.split")
    limit: int | None = setting("dataset.limit")
    heldout: int = setting("dataset.heldout")
    seed: int = setting("dataset.seed")
    keep_system: bool = setting("dataset.keep_system")
    max_prompt_chars: int = setting("dataset.max_prompt_chars")
    max_turns: int = setting("dataset.max_turns")  # assistant turns of a conversation kept; the user turns past them dropped
    columns: dict = setting("dataset.columns")  # the columns of the question and the id (None each: guessed)
    shards: int = setting("shards")
    cache_dir: str | None = setting("dataset.cache_dir", reruns=False)  # where datasets caches, not what it reads


@dataclass(frozen=True)
class QuestionSettings(Stage):
    """write_questions (dataset.generate): the target writes its own training questions on the trace server."""

    served_model: str = setting(served_model_id, reads=("server.served_model_name", "server.model"))  # who writes
    questions: int = setting("dataset.generate.questions")
    max_tokens: int = setting("dataset.generate.max_tokens")
    temperature: float = setting("dataset.generate.temperature")
    top_p: float = setting("dataset.generate.top_p")
    min_chars: int = setting("dataset.generate.min_chars")
    seed: int = setting("dataset.generate.seed")
    turns: int = setting("dataset.generate.turns")  # user turns per conversation (1: first questions alone)
    # the target's answers between the user turns: as the traces stage answers (generation's sampling)
    answer_max_tokens: int = setting("generation.max_tokens")
    answer_temperature: float = setting("generation.temperature")
    answer_top_p: float = setting("generation.top_p")
    evalsets: list[dict] = setting("validate.datasets")  # their questions never become training questions
    concurrency: int = setting("generation.concurrency", reruns=False)
    request_timeout: float = setting("generation.request_timeout", reruns=False)
    max_retries: int = setting("generation.max_retries", reruns=False)
    backoff_base: float = setting("generation.backoff_base", reruns=False)
    backoff_max: float = setting("generation.backoff_max", reruns=False)
    cache_dir: str | None = setting("dataset.cache_dir", reruns=False)

    def fingerprint(self) -> dict:
        """First questions alone (turns 1) are written without answers: neither the turns nor the answers'
        sampling is in their fingerprint, so the questions of a run from before conversations stay."""
        out = super().fingerprint()
        if self.turns == 1:
            for name in ("turns", "answer_max_tokens", "answer_temperature", "answer_top_p"):
                del out[name]
        return out


@dataclass(frozen=True)
class GenerationSettings(Stage):
    """generate_traces: what makes the answers (the served model and the sampling), and how the client sends."""

    model: str = setting(served_model_id, reads=("server.served_model_name", "server.model"))
    max_tokens: int = setting("generation.max_tokens")
    temperature: float = setting("generation.temperature")
    top_p: float = setting("generation.top_p")
    seed: int | None = setting("generation.seed")
    chat_template_kwargs: dict | None = setting("generation.chat_template_kwargs")
    extra_body: dict | None = setting("generation.extra_body")
    # where a conversation's regeneration ends (eaglenest.data.conversations)
    max_turns: int = setting("dataset.max_turns")
    max_context_tokens: int | None = setting("dataset.max_context_tokens")
    concurrency: int = setting("generation.concurrency", reruns=False)
    request_timeout: float = setting("generation.request_timeout", reruns=False)
    max_retries: int = setting("generation.max_retries", reruns=False)
    backoff_base: float = setting("generation.backoff_base", reruns=False)
    backoff_max: float = setting("generation.backoff_max", reruns=False)
    max_error_fraction: float = setting("generation.max_error_fraction", reruns=False)


# GenerationSettings' fields from dataset: that end a conversation's regeneration.
CONVERSATION_KEYS = ("max_turns", "max_context_tokens")


# The generation server's keys that change the states the vLLM extraction server computes.
SERVED_KEYS = ("model", "dtype", "tensor_parallel_size", "extra_args")


@dataclass(frozen=True)
class HiddenSettings(Stage):
    """save_target_head and the extraction of the hidden states (either backend, shards or stream)."""

    backend: str = setting("hidden.backend", reruns=False)
    mode: str = setting("hidden.mode", reruns=False)
    target: str = setting(target_model, reads=("hidden.target", "server.model"))  # as transformers loads it
    aux_layers: list[int] | None = setting("draft.aux_layers")  # None: the default ids (states.target)
    max_length: int = setting("hidden.max_length")
    use_truncated: bool = setting("hidden.use_truncated")
    dtype: str = setting("hidden.dtype")
    # backend vllm: the generation server's settings the extraction server shares
    served: dict = setting(lambda c: {k: c["server"][k] for k in SERVED_KEYS}, reads=tuple(f"server.{k}" for k in SERVED_KEYS))
    device: str = setting("hidden.transformers.device", reruns=False)
    batch_tokens: int = setting("hidden.transformers.batch_tokens", reruns=False)
    temporary: bool = setting("hidden.temporary", reruns=False)
    gpus: int | None = setting("hidden.gpus", reruns=False)
    concurrency: int = setting("hidden.vllm.concurrency", reruns=False)
    port: int | None = setting("hidden.vllm.port", reruns=False)
    request_timeout: float = setting("hidden.vllm.request_timeout", reruns=False)
    max_retries: int = setting("hidden.vllm.max_retries", reruns=False)
    backoff_base: float = setting("hidden.vllm.backoff_base", reruns=False)
    backoff_max: float = setting("hidden.vllm.backoff_max", reruns=False)
    max_disk_gb: float = setting("hidden.stream.max_disk_gb", reruns=False)
    cache: bool = setting("hidden.stream.cache", reruns=False)
    stream_ahead: int = setting("hidden.stream.stream_ahead", reruns=False)
    placement: str = setting("hidden.stream.placement", reruns=False)
    states_dir: str = setting("hidden.vllm.states_dir", reruns=False)
    server_env: dict = setting("hidden.vllm.server_env", reruns=False)
    gpu_memory_utilization: float | None = setting("hidden.vllm.gpu_memory_utilization", reruns=False)
    gpu_memory_gib: float | None = setting("hidden.vllm.gpu_memory_gib", reruns=False)

    def fingerprint(self) -> dict:
        """What changes the states: the sequences, and the target that computes them (transformers:
        hidden.target, its dtype and the aux layers; vllm: the served model's settings; its aux layers
        reach it through target_head.json, an input)."""
        states = {"max_length": self.max_length, "use_truncated": self.use_truncated}
        if self.backend == "vllm":
            return {**states, "served": copy.deepcopy(self.served)}
        return {"target": self.target, "aux_layers": copy.deepcopy(self.aux_layers), "dtype": self.dtype, **states}

    def server_fingerprint(self) -> dict:
        """Every hidden key (the extraction server's port, environment, memory share ...): a change starts
        the extraction server again."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    def head_fingerprint(self) -> dict:
        """What changes target_head.safetensors and its facts: the target and the aux layers."""
        return {"target": self.target, "aux_layers": copy.deepcopy(self.aux_layers)}


@dataclass(frozen=True)
class DFlashSettings(Stage):
    """draft.kind dflash: the block the draft fills in one forward and its depth (eaglenest.draft.dflash); its mask
    token is DraftSettings.mask_token_id, as a P-EAGLE draft's."""

    block_size: int = setting("draft.dflash.block_size")
    num_layers: int = setting("draft.dflash.num_layers")


DFLASH_TRAIN_KEYS = ("dflash_anchors", "dflash_gamma")  # train.* keys only a DFlash draft reads


@dataclass(frozen=True)
class DraftSettings(Stage):
    """The draft's shape (build_vocab, train_draft, export): its vocabulary, its sizes (None: the target's)
    and the aux layers it reads."""

    aux_layers: list[int] | None = setting("draft.aux_layers")
    vocab_size: int = setting("draft.vocab_size")
    kind: str = setting("draft.kind")  # eagle3, eagle3.1, peagle (their vLLM switches: draft.config.KINDS) or dflash
    mask_token_id: int | None = setting("draft.mask_token_id")  # peagle's and dflash's mask token (None: peagle's default)
    norm_before_residual: bool = setting("draft.norm_before_residual")
    intermediate_size: int | None = setting("draft.intermediate_size")
    num_attention_heads: int | None = setting("draft.num_attention_heads")
    num_key_value_heads: int | None = setting("draft.num_key_value_heads")
    head_dim: int | None = setting("draft.head_dim")
    dflash: DFlashSettings = setting(DFlashSettings.from_config)  # read only where kind is dflash
    use_truncated: bool = setting("hidden.use_truncated", reruns=False)  # the vocabulary counts the traces trained on

    def fingerprint(self) -> dict:
        out = super().fingerprint()
        if self.kind != "dflash":  # an EAGLE draft does not read them: changing them reruns nothing
            del out["dflash"]
        return out

    def vocab_fingerprint(self) -> dict:
        """What changes the draft vocabulary (build_vocab)."""
        return {"vocab_size": self.vocab_size, "use_truncated": self.use_truncated}

    def shape(self) -> dict:
        """The keys DraftConfig.from_target takes: the kind, and the sizes it overrides the target's with
        (None: the target's)."""
        return {k: getattr(self, k) for k in ("kind", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                              "head_dim", "norm_before_residual", "mask_token_id")}


@dataclass(frozen=True)
class TrainSettings(Stage):
    """train_draft: the schedule, the batches and the GPU code paths; the draft's shape; in hidden.mode
    stream, the states it asks the extraction server for."""

    device: str = setting("train.device", reruns=False)
    gpus: int | None = setting("train.gpus", reruns=False)
    nproc: int | None = setting("train.nproc", reruns=False)
    ttt_length: int = setting("train.ttt_length")
    ttt_decay: float = setting("train.ttt_decay")
    lr: float = setting("train.lr")
    min_lr_ratio: float = setting("train.min_lr_ratio")
    warmup_steps: int | None = setting("train.warmup_steps")
    epochs: float = setting("train.epochs")
    max_steps: int | None = setting("train.max_steps")
    batch_tokens: int = setting("train.batch_tokens")
    batch_size: int | None = setting("train.batch_size")
    grad_accum: int = setting("train.grad_accum")
    clip: float = setting("train.clip")
    weight_decay: float = setting("train.weight_decay")
    seed: int = setting("train.seed")
    init_from_target: bool = setting("train.init_from_target")
    save_every: int = setting("train.save_every")
    keep_states: int = setting("train.keep_states")
    snapshots: int = setting("train.snapshots")
    loss_chunk: int = setting("train.loss_chunk")
    attention: str = setting("train.attention")
    compile: str | bool = setting("train.compile")
    recompute: str | bool = setting("train.recompute")
    bf16_weights: str | bool = setting("train.bf16_weights")
    split_step_grads: str | bool = setting("train.split_step_grads")
    diag_split: str | bool = setting("train.diag_split")
    skip_unscored: str | bool = setting("train.skip_unscored")
    fp8: str | bool = setting("train.fp8")
    fused_loss: str | bool = setting("train.fused_loss")
    freeze_lm_head: bool = setting("train.freeze_lm_head")
    dflash_anchors: int = setting("train.dflash_anchors")
    dflash_gamma: float = setting("train.dflash_gamma")
    log_every: int = setting("train.log_every")
    prefetch: int = setting("train.prefetch")
    draft: DraftSettings = setting(DraftSettings.from_config)
    hidden: HiddenSettings = setting(HiddenSettings.from_config, reruns=False)  # stream mode: in the fingerprint

    def fingerprint(self) -> dict:
        out = super().fingerprint()
        if self.draft.kind != "dflash":
            for key in DFLASH_TRAIN_KEYS:
                del out[key]
        if self.hidden.mode == "stream":  # the states come from the extraction server: what makes them retrains
            out["stream"] = self.hidden.fingerprint()
        return out


# The generation keys in validation's fingerprint: what its requests take from generation that decides their
# tokens or their wait (validation.requests.request_settings: validate.max_tokens, top_p and seed win).
VALIDATION_GENERATION_KEYS = ("max_tokens", "temperature", "top_p", "chat_template_kwargs", "extra_body",
                              "request_timeout")


@dataclass(frozen=True)
class ValidateSettings(Stage):
    """validate_draft and curve_point: the runs, the requests, the matrix, the offline prediction; the servers
    and the target. Each ``validate:`` key is a field of its own name (docs/settings.md says what it does)."""

    num_speculative_tokens: int = setting("validate.num_speculative_tokens")
    max_tokens: int | None = setting("validate.max_tokens")  # None: generation.max_tokens (request_max_tokens)
    concurrency: int = setting("validate.concurrency")
    warmup_requests: int = setting("validate.warmup_requests")
    min_seconds: float = setting("validate.min_seconds")
    port: int | None = setting("validate.port")  # None: server.port
    gpus: int | None = setting("validate.gpus")  # the job's GPUs (the workflow reads them; they rerun it as before)
    ngram: dict = setting("validate.ngram")  # vLLM's n-gram speculative config keys, sent as they are
    offline: dict = setting("validate.offline")  # tokens, dtype, device, engine of the offline prediction
    warn_below: float = setting("validate.warn_below")
    temperatures: list[float] | None = setting("validate.temperatures")  # None: 0 and generation.temperature
    top_p: float | None = setting("validate.top_p")  # None: generation.top_p (request_top_p)
    seed: int | None = setting("validate.seed")
    datasets: list[dict] = setting("validate.datasets")
    second_turns: bool = setting("validate.second_turns")
    matrix_prompts: int | None = setting("validate.matrix_prompts")
    lossless_alpha: float = setting("validate.lossless_alpha")
    lossless_tolerance: float = setting("validate.lossless_tolerance")
    # The generation server's settings, which the validation servers start from: the fingerprint's "server" (the
    # servers themselves start from the ServerConfig validate_draft and measure_point take).
    served: dict = setting("server")
    generation: GenerationSettings = setting(GenerationSettings.from_config)  # the requests' (request_settings)
    target: str = setting(target_model, reads=("hidden.target", "server.model"))
    hidden_dtype: str = setting("hidden.dtype")
    hidden_backend: str = setting("hidden.backend")
    cache_dir: str | None = setting("dataset.cache_dir", reruns=False)
    # Other exported drafts measured beside this run's: [{name, path}]. Not in the fingerprint (curve_point
    # shares it): validate_draft takes their directories as inputs and the list as a param of its own.
    other_drafts: list[dict] = setting("validate.drafts", reruns=False)
    # The order the config wrote the validate: keys in: the fingerprint keeps it, as Snakemake compares the
    # params' repr (a reordered section would rerun every validation).
    key_order: tuple[str, ...] = setting(lambda c: tuple(c["validate"]), reads=("validate",), reruns=False)

    @property
    def request_max_tokens(self) -> int:
        """The longest answer validation asks for: validate.max_tokens, else generation.max_tokens."""
        return self.generation.max_tokens if self.max_tokens is None else self.max_tokens

    @property
    def request_top_p(self) -> float:
        """The top_p of validation's sampled cells: validate.top_p, else generation.top_p."""
        return self.generation.top_p if self.top_p is None else self.top_p

    def fingerprint(self) -> dict:
        """The ``validate:`` section as the config wrote it (validate.drafts, ``other_drafts``, is not in it), less
        validate.second_turns where on (the default), so that a validation made before second turns were asked
        is not made again; then the servers, the requests, the target and the offline prediction's dtype and
        backend. Of generation, the keys its requests take (VALIDATION_GENERATION_KEYS)."""
        out = {"server" if k == "served" else k: v for k, v in super().fingerprint().items()}
        out["generation"] = {k: copy.deepcopy(getattr(self.generation, k)) for k in VALIDATION_GENERATION_KEYS}
        section = {k: out.pop(k) for k in self.key_order if k in out}
        if section.get("second_turns"):
            del section["second_turns"]
        return {"validate": section, **out}


def target_models(config: dict) -> list[str]:
    """Every name the target goes by: the served model and, where it differs, the transformers target."""
    return sorted({config["server"]["model"], target_model(config)})


@dataclass(frozen=True)
class FetchSettings(Stage):
    """fetch_inputs: what the jobs read from the Hugging Face hub, fetched before them (eaglenest.fetch)."""

    evalsets: list[dict] = setting("validate.datasets")
    models: list[str] = setting(target_models, reads=("server.model", "hidden.target"))
    cache_dir: str | None = setting("dataset.cache_dir", reruns=False)  # where datasets caches, not what it reads


@dataclass(frozen=True)
class ExportSettings(Stage):
    """export_draft: the formats, the model card and the verifier the speculators format names."""

    format: str = setting("export.format", reruns=False)  # the outputs themselves say which formats
    verifier: str = setting(lambda c: c["export"]["verifier"] or c["server"]["model"],
                            reads=("export.verifier", "server.model"))
    license: str | None = setting("export.license")
    dataset: str = setting("dataset.path")
    target: str = setting(target_model, reads=("hidden.target", "server.model"))
    k: int = setting("validate.num_speculative_tokens")

    def card(self) -> dict:
        """The model card's facts."""
        return {"dataset": self.dataset, "target": self.target, "license": self.license}


@dataclass(frozen=True)
class PlanSettings(Stage):
    """The plan and the checks before any job (eaglenest.plan, eaglenest.checks): the `plan:` section's stand-ins
    and rates, and the keys they read that no stage holds as a field of its own. No job reads them."""

    hidden_size: int | None = setting("plan.hidden_size")  # the target's, until its config.json is here
    weights_gb: float | None = setting("plan.weights_gb")  # the target's weights, until they are here
    generate_tokens_per_s: float | None = setting("plan.generate_tokens_per_s")
    decode_tokens_per_s: float | None = setting("plan.decode_tokens_per_s")
    extract_tokens_per_s: float | None = setting("plan.extract_tokens_per_s")
    train_tokens_per_s: float | None = setting("plan.train_tokens_per_s")
    server_start_s: float = setting("plan.server_start_s")
    validate_gpus: int | None = setting("validate.gpus")
    validate_max_tokens: int | None = setting("validate.max_tokens")  # None: generation.max_tokens
    validate_concurrency: int = setting("validate.concurrency")
    temperatures: list = setting("validate.temperatures")
    matrix_prompts: int | None = setting("validate.matrix_prompts")
