"""The plan printed before any job runs (eaglenest.plan): its figures come from the config and the
dataset's size, so changing either changes them; the Kimi-K2.5 preset's files mode shows terabytes
and the plan suggests stream mode. No server, no Snakemake: the dry-run's copy is in test_presets."""
import copy
import json
from pathlib import Path

import pytest
import yaml

from eaglenest.config import validate_config
from eaglenest.plan import RunSettings, answers_fingerprints, format_plan, make_plan
from eaglenest.checks.__main__ import main
from eaglenest.states.preflight import bytes_per_token

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
# The presets that read a hub dataset up to dataset.limit (the others have the target write its questions).
LIMITED = [p for p in PRESETS if (yaml.safe_load(p.read_text())["dataset"] or {}).get("limit")]


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path_factory, monkeypatch):
    """No model of this machine's Hugging Face cache stands in for the presets' plan.weights_gb and hidden_size."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty_hub")))


def preset(name: str) -> dict:
    return validate_config(yaml.safe_load((ROOT / "configs" / name).read_text()))


def changed(config: dict, section: str, key: str, value) -> dict:
    config = copy.deepcopy(config)
    config[section][key] = value
    return config


@pytest.mark.parametrize("path", LIMITED, ids=lambda p: p.name)
def test_the_figures_follow_the_dataset_limit_and_max_tokens(path, tmp_path):
    config = validate_config(yaml.safe_load(path.read_text()))
    base = make_plan(config, tmp_path, has_gpu=True)
    h = config["plan"]["hidden_size"]
    assert base.prompts == config["dataset"]["limit"] and base.requests == base.prompts * base.turns
    assert base.generated_tokens == base.requests * config["generation"]["max_tokens"]
    assert base.files_bytes == base.state_tokens * (8 * h + 13) == base.requests * base.sequence_tokens * (8 * h + 13)

    half = make_plan(changed(config, "dataset", "limit", config["dataset"]["limit"] // 2), tmp_path, has_gpu=True)
    assert half.prompts == base.prompts // 2 and half.files_bytes < base.files_bytes
    assert format_plan(half) != format_plan(base)

    short = make_plan(changed(config, "generation", "max_tokens", 100), tmp_path, has_gpu=True)
    assert short.generated_tokens == base.requests * 100
    # a sequence is then at most the prompt (dataset.max_prompt_chars) plus 100 tokens, within hidden.max_length
    assert short.sequence_tokens == min(base.sequence_tokens, config["dataset"]["max_prompt_chars"] + 100)
    assert f"{short.generated_tokens:,} generated" in format_plan(short)


def test_questions_the_target_writes_count_as_the_prompts_less_the_held_out(tmp_path):
    config = preset("smollm2-135m.yaml")
    plan = make_plan(config, tmp_path, has_gpu=False)
    assert plan.prompts == config["dataset"]["generate"]["questions"] - config["dataset"]["heldout"] == 2000 and "dataset.generate.questions" in plan.prompts_source
    assert make_plan(changed(config, "dataset", "limit", 500), tmp_path, has_gpu=False).prompts == 500
    # the target's hidden size from the plan, until the conversion writes its config.json
    assert plan.files_bytes == plan.state_tokens * (8 * 576 + 13)


def test_the_kimi_preset_shows_terabytes_in_files_mode_and_suggests_stream(tmp_path):
    files = changed(preset("kimi-k2.5-int4.yaml"), "hidden", "mode", "files")  # the preset streams: it must
    plan = make_plan(files, tmp_path, has_gpu=True)
    assert bytes_per_token(7168) == 57357  # docs/hidden-states.md's figure for Kimi-K2.5
    assert plan.files_bytes > 5e12 and plan.suggest_stream
    text = format_plan(plan)
    assert " TB of shards" in text and "suggest hidden.mode: stream" in text
    streamed = make_plan(changed(preset("kimi-k2.5-int4.yaml"), "hidden", "mode", "stream"), tmp_path, has_gpu=True)
    assert not streamed.suggest_stream
    assert "suggest" not in format_plan(make_plan(validate_config({"dataset": {"limit": 600}}), tmp_path, has_gpu=False))


def test_replicas_and_the_gpus_each_stage_holds(tmp_path):
    slurm = changed(preset("kimi-k2.5-int4.slurm.yaml"), "hidden", "mode", "files")
    slurm["server"]["replicas"] = 4
    gpus = make_plan(slurm, tmp_path, has_gpu=False).gpus
    assert gpus["generate_traces"] == "4 SLURM job(s) x 8 GPUs = 32 GPUs"
    assert gpus["extract_hidden"] == gpus["generate_traces"]  # files mode: every replica extracts
    assert gpus["train_draft"] == "1 GPU" and gpus["validate_draft"].startswith("8 GPUs")
    llama = preset("llama-3.1-8b-instruct.yaml")
    llama["server"]["replicas"] = 8
    assert make_plan(llama, tmp_path, has_gpu=True).gpus["generate_traces"] == "8 local server(s) x 1 GPU = 8 GPUs"


def test_a_local_dataset_is_counted_and_prepared_prompts_are_read(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(30)))
    config = validate_config({"dataset": {"path": str(data), "heldout": 5, "limit": None}, "plan": {"hidden_size": 64}})
    assert make_plan(config, tmp_path).prompts == 25
    (tmp_path / "data/prompts").mkdir(parents=True)
    made = {"train": 21, "path": str(data), "seed": 0, "limit": None, "keep_system": False, "max_prompt_chars": 32000}
    (tmp_path / "data/prompts/stats.json").write_text(json.dumps(made))
    assert make_plan(config, tmp_path).prompts == 21


def test_gzipped_datasets_are_counted_and_stats_of_another_column_mapping_are_not_read(tmp_path):
    """A .jsonl.gz or .json.gz dataset was counted as 0 rows ("prompts: 0"); prompts prepared with another
    dataset.columns are not this config's."""
    import gzip

    for name, text in [("d.jsonl.gz", "".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(30))),
                       ("d.json.gz", json.dumps([{"prompt": f"q{i}"} for i in range(30)]))]:
        with gzip.open(tmp_path / name, "wt") as f:
            f.write(text)
        config = validate_config({"dataset": {"path": str(tmp_path / name), "heldout": 5}, "plan": {"hidden_size": 64}})
        assert make_plan(config, tmp_path).prompts == 25
    (tmp_path / "data/prompts").mkdir(parents=True)
    made = {"train": 21, "path": str(tmp_path / name), "seed": 0, "limit": None, "keep_system": False,
            "max_prompt_chars": 32000, "columns": {"question": "text", "conversation": None, "id": None}}
    (tmp_path / "data/prompts/stats.json").write_text(json.dumps(made))
    plan = make_plan(config, tmp_path)
    assert plan.prompts == 25 and "another dataset's or setting's" in plan.prompts_source
    mapped = validate_config({**config, "dataset": {**config["dataset"], "columns": {"question": "text"}}})
    assert make_plan(mapped, tmp_path).prompts == 21


def test_the_generation_time_is_projected_from_finished_shards(tmp_path, capsys):
    """The measured rate wins over plan.generate_tokens_per_s (and over an assumed rate)."""
    config = validate_config({"dataset": {"limit": 600}, "plan": {"hidden_size": 128, "generate_tokens_per_s": 1.0}})
    assert "generation so far" not in format_plan(make_plan(config, tmp_path, has_gpu=True))
    (tmp_path / "traces").mkdir()
    shard = {"records": 300, "completed": 300, "wall_s": 60.0}
    fingerprint = answers_fingerprints(RunSettings.from_config(config))[0]
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps({**shard, "fingerprint": fingerprint}))
    plan = make_plan(config, tmp_path, has_gpu=True)
    assert plan.measured["rate"] == 5.0 and plan.measured["remaining_s"] == 60.0  # 300 more at 5 a second
    assert "300 traces at 5.00 requests/s; the rest about 1.0 min" in format_plan(plan)
    assert plan.stages["generation"].seconds == 60.0 and "measured" in plan.stages["generation"].how
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"dataset": {"limit": 600, "path": str(ROOT / "toy/prompts.jsonl")},
                                                       "server": {"model": str(ROOT / "toy/target"), "max_model_len": 512},
                                                       "generation": {"max_tokens": 256}, "hidden": {"max_length": 512},
                                                       "draft": {"vocab_size": 48}, "plan": {"hidden_size": 128}}))
    mine = validate_config(yaml.safe_load((tmp_path / "cfg.yaml").read_text()))
    fingerprint = answers_fingerprints(RunSettings.from_config(mine))[0]
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps({**shard, "fingerprint": fingerprint}))
    main(["--configfile", str(tmp_path / "cfg.yaml"), "-d", str(tmp_path)])
    assert "the rest about 1.0 min" in capsys.readouterr().out


def test_the_targets_own_hidden_size_wins_over_plan_hidden_size(tmp_path):
    from eaglenest.plan import target_hidden_size

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30}))
    config = validate_config({"server": {"model": str(target)}, "plan": {"hidden_size": 4096}})
    assert target_hidden_size(RunSettings.from_config(config)) == (576, f"{target}'s config.json")
    config["server"]["model"] = str(tmp_path / "not-here")  # no config.json: the stand-in
    assert target_hidden_size(RunSettings.from_config(config)) == (4096, "plan.hidden_size")


def test_another_configs_prompts_and_traces_are_not_this_plans_figures(tmp_path):
    """After `make run` on the toy, planning Kimi in the same directory: the toy's 600 prompts and its
    trace rate are not Kimi's."""
    kimi = preset("kimi-k2.5-int4.yaml")
    (tmp_path / "data/prompts").mkdir(parents=True)
    toy_stats = {"path": "toy/prompts.jsonl", "train": 600, "heldout": 40, "seed": 0, "limit": 600,
                 "keep_system": False, "max_prompt_chars": 32000}
    (tmp_path / "data/prompts/stats.json").write_text(json.dumps(toy_stats))
    (tmp_path / "traces").mkdir()
    shard = {"records": 300, "completed": 300, "wall_s": 17.7, "fingerprint": "0123456789ab"}
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps(shard))
    plan = make_plan(kimi, tmp_path, has_gpu=True)
    assert plan.prompts == kimi["dataset"]["limit"] and "another dataset's or setting's" in plan.prompts_source
    assert plan.measured is None
    # this config's own: both are read
    mine = {**toy_stats, "path": kimi["dataset"]["path"], "limit": kimi["dataset"]["limit"], "train": 49000}
    (tmp_path / "data/prompts/stats.json").write_text(json.dumps(mine))
    fingerprint = answers_fingerprints(RunSettings.from_config(kimi))[0]
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps({**shard, "fingerprint": fingerprint}))
    plan = make_plan(kimi, tmp_path, has_gpu=True)
    assert plan.prompts == 49000 and plan.measured["done"] == 300


def stated(config: dict, *settings) -> dict:
    for section, key, value in settings:
        config = changed(config, section, key, value)
    return config


def rated_llama() -> dict:
    """Files mode, 100 first questions (dataset.max_turns 1) of at most 64 answer tokens, a 2-GPU server, every
    rate stated."""
    return stated(preset("llama-3.1-8b-instruct.yaml"), ("dataset", "max_turns", 1),
                  ("dataset", "limit", 100), ("generation", "max_tokens", 64), ("hidden", "mode", "files"),
                  ("server", "tensor_parallel_size", 2), ("plan", "generate_tokens_per_s", 32.0),
                  ("plan", "extract_tokens_per_s", 1000.0), ("plan", "train_tokens_per_s", 500.0),
                  ("train", "epochs", 2), ("train", "gpus", 1), ("validate", "gpus", 2))


def test_each_stage_has_a_time_and_gpu_hours_from_the_stated_rates(tmp_path):
    """Generation one start + 100 x 64 / 32 tok/s on 2 GPUs; extraction (vLLM backend) one start + state tokens /
    rate on the server's GPUs; training epochs x state tokens / rate on its GPU; validation from decode_tokens_per_s."""
    config = rated_llama()
    start = config["plan"]["server_start_s"]
    plan = make_plan(config, tmp_path, has_gpu=True)
    st = plan.stages
    assert st["generation"][:2] == (start + 100 * 64 / 32.0, 2) and plan.assumed is None
    assert st["extraction"][:2] == (start + plan.state_tokens / 1000.0, 2)
    assert st["training"][:2] == (2 * plan.state_tokens / 500.0, 1)
    two = make_plan(changed(config, "train", "gpus", 2), tmp_path, has_gpu=True).stages["training"]
    assert two[:2] == (2 * plan.state_tokens / (500.0 * 2), 2), "one process a GPU: half the time, the same GPU-hours"
    assert st["validation"][1] == 2 and st["validation"][0] > plan.validation["seconds"]  # the curve's starts added
    text = format_plan(plan)
    assert "time, generation: about" in text and "plan.generate_tokens_per_s 32 a replica x 1" in text
    unknown = make_plan(changed(config, "plan", "train_tokens_per_s", None), tmp_path, has_gpu=True)
    assert "time, training: not estimated (1 GPU): set plan.train_tokens_per_s" in format_plan(unknown)
    assert "total: wall time and GPU-hours not estimated (no time for training)" in format_plan(unknown)


def test_generation_time_from_plan_generate_tokens_per_s_shares_the_tokens_among_the_replicas(tmp_path):
    config = rated_llama()
    start, tokens = config["plan"]["server_start_s"], 100 * 64
    one = make_plan(config, tmp_path, has_gpu=True).stages["generation"]
    four = make_plan(changed(config, "server", "replicas", 4), tmp_path, has_gpu=True).stages["generation"]
    assert one.seconds == start + tokens / 32.0 and one.gpus == 2
    assert four.seconds == start + tokens / (32.0 * 4) and four.gpus == 8
    assert "generation rate, assumed" not in format_plan(make_plan(config, tmp_path, has_gpu=True))


def test_without_a_stated_rate_generation_assumes_one_from_the_gpu_kind_and_the_weights(tmp_path):
    """The Llama SLURM preset: 79.6 GiB GPUs (an H100, 3.35 TB/s), 16.1 GB of weights (plan.weights_gb), 200 in
    flight: a decode step of 10 x 16.1e9 / 3.35e12 s = 48 ms, so 200 / 0.048 = 4,161 tokens/s, said to be assumed."""
    config = preset("llama-3.1-8b-instruct.slurm.yaml")
    assert config["plan"]["generate_tokens_per_s"] is None and config["plan"]["weights_gb"] == 16.1
    plan = make_plan(config, tmp_path, has_gpu=False)
    step = 10 * 16.1e9 / 3.35e12
    assert plan.assumed["kind"] == "H100" and plan.assumed["rate"] == pytest.approx(200 / step)
    gen = plan.stages["generation"]
    assert gen.seconds == pytest.approx(config["plan"]["server_start_s"] + plan.generated_tokens * step / 200)
    text = format_plan(plan)
    assert "generation rate, assumed: 4,161 tokens/s a replica: 200 requests in flight, a decode step of 48 ms" in text
    assert "1 x H100's 3.35 TB/s" in text and "set plan.generate_tokens_per_s" in text
    assert "time, generation: about 5.5 h, 5.5 GPU-hours (1 GPU): 81,920,000 tokens at the assumed 4,161" in text
    # an H200 reads the weights 4.8 / 3.35 times as fast; two replicas share the 200 requests. The GPU a config
    # states it was sized for names it (server.slurm.gpu_type), else the one whose memory is gpu_memory_gib's
    h200 = make_plan(stated(config, ("server", "slurm", {**config["server"]["slurm"], "gpu_type": "H200"})),
                     tmp_path, has_gpu=False).assumed
    unstated = stated(config, ("server", "slurm", {**config["server"]["slurm"], "gpu_type": None}))
    by_memory = make_plan(stated(unstated, ("hidden", "vllm", {**config["hidden"]["vllm"], "gpu_memory_gib": 140.4})),
                          tmp_path, has_gpu=False).assumed
    assert by_memory["kind"] == "H200" and "gpu_memory_gib 140.4" in by_memory["kind_source"]
    assert h200["kind"] == "H200" and h200["rate"] == pytest.approx(plan.assumed["rate"] * 4.8 / 3.35)
    two = make_plan(changed(config, "server", "replicas", 2), tmp_path, has_gpu=False)
    assert two.assumed["in_flight"] == 100 and two.stages["generation"].seconds == pytest.approx(gen.seconds)
    # a small model's step is no shorter than vLLM's own overhead
    tiny = make_plan(changed(config, "plan", "weights_gb", 0.1), tmp_path, has_gpu=False).assumed
    assert tiny["step_s"] == 0.02 and tiny["rate"] == 200 / 0.02


def test_no_generation_rate_is_assumed_without_the_weights_size_or_a_gpu(tmp_path):
    config = changed(preset("llama-3.1-8b-instruct.slurm.yaml"), "plan", "weights_gb", None)
    plan = make_plan(config, tmp_path, has_gpu=False)
    assert plan.assumed is None and plan.weights_bytes is None and plan.stages["generation"].seconds is None
    text = format_plan(plan)
    assert "set plan.generate_tokens_per_s (or plan.weights_gb for an assumed one)" in text
    assert "the target's weights unknown (meta-llama/Llama-3.1-8B-Instruct is not here" in text
    toy = validate_config({"dataset": {"limit": 600}})  # the toy target: a local directory, served on this CPU
    plan = make_plan(toy, tmp_path, has_gpu=False)
    assert plan.weights_bytes and plan.assumed is None
    assert "no rate is assumed for vLLM on this machine's CPU" in format_plan(plan)
    # a SLURM server job without GPUs (server.slurm.gpus 0: vLLM on the node's CPU) divided by zero GPUs
    cpu_job = validate_config({"dataset": {"limit": 600}, "server": {"mode": "slurm", "slurm": {"gpus": 0}}})
    plan = make_plan(cpu_job, tmp_path, has_gpu=False)
    assert plan.weights_bytes and plan.assumed is None


def test_the_targets_weights_come_from_its_directory_or_the_hf_cache_before_plan_weights_gb(tmp_path, monkeypatch):
    from eaglenest.plan import target_weights

    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"x" * 1000)
    (target / "sub" / "tokenizer.json").write_bytes(b"x" * 24)
    config = validate_config({"server": {"model": str(target)}, "plan": {"weights_gb": 5.0}})
    assert target_weights(RunSettings.from_config(config)) == (1024, f"{target}'s files")
    cache = tmp_path / "hub"
    snap = cache / "models--org--big" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 7 * 10**9}}))
    (cache / "models--org--big" / "refs").mkdir()
    (cache / "models--org--big" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    config["server"]["model"] = "org/big"
    assert target_weights(RunSettings.from_config(config)) == (7 * 10**9, "org/big's model.safetensors.index.json in the Hugging Face cache")
    config["server"]["model"] = "org/not-cached"
    assert target_weights(RunSettings.from_config(config)) == (5 * 10**9, "plan.weights_gb")


def test_the_total_adds_the_stages_wall_time_gpu_hours_and_the_peak_disk_with_the_model(tmp_path):
    """Files mode: wall time is every stage's, one after another; GPU-hours each stage's seconds x GPUs; the peak
    disk the target's weights (plan.weights_gb 16.1 GB, the hub name not being here) + the traces (12 B a state
    token) + the shards."""
    from eaglenest.plan import human_bytes, human_seconds

    plan = make_plan(rated_llama(), tmp_path, has_gpu=True)
    st = plan.stages
    wall = sum(s.seconds for s in st.values())
    gpu_hours = sum(s.seconds * s.gpus for s in st.values()) / 3600
    peak = int(16.1e9) + plan.state_tokens * 12 + plan.files_bytes
    text = format_plan(plan)
    assert (f"total: about {human_seconds(wall)} wall time, {gpu_hours:,.1f} GPU-hours (upper bounds on the tokens; the stages one after another); "
            f"peak disk about {human_bytes(peak)}: the target's weights 16.1 GB (plan.weights_gb), ") in text, text
    assert f"hidden states {human_bytes(plan.files_bytes)} (files mode's shards)" in text


def test_stream_mode_runs_one_extraction_server_during_training(tmp_path):
    """hidden.mode stream with server.replicas 8: one extraction server job (not 8), held from its start until
    training ends; it adds only its start to the wall time, its GPUs x that time to the GPU-hours; the peak disk
    counts hidden.stream.max_disk_gb for the states. An extraction slower than training holds training back."""
    from eaglenest.plan import human_bytes, human_seconds

    config = stated(preset("kimi-k2.5-int4.slurm.yaml"), ("server", "replicas", 8),
                    ("plan", "generate_tokens_per_s", 1000.0))
    plan = make_plan(config, tmp_path, has_gpu=False)
    assert plan.gpus["generate_traces"] == "8 SLURM job(s) x 8 GPUs = 64 GPUs"
    assert plan.gpus["extract_hidden"].startswith("1 SLURM job(s) x 8 GPUs = 8 GPUs, while train_draft runs")
    st, start = plan.stages, config["plan"]["server_start_s"]
    assert st["extraction"].gpus == 8 and st["extraction"].seconds == start + st["training"].seconds
    assert st["extraction"].wall_s == start
    wall = st["generation"].seconds + start + st["training"].seconds + st["validation"].seconds
    gpu_hours = sum(s.seconds * s.gpus for s in st.values()) / 3600
    peak = int(595e9) + plan.state_tokens * 12 + int(200e9)
    text = format_plan(plan)
    assert (f"total: about {human_seconds(wall)} wall time, {gpu_hours:,.1f} GPU-hours (upper bounds on the tokens; the stages one after another, "
            f"extraction during training); peak disk about {human_bytes(peak)}") in text, text
    assert f"time, extraction: about {human_seconds(st['extraction'].seconds)} (adds {human_seconds(start)}" in text
    slow = make_plan(changed(config, "plan", "extract_tokens_per_s", 1000.0), tmp_path, has_gpu=False).stages
    assert slow["training"].seconds == 2 * plan.state_tokens / 1000.0 and "held back" in slow["training"].how


def test_a_conversation_of_n_turns_costs_n_requests_and_their_tokens(tmp_path):
    """Up to dataset.max_turns answers a prompt before any trace (each turn's chain a sequence at most); the
    target's own questions at most dataset.generate.turns; once shards finished, their turns per record."""
    config = validate_config({"dataset": {"limit": 600}, "generation": {"max_tokens": 100},
                              "plan": {"hidden_size": 128, "generate_tokens_per_s": 1.0}})
    first = make_plan(changed(config, "dataset", "max_turns", 1), tmp_path, has_gpu=True)
    assert first.turns == 1 and first.requests == 600 and "conversations" not in format_plan(first)
    three = make_plan(changed(config, "dataset", "max_turns", 3), tmp_path, has_gpu=True)
    assert three.turns == 3 and three.requests == 1800 and three.generated_tokens == 1800 * 100
    assert three.state_tokens == 1800 * three.sequence_tokens
    assert three.stages["generation"].seconds > 2.9 * first.stages["generation"].seconds
    assert "conversations: 3 turns each (dataset.max_turns: at most): 1,800 requests" in format_plan(three)
    assert "180,000 generated (1,800 requests x generation.max_tokens 100)" in format_plan(three)

    written = stated(config, ("dataset", "max_turns", 3), ("dataset", "generate", {**config["dataset"]["generate"],
                                                                                   "questions": 610, "turns": 2}))
    assert make_plan(written, tmp_path, has_gpu=True).turns == 2

    (tmp_path / "traces").mkdir()
    # a shard of conversations carries the key with the conversation limits (data.traces.answers_key)
    shard = {"records": 100, "completed": 250, "wall_s": 50.0, "conversations": {"records": 80, "turns": 230},
             "fingerprint": answers_fingerprints(RunSettings.from_config(changed(config, "dataset", "max_turns", 3)))[1]}
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps(shard))
    measured = make_plan(changed(config, "dataset", "max_turns", 3), tmp_path, has_gpu=True)
    # 20 single answers and 230 turns of 80 conversations: 2.5 requests a record, 500 records left at 5 a second
    assert measured.turns == 2.5 and measured.requests == 1500
    assert measured.measured["rate"] == 5.0 and measured.measured["remaining_s"] == 250.0
