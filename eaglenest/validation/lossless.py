"""Is the engine lossless when it samples? Speculative outputs scored under the target, against the target alone's.

At temperature 0 a lossless engine returns the target's own tokens, and the report compares outputs
exactly. At T > 0 a correct speculative engine returns *samples from the same distribution* as the
target alone, not the same tokens; what can be compared is a statistic of the samples. Here: each
output's mean per-token log-probability under the target (``sequence_scores``, the transformers
target, independent of the engine under test), one number per request.

``score_check`` tests one speculative run at one temperature against the target alone at the same
temperature, top_p and seed, over every evaluation set at once: losslessness is a property of the
engine and its sampling settings, not of the prompts, and a matrix cell holds few requests (six in the
embedded default), too few for any test of its own to separate a fault from chance at a bound that
stays quiet over a whole report (two samples of six cannot give a two-sided p below 2/924 by any
rank or permutation test). The statistic is the difference between the run's mean score and the target
alone's, over all the sets' requests; its null distribution comes from permuting the run / target-alone
labels *within each set* (a stratified permutation test: both runs sent the same prompts, so under a
lossless engine the labels are exchangeable within a set whatever the sets' scores are). The p-value
is the share of ``permutations`` random relabellings (seeded, plus the observed one) at least as
extreme, two-sided. It assumes nothing about the scores' distribution, which is far from normal
(near 0 for most of a confident target's outputs, a long tail below). Pairing by prompt is ignored,
which makes the test conservative when a prompt's two outputs are alike.

The run fails when p < ``alpha`` (default 0.001: a lossless engine is flagged with probability at most
0.001 per run and temperature, so a report of a few dozen such tests stays quiet) AND the difference
exceeds ``tolerance`` nats per token (numerical noise: batching and kernels change the last bits of
the logits, which at T=0 can flip a near-tie between two tokens; a real fault moves the mean by far
more). The p bound covers sampling noise, the tolerance covers arithmetic.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import defaults

# The bounds' defaults: validate.lossless_alpha and validate.lossless_tolerance in the schema.
ALPHA = defaults("validate")["lossless_alpha"]
TOLERANCE = defaults("validate")["lossless_tolerance"]
# Random relabellings per test: p-values down to 1/20,001 (5e-5), well below the default alpha.
PERMUTATIONS = 20_000
_CHUNK = 2_000  # relabellings drawn at once (memory: CHUNK x the set's requests)


@torch.no_grad()
def sequence_scores(model, sequences) -> list[float | None]:
    """Mean log-probability per completion token under ``model`` (a transformers CausalLM, raw
    logits: the T=1 distribution) of each ``(prompt_ids, completion_ids)``; None for an empty completion
    or prompt (the first token of a sequence has no log-probability), as ``served_scores``."""
    device = next(model.parameters()).device
    out = []
    for prompt, completion in sequences:
        if not completion or not prompt:
            out.append(None)
            continue
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [completion, vocab]: the logits that chose each token
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None])
        out.append(float(logp.mean()))
    return out


def served_scores(url: str, model: str, sequences, *, api_key=None, concurrency: int = 8, timeout: float = 600.0) -> list[float | None]:
    """``sequence_scores`` from a vLLM server of the target alone instead of a transformers copy: each
    ``(prompt_ids, completion_ids)`` sent whole as the prompt of one completions request with
    ``prompt_logprobs: 0`` (vLLM's log-probability of each prompt token under the raw logits, the T=1
    distribution), the completion's positions averaged. For a target too large for transformers: the
    server validation already starts answers it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlsplit

    from ..errors import ValidationError
    from ..serving.probe import session

    parts = urlsplit(url)
    local = threading.local()  # one requests.Session per thread: a Session is not documented as thread-safe

    def http():
        if not hasattr(local, "session"):
            local.session = session(f"{parts.scheme}://{parts.netloc}", api_key)
        return local.session

    def one(seq):
        prompt, completion = list(seq[0]), list(seq[1])
        if not completion or not prompt:  # the first token of a sequence has no log-probability
            return None
        body = {"model": model, "prompt": prompt + completion, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        try:
            resp = http().post(f"{url}/v1/completions", json=body, timeout=timeout)
            resp.raise_for_status()
            rows = resp.json()["choices"][0]["prompt_logprobs"]
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise ValidationError(f"scoring outputs with prompt_logprobs at {url} failed: {e}") from e
        logps = []
        for token, row in zip(completion, rows[len(prompt):]):
            entry = (row or {}).get(str(token))
            if entry is None:
                raise ValidationError(f"{url} returned no prompt log-probability for token {token}")
            logps.append(float(entry["logprob"]))
        return sum(logps) / len(logps)

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, sequences))


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def permutation_p(strata, *, permutations: int = PERMUTATIONS, seed: int = 0) -> float:
    """Two-sided p-value of mean(run) - mean(target alone) over ``strata`` [(run, target_alone), ...],
    the labels permuted within each stratum (module docstring)."""
    n_a = sum(len(a) for a, _ in strata)
    n_b = sum(len(b) for _, b in strata)
    total = sum(sum(a) + sum(b) for a, b in strata)
    observed = sum(sum(a) for a, _ in strata) / n_a - sum(sum(b) for _, b in strata) / n_b
    rng = np.random.default_rng(seed)
    extreme = 0
    for start in range(0, permutations, _CHUNK):
        size = min(_CHUNK, permutations - start)
        sum_a = np.zeros(size)
        for a, b in strata:
            values = np.asarray(a + b, dtype=np.float64)
            picked = np.argsort(rng.random((size, len(values))), axis=1)[:, : len(a)]
            sum_a += values[picked].sum(axis=1)
        diffs = sum_a / n_a - (total - sum_a) / n_b
        # A relabelling as extreme as the observed one, up to rounding (ties, such as identical T=0 outputs, count).
        extreme += int(np.count_nonzero(np.abs(diffs) >= abs(observed) - 1e-12 * max(1.0, abs(observed))))
    return (extreme + 1) / (permutations + 1)


def score_check(strata, *, alpha: float = ALPHA, tolerance: float = TOLERANCE, permutations: int = PERMUTATIONS,
                seed: int = 0) -> dict | None:
    """Compare a run's per-request scores with the target alone's over ``strata``: one ``(scores,
    reference)`` pair per evaluation set, the same prompts sent at the same temperature. None where no
    set has scored outputs on both sides. ``lossless`` is False when the difference is beyond both bounds
    (module docstring)."""
    pairs = [(_finite(a), _finite(b)) for a, b in strata]
    pairs = [(a, b) for a, b in pairs if a and b]
    if not pairs:
        return None
    a = [x for s, _ in pairs for x in s]
    b = [x for _, s in pairs for x in s]
    diff = sum(a) / len(a) - sum(b) / len(b)
    p = permutation_p(pairs, permutations=permutations, seed=seed)
    return {"score": sum(a) / len(a), "reference_score": sum(b) / len(b), "difference": diff, "p": p,
            "alpha": alpha, "tolerance": tolerance, "permutations": permutations, "n": len(a), "reference_n": len(b),
            "sets": len(pairs), "lossless": not (p < alpha and abs(diff) > tolerance)}
