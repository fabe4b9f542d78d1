"""Validation of an exported draft: acceptance in real vLLM, an offline prediction, and baselines.

``validate_draft`` writes ``validation.json`` and a self-contained ``validation.html`` from:

- three vLLM runs over the held-out prompts, one server at a time (each stopped before the next
  starts, so GPUs are free between them): the target alone, the target with the EAGLE-3 draft, the
  target with vLLM's n-gram speculation. Same greedy settings for all. Per run: output tokens/s
  (completion tokens / wall time of the timed requests, the prompt set resent until the window
  lasts ``min_seconds``) and mean latency; for the speculative runs the acceptance from the
  DIFFERENCE of vLLM's /metrics counters read before and after the timed requests
  (``spec_counters``, ``acceptance``);
- an offline simulation of vLLM's chain speculation with the transformers target and the exported
  draft (``offline_acceptance``): the draft's chain at every position as vLLM's proposer drafts it
  (``chain_proposals``), walked with greedy verification (``simulate_chain``). It is the prediction
  the vLLM number is checked against; on the toy the two agree to the token count;
- the training curves of ``train_metrics.csv``, and checks that point at a cause when numbers
  disagree (served dtype, prompt tokens, the export against the training checkpoint).

Acceptance (vLLM's definitions, v1/spec_decode/metrics.py): mean acceptance length
``1 + accepted / drafts`` (the bonus token included), acceptance rate ``accepted / draft_tokens``,
per-position rate ``accepted_per_pos[i] / drafts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import torch

from .config import defaults
from .errors import ServerError, ValidationError
from .server import LocalPaths, ServerConfig, start_local, stop_local, wait_ready

SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}
# vLLM's acceptance length below this share of the offline prediction is reported as a disagreement.
WARN_BELOW = defaults("validate")["warn_below"]
# The usual reasons a draft does worse in vLLM than offline or than in training, each with the
# check (in report["checks"]) that speaks to it.
LIKELY_CAUSES = {
    "aux_layers": "auxiliary layer ids off by one: vLLM's id i is the state entering layer i (transformers' "
                  "output_hidden_states[i]); SpecForge counts layer outputs, one less",
    "norm_before_residual": "norm_before_residual differs between training and config.json (vLLM reads it from "
                            "config.json; absent means false)",
    "d2t": "d2t inverted, or written as target ids instead of offsets (vLLM: target_id = draft_id + d2t[draft_id])",
    "dtype": "the target served in a different dtype than the hidden states were extracted in",
    "template": "chat template or tokenization differences between the traces and serving",
    "data": "the draft trained on too little data (it fits its training set, not the held-out prompts)",
}

DEFAULTS = defaults("validate")  # the schema's `validate:` section (the only place defaults are written)




# ----------------------------------------------------------------------------- Prometheus


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """Samples of a Prometheus text exposition: ``(name, labels, value)``; comments are skipped."""
    samples = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"line {lineno} of the metrics text is not a Prometheus sample: {line[:200]!r}")
        name, _, body, value = m.group(1), m.group(2), m.group(3), m.group(4)
        labels, pos = {}, 0
        body = body or ""
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if not lm:
                raise ValueError(f"line {lineno}: bad label set {{{body}}}")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        samples.append((name, labels, float(value)))
    return samples


def spec_counters(text: str) -> dict:
    """vLLM's speculative-decoding counters from /metrics text, summed over every label set
    (engines, model names) except ``position``: ``{drafts, draft_tokens, accepted,
    accepted_per_pos: {position: count}}``. Counters vLLM does not expose (no speculation) are 0."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "accepted_per_pos": {}}
    names = {v: k for k, v in SPEC_METRICS.items()}
    for name, labels, value in parse_prometheus(text):
        key = names.get(name)
        if key is None:
            continue
        if key == "accepted_per_pos":
            pos = int(labels["position"])
            out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + value
        else:
            out[key] += value
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two ``spec_counters`` readings (counters only grow while a server lives)."""
    delta = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    positions = set(before["accepted_per_pos"]) | set(after["accepted_per_pos"])
    delta["accepted_per_pos"] = {p: after["accepted_per_pos"].get(p, 0.0) - before["accepted_per_pos"].get(p, 0.0)
                                 for p in sorted(positions)}
    if min([delta["drafts"], delta["draft_tokens"], delta["accepted"], *delta["accepted_per_pos"].values()]) < 0:
        raise ValidationError(f"vLLM's speculative-decoding counters went down between two readings "
                              f"({before} -> {after}): the server restarted during the run")
    return delta


def acceptance(counts: dict, k: int) -> dict:
    """Acceptance statistics of counter differences (or of simulated counts, same keys)."""
    drafts, draft_tokens, accepted = counts["drafts"], counts["draft_tokens"], counts["accepted"]
    per_pos = counts["accepted_per_pos"]
    return {
        "acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "per_position": [per_pos.get(i, 0.0) / drafts for i in range(k)] if drafts else None,
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted": int(accepted),
    }


def read_metrics(url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    req = urllib.request.Request(f"{url}/metrics")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode()
    except OSError as e:
        raise ValidationError(f"could not read {url}/metrics: {e}") from e


def settled_counters(url: str, api_key: str | None = None, wait_s: float = 5.0) -> dict:
    """The counters once two readings 0.5 s apart agree (stats reach the frontend with a small lag)."""
    last = spec_counters(read_metrics(url, api_key))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = spec_counters(read_metrics(url, api_key))
        if now == last:
            break
        last = now
    return last


# ----------------------------------------------------------------------------- the client


async def _chat_all(url, model, prompts, body, concurrency, timeout_s, api_key, retries=2):
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    results = [None] * len(prompts)
    queue = iter(range(len(prompts)))
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(30.0, timeout_s))

    async def one(session, i):
        payload = {"model": model, "messages": prompts[i]["messages"], **body}
        for attempt in range(retries + 1):
            t0 = time.monotonic()
            try:
                async with session.post(f"{url}/v1/chat/completions", json=payload) as r:
                    raw = await r.read()
                    if r.status == 200:
                        answer = json.loads(raw)
                        choice = answer["choices"][0]
                        return {
                            "id": prompts[i].get("id", str(i)),
                            "latency_s": time.monotonic() - t0,
                            "completion_tokens": answer["usage"]["completion_tokens"],
                            "prompt_token_ids": answer.get("prompt_token_ids"),
                            "token_ids": choice.get("token_ids"),
                            "finish_reason": choice.get("finish_reason"),
                        }
                    problem = f"HTTP {r.status}: {raw[:500].decode('utf-8', 'replace')}"
                    if r.status < 500 and r.status not in (408, 429):
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                problem = f"{type(e).__name__}: {e}"
            await asyncio.sleep(1.0 + attempt)
        raise ValidationError(f"request {prompts[i].get('id', i)} to {url}/v1/chat/completions failed: {problem}")

    async def worker(session):
        for i in queue:
            results[i] = await one(session, i)

    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(prompts)))))
    return results


def request_body(max_tokens: int, chat_template_kwargs=None, extra_body=None) -> dict:
    """Greedy request settings, the same for every run; exact token ids come back (return_token_ids)."""
    body = dict(extra_body or {})
    body.update({"max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True})
    if chat_template_kwargs:
        body["chat_template_kwargs"] = chat_template_kwargs
    return body


def run_requests(url, model, prompts, body, *, concurrency=8, timeout_s=3600.0, api_key=None, min_seconds=0.0) -> dict:
    """Send every prompt (``concurrency`` in flight), and the whole set again until ``min_seconds``
    have passed (a short window makes tokens/s noise); returns throughput, latency, the number of
    passes and the first pass's answers."""
    t0 = time.monotonic()
    answers, passes, tokens, latencies = None, 0, 0, []
    while passes == 0 or time.monotonic() - t0 < min_seconds:
        got = asyncio.run(_chat_all(url, model, prompts, body, concurrency, timeout_s, api_key))
        answers = answers or got
        passes += 1
        tokens += sum(a["completion_tokens"] for a in got)
        latencies += [a["latency_s"] for a in got]
    wall = time.monotonic() - t0
    return {
        "requests": len(latencies),
        "passes": passes,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "mean_latency_s": sum(latencies) / max(len(latencies), 1),
        "answers": answers,
    }


# ----------------------------------------------------------------------------- one vLLM run


def speculative_config(method: str, k: int, draft_dir=None, ngram=None) -> dict | None:
    """vLLM's --speculative-config for a run: None (target alone), eagle3 or ngram."""
    if method == "baseline":
        return None
    if method == "eagle3":
        return {"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, **(ngram or {})}
    raise ValueError(f"unknown speculative method {method!r}")


def served_dtype(log_path) -> str | None:
    """The dtype vLLM reports in its engine config line, from the last start in its log."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return None
    text = text.rsplit("=== ", 1)[-1]
    m = re.search(r"\bdtype=(?:torch\.)?(\w+)", text)
    return m.group(1) if m else None


@contextlib.contextmanager
def _sigterm_stops_servers():
    """Turn SIGTERM (Snakemake cancelling a job) into KeyboardInterrupt so `finally` stops the server."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _reap(pid: int) -> None:
    """Collect the exit status of a server this process started, so no zombie is left behind."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def measure_run(name, server: ServerConfig, spec: dict | None, prompts, body, *, log_dir, concurrency=8,
                timeout_s=3600.0, warmup_requests=2, min_seconds=0.0, workflow_pid=None, log=print) -> dict:
    """Start vLLM (the target, with ``spec`` as its --speculative-config), send the prompts, read
    the counters around the timed requests, and stop the server (its whole process group) always."""
    if any(str(a).startswith("--speculative-config") or str(a).startswith("--speculative_config")
           for a in server.extra_args):
        raise ValidationError("server.extra_args holds a --speculative-config: validation sets its own "
                              "per run; remove it from server.extra_args")
    extra = list(server.extra_args) + (["--speculative-config", json.dumps(spec)] if spec else [])
    cfg = dataclasses.replace(server, mode="local", extra_args=extra, keep_server=False)
    paths = LocalPaths(Path(log_dir) / name)
    stop_local(paths, log=log)  # a server left by a killed earlier validation
    api_key = cfg.api_key()
    t0 = time.monotonic()
    record = None
    with _sigterm_stops_servers():
        try:
            # start_local leaves out the job's thread-count variables (server.THREAD_ENV)
            record = start_local(cfg, paths, workflow_pid=workflow_pid, log=log)
            ready = wait_ready(cfg, paths, log=log)
            url = cfg.local_url
            if warmup_requests:
                run_requests(url, cfg.model_id, prompts[:warmup_requests], body, concurrency=concurrency,
                             timeout_s=timeout_s, api_key=api_key)
            before = settled_counters(url, api_key, wait_s=2.0)
            load = os.getloadavg()[0]
            result = run_requests(url, cfg.model_id, prompts, body, concurrency=concurrency,
                                  timeout_s=timeout_s, api_key=api_key, min_seconds=min_seconds)
            after = settled_counters(url, api_key)
            # Other processes on the machine skew tokens/s: the 1-minute load around the timed requests.
            result["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        finally:
            stop_local(paths, log=log)
            if record:
                _reap(record["pid"])
    result.update({"seconds_to_ready": ready["seconds_to_ready"], "vllm_version": ready.get("version"),
                   "served_dtype": served_dtype(paths.log), "seconds": round(time.monotonic() - t0, 1),
                   "speculative_config": spec})
    if spec:
        k = spec["num_speculative_tokens"]
        result.update(acceptance(counter_delta(before, after), k))
        if result["drafts"] == 0:
            raise ValidationError(f"{name}: vLLM counted no speculative drafts over {len(prompts)} requests "
                                  f"(counters {after}); speculation did not run: see {paths.log}")
    log(f"{name}: {result['completion_tokens']} tokens ({result['passes']} pass(es)) in {result['wall_s']:.1f} s "
        f"({result['output_tokens_per_s']:.1f} tok/s, mean latency {result['mean_latency_s']:.2f} s)"
        + (f", acceptance length {result['acceptance_length']:.3f}" if spec else ""))
    return result


# ----------------------------------------------------------------------------- offline prediction


def load_exported_draft(draft_dir, embed_weight, *, dtype=torch.float32, device="cpu"):
    """The exported draft as vLLM reads it (config.json keys, vLLM's defaults where absent) in an
    ``Eagle3Draft``, with the target's embedding. Returns ``(model, config)``."""
    from .export import load_exported
    from .model import DraftConfig, Eagle3Draft

    config, tensors = load_exported(draft_dir)
    hidden = config["hidden_size"]
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    cfg = DraftConfig(
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim") or hidden // config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        target_hidden_size=config.get("target_hidden_size", hidden),
        num_aux_layers=len(ids) or 3,
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters=config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)},
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        norm_before_residual=bool(config.get("norm_before_residual", False)),  # llama_eagle3.py: absent = false
    )
    model = Eagle3Draft(cfg)
    state = dict(tensors)
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # left out when vocabularies match
    state.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "embed_weight"]:
        raise ValidationError(f"{draft_dir}: tensors do not fit an EAGLE-3 draft (missing {missing}, unexpected {unexpected})")
    model.to(device)
    # Weights in the serving dtype; the rope frequencies stay float32 (vLLM builds its cos/sin cache
    # in float32 too): a bf16 inv_freq turns far positions by a visible angle.
    for module in (model.fc, model.midlayer, model.norm, model.lm_head):
        module.to(dtype)
    model.embed_weight = embed_weight.detach().to(device, dtype).clone()
    return model.eval(), config


@torch.no_grad()
def chain_proposals(draft, aux_hidden, tokens, k) -> torch.Tensor:
    """What vLLM's EAGLE-3 proposer drafts at every position of one sequence, as target ids [T, k].

    Row t is the chain drafted after the target has verified tokens 0..t and sampled token t+1:
    step 0 takes the target's fused features at t and token t+1 at position t; step j takes the
    draft's own token of step j-1 and its pre-norm output at position t+j, and attends to step 0's
    keys at positions <= t (the draft's KV cache, always rebuilt from target features at accepted
    positions) plus its own chain's keys (llm_base_proposer.propose). The last row, which has no
    token t+1 to start from, is -1.
    ``aux_hidden`` [T, 3*Ht] are the target's states at the draft's layer ids; ``tokens`` [T] int64.
    """
    from .model import ttt_mask

    T = tokens.shape[0]
    dev = draft.fc.weight.device
    dtype = draft.fc.weight.dtype
    nxt = torch.cat([tokens[1:], tokens.new_zeros(1)]).to(dev)  # token t+1 at row t
    hidden = draft.fc(aux_hidden.to(dev, dtype)).unsqueeze(0)  # [1, T, H]
    ids = nxt.unsqueeze(0)
    base = torch.arange(T, device=dev)
    draft_to_target = draft.draft_ids()
    past, proposals = [], []
    for j in range(k):
        embeds = torch.nn.functional.embedding(ids, draft.embed_weight).to(dtype)
        cos, sin = draft.rotary_emb(hidden, (base + j).unsqueeze(0))
        hidden, kv = draft.midlayer(embeds, hidden, cos, sin, past, ttt_mask(T, j, dev))
        past.append(kv)
        logits = draft.norm(hidden) @ draft.lm_head.weight.T
        ids = draft_to_target[logits.argmax(-1)]  # [1, T] target ids
        proposals.append(ids[0])
    out = torch.stack(proposals, dim=1).cpu()
    out[T - 1 :] = -1  # no token t+1 to start from
    return out


def simulate_chain(proposals, tokens, start: int, k: int, end: int | None = None) -> list[int]:
    """Accepted count of every draft when greedy speculation generates ``tokens[start:end+1]``.

    ``tokens`` is the whole greedy sequence (prompt + completion), optionally followed by the
    target's greedy continuation past the last generated token ``end`` (default: the last token).
    A draft is made each step after the target has sampled token m (from m = start) until token
    ``end`` is out; its j-th token is accepted while it equals tokens[m+1+j]; the target then adds
    one token (the bonus, or its correction). Like vLLM, which verifies a draft before its stop
    check, a draft that runs past ``end`` is still compared with the continuation there (an eos
    accepted mid-draft, then what the target would say after it); without a continuation, tokens
    past the end count as rejected.
    """
    end = len(tokens) - 1 if end is None else end
    last = len(tokens) - 1
    counts, m = [], start
    while m < end:
        chain = proposals[m - 1]
        a = 0
        while a < k and m + 1 + a <= last and int(chain[a]) == int(tokens[m + 1 + a]):
            a += 1
        counts.append(a)
        m += a + 1
    return counts


def counts_from_accepted(accepted: list[int], k: int) -> dict:
    """Counter-shaped totals (as vLLM's /metrics would count them) from per-draft accepted counts."""
    return {
        "drafts": len(accepted),
        "draft_tokens": k * len(accepted),
        "accepted": sum(accepted),
        "accepted_per_pos": {i: sum(a > i for a in accepted) for i in range(k)},
    }


def greedy_sequences(model, tokenizer, prompts, max_tokens, chat_template_kwargs=None):
    """``(prompt_ids, completion_ids)`` of the target's greedy answer to each prompt (transformers,
    one prompt at a time: no padding that could change the numbers). Stops at eos, as vLLM does."""
    dev = model.get_input_embeddings().weight.device
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or [])) | ({tokenizer.eos_token_id} - {None})
    out = []
    for p in prompts:
        ids = chat_prompt_ids(tokenizer, p["messages"], chat_template_kwargs)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids], device=dev), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                                 do_sample=False, max_new_tokens=max_tokens, eos_token_id=sorted(eos),
                                 pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(eos)[0])
        completion = gen[0, len(ids):].tolist()
        for i, t in enumerate(completion):
            if t in eos:
                completion = completion[: i + 1]
                break
        out.append((ids, completion))
    return out


def chat_prompt_ids(tokenizer, messages, chat_template_kwargs=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **(chat_template_kwargs or {}))
    return list(ids)


@torch.no_grad()
def target_states(model, tokens, aux_layers, extra: int = 0):
    """The target over one sequence: its aux states at vLLM ids ``aux_layers`` [T, 3*H], its greedy
    choice at every position [T] (the token it would put next), and its greedy continuation of
    ``extra`` tokens past the end (eos or not: what vLLM's verifier sees after a drafted eos)."""
    from .hidden import _AuxCapture, _decoder

    decoder = _decoder(model)
    dev = model.get_input_embeddings().weight.device
    head = model.get_output_embeddings().weight
    capture = _AuxCapture(decoder, aux_layers)
    try:
        out = decoder(input_ids=torch.tensor([tokens], device=dev), use_cache=extra > 1)
        aux = torch.cat([capture.states[i][0] for i in aux_layers], dim=-1)
    finally:
        capture.remove()
    last = out.last_hidden_state[0]
    argmax = torch.cat([(last[s : s + 1024] @ head.T).argmax(-1) for s in range(0, len(tokens), 1024)])
    tail = [int(argmax[-1])] if extra else []
    past = out.past_key_values
    while len(tail) < extra:
        out = decoder(input_ids=torch.tensor([[tail[-1]]], device=dev), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tail.append(int((out.last_hidden_state[0, -1] @ head.T).argmax()))
    return aux, argmax.cpu(), tail


def offline_acceptance(target, draft_dir, *, k, sequences=None, prompts=None, max_tokens=256,
                       chat_template_kwargs=None, dtype="bfloat16", device="auto", model=None, progress=True) -> dict:
    """Predict vLLM's acceptance of the exported draft by simulating greedy chain speculation.

    The greedy sequences are ``sequences`` (``(prompt_ids, completion_ids)`` pairs, e.g. the answers
    of the target-alone vLLM run), or else generated from ``prompts`` with the transformers target.
    The target runs once over each whole sequence for its auxiliary states (and k tokens past its
    end, which vLLM's verifier also compares a draft with); the draft's chains at every position
    come from ``chain_proposals``; ``simulate_chain`` counts what greedy verification accepts. ``target_agreement``: the share of completion tokens that the
    transformers target would also choose (below 1: the sequences are not this target's greedy
    answers, e.g. served in another dtype).
    """
    from .hidden import load_target, resolve_device
    from .util import progress_bar as tqdm

    t0 = time.time()
    device = resolve_device(device)
    if model is None:
        model = load_target(target, device=device, dtype=dtype)
    torch_dtype = model.get_input_embeddings().weight.dtype
    draft, config = load_exported_draft(draft_dir, model.get_input_embeddings().weight, dtype=torch_dtype,
                                        device=model.get_input_embeddings().weight.device)
    n_layers = model.config.get_text_config().num_hidden_layers
    aux_layers = sorted(set(config.get("eagle_aux_hidden_state_layer_ids") or (2, n_layers // 2, n_layers - 3)))
    source = "given"
    if sequences is None:
        from transformers import AutoTokenizer

        source = "generated"
        tokenizer = AutoTokenizer.from_pretrained(target)
        sequences = greedy_sequences(model, tokenizer, prompts, max_tokens, chat_template_kwargs)
    accepted, agree, total = [], 0, 0
    for prompt_ids, completion in tqdm(sequences, desc="offline", unit="seq", disable=not progress):
        if not completion:
            continue
        tokens = list(prompt_ids) + list(completion)
        aux, greedy, tail = target_states(model, tokens, aux_layers, extra=k)
        agree += int((greedy[len(prompt_ids) - 1 : -1] == torch.tensor(completion)).sum())
        total += len(completion)
        proposals = chain_proposals(draft, aux, torch.tensor(tokens), k)
        accepted += simulate_chain(proposals, tokens + tail, len(prompt_ids), k, end=len(tokens) - 1)
    result = acceptance(counts_from_accepted(accepted, k), k)
    result.update({
        "sequences": len(sequences), "completion_tokens": total, "tokens_source": source,
        "target_agreement": agree / total if total else None, "dtype": str(torch_dtype).removeprefix("torch."),
        "aux_layers": aux_layers, "seconds": round(time.time() - t0, 1),
    })
    return result


# ----------------------------------------------------------------------------- training curves


def read_train_metrics(path) -> dict:
    """Columns of train_metrics.csv as float lists, plus ``ttt_length`` (the number of acc_j columns)."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {"step": [], "ttt_length": 0}
    cols = {key: [float(r[key]) if r[key] not in ("", None) else math.nan for r in rows] for key in rows[0]}
    cols["ttt_length"] = sum(1 for key in rows[0] if re.fullmatch(r"acc_\d+", key))
    return cols


def train_summary(curves: dict, k: int) -> dict:
    """Final training numbers (mean over the last tenth of the steps) and the acceptance they imply
    if the steps' top-1 hits were independent: P(first i accepted) = acc_0 · ... · acc_{i-1}."""
    n = len(curves.get("step", []))
    if not n:
        return {}
    tail = max(1, n // 10)
    mean = lambda key: sum(curves[key][-tail:]) / tail  # noqa: E731
    J = curves["ttt_length"]
    acc = [mean(f"acc_{j}") for j in range(J)]
    per_pos, p = [], 1.0
    for j in range(min(k, J)):
        p *= acc[j]
        per_pos.append(p)
    return {
        "steps": int(curves["step"][-1]), "final_loss": mean("loss"), "acc": acc,
        "predicted_per_position": per_pos,
        "predicted_acceptance_length": 1 + sum(per_pos) if len(per_pos) == k else None,
    }


# ----------------------------------------------------------------------------- the report


def _evidence(report: dict) -> dict:
    """What the checks say about each likely cause: ``{cause: note}``."""
    checks, notes = report.get("checks") or {}, {}
    diffs = checks.get("export_vs_training")
    if diffs is not None:
        for key, words in (("aux_layers", "aux"), ("norm_before_residual", "norm_before_residual"), ("d2t", "d2t")):
            found = [d for d in diffs if words in d]
            notes[key] = "FOUND: " + "; ".join(found) if found else "config.json and tensors match the training checkpoint"
    if checks.get("served_dtype"):
        same = checks["served_dtype"] == checks.get("offline_dtype")
        notes["dtype"] = ("" if same else "FOUND: ") + f"vLLM served {checks['served_dtype']}, offline ran {checks.get('offline_dtype')}"
    if checks.get("prompt_template_mismatches") is not None:
        n = checks["prompt_template_mismatches"]
        notes["template"] = (f"FOUND: {n} prompts tokenized differently by vLLM" if n
                             else "vLLM's prompt tokens equal apply_chat_template's for every prompt")
    t, o = report.get("train") or {}, report.get("offline") or {}
    if t.get("predicted_acceptance_length") and o.get("acceptance_length"):
        notes["data"] = (f"training accuracy implies {t['predicted_acceptance_length']:.2f}, held-out offline "
                         f"{o['acceptance_length']:.2f} after {t.get('steps')} steps")
    return notes


def findings(report: dict, warn_below: float = WARN_BELOW) -> list[dict]:
    """Warnings in words: the vLLM/offline disagreement first (with its likely causes and what the
    checks say about each), then notes."""
    out = []
    e, o, n, t = (report.get(key) or {} for key in ("eagle3", "offline", "ngram", "train"))
    checks = report.get("checks") or {}
    notes = _evidence(report)
    causes = [text + (f" [{notes[key]}]" if key in notes else "") for key, text in LIKELY_CAUSES.items()]
    vllm_al, off_al = e.get("acceptance_length"), o.get("acceptance_length")
    if vllm_al is not None and off_al is not None and vllm_al < warn_below * off_al:
        out.append({
            "kind": "disagreement",
            "message": f"vLLM's mean acceptance length {vllm_al:.3f} is {vllm_al / off_al:.0%} of the offline "
                       f"prediction {off_al:.3f} (below {warn_below:.0%}): vLLM does not run the draft the way it "
                       f"was trained and evaluated. Likely causes:",
            "causes": causes,
        })
    train_al = t.get("predicted_acceptance_length")
    if train_al and off_al is not None and off_al < warn_below * train_al:
        out.append({
            "kind": "training_gap",
            "message": f"On the held-out prompts the draft reaches an acceptance length of {off_al:.3f} offline, "
                       f"{off_al / train_al:.0%} of the {train_al:.3f} its final training accuracy implies: the exported "
                       f"draft is not the trained one, or it fits its training data only. Likely causes:",
            "causes": [c for c, key in zip(causes, LIKELY_CAUSES) if key in ("aux_layers", "norm_before_residual", "d2t", "data")],
        })
    if checks.get("export_vs_training"):
        out.append({"kind": "export", "message": "The exported draft differs from the training checkpoint: "
                    + "; ".join(checks["export_vs_training"])})
    if checks.get("prompt_template_mismatches"):
        out.append({"kind": "template", "message": f"{checks['prompt_template_mismatches']} of {report.get('prompts')} "
                    "prompts were tokenized differently by vLLM's chat template than by the tokenizer's "
                    "apply_chat_template: traces and serving may not see the same tokens."})
    if checks.get("served_dtype") and checks.get("offline_dtype") and checks["served_dtype"] != checks["offline_dtype"]:
        out.append({"kind": "dtype", "message": f"vLLM served the target in {checks['served_dtype']}, the offline "
                    f"evaluation ran it in {checks['offline_dtype']}."})
    if vllm_al is not None and n.get("acceptance_length") is not None and vllm_al <= n["acceptance_length"]:
        out.append({"kind": "ngram", "message": f"The EAGLE-3 draft ({vllm_al:.3f}) does not beat n-gram "
                    f"speculation ({n['acceptance_length']:.3f}) on acceptance length."})
    loads = {key: max((report.get(key) or {}).get("load_average") or [0]) for key in ("baseline", "eagle3", "ngram")}
    cores = os.cpu_count() or 1
    if max(loads.values()) > 1.5 * cores:
        out.append({"kind": "load", "message": f"Other processes competed for the {cores} CPU cores during the runs "
                    f"(1-minute load up to {max(loads.values()):.1f}): the tokens/s and the speed-up are unreliable; "
                    "acceptance is not affected."})
    if report.get("speedup") is not None and report["speedup"] < 1:
        out.append({"kind": "speed", "message": f"EAGLE-3 is slower than the target alone (×{report['speedup']:.2f} "
                    "output tokens/s): the draft's cost outweighs the accepted tokens at this size and batch."})
    return out


def export_differences(export_dir, checkpoint_path) -> list[str]:
    """How the exported draft (what vLLM loads) differs from the training checkpoint: config keys
    vLLM reads, d2t, and every weight (compared in the export's dtype). Empty when they agree."""
    from .export import load_exported
    from .train import load_checkpoint

    config, tensors = load_exported(export_dir)
    saved, dcfg, info, _ = load_checkpoint(checkpoint_path)
    diffs = []
    ids = list(config.get("eagle_aux_hidden_state_layer_ids") or [])
    if ids != list(info["aux_layers"]):
        diffs.append(f"aux layer ids: config.json {ids or '(absent: vLLM default)'}, trained on {info['aux_layers']}")
    if bool(config.get("norm_before_residual", False)) != bool(dcfg.norm_before_residual):
        diffs.append(f"norm_before_residual: config.json {config.get('norm_before_residual', '(absent: false)')}, "
                     f"trained with {dcfg.norm_before_residual}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "draft_vocab_size", "rms_norm_eps"):
        if config.get(key) != getattr(dcfg, key):
            diffs.append(f"{key}: config.json {config.get(key)}, trained with {getattr(dcfg, key)}")
    d2t = tensors.get("d2t", torch.zeros_like(saved["d2t"]))
    if d2t.shape != saved["d2t"].shape or not torch.equal(d2t, saved["d2t"]):
        as_ids = d2t.shape == saved["d2t"].shape and torch.equal(d2t, saved["d2t"] + torch.arange(len(d2t)))
        diffs.append("d2t differs from training's" + (" (written as target ids, not offsets)" if as_ids else ""))
    for name, t in saved.items():
        if name in ("d2t", "t2d"):
            continue
        if name not in tensors:
            diffs.append(f"{name} missing from the export")
        elif tensors[name].shape != t.shape or not torch.equal(tensors[name], t.to(tensors[name].dtype)):
            diffs.append(f"{name} differs from training's")
    return diffs


def _ratio(a, b):
    return a / b if a is not None and b else None


def _identical(answers_a, answers_b) -> float | None:
    pairs = [(a.get("token_ids"), b.get("token_ids")) for a, b in zip(answers_a, answers_b)]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def build_report(*, target, draft_dir, k, prompts, max_tokens, runs: dict, offline: dict, train: dict,
                 checks: dict, settings: dict, warn_below=WARN_BELOW) -> dict:
    """The validation.json dict (answers dropped) with the speed-up, agreement and warnings."""
    strip = lambda r: {key: v for key, v in (r or {}).items() if key != "answers"}  # noqa: E731
    e, n, b = (strip(runs.get(key)) for key in ("eagle3", "ngram", "baseline"))
    report = {
        "target": str(target),
        "draft": str(Path(draft_dir).resolve()),
        "num_speculative_tokens": k,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "eagle3": e,
        "ngram": n,
        "baseline": b,
        "offline": offline,
        "train": train,
        "speedup": _ratio(e.get("output_tokens_per_s"), b.get("output_tokens_per_s")),
        "ngram_speedup": _ratio(n.get("output_tokens_per_s"), b.get("output_tokens_per_s")),
        "agreement": _ratio(e.get("acceptance_length"), (offline or {}).get("acceptance_length")),
        "checks": checks,
        "settings": settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    report["warnings"] = findings(report, warn_below)
    return report


def write_report(report: dict, json_path, html_path, train_curves=None) -> None:
    from .report import render_html

    for path, text in ((json_path, json.dumps(report, indent=2) + "\n"), (html_path, render_html(report, train_curves))):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(text)
        os.replace(tmp, path)


def resolve_settings(validate: dict | None, generation: dict) -> dict:
    """The ``validate:`` config with defaults, ``max_tokens`` falling back to generation.max_tokens."""
    s = {**DEFAULTS, **(validate or {})}
    s["ngram"] = {**DEFAULTS["ngram"], **(s.get("ngram") or {})}
    s["offline"] = {**DEFAULTS["offline"], **(s.get("offline") or {})}
    if s["max_tokens"] is None:
        s["max_tokens"] = generation["max_tokens"]
    return s


def read_prompts(path) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("messages"), list):
                raise ValidationError(f"{path}:{lineno}: a prompt row needs 'messages' (a list of chat turns)")
            rows.append(row)
    if not rows:
        raise ValidationError(f"{path} holds no prompts: set dataset.heldout above 0")
    return rows


def validate_draft(draft_dir, heldout_path, metrics_path, json_path, html_path, *, server: dict, generation: dict,
                   validate: dict | None = None, target=None, hidden_dtype="bfloat16", checkpoint_path=None,
                   log_dir="logs/validate", workflow_pid=None, log=print) -> dict:
    """The whole validation (module docstring); returns the report dict it wrote. ``checkpoint_path``
    (the training checkpoint) adds the export-against-training check."""
    t0 = time.time()
    s = resolve_settings(validate, generation)
    k = s["num_speculative_tokens"]
    prompts = read_prompts(heldout_path)
    srv = ServerConfig.from_dict(server)
    if s.get("port"):
        srv = dataclasses.replace(srv, port=s["port"])
    target = target or srv.model
    body = request_body(s["max_tokens"], generation.get("chat_template_kwargs"), generation.get("extra_body"))
    timeout_s = generation.get("request_timeout", 3600.0)
    runs = {}
    specs = {"baseline": speculative_config("baseline", k),
             "eagle3": speculative_config("eagle3", k, draft_dir),
             "ngram": speculative_config("ngram", k, ngram=s["ngram"])}
    for name, spec in specs.items():
        log(f"validate_draft: run '{name}' ({len(prompts)} prompts, k={k})")
        try:
            runs[name] = measure_run(name, srv, spec, prompts, body, log_dir=log_dir, concurrency=s["concurrency"],
                                     timeout_s=timeout_s, warmup_requests=s["warmup_requests"],
                                     min_seconds=s["min_seconds"], workflow_pid=workflow_pid, log=log)
        except ServerError as e:
            raise ValidationError(f"validation run '{name}' could not start vLLM: {e}") from e

    off = s["offline"]
    offline_dtype = off["dtype"] or hidden_dtype
    log(f"validate_draft: offline prediction ({off['tokens']} sequences, {offline_dtype})")
    sequences = None
    if off["tokens"] == "served":
        sequences = [(a["prompt_token_ids"], a["token_ids"]) for a in runs["baseline"]["answers"]]
    offline = offline_acceptance(target, draft_dir, k=k, sequences=sequences, prompts=prompts, max_tokens=s["max_tokens"],
                                 chat_template_kwargs=generation.get("chat_template_kwargs"), dtype=offline_dtype,
                                 device=off["device"])
    log(f"validate_draft: offline acceptance length {offline['acceptance_length']:.3f} "
        f"({offline['drafts']} drafts, {offline['seconds']} s)")

    checks = _checks(target, prompts, runs, generation, offline)
    if checkpoint_path is not None:
        checks["export_vs_training"] = export_differences(draft_dir, checkpoint_path)
    curves = read_train_metrics(metrics_path)
    report = build_report(
        target=target, draft_dir=draft_dir, k=k, prompts=len(prompts), max_tokens=s["max_tokens"], runs=runs,
        offline=offline, train=train_summary(curves, k), checks=checks, warn_below=s["warn_below"],
        settings={"concurrency": s["concurrency"], "ngram": s["ngram"], "offline": off, "warmup_requests": s["warmup_requests"],
                  "min_seconds": s["min_seconds"],
                  "served_model": srv.model_id, "tensor_parallel_size": srv.tensor_parallel_size,
                  "max_model_len": srv.max_model_len, "server": f"{srv.host}:{srv.port}"},
    )
    report["seconds"] = round(time.time() - t0, 1)
    write_report(report, json_path, html_path, curves)
    e = report["eagle3"]
    log(f"validate_draft: EAGLE-3 acceptance length {e['acceptance_length']:.3f} in vLLM vs {offline['acceptance_length']:.3f} "
        f"offline, n-gram {report['ngram']['acceptance_length']:.3f}; speed-up ×{report['speedup']:.2f}; "
        f"{len(report['warnings'])} warning(s); {report['seconds']} s -> {json_path}, {html_path}")
    return report


def _checks(target, prompts, runs, generation, offline) -> dict:
    """Cross-checks that point at a cause when the numbers disagree."""
    base = runs["baseline"]["answers"]
    checks = {
        "served_dtype": runs["baseline"].get("served_dtype"),
        "offline_dtype": offline.get("dtype"),
        "offline_target_agreement": offline.get("target_agreement"),
        "eagle3_outputs_equal_baseline": _identical(runs["eagle3"]["answers"], base),
        "ngram_outputs_equal_baseline": _identical(runs["ngram"]["answers"], base),
        "finish_reasons": {r: sum(a["finish_reason"] == r for a in base) for r in {a["finish_reason"] for a in base}},
    }
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        mismatches = sum(
            a["prompt_token_ids"] is not None
            and a["prompt_token_ids"] != chat_prompt_ids(tok, p["messages"], generation.get("chat_template_kwargs"))
            for a, p in zip(base, prompts))
        checks["prompt_template_mismatches"] = mismatches
    except (OSError, ValueError) as e:  # a target without a loadable tokenizer here: say so, do not fail
        checks["prompt_template_mismatches"] = None
        checks["prompt_template_error"] = str(e)[:300]
    return checks
