"""A tiny random target and fake traces: the pipeline's files for the training, export, report and
DDP tests (no server, no Snakemake)."""
import json
import random

VOCAB, HIDDEN, LAYERS = 100, 64, 4


def tiny_target(path, seed=0):
    """A randomly initialised 4-layer Llama (hidden 64, vocab 100) saved to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def fake_traces(path, n=12, seed=0, truncated_every=4):
    """Trace records with random token ids; every ``truncated_every``-th one is truncated."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))]
            # skewed so that some tokens are frequent: the draft vocabulary then means something
            completion = [min(VOCAB - 1, int(rng.expovariate(0.08))) for _ in range(rng.randint(5, 30))]
            rec = {
                "id": f"q{i}", "source": "test", "messages": [], "reasoning": "", "content": "",
                "finish_reason": "length" if i % truncated_every == 1 else "stop",
                "truncated": i % truncated_every == 1, "prompt_token_ids": prompt,
                "completion_token_ids": completion, "usage": {}, "latency_s": 0.0, "server": "test",
            }
            f.write(json.dumps(rec) + "\n")
    return path
