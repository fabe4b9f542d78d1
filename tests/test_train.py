"""train_draft: outputs, metrics, batching, schedule, and a killed run resuming to the same result."""

import csv
import os
import socket

import pytest
import torch

from eaglenest.draft import batches as batching
from eaglenest.draft import train
from eaglenest.draft.batches import epoch_batches
from eaglenest.draft.checkpoint import load_checkpoint
from eaglenest.draft.device import AUTO_KEYS, resolve_runtime
from eaglenest.draft.runtime import Runtime
from eaglenest.draft.targets import target_distribution
from eaglenest.draft.train import lr_at, train_draft
from eaglenest.states.target import load_target_head
from tests.support.training import train_settings
from tests.support.training_run import CONFIG, run


def test_train_writes_checkpoint_and_metrics(data, tmp_path):
    stats = run(data, tmp_path)
    tensors, cfg, info, trained = load_checkpoint(tmp_path / "checkpoint.safetensors")
    assert cfg.draft_vocab_size == 40 and cfg.target_vocab_size == 100 and info.aux_layers == [1, 2, 3]
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape == (40, 64)
    assert trained["steps"] == stats["steps"] == 6
    rows = list(csv.DictReader(open(tmp_path / "train_metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    for key in ("lr", "loss", "loss_0", "loss_2", "acc_0", "acc_2", "grad_norm", "tokens", "tokens_per_s"):
        assert key in rows[0]
    assert all(0 <= float(r["acc_0"]) <= 1 for r in rows)
    assert not list((tmp_path / ".train_state").glob("step_*.pt"))  # resume points go once done


def test_killed_run_resumes_to_the_same_result(data, tmp_path, monkeypatch):
    run(data, tmp_path / "straight")
    interrupted_after_save(data, tmp_path / "killed", monkeypatch, at_step=4)
    assert not (tmp_path / "killed" / "checkpoint.safetensors").exists()
    assert {p.name for p in (tmp_path / "killed" / ".train_state").glob("*.pt")} == {"step_2.pt", "step_4.pt"}
    stats = run(data, tmp_path / "killed")
    assert stats["resumed_from"] == 4
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.safetensors")[0]
    b = load_checkpoint(tmp_path / "killed" / "checkpoint.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra = list(csv.DictReader(open(tmp_path / "straight" / "train_metrics.csv")))
    rb = list(csv.DictReader(open(tmp_path / "killed" / "train_metrics.csv")))
    assert [(r["step"], r["loss"], r["acc_1"], r["lr"]) for r in ra] == [(r["step"], r["loss"], r["acc_1"], r["lr"]) for r in rb]


def interrupted_after_save(data, out, monkeypatch, at_step=None, config=CONFIG):
    """Train in ``out`` until the resumable state of step ``at_step`` (default: the first) is saved,
    then stop there."""
    save = train._save_state

    def save_then_die(state_dir, step, state, keep):
        save(state_dir, step, state, keep)
        if at_step is None or step == at_step:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(train, "_save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(data, out, config)
    monkeypatch.setattr(train, "_save_state", save)


def test_stale_state_of_another_config_is_ignored(data, tmp_path, monkeypatch):
    interrupted_after_save(data, tmp_path, monkeypatch)
    assert run(data, tmp_path, {**CONFIG, "seed": 4})["resumed_from"] is None


def test_state_saved_for_a_shard_whose_content_changed_is_ignored(data, tmp_path, monkeypatch):
    """Same name, same size, other numbers: the saved state belongs to other data."""
    import shutil
    copy = dict(data, hidden_paths=[tmp_path / "shard_0.safetensors"])
    shutil.copy(data["hidden_paths"][0], copy["hidden_paths"][0])
    interrupted_after_save(copy, tmp_path / "out", monkeypatch)
    path = copy["hidden_paths"][0]
    size = path.stat().st_size
    _flip_signs_in_place(path)
    assert path.stat().st_size == size
    assert run(copy, tmp_path / "out")["resumed_from"] is None


def _flip_signs_in_place(path):
    """Flip the sign of the first values of a float tensor, rewriting those bytes only (the size stays)."""
    import json
    import struct
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        name, width = next((k, {"F32": 4, "BF16": 2, "F16": 2}[v["dtype"]]) for k, v in header.items()
                           if k != "__metadata__" and v["dtype"] in ("F32", "BF16", "F16"))
        begin = 8 + n + header[name]["data_offsets"][0]
        f.seek(begin)
        raw = bytearray(f.read(16 * width))
        for i in range(width - 1, len(raw), width):  # little-endian: the sign is the last byte's top bit
            raw[i] ^= 0x80
        f.seek(begin)
        f.write(raw)


def _ddp_rank(rank, world, port, data, out, config):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    run(data, out, config)


def test_two_ranks_equal_one_process_accumulating_two(data, tmp_path):
    """DDP deals the micro-batches to the ranks in turn: 2 ranks x 1 == 1 process x grad_accum 2."""
    config = {**CONFIG, "max_steps": 3}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_ddp_rank, args=(2, port, data, tmp_path / "ddp", config), nprocs=2)
    run(data, tmp_path / "one", {**config, "grad_accum": 2})
    a = load_checkpoint(tmp_path / "ddp" / "checkpoint.safetensors")[0]
    b = load_checkpoint(tmp_path / "one" / "checkpoint.safetensors")[0]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    ra = list(csv.DictReader(open(tmp_path / "ddp" / "train_metrics.csv")))
    rb = list(csv.DictReader(open(tmp_path / "one" / "train_metrics.csv")))
    assert [(r["tokens"], round(float(r["loss"]), 4)) for r in ra] == [(r["tokens"], round(float(r["loss"]), 4)) for r in rb]


def test_batches_cover_each_sequence_once_within_budget():
    lengths = [5, 40, 17, 33, 8, 21, 40, 2, 11, 29] * 3
    batches = epoch_batches(lengths, epoch=0, seed=1, batch_tokens=80, window=8)
    assert sorted(k for b in batches for k in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[k] for k in b) <= 80 for b in batches)
    assert batches == epoch_batches(lengths, epoch=0, seed=1, batch_tokens=80, window=8)
    assert batches != epoch_batches(lengths, epoch=1, seed=1, batch_tokens=80, window=8)
    assert all(len(b) <= 2 for b in epoch_batches(lengths, 0, 1, 10**6, batch_size=2))
    per_epoch = len(epoch_batches([10] * 100, 0, 0, 20))  # 2 sequences a batch: 50
    assert [batching.count_steps([10] * 100, train_settings({"epochs": e, "batch_tokens": 20}), 1) for e in (0.5, 1, 2)] == [
        per_epoch // 2, per_epoch, 2 * per_epoch]


def test_lr_warmup_then_cosine():
    cfg = train_settings({"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1})
    lrs = [lr_at(s, cfg, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] >= 0.1
    with pytest.raises(ValueError, match="unknown training keys"):
        train_settings({"learning_rate": 1})


def test_target_distribution_shifts_the_mask_and_flags_out_of_vocab():
    torch.manual_seed(0)
    lm_head = torch.randn(10, 4)
    last = torch.randn(1, 6, 4)
    loss_mask = torch.tensor([[False, False, True, True, True, False]])
    draft_ids = torch.tensor([1, 3, 4])
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[draft_ids] = True
    tg = target_distribution(last, loss_mask, lm_head, draft_ids, t2d, max_elements=20)
    assert tg["rows"].tolist() == [1, 2, 3]  # position q predicts token q+1
    logits = last[0, 1:4] @ lm_head.T
    assert torch.equal(tg["argmax"], logits.argmax(-1))
    torch.testing.assert_close(tg["probs"], torch.softmax(logits[:, draft_ids], -1))
    assert torch.equal(tg["in_draft"], t2d[logits.argmax(-1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_distribution_from_target_next_equals_the_full_vocabulary_one(dtype):
    """The default path (the shard's greedy tokens, only the draft rows of the head) gives the full-vocab
    path's probs, argmax and in_draft, up to the matmul's rounding."""
    torch.manual_seed(1)
    V, H, B, T = 1000, 64, 3, 50
    lm_head, last = torch.randn(V, H).to(dtype), torch.randn(B, T, H).to(dtype)
    loss_mask = torch.rand(B, T) < 0.7
    draft_ids = torch.randperm(V)[:200].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    # the target's greedy tokens, as extraction stores them, with some of them in the draft vocabulary
    lm_head[draft_ids[:20]] *= 4
    full = target_distribution(last, loss_mask, lm_head, draft_ids, t2d, max_elements=V * 16)
    nxt = (last.float() @ lm_head.float().T).argmax(-1).to(torch.int32)
    fast = target_distribution(last, loss_mask, lm_head[draft_ids].contiguous(), draft_ids, t2d,
                               max_elements=V * 16, target_next=nxt)
    assert torch.equal(fast["rows"], full["rows"]) and fast["rows"].numel() > 50
    assert fast["argmax"].dtype == torch.int64
    assert torch.equal(fast["argmax"], full["argmax"]) and torch.equal(fast["in_draft"], full["in_draft"])
    assert 0 < int(fast["in_draft"].sum()) < len(fast["rows"])
    torch.testing.assert_close(fast["probs"], full["probs"], atol=1e-6, rtol=1e-5)
    # nothing to score: empty, not an error
    none = target_distribution(last, torch.zeros(B, T, dtype=torch.bool), lm_head[draft_ids], draft_ids, t2d, target_next=nxt)
    assert none["probs"].shape == (0, 200) and none["argmax"].numel() == 0
    with pytest.raises(ValueError, match="draft vocabulary's 200 rows, got 1000"):
        target_distribution(last, loss_mask, lm_head, draft_ids, t2d, target_next=nxt)


def test_shards_without_target_next_train_the_same_draft_on_the_full_vocab_path(data, tmp_path, capsys):
    """A shard written before target_next: the old path (a line says so); with target_next set to what
    that path computes, the default path's losses are the same."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.support.shards import without_target_next

    old = without_target_next(data["hidden_paths"][0], tmp_path / "old.safetensors")
    with safe_open(str(old), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    lm_head = load_target_head(data["head_path"])[0]["lm_head.weight"].float()
    tensors["target_next"] = (tensors["last_hidden"].float() @ lm_head.T).argmax(-1).to(torch.int32)
    same = tmp_path / "same.safetensors"
    save_file(tensors, str(same), meta)
    rows = {}
    for name, shard in (("old", old), ("same", same)):
        out = tmp_path / name
        train_draft([shard], data["vocab_path"], out / "c.safetensors", out / "m.csv", head_path=data["head_path"],
                    settings=train_settings(CONFIG), state_dir=out / "state", progress=False)
        rows[name] = list(csv.DictReader(open(out / "m.csv")))
    said = capsys.readouterr()
    assert "1 shard(s) have no target_next" in said.out + said.err and str(old) in said.out + said.err
    assert len(rows["old"]) == len(rows["same"]) == 6
    for a, b in zip(rows["old"], rows["same"]):
        assert float(a["acc_0"]) == float(b["acc_0"])
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-4)


def test_default_selection_picks_the_fast_path_on_cuda_and_the_reference_on_cpu():
    cfg = train_settings({})
    assert {k: getattr(cfg, k) for k in AUTO_KEYS} == dict.fromkeys(AUTO_KEYS, "auto")
    cpu = resolve_runtime(cfg, "cpu")
    assert (cpu.attention, cpu.compile, cpu.recompute, cpu.fused_loss) == ("sdpa", False, False, False)
    cuda = resolve_runtime(cfg, "cuda:0")
    assert (cuda.attention, cuda.compile, cuda.recompute, cuda.fused_loss) == ("flex", True, False, True)
    assert cfg.freeze_lm_head is True
    assert (cpu.bf16_weights, cuda.bf16_weights) == (False, True)
    assert resolve_runtime(cfg.replace(attention="sdpa"), "cuda").compile is False
    assert resolve_runtime(cfg.replace(freeze_lm_head=False), "cuda").recompute is True
    with pytest.raises(ValueError, match="train.compile: true needs attention: flex on a CUDA device"):
        resolve_runtime(cfg.replace(compile=True), "cpu")
    assert (cpu.split_step_grads, cpu.diag_split, cuda.split_step_grads, cuda.diag_split) == (False, False, True, True)
    for key in ("split_step_grads", "diag_split"):
        with pytest.raises(ValueError, match=f"train.{key}: true needs attention: flex"):
            resolve_runtime(cfg.replace(**{key: True}), "cpu")
    assert (cpu.skip_unscored, cuda.skip_unscored) == (False, True)
    assert resolve_runtime(cfg.replace(diag_split=False), "cuda").skip_unscored is False
    with pytest.raises(ValueError, match="train.skip_unscored: true needs diag_split"):
        resolve_runtime(cfg.replace(diag_split=False, skip_unscored=True), "cuda")
    runtime = Runtime.from_settings(cuda, world=2)  # DDP watches the parameters' own gradients
    assert runtime.split_step_grads is False and runtime.diag_split is True
    # compiled: batches padded to one shape per padded length
    assert batching.padded_shape(1900, 3, cuda.replace(batch_tokens=8192, batch_size=None)) == (4, 1920)
    assert batching.padded_shape(1900, 3, cpu.replace(batch_tokens=8192, batch_size=None)) == (3, 1900)


def test_default_config_trains_on_cpu_with_the_reference_path(data, tmp_path, capsys):
    config = {k: v for k, v in CONFIG.items() if k != "save_every"}
    stats = run(data, tmp_path, {**config, "log_every": 4})
    assert "train_draft: cpu, attention sdpa, recompute False, fused loss False" in capsys.readouterr().err
    rows = list(csv.DictReader(open(tmp_path / "train_metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 7)) and stats["steps"] == 6
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)


def test_a_peagle_draft_trains_its_parallel_positions_and_their_mask(data, tmp_path):
    """draft.kind peagle through the same training loop: every position's loss falls, mask_hidden
    learns, the checkpoint carries it and the mask token (the target's last id), and the exported draft
    proposes what the trained one does (one forward, k tokens)."""
    from eaglenest.draft.export import export_draft
    from eaglenest.draft.model import Eagle3Draft
    from eaglenest.validation.predict import load_exported_draft

    stats = run(data, tmp_path, {**CONFIG, "kind": "peagle", "max_steps": 12})
    rows = list(csv.DictReader(open(tmp_path / "train_metrics.csv")))
    for j in range(CONFIG["ttt_length"]):
        assert float(rows[-1][f"loss_{j}"]) < float(rows[0][f"loss_{j}"]), j
    tensors, cfg, info, _ = load_checkpoint(tmp_path / "checkpoint.safetensors")
    assert (cfg.kind, cfg.parallel_drafting, cfg.mask_token_id) == ("peagle", True, info.vocab_size - 1)
    torch.manual_seed(CONFIG["seed"])
    start = Eagle3Draft(cfg).mask_hidden.detach()  # the seeded initial value train_draft started from
    assert tensors["mask_hidden"].shape == start.shape and not torch.allclose(tensors["mask_hidden"], start)
    assert stats["steps"] == 12
    export_draft(tmp_path / "checkpoint.safetensors", tmp_path / "export", dtype="float32")
    head, _ = load_target_head(data["head_path"])
    draft, _ = load_exported_draft(tmp_path / "export", head["embed_tokens.weight"])
    trained = Eagle3Draft(cfg)
    trained.load_state_dict(tensors)
    trained.set_target(head["embed_tokens.weight"], tensors["d2t"], tensors["t2d"])
    ids, aux = torch.randint(0, info.vocab_size, (9,)), torch.randn(9, 3 * info.hidden_size)
    assert torch.equal(draft.propose(ids, aux, 3), trained.propose(ids, aux, 3))


def test_bf16_weights_checkpoint_the_fp32_masters_and_resume_exactly(data, tmp_path, monkeypatch):
    """The CUDA default (bf16 weights, optim.MasterAdamW) run on CPU: the checkpoint holds the fp32
    masters, not the bf16 weights, and a run stopped after a saved state resumes to the same result."""
    config = {**CONFIG, "bf16_weights": True}
    run(data, tmp_path / "straight", config)
    a, _, _, trained = load_checkpoint(tmp_path / "straight" / "checkpoint.safetensors")
    assert trained["config"]["bf16_weights"] is True
    assert a["fc.weight"].dtype == torch.float32 and not torch.equal(a["fc.weight"], a["fc.weight"].bfloat16().float())
    rows = list(csv.DictReader(open(tmp_path / "straight" / "train_metrics.csv")))
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    interrupted_after_save(data, tmp_path / "killed", monkeypatch, at_step=4, config=config)
    assert run(data, tmp_path / "killed", config)["resumed_from"] == 4
    b = load_checkpoint(tmp_path / "killed" / "checkpoint.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_frozen_lm_head_stays_put(data, tmp_path):
    run(data, tmp_path / "a", {**CONFIG, "freeze_lm_head": True, "max_steps": 2})
    run(data, tmp_path / "b", {**CONFIG, "freeze_lm_head": False, "max_steps": 2})
    def head(d):
        return load_checkpoint(tmp_path / d / "checkpoint.safetensors")[0]["lm_head.weight"]

    from safetensors.torch import load_file

    start = load_file(str(data["head_path"]))["lm_head.weight"]
    d2t = load_file(str(data["vocab_path"]))["d2t"]
    torch.testing.assert_close(head("a"), start[torch.arange(len(d2t)) + d2t])
    assert not torch.allclose(head("b"), head("a"))


def test_a_failed_batch_read_stops_training_with_the_shard_named(data, tmp_path, monkeypatch):
    """Batches are read by a background thread: its error must reach the training loop, not hang it."""
    real = batching.load_batch
    calls = []

    def failing(shards, seq_ids, *args, **kwargs):
        calls.append(seq_ids)
        if len(calls) == 3:
            raise OSError("Input/output error")
        return real(shards, seq_ids, *args, **kwargs)

    monkeypatch.setattr(batching, "load_batch", failing)
    with pytest.raises(RuntimeError, match=r"reading a batch from .*shard_0.safetensors.* failed: Input/output error"):
        run(data, tmp_path, {**CONFIG, "save_every": 100})
    assert not (tmp_path / "checkpoint.safetensors").exists()


def test_compiled_batches_come_in_one_shape_per_padded_length():
    """Compiled, every micro-batch of a run is padded to [batch_tokens // T, T] with T a multiple of
    128, so the run compiles one graph per padded length, and never has more sequences than rows."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(5, 2048) for _ in range(3000)]
    cfg = resolve_runtime(train_settings({"batch_tokens": 8192}), "cuda")
    shapes = batching.run_shapes(lengths, cfg, 0, 400, 1)
    assert all(T % 128 == 0 and B == 8192 // T for B, T in shapes)
    assert len(shapes) == len({T for _, T in shapes}) <= 2048 // 128
    for batch in batching.epoch_batches(lengths, 0, cfg.seed, 8192, pad_to=128):
        B, T = batching.padded_shape(max(lengths[k] for k in batch), len(batch), cfg)
        assert len(batch) <= B and B * T <= 8192


def test_skip_unscored_trains_the_same_draft(data, tmp_path, monkeypatch):
    """train_draft on the flex path (the CUDA default's layout, uncompiled on CPU) with the later TTT
    steps at the scored chains only, and at every position: the same losses and accuracies step by
    step (the toy's traces have prompts, and batches of several sequences have padding)."""
    import eaglenest.draft.model
    import eaglenest.draft.ttt

    config = {**CONFIG, "attention": "flex", "fused_loss": True, "split_step_grads": True, "diag_split": True}
    sizes, chains = [], eaglenest.draft.ttt.ttt_chains

    def counted(rows, T, J, n_flat):  # how many positions the later steps run at, of how many
        out = chains(rows, T, J, n_flat)
        sizes.append((len(out), n_flat))
        return out

    monkeypatch.setattr(eaglenest.draft.model, "ttt_chains", counted)
    monkeypatch.setattr(eaglenest.draft.ttt, "ttt_chains", counted)  # the batch plan's chains
    rows = {}
    for skip in (True, False):
        out = tmp_path / str(skip)
        train_draft(data["hidden_paths"], data["vocab_path"], out / "c.safetensors", out / "m.csv", head_path=data["head_path"],
                    settings=train_settings({**config, "skip_unscored": skip}), state_dir=out / "state", progress=False)
        rows[skip] = list(csv.DictReader(open(out / "m.csv")))
    assert sum(n for n, _ in sizes) < 0.9 * sum(n_flat for _, n_flat in sizes)  # positions were skipped
    assert len(rows[True]) == len(rows[False]) == 6
    for a, b in zip(rows[True], rows[False]):
        for key in ("acc_0", "acc_2"):
            assert float(a[key]) == float(b[key])
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-5)


def test_drafts_kept_along_training_survive_a_kill_and_equal_an_uninterrupted_runs(data, tmp_path, monkeypatch):
    """train.snapshots: drafts at a third and two thirds of the run, written to their outputs at the end; a run
    killed after the first was kept resumes and still delivers both, equal to the uninterrupted run's."""
    def run_kept(out):
        paths = [out / "curve" / f"point_{i}.safetensors" for i in (1, 2)]
        stats = train_draft(data["hidden_paths"], data["vocab_path"], out / "checkpoint.safetensors", out / "m.csv",
                            head_path=data["head_path"], settings=train_settings(CONFIG), state_dir=out / ".train_state",
                            progress=False, snapshot_paths=paths)
        return stats, paths

    assert train.snapshot_steps(6, 2) == [2, 4] and train.snapshot_steps(1, 2) == [1, 1]
    _, straight = run_kept(tmp_path / "straight")
    kept = [load_checkpoint(p) for p in straight]
    assert [k[3]["step"] for k in kept] == [2, 4] and all(k[3]["of_steps"] == 6 for k in kept)
    assert kept[0][3]["tokens"] < kept[1][3]["tokens"]
    assert not any(torch.equal(kept[0][0][n], kept[1][0][n]) for n in ("fc.weight",))
    assert not list((tmp_path / "straight" / ".train_state").glob("curve_*")), "kept drafts are moved, not copied"

    save = train._save_state

    def save_then_die(state_dir, step, state, keep):
        save(state_dir, step, state, keep)
        if step == 4:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(train, "_save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_kept(tmp_path / "killed")
    monkeypatch.setattr(train, "_save_state", save)
    stats, resumed = run_kept(tmp_path / "killed")
    assert stats["resumed_from"] == 4
    for a, b in zip(straight, resumed):
        ta, tb = load_checkpoint(a)[0], load_checkpoint(b)[0]
        assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)


def test_a_resume_point_whose_kept_draft_is_gone_is_not_used(data, tmp_path, monkeypatch):
    """A state past a kept draft that is gone (here: a run killed before train.snapshots was set) cannot deliver
    that draft: the run resumes from the state before it (step 2; the one draft is kept at step 3)."""
    out = tmp_path / "out"
    paths = [out / "curve" / "point_1.safetensors"]
    interrupted_after_save(data, out, monkeypatch, at_step=4)
    stats = train_draft(data["hidden_paths"], data["vocab_path"], out / "checkpoint.safetensors", out / "m.csv",
                        head_path=data["head_path"], settings=train_settings(CONFIG), state_dir=out / ".train_state",
                        progress=False, snapshot_paths=paths)
    assert stats["resumed_from"] == 2 and load_checkpoint(paths[0])[3]["step"] == 3


def test_batches_carry_the_loss_plan_of_the_models_runtime(data):
    """The loader reads the model's resolved Runtime, not the config: the fused loss's plan, with the chains
    only where the model runs the later TTT steps at them (skip_unscored on the flex path with diag_split)."""
    from eaglenest.states.shards import HiddenShards

    shards = HiddenShards(data["hidden_paths"])
    lengths = [shards.length(k) for k in range(len(shards))]

    def first_batch(runtime):
        loader = batching.BatchLoader(shards, lengths, train_settings({"batch_tokens": 200}), start=0, count=1, rank=0,
                                      world=1, device="cpu", ttt_length=3, embed_table=torch.zeros(100, 8), runtime=runtime)
        try:
            return loader.next()[2]
        finally:
            loader.close()

    assert "plan" not in first_batch(Runtime())
    assert "chains" not in first_batch(Runtime(fused_loss=True))["plan"]
    assert "chains" not in first_batch(Runtime(attention="flex", fused_loss=True, skip_unscored=True))["plan"]  # no diag_split
    chained = first_batch(Runtime(attention="flex", diag_split=True, skip_unscored=True))
    assert len(chained["plan"]["chains"]) > 0 and "rows" in chained


class _FixedShards:
    def fingerprint_facts(self):
        return {"files": [["a", 1, 2]]}


@pytest.mark.parametrize("device, changes, expected", [
    ("cpu", {}, "99b8033c8030564a0c0c134374ab377a38bee8ea1545d0e71efafe71ef24fb80"),
    ("cuda", {}, "ddb6559bcd30ebac85765b12f168888a298676f2b95a8d32569d5d7070a6f97d"),
    ("cuda", {"lr": 1e-3, "grad_accum": 4, "kind": "peagle", "intermediate_size": 64},
     "bd45a75e9e9d5bb7e92a5bd4c40780be54ba13f296de54060e3228116d3d31ea"),
    ("cpu", {"kind": "dflash"}, "857078a90033f7314636f9b143d6f426d878eeeaf906c4f382959e939af2f1cb"),
])
def test_resume_fingerprint_is_the_one_states_were_saved_with(tmp_path, device, changes, expected):
    """The hash a resume point is saved under (``train.run_fingerprint``), pinned to the bytes the trainer wrote
    before its settings became typed (the training config dict): a state saved by an earlier version resumes.
    Two processes, the default settings, resolved for the device (an H100's capability: FP8 on CUDA)."""
    (tmp_path / "vocab").write_bytes(b"vocab")
    (tmp_path / "head").write_bytes(b"h" * 10)
    os.utime(tmp_path / "head", ns=(1_700_000_000_000_000_000,) * 2)
    settings = resolve_runtime(train_settings(changes), device, capability=(9, 0))
    assert train.run_fingerprint(settings, _FixedShards(), tmp_path / "vocab", tmp_path / "head", 2) == expected
