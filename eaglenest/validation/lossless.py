"""Is the engine lossless when it samples? Speculative outputs scored under the target, against the target alone's.

At temperature 0 a lossless engine returns the target's own tokens, and the report compares outputs
exactly. At T > 0 a correct speculative engine returns *samples from the same distribution* as the
target alone, not the same tokens; what can be compared is a statistic of the samples. Here: each
output's mean per-token log-probability under the target (``sequence_scores``, the transformers
target, independent of the engine under test), one number per request.

``score_check`` compares the per-request scores of a speculative run with the target alone's at the
same temperature, top_p and seed, as two independent samples (Welch): the difference of the means
over its standard error is z. The cell fails when |z| exceeds ``z_max`` (default 4: a lossless engine
is flagged with probability about 6e-5 per cell under the normal approximation, so a report of a
few dozen cells stays quiet) AND the difference exceeds ``tolerance`` nats per token (numerical noise:
batching and kernels change the last bits of the logits, which at T=0 can flip a near-tie between
two tokens; a real fault moves the mean by far more). The z threshold covers sampling noise, the
tolerance covers arithmetic.
"""

from __future__ import annotations

import math

import torch

from ..config import defaults

# The bounds' defaults: validate.lossless_z and validate.lossless_tolerance in the schema.
Z_MAX = defaults("validate")["lossless_z"]
TOLERANCE = defaults("validate")["lossless_tolerance"]


@torch.no_grad()
def sequence_scores(model, sequences) -> list[float | None]:
    """Mean log-probability per completion token under ``model`` (a transformers CausalLM, raw
    logits: the T=1 distribution) of each ``(prompt_ids, completion_ids)``; None for an empty completion."""
    device = next(model.parameters()).device
    out = []
    for prompt, completion in sequences:
        if not completion:
            out.append(None)
            continue
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [completion, vocab]: the logits that chose each token
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None])
        out.append(float(logp.mean()))
    return out


def _mean_var(xs):
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return mean, var


def score_check(scores, reference, *, z_max: float = Z_MAX, tolerance: float = TOLERANCE) -> dict | None:
    """Compare a run's per-request scores with the target alone's (``reference``); None where either
    has no scored output. ``lossless`` is False when the difference is beyond both bounds (module
    docstring)."""
    a = [s for s in scores if s is not None and math.isfinite(s)]
    b = [s for s in reference if s is not None and math.isfinite(s)]
    if not a or not b:
        return None
    (ma, va), (mb, vb) = _mean_var(a), _mean_var(b)
    diff = ma - mb
    se = math.sqrt(va / len(a) + vb / len(b))
    z = diff / se if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    return {"score": ma, "reference_score": mb, "difference": diff, "se": se, "z": z,
            "z_max": z_max, "tolerance": tolerance, "n": len(a), "reference_n": len(b),
            "lossless": not (abs(z) > z_max and abs(diff) > tolerance)}
