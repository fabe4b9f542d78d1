"""Both hidden-state backends on the toy target: extraction rate and agreement.

Starts an extraction server (the workflow's lifecycle code, toy in float32), extracts the same
synthetic traces with `hidden.backend: vllm` and `transformers`, and prints tokens/s of each, then
the largest |vLLM - transformers| per layer in float32 (vLLM's per-request files against
transformers' `output_hidden_states`, before either is rounded to the shard's bf16), and the
share of positions where the shards' `target_next` (vLLM: prompt logprobs' top-1 and the generated
token; transformers: the argmax of its head) agree.

    python benchmarks/bench_extract_backends.py [--seqs 1000 --concurrency 32 --port 18200]
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "toy" / "target"
AUX = [1, 2, 3]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--port", type=int, default=18200)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from eaglenest.states.extract import extract_hidden_vllm, hidden_server_config, layer_ids
    from eaglenest.settings import HiddenSettings
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import save_target_head
    from eaglenest.serving.local import LocalPaths, start_local, stop_local
    from eaglenest.serving.settings import ServerConfig
    from eaglenest.serving.lifecycle import wait_ready
    from eaglenest.serving.connector import read_states, storage_dir

    wd = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    rng = random.Random(0)
    seqs = []
    with open(wd / "traces.jsonl", "w") as f:
        for i in range(args.seqs):
            prompt = [rng.randrange(3, 105) for _ in range(rng.randint(5, 40))]
            completion = [rng.randrange(3, 105) for _ in range(rng.randint(20, 400))]
            seqs.append(prompt + completion)
            f.write(json.dumps({"id": f"t{i}", "prompt_token_ids": prompt, "completion_token_ids": completion}) + "\n")
    info = save_target_head(wd / "head.safetensors", HiddenSettings.defaults().replace(target=str(TOY), aux_layers=AUX))
    storage = storage_dir(wd / "states")
    server = {"model": str(TOY), "served_model_name": "toy", "port": args.port, "max_model_len": 512,
              "gpu_memory_utilization": 0.1, "dtype": "float32", "poll_interval": 1, "ready_timeout": 600}
    cfg = hidden_server_config(ServerConfig.from_dict(server), HiddenSettings.defaults().replace(max_length=512, port=args.port),
                               info, storage)
    paths = LocalPaths(wd / "logs")
    start_local(cfg, paths)
    try:
        wait_ready(cfg, paths)
        t = time.time()
        v = extract_hidden_vllm([wd / "traces.jsonl"], wd / "v.safetensors",
                                HiddenSettings.defaults().replace(max_length=512, concurrency=args.concurrency),
                                url=cfg.local_url, model="toy", head_path=wd / "head.safetensors", storage=storage,
                                progress=False)
        v_wall = time.time() - t
        # float32 agreement: a few raw per-request files, kept by asking the server directly
        import urllib.request

        raw = []
        for ids in seqs[:20]:
            body = json.dumps({"model": "toy", "prompt": ids, "max_tokens": 1}).encode()
            req = urllib.request.Request(cfg.local_url + "/v1/completions", body, {"Content-Type": "application/json"})
            path = json.loads(urllib.request.urlopen(req).read())["kv_transfer_params"]["hidden_states_path"]
            raw.append(read_states(path)["hidden_states"])
    finally:
        stop_local(paths)
    t = time.time()
    tf = extract_hidden([wd / "traces.jsonl"], wd / "t.safetensors",
                        HiddenSettings.defaults().replace(target=str(TOY), aux_layers=AUX, max_length=512, dtype="float32"), progress=False)
    tf_wall = time.time() - t
    from safetensors import safe_open

    nxt = []
    for name in ("v", "t"):
        with safe_open(str(wd / f"{name}.safetensors"), "pt") as f:
            nxt.append(f.get_tensor("target_next"))
    agree = (nxt[0] == nxt[1]).float().mean().item()
    model = AutoModelForCausalLM.from_pretrained(TOY, dtype=torch.float32).eval()
    worst = {i: 0.0 for i in layer_ids(info)}
    with torch.inference_mode():
        for ids, states in zip(seqs, raw):
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for j, i in enumerate(layer_ids(info)):
                ref = hs[i][0] if i < len(hs) - 1 else None
                if ref is None:  # id N: vLLM's pre-norm final state; transformers' last entry is post-norm
                    ref = model.model.norm(states[:, j])
                    got = hs[i][0]
                    worst[i] = max(worst[i], (ref - got).abs().max().item())
                else:
                    worst[i] = max(worst[i], (states[:, j] - ref).abs().max().item())
    print(json.dumps({
        "tokens": v["tokens"],
        "vllm": {"tokens_per_s": v["tokens_per_s"], "wall_s": round(v_wall, 2), "bytes": v["bytes"],
                 "concurrency": args.concurrency},
        "transformers": {"tokens_per_s": tf["tokens_per_s"], "wall_s": round(tf_wall, 2), "bytes": tf["bytes"]},
        "max_abs_diff_float32_by_vllm_id": worst,
        "target_next_agree": round(agree, 5),
        "note": f"id {max(worst)}: final norm applied to vLLM's state vs transformers' post-norm last state",
    }, indent=1))


if __name__ == "__main__":
    main()
