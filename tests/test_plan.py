"""The plan printed before any job runs (eaglenest.plan): its figures come from the config and the
dataset's size, so changing either changes them; the Kimi-K2.5 preset's files mode shows terabytes
and the plan suggests stream mode. No server, no Snakemake: the dry-run's copy is in test_presets."""
import copy
import json
from pathlib import Path

import pytest
import yaml

from eaglenest.config import validate_config
from eaglenest.plan import answers_fingerprint, format_plan, main, make_plan
from eaglenest.states.preflight import bytes_per_token

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
# The presets that read a hub dataset up to dataset.limit (the others have the target write its questions).
LIMITED = [p for p in PRESETS if (yaml.safe_load(p.read_text())["dataset"] or {}).get("limit")]


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
    assert base.prompts == config["dataset"]["limit"]
    assert base.generated_tokens == base.prompts * config["generation"]["max_tokens"]
    assert base.files_bytes == base.state_tokens * (8 * h + 13) == base.prompts * base.sequence_tokens * (8 * h + 13)

    half = make_plan(changed(config, "dataset", "limit", config["dataset"]["limit"] // 2), tmp_path, has_gpu=True)
    assert half.prompts == base.prompts // 2 and half.files_bytes < base.files_bytes
    assert format_plan(half) != format_plan(base)

    short = make_plan(changed(config, "generation", "max_tokens", 100), tmp_path, has_gpu=True)
    assert short.generated_tokens == base.prompts * 100
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
    assert bytes_per_token(7168) == 57357  # the README's figure for Kimi-K2.5
    assert plan.files_bytes > 5e12 and plan.suggest_stream
    text = format_plan(plan)
    assert " TB of shards" in text and "suggest hidden.mode: stream" in text
    streamed = make_plan(changed(preset("kimi-k2.5-int4.yaml"), "hidden", "mode", "stream"), tmp_path, has_gpu=True)
    assert not streamed.suggest_stream
    assert "suggest" not in format_plan(make_plan(validate_config({"dataset": {"limit": 600}}), tmp_path, has_gpu=False))


def test_replicas_and_the_gpus_each_stage_holds(tmp_path):
    slurm = preset("kimi-k2.5-int4.slurm.yaml")
    slurm["server"]["replicas"] = 4
    gpus = make_plan(slurm, tmp_path, has_gpu=False).gpus
    assert gpus["generate_traces"] == "4 SLURM job(s) x 8 GPUs = 32 GPUs"
    assert gpus["extract_hidden"] == gpus["generate_traces"]
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
    config = validate_config({"dataset": {"limit": 600}, "plan": {"hidden_size": 128}})
    assert "projected once a trace shard has finished" in format_plan(make_plan(config, tmp_path))
    (tmp_path / "traces").mkdir()
    shard = {"records": 300, "completed": 300, "wall_s": 60.0}
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps({**shard, "fingerprint": answers_fingerprint(config)}))
    plan = make_plan(config, tmp_path)
    assert plan.measured["rate"] == 5.0 and plan.measured["remaining_s"] == 60.0  # 300 more at 5 a second
    assert "300 traces at 5.00 requests/s; the rest about 1.0 min" in format_plan(plan)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"dataset": {"limit": 600, "path": str(ROOT / "toy/prompts.jsonl")},
                                                       "server": {"model": str(ROOT / "toy/target"), "max_model_len": 512},
                                                       "generation": {"max_tokens": 256}, "hidden": {"max_length": 512},
                                                       "draft": {"vocab_size": 48}, "plan": {"hidden_size": 128}}))
    mine = validate_config(yaml.safe_load((tmp_path / "cfg.yaml").read_text()))
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps({**shard, "fingerprint": answers_fingerprint(mine)}))
    main(["--configfile", str(tmp_path / "cfg.yaml"), "-d", str(tmp_path)])
    assert "the rest about 1.0 min" in capsys.readouterr().out


def test_the_targets_own_hidden_size_wins_over_plan_hidden_size(tmp_path):
    from eaglenest.plan import target_hidden_size

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30}))
    config = validate_config({"server": {"model": str(target)}, "plan": {"hidden_size": 4096}})
    assert target_hidden_size(config) == (576, f"{target}'s config.json")
    config["server"]["model"] = str(tmp_path / "not-here")  # no config.json: the stand-in
    assert target_hidden_size(config) == (4096, "plan.hidden_size")


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
    (tmp_path / "traces/shard_0.stats.json").write_text(json.dumps({**shard, "fingerprint": answers_fingerprint(kimi)}))
    plan = make_plan(kimi, tmp_path, has_gpu=True)
    assert plan.prompts == 49000 and plan.measured["done"] == 300


def test_each_stage_has_a_time_and_gpu_hours_from_the_stated_rates(tmp_path):
    """Files mode, 100 prompts of at most 64 answer tokens, a 2-GPU server: generation 100 x 64 / 32 tok/s =
    200 s on 2 GPUs; extraction (vLLM backend) one start + state tokens / rate on the server's GPUs; training
    epochs x state tokens / rate on its GPU; validation from decode_tokens_per_s. In stream mode extraction holds
    its server while training runs, and the total does not count that time twice."""
    config = preset("llama-3.1-8b-instruct.yaml")
    for section, key, value in (("dataset", "limit", 100), ("generation", "max_tokens", 64), ("hidden", "mode", "files"),
                                ("server", "tensor_parallel_size", 2), ("plan", "generate_tokens_per_s", 32.0),
                                ("plan", "extract_tokens_per_s", 1000.0), ("plan", "train_tokens_per_s", 500.0),
                                ("train", "epochs", 2), ("train", "gpus", 1), ("validate", "gpus", 2)):
        config = changed(config, section, key, value)
    plan = make_plan(config, tmp_path, has_gpu=True)
    st = plan.stages
    assert st["generation"][:2] == (100 * 64 / 32.0, 2)
    assert st["extraction"][:2] == (config["plan"]["server_start_s"] + plan.state_tokens / 1000.0, 2)
    assert st["training"][:2] == (2 * plan.state_tokens / 500.0, 1)
    two = make_plan(changed(config, "train", "gpus", 2), tmp_path, has_gpu=True).stages["training"]
    assert two[:2] == (2 * plan.state_tokens / (500.0 * 2), 2), "one process a GPU: half the time, the same GPU-hours"
    assert st["validation"][1] == 2 and st["validation"][0] > plan.validation["seconds"]  # the curve's starts added
    text = format_plan(plan)
    gpu_hours = sum(s * g for s, g, _ in st.values()) / 3600
    assert "time, generation: about" in text and f"{gpu_hours:,.1f} GPU-hours" in text, text
    stream = make_plan(changed(config, "hidden", "mode", "stream"), tmp_path, has_gpu=True)
    assert stream.stages["extraction"][0] == stream.stages["training"][0]
    total = sum(s for s, _, _ in stream.stages.values()) - stream.stages["extraction"][0]
    from eaglenest.plan import human_seconds
    assert f"time, all stages: about {human_seconds(total)}" in format_plan(stream)
    unknown = make_plan(changed(config, "plan", "train_tokens_per_s", None), tmp_path, has_gpu=True)
    assert "time, training: not estimated (1 GPU): set plan.train_tokens_per_s" in format_plan(unknown)
    assert "time, all stages" not in format_plan(unknown)
